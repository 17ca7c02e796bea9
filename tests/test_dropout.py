"""bias_dropout_residual and bias_act_dropout: reference vs plain formulas, gradients,
transformations, dropout statistics, sharding, CUDA lowering, bad inputs, GPU numerics."""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ls2
from jax_ls2 import _random
from jax_ls2.ops import bias_act_dropout, bias_dropout_residual

ACTS = ("relu", "gelu", "gelu_tanh")
RATE = 0.1


def _inputs(shape, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = shape[-1]
    x = jax.random.normal(k[0], shape, jnp.float32).astype(dtype)
    b = (0.5 * jax.random.normal(k[1], (h,), jnp.float32)).astype(dtype)
    r = jax.random.normal(k[2], shape, jnp.float32).astype(dtype)
    dy = jax.random.normal(k[3], shape, jnp.float32).astype(dtype)
    return x, b, r, dy


def _mask(key, shape, rate):
    return _random.keep_mask(_random.seed_words(key), shape, _random.dropout_threshold(rate))


# Plain formulas, written independently of the op module (jax.nn activations).
_PLAIN_ACT = {
    "relu": jax.nn.relu,
    "gelu": lambda v: jax.nn.gelu(v, approximate=False),
    "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True),
}


def plain_bdr(x, b, r, keep, rate):
    v = x.astype(jnp.float32) + b.astype(jnp.float32)
    if keep is not None:
        v = jnp.where(keep, v * np.float32(_random.keep_scale(rate)), 0.0)
    return (r.astype(jnp.float32) + v).astype(x.dtype)


def plain_bad(x, b, act, keep, rate):
    v = _PLAIN_ACT[act](x.astype(jnp.float32) + b.astype(jnp.float32))
    if keep is not None:
        v = jnp.where(keep, v * np.float32(_random.keep_scale(rate)), 0.0)
    return v.astype(x.dtype)


# ---------------------------------------------------------------- reference vs plain
@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 123), (7, 769), (1, 64)])
def test_bdr_matches_plain(shape):
    x, b, r, _ = _inputs(shape)
    key = jax.random.key(3)
    got = bias_dropout_residual(x, b, r, rate=RATE, key=key)
    want = plain_bdr(x, b, r, _mask(key, shape, RATE), RATE)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(4, 16), (7, 123), (1, 769)])
def test_bad_matches_plain(act, shape):
    x, b, _, _ = _inputs(shape)
    key = jax.random.key(4)
    got = bias_act_dropout(x, b, activation=act, rate=RATE, key=key)
    want = plain_bad(x, b, act, _mask(key, shape, RATE), RATE)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_bdr_grads_match_plain():
    x, b, r, dy = _inputs((6, 40))
    key = jax.random.key(5)
    keep = _mask(key, x.shape, RATE)
    f = lambda x, b, r: jnp.sum(bias_dropout_residual(x, b, r, rate=RATE, key=key) * dy)
    g = lambda x, b, r: jnp.sum(plain_bdr(x, b, r, keep, RATE) * dy)
    for a, w in zip(jax.grad(f, (0, 1, 2))(x, b, r), jax.grad(g, (0, 1, 2))(x, b, r)):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ACTS)
def test_bad_grads_match_plain(act):
    x, b, _, dy = _inputs((6, 40))
    key = jax.random.key(6)
    keep = _mask(key, x.shape, RATE)
    f = lambda x, b: jnp.sum(bias_act_dropout(x, b, activation=act, rate=RATE, key=key) * dy)
    g = lambda x, b: jnp.sum(plain_bad(x, b, act, keep, RATE) * dy)
    for a, w in zip(jax.grad(f, (0, 1))(x, b), jax.grad(g, (0, 1))(x, b)):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


def test_bias_grad_dtype_follows_bias():
    x, b, r, _ = _inputs((4, 16), jnp.bfloat16)
    b32 = b.astype(jnp.float32)
    db = jax.grad(lambda b: jnp.sum(bias_dropout_residual(x, b, r, rate=RATE, key=jax.random.key(0))
                                    .astype(jnp.float32)))(b32)
    assert db.dtype == jnp.float32


@pytest.mark.parametrize("act", ACTS)
def test_check_grads_deterministic(act):
    x, b, r, _ = _inputs((3, 8))
    if act == "relu":  # keep away from the kink
        x = x + jnp.sign(x + b) * 0.1
    f = lambda x, b, r: bias_dropout_residual(x, b, r, rate=RATE, key=None, deterministic=True)
    jax.test_util.check_grads(f, (x, b, r), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)
    g = lambda x, b: bias_act_dropout(x, b, activation=act, rate=0.0, key=None)
    jax.test_util.check_grads(g, (x, b), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


# ---------------------------------------------------------------- exact paths
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_rate0_and_deterministic_exact(dtype):
    x, b, r, _ = _inputs((5, 33), dtype)
    key = jax.random.key(1)
    want = plain_bdr(x, b, r, None, 0.0)
    for y in (bias_dropout_residual(x, b, r, rate=0.0, key=key),
              bias_dropout_residual(x, b, r, rate=0.3, key=key, deterministic=True),
              bias_dropout_residual(x, b, r, rate=0.0, key=None)):
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    for act in ACTS:
        want = plain_bad(x, b, act, None, 0.0)
        y = bias_act_dropout(x, b, activation=act, rate=0.5, key=None, deterministic=True)
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6)
        # deterministic backward: dx = dy * act'(x + b), dbias = its column sum
    dx, db, dr = jax.grad(lambda x, b, r: jnp.sum(bias_dropout_residual(x, b, r, rate=0.0, key=None)
                                                   .astype(jnp.float32)), (0, 1, 2))(x, b, r)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.ones(x.shape, np.float32))
    np.testing.assert_array_equal(np.asarray(dr, np.float32), np.ones(x.shape, np.float32))
    np.testing.assert_allclose(np.asarray(db, np.float32), np.full((33,), 5.0, np.float32))


# ---------------------------------------------------------------- statistics and keys
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kept_fraction_and_mean(rate):
    n, h = 256, 512
    x = jnp.ones((n, h), jnp.float32)
    y = bias_act_dropout(x, jnp.zeros((h,)), activation="relu", rate=rate, key=jax.random.key(11))
    kept = float(jnp.mean(y != 0))
    keep_p = 1 - _random.dropout_threshold(rate) / 65536
    sd = np.sqrt(keep_p * (1 - keep_p) / (n * h))
    assert abs(kept - keep_p) < 5 * sd, (kept, keep_p)
    assert abs(float(jnp.mean(y)) - 1.0) < 5 * sd / keep_p
    np.testing.assert_allclose(np.unique(np.asarray(y)), sorted({0.0, np.float32(_random.keep_scale(rate))}))


def test_same_key_same_mask_different_key_different_mask():
    x, b, r, _ = _inputs((16, 64))
    y1 = bias_act_dropout(x, b, activation="gelu", rate=0.5, key=jax.random.key(1))
    y2 = bias_act_dropout(x, b, activation="gelu", rate=0.5, key=jax.random.key(1))
    y3 = bias_act_dropout(x, b, activation="gelu", rate=0.5, key=jax.random.key(2))
    np.testing.assert_array_equal(y1, y2)
    assert float(jnp.mean((y1 == 0) != (y3 == 0))) > 0.3
    # raw uint32[2] keys work too and draw the key's mask
    y4 = bias_act_dropout(x, b, activation="gelu", rate=0.5, key=jax.random.key_data(jax.random.key(1)))
    np.testing.assert_array_equal(y1, y4)


# ---------------------------------------------------------------- transformations
def _assert_same_mask_and_close(actual, desired):
    np.testing.assert_array_equal(np.asarray(actual) == 0, np.asarray(desired) == 0)
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-6)


def test_jit_grad_vmap_checkpoint_scan():
    x, b, r, dy = _inputs((3, 4, 24))
    key = jax.random.key(8)
    f = lambda x, b, r: bias_dropout_residual(x, b, r, rate=RATE, key=key)
    g = lambda x, b: bias_act_dropout(x, b, activation="gelu_tanh", rate=RATE, key=key)
    np.testing.assert_array_equal(jax.jit(f)(x, b, r), f(x, b, r))
    # gelu_tanh's tanh is compiled differently by XLA's CPU fusions inside and outside jit
    # (a few ulps apart): the mask must match exactly, the values to float32 rounding.
    _assert_same_mask_and_close(jax.jit(g)(x, b), g(x, b))
    # vmap: each example draws the mask it draws alone
    yv = jax.vmap(f, in_axes=(0, None, 0))(x, b, r)
    np.testing.assert_array_equal(yv, jnp.stack([f(x[i], b, r[i]) for i in range(3)]))
    yv = jax.vmap(g, in_axes=(0, None))(x, b)
    _assert_same_mask_and_close(yv, jnp.stack([g(x[i], b) for i in range(3)]))
    # vmap over keys
    keys = jax.random.split(key, 3)
    yk = jax.vmap(lambda x, k: bias_act_dropout(x, b, activation="relu", rate=0.5, key=k))(x, keys)
    for i in range(3):
        np.testing.assert_array_equal(yk[i], bias_act_dropout(x[i], b, activation="relu", rate=0.5, key=keys[i]))
    # vmap(grad) equals per-example grads
    lg = lambda x, b: jnp.sum(g(x, b) * dy[0])
    gv = jax.vmap(jax.grad(lg, (0, 1)), in_axes=(0, None))(x, b)
    for i in range(3):
        gi = jax.grad(lg, (0, 1))(x[i], b)
        np.testing.assert_allclose(gv[0][i], gi[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(gv[1][i], gi[1], rtol=1e-6, atol=1e-6)
    # grad of vmap, and jit(grad)
    lv = lambda x, b: jnp.sum(jax.vmap(g, in_axes=(0, None))(x, b) * dy)
    lp = lambda x, b: sum(jnp.sum(g(x[i], b) * dy[i]) for i in range(3))
    for a, w in zip(jax.jit(jax.grad(lv, (0, 1)))(x, b), jax.grad(lp, (0, 1))(x, b)):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)

    # checkpoint + scan over layers
    def body(c, bb):
        c = jax.checkpoint(lambda c: bias_dropout_residual(g(c, bb), bb, c, rate=RATE, key=key))(c)
        return c, None

    bs = jnp.stack([b, b * 0.5])
    loss = lambda x, bs: jnp.sum(jax.lax.scan(body, x, bs)[0] * dy)

    def unrolled(x, bs):
        for i in range(2):
            x = bias_dropout_residual(g(x, bs[i]), bs[i], x, rate=RATE, key=key)
        return jnp.sum(x * dy)

    np.testing.assert_allclose(jax.jit(loss)(x, bs), unrolled(x, bs), rtol=1e-6)
    for a, w in zip(jax.jit(jax.grad(loss, (0, 1)))(x, bs), jax.grad(unrolled, (0, 1))(x, bs)):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- sharding
def _mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def test_sharded_jit_equals_unsharded_no_allgather():
    mesh = _mesh()
    x, b, r, dy = _inputs((16, 12, 40))
    key = jax.random.key(9)

    def loss(x, b, r):
        y = bias_dropout_residual(bias_act_dropout(x, b, activation="gelu", rate=RATE, key=key), b, r,
                                  rate=RATE, key=key)
        return jnp.sum(y * dy)

    fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    want = fn(x, b, r)
    shard = NamedSharding(mesh, P("data"))
    xs, rs = jax.device_put(x, shard), jax.device_put(r, shard)
    bs = jax.device_put(b, NamedSharding(mesh, P()))
    got = fn(xs, bs, rs)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    # the forward alone is bit-identical (same mask on every shard)
    fwd = jax.jit(lambda x, b, r: bias_dropout_residual(x, b, r, rate=0.5, key=key))
    np.testing.assert_array_equal(fwd(xs, bs, rs), fwd(x, b, r))
    hlo = fn.lower(xs, bs, rs).compile().as_text()
    assert "all-gather" not in hlo


@pytest.mark.parametrize("spec", [P(None, "data"), P("data", None)])
def test_sequence_sharded_jit_gives_the_unsharded_mask(spec):
    """Masks are a function of the global element index: sharding a leading dim other than
    the first (sequence parallelism) must not change them, and nothing is gathered."""
    mesh = _mesh()
    x, b, r, _ = _inputs((2, 16, 40)) if spec == P(None, "data") else _inputs((16, 3, 40))
    key = jax.random.key(11)
    fwd = jax.jit(lambda x, b, r: bias_dropout_residual(bias_act_dropout(x, b, activation="gelu", rate=0.5, key=key),
                                                        b, r, rate=0.5, key=key))
    shard = NamedSharding(mesh, spec)
    args = (jax.device_put(x, shard), jax.device_put(b, NamedSharding(mesh, P())), jax.device_put(r, shard))
    np.testing.assert_array_equal(fwd(*args), fwd(x, b, r))
    assert "all-gather" not in fwd.lower(*args).compile().as_text()


def _seq_first_pair(act, rate, key):
    """(f, g): the two ops chained with ``seq_first=True`` on (len, batch, hidden), and
    the same on the (batch, len, hidden) transpose, transposed back."""
    def chain(x, b, r, seq_first):
        y = bias_act_dropout(x, b, activation=act, rate=rate, key=key, seq_first=seq_first)
        return bias_dropout_residual(y, b, r, rate=rate, key=jax.random.fold_in(key, 1), seq_first=seq_first)

    def f(x, b, r):
        return chain(x, b, r, True)

    def g(x, b, r):
        return chain(x.swapaxes(0, 1), b, r.swapaxes(0, 1), False).swapaxes(0, 1)
    return f, g


@pytest.mark.parametrize("act", ACTS)
def test_seq_first_draws_the_batch_first_mask(act):
    """seq_first=True on a (len, batch, hidden) activation drops exactly the elements the
    batch-first op drops on its transpose: outputs and all gradients equal."""
    x, b, r, dy = _inputs((6, 3, 40))
    f, g = _seq_first_pair(act, 0.3, jax.random.key(21))
    np.testing.assert_array_equal(jax.jit(f)(x, b, r), jax.jit(g)(x, b, r))
    loss = lambda fn: lambda x, b, r: jnp.sum(fn(x, b, r) * dy)
    for a, w in zip(jax.jit(jax.grad(loss(f), (0, 1, 2)))(x, b, r), jax.jit(jax.grad(loss(g), (0, 1, 2)))(x, b, r)):
        np.testing.assert_allclose(a, w, rtol=1e-6, atol=1e-6)
    # and the masks are not those of the flat (len, batch) order
    flat = bias_dropout_residual(x, b, r, rate=0.3, key=jax.random.key(21))
    assert not np.array_equal(np.asarray(flat), np.asarray(bias_dropout_residual(
        x, b, r, rate=0.3, key=jax.random.key(21), seq_first=True)))


@pytest.mark.parametrize("spec", [P(None, "data"), P("data")])
def test_seq_first_sharded_keeps_its_shards(spec):
    """A sequence-first activation sharded along batch (dim 1) or length (dim 0) is not
    gathered, and gives the unsharded result bit for bit (forward) and to rounding
    (gradients)."""
    mesh = _mesh()
    x, b, r, dy = _inputs((5, 16, 40) if spec == P(None, "data") else (16, 5, 40))
    f, _ = _seq_first_pair("gelu", RATE, jax.random.key(22))
    fn = jax.jit(jax.value_and_grad(lambda x, b, r: jnp.sum(f(x, b, r) * dy), (0, 1, 2)))
    shard = NamedSharding(mesh, spec)
    xs, rs = jax.device_put(x, shard), jax.device_put(r, shard)
    bs = jax.device_put(b, NamedSharding(mesh, P()))
    assert "all-gather" not in fn.lower(xs, bs, rs).compile().as_text()
    for a, w in zip(jax.tree.leaves(fn(xs, bs, rs)), jax.tree.leaves(fn(x, b, r))):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(jax.jit(f)(xs, bs, rs), jax.jit(f)(x, b, r))


def test_shard_map():
    mesh = _mesh()
    x, b, r, dy = _inputs((16, 40))
    key = jax.random.key(10)

    def per_device(x, b, r):
        k = jax.random.fold_in(key, jax.lax.axis_index("data"))
        return bias_dropout_residual(bias_act_dropout(x, b, activation="relu", rate=RATE, key=k), b, r,
                                     rate=RATE, key=k)

    sm = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P("data"))
    got = jax.jit(sm)(x, b, r)
    for i in range(8):
        k = jax.random.fold_in(key, i)
        sl = slice(2 * i, 2 * i + 2)
        w = bias_dropout_residual(bias_act_dropout(x[sl], b, activation="relu", rate=RATE, key=k), b, r[sl],
                                  rate=RATE, key=k)
        np.testing.assert_array_equal(got[sl], w)
    gx, gb = jax.jit(jax.grad(lambda x, b: jnp.sum(sm(x, b, r) * dy), (0, 1)))(x, b)
    assert np.isfinite(np.asarray(gx)).all() and np.isfinite(np.asarray(gb)).all()


def test_cuda_lowering_has_targets():
    if not jax_ls2.kernels_built():
        pytest.skip("extension not built")
    x, b, r, _ = _inputs((4, 32))
    key = jax.random.key(0)

    def loss(x, b, r):
        y = bias_act_dropout(x, b, activation="gelu", rate=RATE, key=key)
        return jnp.sum(bias_dropout_residual(y, b, r, rate=RATE, key=key))

    text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(x, b, r).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("jax_ls2_bias_dropout_residual_fwd", "jax_ls2_bias_dropout_residual_bwd",
                 "jax_ls2_bias_act_dropout_fwd", "jax_ls2_bias_act_dropout_bwd"):
        assert name in text, name


def test_bdr_backward_without_dropout_passes_dy_through():
    """rate=0 / deterministic: dx and dresidual are dy itself (no backward kernel is
    lowered for CUDA), dbias is the fp32 sum of dy over the rows."""
    x, b, r, _ = _inputs((6, 5, 48), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(3), x.shape, jnp.bfloat16)
    for kw in (dict(rate=0.0), dict(rate=RATE, key=jax.random.key(0), deterministic=True)):
        _, pull = jax.vjp(lambda x, b, r: bias_dropout_residual(x, b, r, **kw), x, b, r)
        dx, db, dr = pull(dy)
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(dy))
        np.testing.assert_array_equal(np.asarray(dr), np.asarray(dy))
        want = np.asarray(dy, np.float64).reshape(-1, 48).sum(0)
        np.testing.assert_allclose(np.asarray(db, np.float64), want, rtol=1e-2, atol=1e-2)
    if jax_ls2.kernels_built():
        def loss(x, b, r):
            return jnp.sum(bias_dropout_residual(x, b, r, rate=0.0).astype(jnp.float32))

        text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(x, b, r).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "jax_ls2_bias_dropout_residual_fwd" in text
        assert "jax_ls2_bias_dropout_residual_bwd" not in text


# ---------------------------------------------------------------- bad inputs
def test_bad_inputs_raise():
    x, b, r, _ = _inputs((4, 16))
    k = jax.random.key(0)
    cases = [
        (TypeError, "x must have dtype", lambda: bias_dropout_residual(x.astype(jnp.int32), b, r, rate=0.1, key=k)),
        (ValueError, "bias must have shape", lambda: bias_dropout_residual(x, b[:8], r, rate=0.1, key=k)),
        (ValueError, "bias must have rank 1", lambda: bias_dropout_residual(x, b[None], r, rate=0.1, key=k)),
        (ValueError, "residual must have shape", lambda: bias_dropout_residual(x, b, r[:2], rate=0.1, key=k)),
        (TypeError, "residual must have dtype", lambda: bias_dropout_residual(
            x, b, r.astype(jnp.bfloat16), rate=0.1, key=k)),
        (ValueError, "rate must be in", lambda: bias_dropout_residual(x, b, r, rate=1.0, key=k)),
        (ValueError, "rate must be in", lambda: bias_act_dropout(x, b, activation="relu", rate=-0.1, key=k)),
        (ValueError, "key is required", lambda: bias_dropout_residual(x, b, r, rate=0.1, key=None)),
        (ValueError, "key is required", lambda: bias_act_dropout(x, b, activation="gelu", rate=0.1, key=None)),
        (ValueError, "activation must be one of", lambda: bias_act_dropout(x, b, activation="swish", rate=0.1,
                                                                            key=k)),
        (ValueError, "rank >= 1", lambda: bias_act_dropout(x[0, 0], b, activation="relu", rate=0.1, key=k)),
        (TypeError, "key must be", lambda: bias_act_dropout(x, b, activation="relu", rate=0.1, key=x)),
        (ValueError, r"with seq_first, x must be \(len, batch, hidden\), got shape \(4, 16\)",
         lambda: bias_dropout_residual(x, b, r, rate=0.1, key=k, seq_first=True)),
        (ValueError, "seq_first must be a bool", lambda: bias_act_dropout(x, b, activation="relu", rate=0.1,
                                                                           key=k, seq_first=1)),
    ]
    for exc, msg, fn in cases:
        with pytest.raises(exc, match=msg):
            fn()


# ---------------------------------------------------------------- GPU
def _err(a, truth):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(truth, np.float64))))


def _np_act(v, act):
    from scipy.special import erf
    if act == "relu":
        return np.maximum(v, 0), (v > 0).astype(np.float64)
    if act == "gelu":
        cdf = 0.5 * (1 + erf(v / np.sqrt(2)))
        return v * cdf, cdf + v * np.exp(-0.5 * v * v) / np.sqrt(2 * np.pi)
    k, c = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(k * (v + c * v ** 3))
    return 0.5 * v * (1 + t), 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * c * v * v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(7, 769), (1, 123), (1025, 1024), (2, 64, 4097), (512, 8, 96)])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_vs_float64(dtype, shape, act):
    key = jax.random.key(12)
    keep = _mask(key, shape, RATE)
    scale = _random.keep_scale(RATE)
    x, b, r, dy = (a.astype(dtype) for a in _inputs(shape, jnp.float32, seed=2))
    keep64 = np.asarray(keep).astype(np.float64)
    x64, b64, r64, dy64 = (np.asarray(a, np.float64) for a in (x, b, r, dy))
    lead = tuple(range(len(shape) - 1))
    # float64 truths (numpy), outputs and grads
    v = x64 + b64
    bdr_truth = (r64 + keep64 * scale * v, keep64 * scale * dy64, np.sum(keep64 * scale * dy64, axis=lead), dy64)
    a64, da64 = _np_act(v, act)
    gx = keep64 * scale * dy64 * da64
    bad_truth = (keep64 * scale * a64, gx, np.sum(gx, axis=lead))

    def with_grads(f, args):
        y, vjp = jax.vjp(f, *args)
        return (y,) + vjp(dy)

    plain_bad_ = lambda x, b: plain_bad(x, b, act, keep, RATE)
    plain_bdr_ = lambda x, b, r: plain_bdr(x, b, r, keep, RATE)
    cases = [
        (lambda x, b, r: bias_dropout_residual(x, b, r, rate=RATE, key=key), plain_bdr_, (x, b, r), bdr_truth),
        (lambda x, b: bias_act_dropout(x, b, activation=act, rate=RATE, key=key), plain_bad_, (x, b), bad_truth),
    ]
    for fused, plain, args, truth in cases:
        xla = jax.jit(lambda *a: with_grads(plain, a))(*args)
        ours = jax.jit(lambda *a: with_grads(fused, a))(*args)
        for i, (o, w, t) in enumerate(zip(ours, xla, truth)):
            assert o.dtype == w.dtype and o.shape == w.shape
            mag = float(np.max(np.abs(t))) + 1.0
            floor = (1e-6 if dtype == jnp.float32 else 1e-3) * mag
            assert np.isfinite(np.asarray(o, np.float32)).all()
            assert _err(o, t) <= 2 * _err(w, t) + floor, (i, _err(o, t), _err(w, t))


@pytest.mark.sanitize
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 1024), (7, 769), (3, 5, 123)])
def test_gpu_masks_equal_reference(shape):
    key = jax.random.key(13)
    x, b, r, _ = _inputs(shape, jnp.bfloat16)
    # dx = mask * scale * dy with dy = 1 shows the mask exactly
    dx = jax.jit(jax.grad(lambda x: jnp.sum(bias_dropout_residual(x, b, r, rate=0.3, key=key)
                                            .astype(jnp.float32))))(x)
    keep = _mask(key, shape, 0.3)
    np.testing.assert_array_equal(np.asarray(dx != 0), np.asarray(keep))
    np.testing.assert_array_equal(np.asarray(dx, np.float32)[np.asarray(keep)],
                                  np.float32(jnp.bfloat16(_random.keep_scale(0.3))))
    # the CUDA forward equals the plain formula with the reference's mask (within one
    # bf16 rounding, in case XLA contracts the float32 multiply-add differently)
    got = jax.jit(lambda x, r: bias_dropout_residual(x, b, r, rate=0.3, key=key))(x, r)
    want = plain_bdr(x, b, r, keep, 0.3)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=2 ** -7)
    dropped = ~np.asarray(keep)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[dropped],
                                  np.asarray((r.astype(jnp.float32) + 0).astype(jnp.bfloat16), np.float32)[dropped])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(128, 256, 768), (7, 5, 123), (33, 3, 64)])
def test_gpu_seq_first_masks_equal_reference(dtype, shape):
    """The kernels number sequence-first rows in batch-first order (a row map of two
    dims, jax_ls2._random.row_map): their masks, forward and backward, are the
    reference's, which are the batch-first masks of the transpose."""
    x, b, r, dy = _inputs(shape, dtype)
    f, g = _seq_first_pair("relu", 0.3, jax.random.key(23))
    loss = lambda fn: lambda x, b, r: jnp.sum((fn(x, b, r) * dy).astype(jnp.float32))
    got = jax.jit(jax.value_and_grad(loss(f), (0, 1, 2)))(x, b, r)
    want = jax.jit(jax.value_and_grad(loss(g), (0, 1, 2)))(x, b, r)
    # relu keeps the zero pattern exact: the dropped elements must coincide
    gx, wx = np.asarray(got[1][0], np.float32), np.asarray(want[1][0], np.float32)
    np.testing.assert_array_equal(gx == 0, wx == 0)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, b, r)), np.asarray(jax.jit(g)(x, b, r)))


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_deterministic_exact():
    x, b, r, _ = _inputs((33, 4096), jnp.bfloat16)
    y = jax.jit(lambda x, b, r: bias_dropout_residual(x, b, r, rate=0.0, key=None))(x, b, r)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(plain_bdr(x, b, r, None, 0.0), np.float32))
    # odd row count and a hidden size off the vector path: every element written and finite
    x, b, _, _ = _inputs((33, 4097), jnp.bfloat16)
    y = jax.jit(lambda x, b: bias_act_dropout(x, b, activation="gelu", rate=0.1, key=jax.random.key(0)))(x, b)
    assert np.isfinite(np.asarray(y, np.float32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [768, 4096])
@pytest.mark.parametrize("option,value", [("dropout_rows_in_flight", 2), ("dropout_rows_in_flight", 4),
                                          ("dropout_rows_in_flight", 8), ("dropout_full_grid", 1),
                                          ("dropout_prefetch", 2)])
def test_gpu_launch_options_compute_the_same(option, value, hidden):
    """The launch variants a benchmark may time give the default's results: outputs and
    dx bit for bit, dbias (summed over another grid) within an ulp of bfloat16. Hidden
    768 and 4096 take different rows-in-flight defaults."""
    from numerics import assert_bf16_close, under_kernel_option
    x, b, r, dy = _inputs((1031, hidden), jnp.bfloat16)
    key = jax.random.key(12)

    def both(x, b, r, dy):
        y1, p1 = jax.vjp(lambda x, b: bias_dropout_residual(x, b, r, rate=0.1, key=key), x, b)
        y2, p2 = jax.vjp(lambda x, b: bias_act_dropout(x, b, activation="gelu", rate=0.1, key=key), x, b)
        return y1, y2, p1(dy), p2(dy)

    prog = jax.jit(both)
    want = jax.block_until_ready(prog(x, b, r, dy))
    got = under_kernel_option(option, value, prog, x, b, r, dy)
    for g, w in [(got[0], want[0]), (got[1], want[1]), (got[2][0], want[2][0]), (got[3][0], want[3][0])]:
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert_bf16_close(got[2][1], want[2][1])
    assert_bf16_close(got[3][1], want[3][1])
