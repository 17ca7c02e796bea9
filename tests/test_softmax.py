import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_ls2
from jax_ls2 import _random
from jax_ls2.ops import softmax_dropout
from numerics import assert_within_2x, compiled_text, cuda_lowering_text, f64, mesh8, shard

F32 = jnp.float32


# ---------------------------------------------------------------- plain formula
def _valid(shape, mask, causal):
    valid = jnp.ones(shape, bool)
    if mask is not None:
        valid = valid & mask
    if causal:
        q, k = shape[-2], shape[-1]
        valid = valid & (jnp.arange(k)[None, :] <= jnp.arange(q)[:, None] + (k - q))
    return valid


def plain(scores, *, scale=1.0, bias=None, mask=None, causal=False, rate=0.0, key=None, dtype=F32):
    """The op written out with jax.nn.softmax in `dtype`; fully masked rows give 0."""
    x = scores.astype(dtype) * jnp.asarray(scale, dtype)
    if bias is not None:
        x = x + bias.astype(dtype)
    valid = _valid(scores.shape, mask, causal)
    big = jnp.asarray(-1e30 if jnp.dtype(dtype).itemsize >= 4 else -1e4, dtype)
    p = jax.nn.softmax(jnp.where(valid, x, big), axis=-1)
    p = jnp.where(valid, p, 0)
    if rate > 0:
        t = _random.dropout_threshold(rate)
        keep = _random.keep_mask(_random.seed_words(key), scores.shape, t)
        p = jnp.where(keep, p * jnp.asarray(_random.keep_scale(rate), dtype), 0)
    return p.astype(scores.dtype)


def inputs(shape, dtype=F32, seed=0, mask_shape=None, bias_shape=None):
    k = jax.random.split(jax.random.key(seed), 4)
    s = (2.0 * jax.random.normal(k[0], shape)).astype(dtype)
    mask = None if mask_shape is None else jax.random.bernoulli(k[1], 0.8, mask_shape)
    bias = None if bias_shape is None else jax.random.normal(k[2], bias_shape).astype(dtype)
    return s, mask, bias, k[3]


CASES = [
    # shape, mask_shape, bias_shape, causal, rate
    ((2, 3, 5, 7), None, None, False, 0.0),
    ((2, 3, 5, 7), (2, 1, 1, 7), None, False, 0.1),
    ((2, 3, 5, 7), None, (1, 3, 5, 7), True, 0.2),
    ((2, 2, 4, 9), (2, 1, 4, 9), (2, 2, 1, 1), True, 0.1),
    ((1, 2, 3, 1), None, None, False, 0.3),
    ((1, 1, 4, 1025), (1, 1, 1, 1025), None, False, 0.1),
    ((1, 1, 2, 3000), None, (1, 1, 1, 3000), True, 0.1),
    ((3, 16), (3, 16), None, True, 0.5),
]


@pytest.mark.parametrize("shape,mask_shape,bias_shape,causal,rate", CASES)
def test_forward_matches_plain_formula(shape, mask_shape, bias_shape, causal, rate):
    s, mask, bias, key = inputs(shape, mask_shape=mask_shape, bias_shape=bias_shape, seed=len(shape) + shape[-1])
    kw = dict(scale=0.7, bias=bias, mask=mask, causal=causal, rate=rate, key=key)
    y = jax.jit(lambda s: softmax_dropout(s, **kw))(s)
    np.testing.assert_allclose(y, plain(s, **kw), rtol=2e-6, atol=1e-7)
    # Dropped elements are exactly where the shared generator says.
    if rate > 0:
        keep = _random.keep_mask(_random.seed_words(key), shape, _random.dropout_threshold(rate))
        valid = _valid(shape, mask, causal)
        assert np.all(np.asarray(y)[np.asarray(valid & ~keep)] == 0)
        assert np.all(np.asarray(y)[np.asarray(valid & keep)] > 0)


@pytest.mark.parametrize("shape,mask_shape,bias_shape,causal,rate", CASES[:4] + CASES[6:])
def test_backward_matches_autodiff_of_plain_formula(shape, mask_shape, bias_shape, causal, rate):
    s, mask, bias, key = inputs(shape, mask_shape=mask_shape, bias_shape=bias_shape, seed=shape[-1])
    w = jax.random.normal(jax.random.key(7), shape)

    def loss(f):
        def run(s, b):
            return jnp.sum(f(s, scale=0.7, bias=b, mask=mask, causal=causal, rate=rate, key=key) * w)
        return run

    argn = (0, 1) if bias is not None else (0,)
    ours = jax.jit(jax.grad(loss(softmax_dropout), argn))(s, bias)
    ref = jax.jit(jax.grad(loss(plain), argn))(s, bias)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_check_grads():
    s, mask, bias, _ = inputs((2, 2, 3, 6), mask_shape=(2, 1, 1, 6), bias_shape=(1, 2, 3, 6))
    f = lambda s, b: softmax_dropout(s, scale=0.5, bias=b, mask=mask, causal=True)
    check_grads(f, (s, bias), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
    # With dropout the function is still smooth in its inputs (fixed key).
    g = lambda s: softmax_dropout(s, scale=0.5, rate=0.2, key=jax.random.key(3))
    check_grads(g, (s,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_zero_scale_still_gives_bias_gradient():
    s, _, bias, _ = inputs((1, 2, 3, 5), bias_shape=(1, 2, 1, 5))
    w = jax.random.normal(jax.random.key(1), s.shape)
    f = lambda fn: (lambda s, b: jnp.sum(fn(s, scale=0.0, bias=b) * w))
    ds, db = jax.grad(f(softmax_dropout), (0, 1))(s, bias)
    rs, rb = jax.grad(f(plain), (0, 1))(s, bias)
    assert np.all(np.asarray(ds) == 0)
    np.testing.assert_allclose(db, rb, rtol=1e-5, atol=1e-6)


def test_bias_dtypes_and_gradient_dtype():
    s, _, _, _ = inputs((2, 2, 3, 8), dtype=jnp.bfloat16)
    for bdt in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
        b = jax.random.normal(jax.random.key(2), (1, 2, 1, 8)).astype(bdt)
        y = softmax_dropout(s, bias=b)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(f64(y), f64(plain(s, bias=b.astype(F32))), atol=1e-2)
        db = jax.grad(lambda b: jnp.sum(softmax_dropout(s, bias=b).astype(F32) * s.astype(F32)))(b)
        assert db.dtype == b.dtype and db.shape == b.shape


def test_transformations():
    s, mask, bias, key = inputs((4, 2, 3, 8), mask_shape=(4, 1, 1, 8), bias_shape=(1, 2, 3, 8))
    kw = dict(scale=0.5, bias=bias, mask=mask, rate=0.1, key=key)
    f = lambda s: softmax_dropout(s, **kw)
    np.testing.assert_allclose(jax.jit(f)(s), plain(s, **kw), rtol=2e-6, atol=1e-7)
    # vmap with dropout: each example draws the mask it draws alone (as jax.random does).
    sv = s.reshape(2, 2, 2, 3, 8)
    mv = mask.reshape(2, 2, 1, 1, 8)
    one = lambda s, m: softmax_dropout(s, scale=0.5, bias=bias, mask=m, rate=0.1, key=key)
    yv = jax.jit(jax.vmap(one))(sv, mv)
    for i in range(2):
        np.testing.assert_allclose(yv[i], one(sv[i], mv[i]), rtol=2e-6, atol=1e-7)
    # vmap over keys: each key its own mask.
    keys = jax.random.split(key, 3)
    yk = jax.jit(jax.vmap(lambda k: softmax_dropout(s, scale=0.5, rate=0.3, key=k)))(keys)
    for i in range(3):
        yi = softmax_dropout(s, scale=0.5, rate=0.3, key=keys[i])
        np.testing.assert_array_equal(yk[i] == 0, yi == 0)
        np.testing.assert_allclose(yk[i], yi, rtol=1e-6)
    # vmap(grad)
    gv = jax.vmap(jax.grad(lambda s: jnp.sum(softmax_dropout(s, rate=0.1, key=key) ** 2)))(sv)
    g1 = jax.grad(lambda s: jnp.sum(softmax_dropout(s, rate=0.1, key=key) ** 2))(sv[0])
    assert gv.shape == sv.shape and np.all(np.isfinite(gv))
    assert g1.shape == sv[0].shape
    # grad under checkpoint + scan equals plain grad.
    def body(c, s):
        y = jax.checkpoint(lambda s: softmax_dropout(s, **kw))(s)
        return c + jnp.sum(y * s), None

    loss_scan = lambda s: jax.lax.scan(body, 0.0, jnp.stack([s, 2 * s]))[0]
    loss_plain = lambda s: jnp.sum(plain(s, **kw) * s) + jnp.sum(plain(2 * s, **kw) * 2 * s)
    np.testing.assert_allclose(jax.jit(jax.grad(loss_scan))(s), jax.grad(loss_plain)(s), rtol=1e-5, atol=1e-6)


def test_rate_zero_and_deterministic_are_exact():
    s, mask, _, key = inputs((2, 2, 4, 16), mask_shape=(2, 1, 1, 16))
    base = softmax_dropout(s, scale=0.3, mask=mask)
    np.testing.assert_array_equal(softmax_dropout(s, scale=0.3, mask=mask, rate=0.0, key=key), base)
    np.testing.assert_array_equal(softmax_dropout(s, scale=0.3, mask=mask, rate=0.4, key=key,
                                                  deterministic=True), base)
    np.testing.assert_array_equal(softmax_dropout(s, scale=0.3, mask=mask, rate=0.4, deterministic=True), base)
    # rows sum to one where anything is attended
    sums = np.asarray(jnp.sum(base, -1))
    np.testing.assert_allclose(sums[sums > 0], 1.0, rtol=1e-6)


def test_fully_masked_rows_give_zeros_and_finite_grads():
    s, _, _, key = inputs((2, 2, 3, 6))
    mask = jnp.ones((2, 1, 3, 6), bool).at[0, 0, 1].set(False).at[1].set(False)
    bias = jnp.zeros((1, 1, 3, 6)).at[0, 0, 2].set(-jnp.inf)  # -inf bias masks a whole row too
    f = lambda s: softmax_dropout(s, mask=mask, bias=bias, rate=0.2, key=key)
    y = f(s)
    assert np.all(np.asarray(y[0, :, 1]) == 0) and np.all(np.asarray(y[1]) == 0)
    assert np.all(np.asarray(y[:, :, 2]) == 0)
    assert np.all(np.isfinite(y))
    g = jax.grad(lambda s: jnp.sum(f(s) * s))(s)
    assert np.all(np.isfinite(g))
    assert np.all(np.asarray(g[1]) == 0) and np.all(np.asarray(g[0, :, 1]) == 0)
    gb = jax.grad(lambda b: jnp.sum(softmax_dropout(s, mask=mask, bias=b) * s))(bias)
    assert np.all(np.isfinite(gb))


@pytest.mark.parametrize("q,k", [(5, 5), (3, 7), (1, 4), (6, 3)])
def test_causal_convention(q, k):
    s, _, _, _ = inputs((1, 2, q, k))
    y = np.asarray(softmax_dropout(s, causal=True))
    for i in range(q):
        last = i + (k - q)  # query i attends keys j <= i + (k - q)
        assert np.all(y[..., i, last + 1:] == 0)
        if last >= 0:
            assert np.all(y[..., i, :last + 1] > 0)
            np.testing.assert_allclose(y[..., i, :].sum(-1), 1.0, rtol=1e-6)
        else:
            assert np.all(y[..., i, :] == 0)


@pytest.mark.parametrize("k", [1, 7, 1025, 3000])
def test_odd_k_len(k):
    s, mask, bias, key = inputs((1, 2, 3, k), mask_shape=(1, 1, 1, k), bias_shape=(1, 2, 3, k), seed=k)
    kw = dict(scale=1.3, mask=mask, bias=bias, rate=0.1, key=key, causal=True)
    np.testing.assert_allclose(softmax_dropout(s, **kw), plain(s, **kw), rtol=2e-6, atol=1e-7)


def test_keep_fraction_and_same_key_same_mask():
    s = jnp.zeros((4, 4, 64, 128))  # uniform probabilities: every zero is a drop
    key = jax.random.key(5)
    rate = 0.3
    y = softmax_dropout(s, rate=rate, key=key)
    n = y.size
    frac = float(jnp.mean(y == 0))
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(frac - rate) < 5 * sigma, (frac, rate)
    np.testing.assert_allclose(float(jnp.mean(y)), 1 / 128, rtol=0.02)  # inverted dropout keeps the mean
    np.testing.assert_array_equal(y, softmax_dropout(s, rate=rate, key=key))
    y2 = softmax_dropout(s, rate=rate, key=jax.random.key(6))
    assert not np.array_equal(np.asarray(y == 0), np.asarray(y2 == 0))
    # raw uint32[2] keys work and match the typed key's data
    np.testing.assert_array_equal(y, softmax_dropout(s, rate=rate, key=jax.random.key_data(key)))


def test_low_precision_dtypes():
    for dt in (jnp.float16, jnp.bfloat16):
        s, mask, bias, key = inputs((2, 2, 4, 24), dtype=dt, mask_shape=(2, 1, 1, 24), bias_shape=(1, 2, 4, 24))
        kw = dict(scale=0.5, mask=mask, bias=bias, rate=0.1, key=key)
        y = softmax_dropout(s, **kw)
        assert y.dtype == dt
        np.testing.assert_allclose(f64(y), f64(plain(s.astype(F32), **{**kw, "bias": bias.astype(F32)})),
                                   rtol=1e-2, atol=2e-3)
        g = jax.grad(lambda s: jnp.sum(softmax_dropout(s, **kw).astype(F32)))(s)
        assert g.dtype == dt and np.all(np.isfinite(f64(g)))


# ---------------------------------------------------------------- sharding
def test_batch_sharded_jit_equals_unsharded_without_all_gather():
    mesh = mesh8()
    s, mask, bias, key = inputs((8, 2, 4, 16), mask_shape=(8, 1, 1, 16), bias_shape=(1, 2, 4, 16))

    def loss(s, mask, bias):
        y = softmax_dropout(s, scale=0.5, mask=mask, bias=bias, rate=0.2, key=key)
        return jnp.sum(y * s), y

    f = jax.jit(jax.value_and_grad(loss, (0, 2), has_aux=True))
    (l0, y0), (g0, gb0) = f(s, mask, bias)
    ss, ms = shard(s, mesh, "data"), shard(mask, mesh, "data")
    (l1, y1), (g1, gb1) = f(ss, ms, bias)
    np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gb1, gb0, rtol=1e-5, atol=1e-6)
    assert y1.sharding.spec[0] == "data"
    text = compiled_text(lambda s, m, b: jax.value_and_grad(loss, (0, 2), has_aux=True)(s, m, b), ss, ms, bias)
    assert "all-gather" not in text


def test_shard_map():
    mesh = mesh8()
    s, mask, _, key = inputs((8, 2, 4, 16), mask_shape=(8, 1, 1, 16))

    def per_device(s, m):
        k = jax.random.fold_in(key, jax.lax.axis_index("data"))
        return softmax_dropout(s, mask=m, rate=0.1, key=k)

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
    y = f(shard(s, mesh, "data"), shard(mask, mesh, "data"))
    for i in range(8):
        k = jax.random.fold_in(key, i)
        np.testing.assert_allclose(y[i:i + 1], softmax_dropout(s[i:i + 1], mask=mask[i:i + 1], rate=0.1, key=k),
                                   rtol=1e-6, atol=1e-7)
    g = jax.jit(jax.grad(lambda s: jnp.sum(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data")),
                                                         out_specs=P("data"))(s, mask) * s)))(s)
    assert np.all(np.isfinite(g))


@pytest.mark.skipif(not jax_ls2.kernels_built(), reason="extension not built")
def test_lowering_for_cuda_reaches_the_kernels():
    s, mask, bias, key = inputs((2, 2, 4, 16), mask_shape=(2, 1, 1, 16), bias_shape=(1, 2, 4, 16))
    f = lambda s, b: jnp.sum(softmax_dropout(s, mask=mask, bias=b, rate=0.1, key=key, causal=True))
    text = cuda_lowering_text(jax.grad(f, (0, 1)), s, bias)
    assert "jax_ls2_softmax_dropout_fwd" in text and "jax_ls2_softmax_dropout_bwd" in text


# ---------------------------------------------------------------- bad inputs
def test_bad_inputs():
    s = jnp.zeros((2, 2, 3, 4))
    key = jax.random.key(0)
    with pytest.raises(TypeError, match="softmax_dropout: scores must have dtype"):
        softmax_dropout(s.astype(jnp.int32))
    with pytest.raises(ValueError, match="softmax_dropout: scores must have rank >= 2"):
        softmax_dropout(jnp.zeros((4,)))
    with pytest.raises(ValueError, match="non-empty last axis"):
        softmax_dropout(jnp.zeros((2, 0)))
    with pytest.raises(ValueError, match=r"softmax_dropout: mask must be broadcastable to \(2, 2, 3, 4\)"):
        softmax_dropout(s, mask=jnp.ones((2, 1, 4), bool))
    with pytest.raises(ValueError, match="softmax_dropout: mask must be broadcastable"):
        softmax_dropout(s, mask=jnp.ones((2, 1, 1, 3), bool))
    with pytest.raises(TypeError, match="softmax_dropout: mask must have dtype"):
        softmax_dropout(s, mask=jnp.ones((2, 1, 1, 4), jnp.float32))
    with pytest.raises(ValueError, match="softmax_dropout: bias must be broadcastable"):
        softmax_dropout(s, bias=jnp.ones((3, 1, 1, 4)))
    with pytest.raises(TypeError, match="softmax_dropout: bias must have a floating dtype"):
        softmax_dropout(s, bias=jnp.ones((1, 1, 1, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"softmax_dropout: rate must be in \[0, 1\)"):
        softmax_dropout(s, rate=1.0, key=key)
    with pytest.raises(ValueError, match="softmax_dropout: rate must be in"):
        softmax_dropout(s, rate=-0.1, key=key)
    with pytest.raises(ValueError, match="softmax_dropout: key is required"):
        softmax_dropout(s, rate=0.1)
    with pytest.raises(TypeError, match="softmax_dropout: key must be a JAX PRNG key"):
        softmax_dropout(s, rate=0.1, key=jnp.zeros((3,), jnp.float32))
    with pytest.raises(TypeError, match="softmax_dropout: scale must be a finite Python float"):
        softmax_dropout(s, scale=float("nan"))
    with pytest.raises(TypeError, match="softmax_dropout: scale must be a finite Python float"):
        jax.jit(lambda s, c: softmax_dropout(s, scale=c))(s, 1.0)
    with pytest.raises(TypeError, match="softmax_dropout: causal must be a Python bool"):
        softmax_dropout(s, causal=1)


# ---------------------------------------------------------------- GPU
GPU_CASES = [
    # shape, padding mask, causal, rate, bias along k
    ((2, 3, 7, 7), False, True, 0.1, True),
    ((2, 2, 33, 1025), True, False, 0.1, True),
    ((1, 2, 16, 3000), True, True, 0.1, True),
    ((1, 1, 8, 12345), True, False, 0.1, True),
    ((32, 12, 128, 512), True, False, 0.1, True),
    ((2, 4, 256, 2048), True, True, 0.1, True),
    # without a bias along k: the register kernels compiled without that path
    ((2, 2, 33, 1000), True, False, 0.1, False),
    ((2, 4, 64, 2048), True, True, 0.1, False),
    ((1, 3, 40, 1536), False, False, 0.0, False),
    ((2, 2, 16, 512), True, True, 0.1, False),
]


def _xla_same_dtype(s, mask, bias, key, scale, causal, rate):
    """The XLA reference in the input dtype: jax.nn.softmax, then the shared mask."""
    return plain(s, scale=scale, mask=mask, bias=bias, causal=causal, rate=rate, key=key, dtype=s.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape,padded,causal,rate,biased", GPU_CASES)
def test_gpu_against_float64_truth(dtype, shape, padded, causal, rate, biased):
    b, h, q, k = shape
    # Without a bias along k, a per-row one (broadcast over k) still takes the bias path.
    s, _, bias, key = inputs(shape, dtype, seed=k, bias_shape=(1, h, q, k) if biased else (1, h, q, 1))
    lens = jax.random.randint(jax.random.key(k), (b,), 1, k + 1)
    mask = (jnp.arange(k)[None, :] < lens[:, None])[:, None, None, :] if padded else None
    w = jax.random.normal(jax.random.key(3), shape).astype(dtype)
    scale = 0.125
    kw = dict(scale=scale, mask=mask, causal=causal, rate=rate, key=key)
    ours = lambda s, bb: softmax_dropout(s, bias=bb, **kw)
    xla = lambda s, bb: _xla_same_dtype(s, mask, bb, key, scale, causal, rate)
    y = jax.jit(ours)(s, bias)
    y_xla = jax.jit(xla)(s, bias)
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        a64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (s, bias, w)]
        m64 = None if mask is None else jax.device_put(mask, cpu)
        k64 = jax.device_put(key, cpu)
        truth_f = lambda s, bb: plain(s, scale=scale, mask=m64, bias=bb, causal=causal, rate=rate, key=k64,
                                      dtype=jnp.float64)
        truth = truth_f(a64[0], a64[1])
        tg = jax.grad(lambda s, bb: jnp.sum(truth_f(s, bb) * a64[2]), (0, 1))(a64[0], a64[1])
    assert_within_2x("y", y, y_xla, truth)
    # the kernel drops exactly the reference's elements
    keep = np.asarray(_random.keep_mask(_random.seed_words(key), shape, _random.dropout_threshold(rate)))
    valid = np.asarray(_valid(shape, mask, causal))
    yk = np.asarray(y.astype(F32))
    assert np.all(yk[valid & ~keep] == 0)
    assert np.all(yk[~valid] == 0)
    if dtype == jnp.float32:
        assert np.all(yk[valid & keep] > 0)
    loss = lambda f: (lambda s, bb: jnp.sum(f(s, bb).astype(F32) * w.astype(F32)))
    gk = jax.jit(jax.grad(loss(ours), (0, 1)))(s, bias)
    gx = jax.jit(jax.grad(loss(xla), (0, 1)))(s, bias)
    for name, a, bx, t in zip(("dscores", "dbias"), gk, gx, tg):
        assert_within_2x(name, a, bx, t)


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_masks_and_values_equal_the_reference_path():
    import os
    s, mask, bias, key = inputs((2, 4, 64, 1000), mask_shape=(2, 1, 1, 1000), bias_shape=(1, 4, 64, 1000))
    f = jax.jit(lambda s: softmax_dropout(s, scale=0.3, mask=mask, bias=bias, rate=0.1, key=key, causal=True))
    y = np.asarray(f(s))
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(a, cpu) for a in (s, mask, bias, key)]
    y_ref = np.asarray(jax.jit(lambda s, m, b, k: softmax_dropout(s, scale=0.3, mask=m, bias=b, rate=0.1, key=k,
                                                                  causal=True))(*args))
    np.testing.assert_array_equal(y == 0, y_ref == 0)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-7)
    assert "JAX_LS2_IMPL" not in os.environ or os.environ["JAX_LS2_IMPL"] != "reference"


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_every_output_element_written():
    s, mask, _, key = inputs((3, 5, 17, 777), jnp.bfloat16, mask_shape=(3, 1, 1, 777))
    poison = jnp.full((3, 5, 17, 777), jnp.nan, jnp.bfloat16)
    del poison
    y = jax.jit(lambda s: softmax_dropout(s, mask=mask, rate=0.1, key=key))(s)
    dx = jax.jit(jax.grad(lambda s: jnp.sum(softmax_dropout(s, mask=mask, rate=0.1, key=key).astype(F32))))(s)
    for arr in (y, dx):
        assert bool(jnp.all(jnp.isfinite(arr)))


@pytest.mark.gpu
def test_gpu_program_calls_the_kernel():
    s, _, _, key = inputs((2, 2, 8, 64))
    text = compiled_text(jax.grad(lambda s: jnp.sum(softmax_dropout(s, rate=0.1, key=key))), s)
    assert "jax_ls2_softmax_dropout_fwd" in text and "jax_ls2_softmax_dropout_bwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("k_len", [512, 2048])
def test_gpu_16_elements_per_thread_computes_the_same(k_len):
    """The launch variant a benchmark may time (softmax_elems=16: the forward's register
    kernel with 16 elements per thread instead of 32) gives the default's probabilities
    and gradients within an ulp of bfloat16 (its row sums add in another order)."""
    from numerics import assert_bf16_close, under_kernel_option
    k = jax.random.split(jax.random.key(13), 3)
    x = jax.random.normal(k[0], (2, 3, 77, k_len), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(k[1], x.shape, jnp.float32).astype(jnp.bfloat16)
    mask = jax.random.uniform(k[2], (2, 1, 1, k_len)) > 0.2

    def both(x, dy):
        y, pull = jax.vjp(lambda x: softmax_dropout(x, scale=0.125, mask=mask, causal=True, rate=0.1,
                                                    key=jax.random.key(4)), x)
        return y, pull(dy)[0]

    prog = jax.jit(both)
    want = jax.block_until_ready(prog(x, dy))
    got = under_kernel_option("softmax_elems", 16, prog, x, dy)
    assert_bf16_close(got[0], want[0])
    assert_bf16_close(got[1], want[1])
