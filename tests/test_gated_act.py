"""gated_act_dropout: reference vs plain formulas (jax.nn activations, the shared mask),
gradients, dropout statistics and key behaviour, transformations, sharding, bad inputs;
on the GPU, the kernels against a float64 truth and the reference's masks."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ls2 import _random
from jax_ls2.ops import gated_act_dropout
from numerics import assert_close, assert_within_2x, compiled_text, f64, mesh8, shard

ACTS = ("swiglu", "geglu", "geglu_tanh")
RATE = 0.1
KEY = jax.random.key(7)
_PLAIN_ACT = {"swiglu": jax.nn.silu, "geglu": lambda v: jax.nn.gelu(v, approximate=False),
              "geglu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}


def plain_gated(x, act, keep=None, rate=0.0, compute=jnp.float32):
    f = x.shape[-1] // 2
    y = _PLAIN_ACT[act](x[..., :f].astype(compute)) * x[..., f:].astype(compute)
    if keep is not None:
        y = jnp.where(keep, y * _random.keep_scale(rate), 0.0)
    return y.astype(x.dtype)


def mask(key, shape, rate):
    """Keep flags of the (rows..., ffn) output: each element numbered by its flat index."""
    return _random.keep_mask(_random.seed_words(key), shape, _random.dropout_threshold(rate))


def inputs(shape, dtype=jnp.float32, seed=0):
    """x and a cotangent of the output from NumPy (no compiled program needed)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(1.5 * rng.standard_normal(shape, np.float32)).astype(dtype)
    dy = jnp.asarray(rng.standard_normal(shape[:-1] + (shape[-1] // 2,), np.float32)).astype(dtype)
    return x, dy


@pytest.mark.parametrize("act", ACTS)
def test_matches_plain_formula_with_and_without_dropout(act):
    @jax.jit
    def run(x, dy):
        keep = mask(KEY, dy.shape, RATE)
        ours = lambda x: gated_act_dropout(x, activation=act, rate=RATE, key=KEY)
        plain = lambda x: plain_gated(x, act, keep, RATE)
        return ((gated_act_dropout(x, activation=act), plain_gated(x, act), 2e-6), (ours(x), plain(x), 2e-6),
                (jax.vjp(ours, x)[1](dy)[0], jax.vjp(plain, x)[1](dy)[0], 1e-5))

    for shape in ((4, 32), (3, 5, 246)):
        for a, b, tol in run(*inputs(shape, seed=shape[-1])):
            assert_close(a, b, tol)


def test_deterministic_and_rate_zero_are_exactly_undropped():
    x, _ = inputs((6, 64), jnp.bfloat16)
    want = gated_act_dropout(x)
    np.testing.assert_array_equal(gated_act_dropout(x, rate=0.3, key=KEY, deterministic=True), want)
    np.testing.assert_array_equal(gated_act_dropout(x, rate=0.0, key=KEY), want)
    assert want.dtype == jnp.bfloat16 and want.shape == (6, 32)


def test_dropout_statistics_and_keys():
    x, _ = inputs((64, 512), seed=1)
    y = gated_act_dropout(x, rate=0.25, key=KEY)
    y0 = gated_act_dropout(x)
    kept = np.asarray(y != 0)
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(y0)[kept] / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(gated_act_dropout(x, rate=0.25, key=KEY), y)
    assert not np.array_equal(gated_act_dropout(x, rate=0.25, key=jax.random.key(8)) != 0, kept)


def test_transformations():
    x, dy = inputs((4, 6, 32), seed=2)
    # vmap: every example draws the mask it would draw alone.
    one = lambda x: gated_act_dropout(x, rate=RATE, key=KEY)
    v, alone = jax.jit(lambda x: (jax.vmap(one)(x), [one(x[i]) for i in range(x.shape[0])]))(x)
    for i in range(x.shape[0]):
        assert_close(v[i], alone[i], 0)

    def body(h, k):
        y = jax.checkpoint(lambda h: gated_act_dropout(h, activation="geglu", rate=RATE, key=k))(h)
        return jnp.concatenate([y, y * 0.5], -1), None

    keys = jax.random.split(KEY, 2)
    scan_loss = lambda x: jnp.sum(jax.lax.scan(body, x, keys)[0] ** 2)

    def unrolled(x):
        for i in range(len(keys)):
            y = plain_gated(x, "geglu", mask(keys[i], x.shape[:-1] + (x.shape[-1] // 2,), RATE), RATE)
            x = jnp.concatenate([y, y * 0.5], -1)
        return jnp.sum(x ** 2)

    assert_close(*jax.jit(lambda x: (jax.grad(scan_loss)(x), jax.grad(unrolled)(x)))(x), 1e-4)


@pytest.mark.parametrize("spec", [("data",), (None, "data")], ids=["rows", "sequence"])
def test_sharded_jit_draws_the_unsharded_mask_without_all_gather(spec):
    mesh = mesh8()
    x, dy = inputs((16, 8, 40), seed=3)
    f = jax.jit(lambda x, dy: jax.value_and_grad(
        lambda x: jnp.sum(gated_act_dropout(x, activation="geglu_tanh", rate=RATE, key=KEY) * dy))(x))
    xs, dys = shard(x, mesh, *spec), shard(dy, mesh, *spec)
    val, grad = f(xs, dys)
    pv, pg = jax.jit(lambda x, dy: jax.value_and_grad(
        lambda x: jnp.sum(plain_gated(x, "geglu_tanh", mask(KEY, dy.shape, RATE), RATE) * dy))(x))(x, dy)
    assert_close(val, pv, 1e-5)
    assert_close(grad, pg, 1e-5)
    assert tuple(grad.sharding.spec)[:len(spec)] == spec
    assert "all-gather" not in compiled_text(f, xs, dys)


def test_shard_map_with_shard_spec_draws_the_unsharded_mask():
    mesh = mesh8()
    x, dy = inputs((16, 24), seed=5)
    one = lambda x: gated_act_dropout(x, rate=RATE, key=KEY, shard_spec=P("data"))
    sm = jax.jit(jax.shard_map(lambda x, dy: (one(x), jax.vjp(one, x)[1](dy)[0]), mesh=mesh,
                               in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))))
    whole = lambda x: gated_act_dropout(x, rate=RATE, key=KEY)
    want = jax.jit(lambda x, dy: (whole(x), jax.vjp(whole, x)[1](dy)[0]))(x, dy)
    for a, b in zip(sm(x, dy), want):
        assert_close(a, b, 0)
    with pytest.raises(ValueError, match=r"gated_act_dropout: x's last axis \(\[gate \| up\]\) cannot be split"):
        gated_act_dropout(x, rate=RATE, key=KEY, shard_spec=P(None, "data"))


def test_bad_inputs():
    x, _ = inputs((4, 8))
    with pytest.raises(ValueError, match=r"gated_act_dropout: x's last axis must be 2 \* ffn"):
        gated_act_dropout(x[:, :7])
    with pytest.raises(TypeError, match="gated_act_dropout: x must have dtype"):
        gated_act_dropout(x.astype(jnp.int32))
    with pytest.raises(ValueError, match="gated_act_dropout: activation must be one of"):
        gated_act_dropout(x, activation="relu")
    with pytest.raises(ValueError, match="gated_act_dropout: key is required when rate > 0"):
        gated_act_dropout(x, rate=0.1)
    with pytest.raises(ValueError, match=r"gated_act_dropout: rate must be in \[0, 1\)"):
        gated_act_dropout(x, rate=1.0, key=KEY)
    with pytest.raises(TypeError, match="gated_act_dropout: deterministic must be a Python bool"):
        gated_act_dropout(x, deterministic="yes")
    with pytest.raises(ValueError, match="gated_act_dropout: key must be a single PRNG key"):
        gated_act_dropout(x, rate=0.1, key=jax.random.split(KEY, 2))
    with pytest.raises(NotImplementedError, match="second derivatives"):
        jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(gated_act_dropout(x) ** 2))(x)))(x)


def _check_infinite_gates(act, dtype):
    """A gate of -inf gives 0 (act(-inf) * up, the limit) and zero gradients, +inf gives
    up * inf and dgate = dy * up: no NaN from inf * 0 (run on the default device, so on
    the GPU it checks the kernel)."""
    x, dy = inputs((3, 2 * 40), dtype, seed=5)
    f = 40
    x = x.at[0, 3].set(-jnp.inf).at[1, :f].set(-jnp.inf).at[2, 7].set(jnp.inf)
    y, pull = jax.jit(lambda x: jax.vjp(lambda x: gated_act_dropout(x, activation=act), x))(x)
    dx = np.asarray(jax.jit(pull)(dy)[0], np.float32)
    y, x32, dy32 = (np.asarray(a, np.float32) for a in (y, x, dy))
    assert y[0, 3] == 0 and np.all(y[1] == 0) and not np.isnan(y).any()
    assert y[2, 7] == np.inf * x32[2, f + 7]
    assert dx[0, 3] == 0 and dx[0, f + 3] == 0 and np.all(dx[1] == 0)
    np.testing.assert_allclose(dx[2, 7], dy32[2, 7] * x32[2, f + 7], rtol=1e-2)
    # with dropout, a dropped infinite element is 0 too (and a kept one inf)
    yd = np.asarray(jax.jit(lambda x: gated_act_dropout(x, activation=act, rate=0.5, key=KEY))(x), np.float32)
    assert not np.isnan(yd).any() and yd[1].tolist() == [0.0] * f
    # elsewhere as before
    finite = np.isfinite(x32[:, :f])
    want = np.asarray(plain_gated(jnp.where(jnp.isinf(x), 0, x), act), np.float32)
    np.testing.assert_allclose(y[finite], want[finite], rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("act", ACTS)
def test_infinite_gate_gives_the_limit_not_nan(act):
    _check_infinite_gates(act, jnp.float32)


# ---------------------------------------------------------------- GPU
GPU_SHAPES = [(7, 246), (1025, 1538), (64, 8194), (2048, 8192), (4096, 2 * 11008), (3, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_gpu_against_float64_truth(dtype, shape, act):
    x, dy = inputs(shape, dtype, seed=shape[-1])
    keep = mask(KEY, dy.shape, RATE)
    ours = lambda x: gated_act_dropout(x, activation=act, rate=RATE, key=KEY)
    xla = lambda x, compute=jnp.float32: plain_gated(x, act, keep, RATE, compute)
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        x64, dy64 = (jax.device_put(jnp.asarray(f64(a)), cpu) for a in (x, dy))
        keep64 = jax.device_put(keep, cpu)
        f64_fn = lambda x: plain_gated(x, act, keep64, RATE, jnp.float64)
        truth_y, pull = jax.vjp(f64_fn, x64)
        truth_dx = pull(dy64)[0]
    assert_within_2x("y", jax.jit(ours)(x), jax.jit(xla)(x), truth_y)
    dx = jax.jit(lambda x, dy: jax.vjp(ours, x)[1](dy)[0])(x, dy)
    dx_xla = jax.jit(lambda x, dy: jax.vjp(xla, x)[1](dy)[0])(x, dy)
    assert_within_2x("dx", dx, dx_xla, truth_dx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_infinite_gate_gives_the_limit_not_nan(act, dtype):
    _check_infinite_gates(act, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7, 246), (513, 2 * 1027), (2048, 8192)], ids=str)
def test_gpu_masks_equal_reference(shape):
    """The kernel drops exactly the elements the reference drops, forward and backward."""
    x, dy = inputs(shape, jnp.float32, seed=4)
    y = jax.jit(lambda x: gated_act_dropout(x, rate=0.3, key=KEY))(x)
    dx = jax.jit(lambda x, dy: jax.vjp(lambda x: gated_act_dropout(x, rate=0.3, key=KEY), x)[1](dy)[0])(x, dy)
    keep = np.asarray(mask(KEY, dy.shape, 0.3))
    np.testing.assert_array_equal(np.asarray(y) != 0, keep)
    # NumPy's float32 normals include exact zeros (one in (2048, 4096) at seed 4): there
    # the up-gradient is 0 whatever the mask.
    np.testing.assert_array_equal(np.asarray(dx[..., shape[-1] // 2:]) != 0, keep & (np.asarray(dy) != 0))


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_every_output_element_written_and_kernels_called():
    assert os.environ.get("JAX_LS2_POISON_OUTPUTS") == "1"
    x, dy = inputs((1027, 2 * 777), jnp.bfloat16, seed=11)
    f = lambda x: gated_act_dropout(x, rate=RATE, key=KEY)
    y = jax.jit(f)(x)
    dx = jax.jit(lambda x, dy: jax.vjp(f, x)[1](dy)[0])(x, dy)
    assert bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(jnp.isfinite(dx)))
    def y_and_dx(x, dy):  # y returned too, or XLA drops the unused forward call
        y, pull = jax.vjp(f, x)
        return y, pull(dy)[0]
    text = compiled_text(y_and_dx, x, dy)
    assert "jax_ls2_gated_act_dropout_fwd" in text and "jax_ls2_gated_act_dropout_bwd" in text
