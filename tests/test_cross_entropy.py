"""cross_entropy and linear_cross_entropy: independent float64 formulas, jax.grad,
optax's smoothing convention, ignored tokens, large vocabularies, validation,
sharding, CUDA lowering, and (on a GPU) the 2x error rule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ls2
from jax_ls2.ops import cross_entropy, linear_cross_entropy

F32 = jnp.float32


def _data(seed, lead, vocab, dtype=F32, ignore=None, frac=0.3):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = (3.0 * jax.random.normal(k1, lead + (vocab,), F32)).astype(dtype)
    y = jax.random.randint(k2, lead, 0, vocab, jnp.int32)
    if ignore is not None:
        y = jnp.where(jax.random.uniform(k3, lead) < frac, ignore, y)
    return x, y


def _truth(x, y, eps=0.0, ignore=None, z=0.0):
    """float64 numpy: per-token loss and dloss/dlogits (per unit cotangent)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y)
    v = x.shape[-1]
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
    keep = np.ones(y.shape, bool) if ignore is None else (y != ignore)
    ys = np.where(keep, y, 0)
    onehot = (np.arange(v) == ys[..., None]).astype(np.float64)
    target = (1 - eps) * onehot + eps / v
    loss = -(target * (x - lse[..., None])).sum(-1) + z * lse ** 2
    p = np.exp(x - lse[..., None])
    grad = p * (1 + 2 * z * lse)[..., None] - target
    return np.where(keep, loss, 0.0), np.where(keep[..., None], grad, 0.0), keep


@pytest.mark.parametrize("lead,vocab", [((7,), 50257), ((2, 3), 11), ((1,), 1), ((5,), 4097)])
@pytest.mark.parametrize("eps,ignore,z", [(0.0, None, 0.0), (0.1, -100, 0.0), (0.2, 3, 1e-3)])
def test_loss_and_grad_match_float64_formula(lead, vocab, eps, ignore, z):
    x, y = _data(1, lead, vocab, ignore=ignore)
    loss, count = cross_entropy(x, y, label_smoothing=eps, ignore_index=ignore, z_loss=z)
    tl, tg, keep = _truth(x, y, eps, ignore, z)
    assert loss.dtype == F32 and loss.shape == y.shape
    np.testing.assert_allclose(loss, tl, rtol=2e-5, atol=2e-5)
    assert int(count) == int(keep.sum())
    ct = jax.random.normal(jax.random.key(9), y.shape, F32)
    g = jax.grad(lambda x: jnp.sum(cross_entropy(x, y, label_smoothing=eps, ignore_index=ignore,
                                                 z_loss=z)[0] * ct))(x)
    assert g.dtype == x.dtype
    np.testing.assert_allclose(g, tg * np.asarray(ct, np.float64)[..., None], rtol=1e-4, atol=1e-6)
    for red in ("sum", "mean"):
        f = lambda x: cross_entropy(x, y, label_smoothing=eps, ignore_index=ignore, z_loss=z, reduction=red)[0]
        denom = 1.0 if red == "sum" else max(int(keep.sum()), 1)
        np.testing.assert_allclose(f(x), tl.sum() / denom, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(jax.grad(f)(x), tg / denom, rtol=1e-4, atol=1e-6)
        # A cotangent other than 1 rescales the kept gradient.
        np.testing.assert_allclose(jax.grad(lambda x: 2.5 * f(x))(x), 2.5 * tg / denom, rtol=1e-4, atol=1e-6)


def test_smoothing_matches_optax():
    x, y = _data(2, (6,), 37)
    for eps in (0.0, 0.1, 0.3):
        ours = lambda x: cross_entropy(x, y, label_smoothing=eps, reduction="mean")[0]
        ref = lambda x: optax.softmax_cross_entropy(x, optax.smooth_labels(jax.nn.one_hot(y, 37), eps)).mean()
        np.testing.assert_allclose(ours(x), ref(x), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(ref)(x), rtol=1e-5, atol=1e-8)
    ref0 = optax.softmax_cross_entropy_with_integer_labels(x, y)
    np.testing.assert_allclose(cross_entropy(x, y)[0], ref0, rtol=1e-6)


def test_ignored_tokens_contribute_nothing():
    x, y = _data(3, (4, 5), 19, ignore=-1, frac=0.5)
    g = jax.grad(lambda x: cross_entropy(x, y, ignore_index=-1, reduction="mean")[0])(x)
    ign = np.asarray(y == -1)
    assert ign.any() and (~ign).any()
    assert np.all(np.asarray(g)[ign] == 0.0)
    loss, _ = cross_entropy(x, y, ignore_index=-1)
    assert np.all(np.asarray(loss)[ign] == 0.0)
    # Changing ignored logits changes nothing.
    x2 = jnp.where(jnp.asarray(ign)[..., None], 1e3, x)
    np.testing.assert_array_equal(cross_entropy(x2, y, ignore_index=-1, reduction="sum")[0],
                                  cross_entropy(x, y, ignore_index=-1, reduction="sum")[0])


def test_all_ignored_batch_is_zero_without_nan():
    x, _ = _data(4, (3, 4), 10)
    y = jnp.full((3, 4), -100, jnp.int32)
    for red in ("mean", "sum"):
        f = lambda x: cross_entropy(x, y, ignore_index=-100, reduction=red, label_smoothing=0.1)[0]
        assert float(f(x)) == 0.0
        g = jax.grad(f)(x)
        assert np.all(np.asarray(g) == 0.0)
    loss, count = cross_entropy(x, y, ignore_index=-100)
    assert int(count) == 0 and np.all(np.asarray(loss) == 0.0)
    h = jax.random.normal(jax.random.key(0), (12, 8), F32)
    w = jax.random.normal(jax.random.key(1), (10, 8), F32)
    lce = lambda h, w: linear_cross_entropy(h, w, y.reshape(12), ignore_index=-100)[0]
    assert float(lce(h, w)) == 0.0
    gh, gw = jax.grad(lce, (0, 1))(h, w)
    assert np.all(np.asarray(gh) == 0) and np.all(np.asarray(gw) == 0)


def test_vocab_128256():
    x, y = _data(5, (3,), 128256, ignore=-100, frac=0.2)
    tl, tg, keep = _truth(x, y, 0.1, -100)
    f = lambda x: cross_entropy(x, y, label_smoothing=0.1, ignore_index=-100, reduction="sum")[0]
    np.testing.assert_allclose(f(x), tl.sum(), rtol=2e-5)
    np.testing.assert_allclose(jax.grad(f)(x), tg, rtol=1e-4, atol=1e-7)


def test_bf16_gradient_in_input_dtype():
    x, y = _data(6, (5,), 50257, dtype=jnp.bfloat16)
    g = jax.grad(lambda x: cross_entropy(x, y, reduction="mean")[0])(x)
    assert g.dtype == jnp.bfloat16
    _, tg, _ = _truth(x.astype(F32), y)
    np.testing.assert_allclose(np.asarray(g, np.float64), tg / 5, atol=2e-3 / 5 + 1e-6)


def test_traced_out_of_range_label_gives_nan():
    x, y = _data(7, (3,), 9)
    y = y.at[1].set(9)
    loss = jax.jit(lambda x, y: cross_entropy(x, y)[0])(x, y)
    assert np.isnan(loss[1]) and np.isfinite(loss[0]) and np.isfinite(loss[2])


def _masked_class_case(dtype, vocab, rows=4):
    """Logits with a few classes masked to -inf (labels elsewhere), and the float64
    truth over the classes left."""
    x, y = _data(9, (rows,), vocab, dtype=dtype)
    masked = np.zeros(vocab, bool)
    masked[[0, vocab // 2, vocab - 1]] = True
    y = jnp.where(jnp.asarray(masked)[y], 1, y)
    x = jnp.where(jnp.asarray(masked), -jnp.inf, x).astype(dtype)
    tl, tg, _ = _truth(np.asarray(x.astype(F32))[:, ~masked], y - np.cumsum(masked)[np.asarray(y)])
    full = np.zeros((rows, vocab))
    full[:, ~masked] = tg
    return x, y, tl, full


def test_masked_classes_without_smoothing_give_finite_loss():
    """A -inf logit (a masked class) gets probability 0: without label smoothing the loss
    and gradient are those of the classes left, not NaN (the mean of the logits, which
    smoothing needs, is left out rather than multiplied by 0)."""
    x, y, tl, tg = _masked_class_case(F32, 9)
    loss, vjp = jax.vjp(lambda x: cross_entropy(x, y)[0], x)
    (g,) = vjp(jnp.ones(y.shape, F32))
    np.testing.assert_allclose(np.asarray(loss, np.float64), tl, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g, np.float64), tg, atol=1e-6)


def test_validation_errors():
    x, y = _data(8, (3,), 9)
    with pytest.raises(ValueError, match=r"cross_entropy: labels must have shape \(3,\), got \(4,\)"):
        cross_entropy(x, jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="cross_entropy: labels must have an integer dtype"):
        cross_entropy(x, y.astype(F32))
    with pytest.raises(TypeError, match="cross_entropy: logits must have dtype"):
        cross_entropy(x.astype(jnp.int32), y)
    with pytest.raises(ValueError, match=r"cross_entropy: labels must be in \[0, 9\)"):
        cross_entropy(x, y.at[0].set(9))
    with pytest.raises(ValueError, match="cross_entropy: label_smoothing must be"):
        cross_entropy(x, y, label_smoothing=1.0)
    with pytest.raises(ValueError, match="cross_entropy: reduction must be"):
        cross_entropy(x, y, reduction="avg")
    with pytest.raises(ValueError, match="cross_entropy: z_loss must be"):
        cross_entropy(x, y, z_loss=-1.0)
    h = jnp.ones((3, 4), F32)
    with pytest.raises(ValueError, match=r"linear_cross_entropy: weight must have shape \(vocab, 4\)"):
        linear_cross_entropy(h, jnp.ones((9, 5), F32), y)
    with pytest.raises(TypeError, match="linear_cross_entropy: weight must have dtype float32"):
        linear_cross_entropy(h, jnp.ones((9, 4), jnp.bfloat16), y)
    with pytest.raises(ValueError, match="linear_cross_entropy: chunk_size must be"):
        linear_cross_entropy(h, jnp.ones((9, 4), F32), y, chunk_size=0)


@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
@pytest.mark.parametrize("use_bias,eps,ignore,red", [(False, 0.0, None, "mean"), (True, 0.1, -1, "mean"),
                                                    (True, 0.0, 2, "sum")])
def test_linear_cross_entropy_equals_unfused(chunk, use_bias, eps, ignore, red):
    k = jax.random.split(jax.random.key(11), 4)
    n_lead, hid, vocab = (3, 7), 16, 53
    h = jax.random.normal(k[0], n_lead + (hid,), F32)
    w = 0.3 * jax.random.normal(k[1], (vocab, hid), F32)
    b = 0.1 * jax.random.normal(k[2], (vocab,), F32)
    y = jax.random.randint(k[3], n_lead, 0, vocab, jnp.int32)
    if ignore is not None:
        y = y.at[0, :3].set(ignore)

    def fused(h, w, b):
        return linear_cross_entropy(h, w, y, bias=b if use_bias else None, label_smoothing=eps,
                                    ignore_index=ignore, chunk_size=chunk, reduction=red)[0]

    def unfused(h, w, b):
        z = h @ w.T + (b if use_bias else 0.0)
        return cross_entropy(z, y, label_smoothing=eps, ignore_index=ignore, reduction=red)[0]

    def independent(h, w, b):  # plain jnp
        z = h @ w.T + (b if use_bias else 0.0)
        lp = jax.nn.log_softmax(z)
        keep = jnp.ones(y.shape, bool) if ignore is None else y != ignore
        t = optax.smooth_labels(jax.nn.one_hot(jnp.where(keep, y, 0), vocab), eps)
        per = jnp.where(keep, -(t * lp).sum(-1), 0.0)
        return per.sum() / (jnp.maximum(keep.sum(), 1) if red == "mean" else 1)

    np.testing.assert_allclose(fused(h, w, b), unfused(h, w, b), rtol=1e-5)
    np.testing.assert_allclose(fused(h, w, b), independent(h, w, b), rtol=1e-5)
    ga = jax.grad(fused, (0, 1, 2))(h, w, b)
    gb = jax.grad(unfused, (0, 1, 2))(h, w, b)
    gc = jax.grad(independent, (0, 1, 2))(h, w, b)
    for a, u, c in zip(ga, gb, gc):
        np.testing.assert_allclose(a, u, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
    _, count = linear_cross_entropy(h, w, y, ignore_index=ignore)
    assert int(count) == (y.size if ignore is None else int((y != ignore).sum()))
    # Loss only (no gradient) and under jit with a scaled cotangent.
    np.testing.assert_allclose(jax.jit(fused)(h, w, b), fused(h, w, b), rtol=1e-6)
    g2 = jax.jit(jax.grad(lambda h, w, b: 3.0 * fused(h, w, b), (0, 1, 2)))(h, w, b)
    for a, c in zip(g2, gc):
        np.testing.assert_allclose(a, 3.0 * c, rtol=1e-4, atol=3e-6)


def test_linear_cross_entropy_vocab_50257_bf16_grad_dtypes():
    k = jax.random.split(jax.random.key(12), 3)
    h = jax.random.normal(k[0], (6, 32), jnp.bfloat16)
    w = (0.05 * jax.random.normal(k[1], (50257, 32), F32)).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (6,), 0, 50257, jnp.int32)
    loss, gs = jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, y, chunk_size=4)[0], (0, 1))(h, w)
    ref, gr = jax.value_and_grad(lambda h, w: cross_entropy(h @ w.T, y, reduction="mean")[0], (0, 1))(h, w)
    assert gs[0].dtype == jnp.bfloat16 and gs[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(loss, ref, rtol=1e-3)
    for a, b in zip(gs, gr):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=1e-4)


def test_vmap_and_checkpoint():
    x, y = _data(13, (4, 3), 17)
    per = jax.vmap(lambda x, y: cross_entropy(x, y)[0])(x, y)
    np.testing.assert_allclose(per, cross_entropy(x, y)[0], rtol=1e-6)
    f = lambda x: cross_entropy(x, y, reduction="mean")[0]
    np.testing.assert_allclose(jax.grad(jax.checkpoint(f))(x), jax.grad(f)(x), rtol=1e-6)
    gv = jax.vmap(jax.grad(lambda x, y: cross_entropy(x, y, reduction="sum")[0]))(x, y)
    np.testing.assert_allclose(gv, jax.grad(lambda x: cross_entropy(x, y, reduction="sum")[0])(x), rtol=1e-6)


def test_batch_sharded_jit_has_no_all_gather():
    devs = jax.devices()
    if len(devs) < 8:
        pytest.skip("needs 8 (simulated) devices")
    mesh = jax.sharding.Mesh(np.array(devs[:8]), ("data",))
    x, y = _data(14, (16, 8), 33, ignore=-100)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ys = jax.device_put(y, NamedSharding(mesh, P("data")))
    for red in (None, "mean"):
        def step(x, y):
            def f(x):
                l, c = cross_entropy(x, y, ignore_index=-100, reduction=red, label_smoothing=0.1)
                return jnp.sum(l)
            return jax.value_and_grad(f)(x)

        hlo = jax.jit(step).lower(xs, ys).compile().as_text()
        assert "all-gather" not in hlo
        v, g = jax.jit(step)(xs, ys)
        v0, g0 = step(x, y)
        np.testing.assert_allclose(v, v0, rtol=1e-5)
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not jax_ls2.kernels_built(), reason="CUDA kernels not built")
def test_lowering_for_cuda_shows_custom_calls():
    x, y = _data(15, (4,), 33)
    f = lambda x: jax.grad(lambda x: cross_entropy(x, y, reduction="mean")[0])(x)
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_ls2_cross_entropy_fwd_grad" in text and "jax_ls2_cross_entropy_scale" in text
    f = lambda x: jax.value_and_grad(lambda x: cross_entropy(x, y)[0].sum())(x)
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_ls2_cross_entropy_fwd" in text and "jax_ls2_cross_entropy_bwd" in text
    h, w = jnp.ones((4, 8), F32), jnp.ones((33, 8), F32)
    f = lambda h, w: jax.grad(lambda h, w: linear_cross_entropy(h, w, y, chunk_size=2)[0], (0, 1))(h, w)
    assert "jax_ls2_cross_entropy_fwd_grad" in jax.jit(f).trace(h, w).lower(lowering_platforms=("cuda",)).as_text()


# ---------------------------------------------------------------- GPU: the 2x rule
def _xla_same_dtype(x, y, eps, ignore):
    """The XLA reference in the input dtype (no upcast)."""
    def f(x):
        v = x.shape[-1]
        lp = jax.nn.log_softmax(x, axis=-1)
        keep = y != ignore if ignore is not None else jnp.ones(y.shape, bool)
        t = optax.smooth_labels(jax.nn.one_hot(jnp.where(keep, y, 0), v, dtype=x.dtype), eps)
        return jnp.where(keep, -(t * lp).sum(-1), 0).astype(x.dtype)
    return f


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("lead,vocab", [((1025,), 50257), ((7,), 128256), ((33,), 4097), ((64,), 123)])
@pytest.mark.parametrize("eps,ignore", [(0.0, None), (0.1, -100)])
def test_gpu_two_x_rule(dtype, lead, vocab, eps, ignore):
    x, y = _data(21, lead, vocab, dtype=dtype, ignore=ignore)
    tl, tg, _ = _truth(np.asarray(x.astype(F32)), y, eps, ignore)
    ct = jax.random.uniform(jax.random.key(3), y.shape, F32, 0.5, 1.5)
    ours = jax.jit(lambda x: jax.vjp(lambda x: cross_entropy(x, y, label_smoothing=eps, ignore_index=ignore)[0], x))
    loss, vjp = ours(x)
    (g,) = jax.jit(vjp)(ct)
    ref_f = _xla_same_dtype(x, y, eps, ignore)
    rl, rvjp = jax.jit(lambda x: jax.vjp(ref_f, x))(x)
    (rg,) = rvjp(ct.astype(dtype))
    tgc = tg * np.asarray(ct, np.float64)[..., None]
    err = lambda a, t: np.max(np.abs(np.asarray(a, np.float64) - t))
    assert err(loss, tl) <= 2 * err(rl, tl)
    assert err(g, tgc) <= 2 * err(rg, tgc)
    # Reduced (gradient formed in the forward pass), unit cotangent.
    fm = lambda x: cross_entropy(x, y, label_smoothing=eps, ignore_index=ignore, reduction="sum")[0]
    gm = jax.jit(jax.grad(fm))(x)
    rgm = jax.jit(jax.grad(lambda x: ref_f(x).astype(F32).sum()))(x)
    assert err(gm, tg) <= 2 * err(rgm, tg)


@pytest.mark.sanitize
@pytest.mark.gpu
@pytest.mark.parametrize("use_bias,eps,ignore", [(False, 0.0, None), (True, 0.1, -100)])
def test_gpu_linear_cross_entropy_matches_unfused(use_bias, eps, ignore):
    # vocab 50257 is padded to a multiple of 64 inside; the padding must not leak into
    # the softmax, the smoothing term or the gradients.
    k = jax.random.split(jax.random.key(22), 4)
    h = jax.random.normal(k[0], (1000, 256), jnp.bfloat16)
    w = (0.05 * jax.random.normal(k[1], (50257, 256), F32)).astype(jnp.bfloat16)
    b = (0.5 * jax.random.normal(k[3], (50257,), F32)).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (1000,), 0, 50257, jnp.int32)
    if ignore is not None:
        y = y.at[::7].set(ignore)
    kw = dict(label_smoothing=eps, ignore_index=ignore)
    f = jax.jit(jax.value_and_grad(lambda h, w, b: linear_cross_entropy(
        h, w, y, bias=b if use_bias else None, chunk_size=384, **kw)[0], (0, 1, 2)))
    u = jax.jit(jax.value_and_grad(lambda h, w, b: cross_entropy(
        h @ w.T + (b if use_bias else 0), y, reduction="mean", **kw)[0], (0, 1, 2)))
    (l1, g1), (l2, g2) = f(h, w, b), u(h, w, b)
    if not use_bias:
        g1, g2 = g1[:2], g2[:2]
    np.testing.assert_allclose(l1, l2, rtol=2e-3)
    for a, b in zip(g1, g2):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 2e-2 * np.max(np.abs(b))


@pytest.mark.gpu
@pytest.mark.parametrize("option,value", [("cross_entropy_threads", 256), ("cross_entropy_threads", 1024),
                                          ("cross_entropy_pipeline", 1)])
@pytest.mark.parametrize("vocab", [50257, 128256])
def test_gpu_launch_options_compute_the_same(option, value, vocab):
    """The launch variants a benchmark may time (thread counts; the row-per-block kernel
    instead of the row-staging one at 50257) give the default's loss within float32
    summation noise and its gradient within an ulp of bfloat16."""
    from numerics import assert_bf16_close, under_kernel_option
    x, y = _data(22, (267,), vocab, dtype=jnp.bfloat16)
    prog = jax.jit(jax.value_and_grad(lambda x: cross_entropy(x, y, reduction="sum")[0]))
    want = jax.block_until_ready(prog(x))
    got = under_kernel_option(option, value, prog, x)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    assert_bf16_close(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [300, 5])
def test_gpu_special_rows_of_the_row_staging_kernel(rows):
    """At 50257 columns (the row-staging kernel): an ignored row gives loss 0 and a zero
    gradient row, a label outside the vocabulary a NaN loss and a NaN gradient row, and
    the rows around them are untouched by either (rows > SMs: each block stages several)."""
    x, y = _data(23, (rows,), 50257, dtype=jnp.bfloat16)
    y = y.at[1].set(-100).at[3].set(50257)
    # Labels traced (inside jit): an eager label outside the vocabulary is refused.
    f = jax.jit(lambda x, y: jax.vjp(lambda x: cross_entropy(x, y, ignore_index=-100)[0], x))
    loss, vjp = f(x, y)
    (g,) = jax.jit(vjp)(jnp.ones(y.shape, F32))
    loss, g = np.asarray(loss, np.float64), np.asarray(g, np.float64)
    assert loss[1] == 0 and not np.any(g[1])
    assert np.isnan(loss[3]) and np.all(np.isnan(g[3]))
    keep = np.ones(rows, bool)
    keep[[1, 3]] = False
    tl, tg, _ = _truth(np.asarray(x[keep].astype(F32)), y[keep])
    np.testing.assert_allclose(loss[keep], tl, rtol=1e-4)
    assert np.max(np.abs(g[keep] - tg)) <= 2 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [50257, 4097])
def test_gpu_masked_classes_without_smoothing_give_finite_loss(vocab):
    """The same on the kernels: 50257 columns run the row-staging kernel, 4097 the
    row-per-block one."""
    x, y, tl, tg = _masked_class_case(jnp.bfloat16, vocab, rows=300)
    loss, vjp = jax.jit(lambda x: jax.vjp(lambda x: cross_entropy(x, y)[0], x))(x)
    (g,) = jax.jit(vjp)(jnp.ones(y.shape, F32))
    np.testing.assert_allclose(np.asarray(loss, np.float64), tl, rtol=1e-4)
    assert np.max(np.abs(np.asarray(g, np.float64) - tg)) <= 2 ** -8
