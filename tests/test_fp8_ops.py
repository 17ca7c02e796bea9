"""The fused FP8 casts (jax_ls2.ops.fp8_cast): references against float64 truths and
against jax_ls2.fp8's quantize, input errors, vmap and sharding, lowering to the CUDA
targets, and (marker gpu) the kernels against the references.

How FP8 outputs are compared: a cast of the same float32 value must give the same
byte (round to nearest even, saturating, NaN kept), so `cast_transpose`, whose float32
value is the input itself, must match bit for bit. The other ops first compute a
float32 value by a sum (LayerNorm's statistics) or a transcendental function (GELU);
two correct implementations may differ there by a few float32 ulps, which changes the
FP8 byte only where the value lies that close to a rounding midpoint. `assert_fp8_match`
allows exactly that: equal bytes, or adjacent FP8 values whose midpoint is within the
float32 math's error bound of the float64 truth.
"""
from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ls2 import _ffi
from jax_ls2._dispatch import forget_choices
from jax_ls2.fp8 import E4M3, E5M2, fp8_max
from jax_ls2.fp8.dot import _quantize
from jax_ls2.ops import bias_gelu_fp8, cast_transpose, dgelu_cast_transpose_dbias, layer_norm_fp8, \
    layer_norm_fp8_backward
from numerics import assert_within_2x, compiled_text, f64, mesh8, shard

fp8_ops = importlib.import_module("jax_ls2.ops.fp8_cast")
ln_ops = importlib.import_module("jax_ls2.ops.layer_norm")

FORMATS = [E4M3, E5M2]
ACTS = ["gelu_tanh", "gelu", "relu"]
SQRT_HALF = 1 / np.sqrt(2.0)


# ---------------------------------------------------------------- helpers
def ordered(q) -> np.ndarray:
    """FP8 bytes as integers in the order of their values (sign-magnitude)."""
    b = np.asarray(q).view(np.uint8).astype(np.int64)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def fp8_truth(v64, scale, dtype) -> np.ndarray:
    """float64 values scaled and saturated, cast to FP8 by ml_dtypes (round to nearest
    even from float64), the rounding a float32 value would get if it had no error."""
    m = fp8_max(dtype)
    return np.clip(v64 * float(scale), -m, m).astype(dtype)


def assert_fp8_match(name, got, want, pre64, tol):
    """got and want (FP8 arrays) are equal byte for byte (all NaNs alike), except where
    both are correct roundings of values within `tol` (absolute, per element, in
    scaled units) of pre64, the float64 value before rounding: rounding is monotonic,
    so each must lie between the roundings of pre64 - tol and pre64 + tol."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(gn, wn, err_msg=f"{name}: NaN positions differ")
    diff = (ordered(got) != ordered(want)) & ~gn
    if not diff.any():
        return
    m = fp8_max(got.dtype)
    pre, bound = np.broadcast_to(pre64, got.shape), np.broadcast_to(tol, got.shape)
    lo = ordered(np.clip(pre - bound, -m, m).astype(got.dtype))
    hi = ordered(np.clip(pre + bound, -m, m).astype(got.dtype))
    # The values two correct float32 computations may round apart: those with a rounding
    # midpoint within `tol` of the truth. Their count is the most that may differ.
    ambiguous = (lo != hi) & ~gn
    for which, arr in (("got", got), ("want", want)):
        o = ordered(arr)
        bad = diff & ((o < lo) | (o > hi))
        if bad.any():
            where = np.argwhere(bad)[:6]
            raise AssertionError(
                f"{name}: {int(bad.sum())} of {int(diff.sum())} differing FP8 values ({which}) are not a rounding of "
                f"a value within the float32 error of the truth: {arr[bad][:6]} for scaled truths {pre[bad][:6]} "
                f"(the other side: {(want if which == 'got' else got)[bad][:6]}) at {where.tolist()}")
    assert diff.sum() <= ambiguous.sum(), (f"{name}: {int(diff.sum())} FP8 values differ, but only "
                                           f"{int(ambiguous.sum())} lie within the float32 error of a rounding midpoint")


def gelu64(v, activation):
    if activation == "relu":
        return np.maximum(v, 0.0)
    if activation == "gelu":
        from scipy.special import erf  # noqa: PLC0415
        return 0.5 * v * (1 + erf(v * SQRT_HALF))
    u = np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)
    return 0.5 * v * (1 + np.tanh(u))


def dgelu64(v, activation):
    if activation == "relu":
        return (v > 0).astype(np.float64)
    if activation == "gelu":
        from scipy.special import erf  # noqa: PLC0415
        return 0.5 * (1 + erf(v * SQRT_HALF)) + v * np.exp(-0.5 * v * v) / np.sqrt(2 * np.pi)
    k = np.sqrt(2 / np.pi)
    t = np.tanh(k * (v + 0.044715 * v ** 3))
    return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * 0.044715 * v * v)


def layer_norm64(x, gamma, beta, eps=1e-5):
    x, gamma, beta = f64(x), f64(gamma), f64(beta)
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    return xhat * gamma + beta, np.abs(xhat * gamma) + np.abs(beta), mu[..., 0], rstd[..., 0]


def rows_inputs(shape, dtype, seed):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    n = shape[-1]
    x = (jax.random.normal(k1, shape) * 2 + 0.5).astype(dtype)
    gamma = (1 + 0.3 * jax.random.normal(k2, (n,))).astype(dtype)
    beta = (0.2 * jax.random.normal(k3, (n,))).astype(dtype)
    g = jax.random.normal(k4, shape).astype(dtype)
    return x, gamma, beta, g


def scale_for(amax, dtype):
    """A delayed-scaling scale that saturates a few values (amax a bit under the real one)."""
    return jnp.float32(fp8_max(dtype) / (0.9 * float(amax)))


# LayerNorm's float32 value y = xhat * gamma + beta: the statistics' rounding errors
# scale with |xhat * gamma| and |beta| (magnitude64), a few hundred float32 ulps at most
# for rows of several thousand.
def ln_tol(magnitude64, scale):
    return 2e-5 * float(scale) * magnitude64 + 1e-30


# A float32 rounding, relative: the sum x + bias and the product with the scale each
# round once.
F32_ROUNDING = 2.0 ** -24


# GELU through the hardware's tanh/exp/erf approximations: within 1e-5 relative plus
# 2e-6 of |v| absolute (the bfloat16 paths of kernels/activation.cuh), scaled. relu is
# exact on the float32 sum v = x + bias: two roundings (the sum, the scale's product).
def act_tol(y64, v64, scale, activation="gelu_tanh"):
    if activation == "relu":
        return float(scale) * 2 * F32_ROUNDING * np.abs(v64)
    return float(scale) * (1e-5 * np.abs(y64) + 2e-6 * (1 + np.abs(v64)))


# Its derivative g * act'(v): the tanh form's polynomial multiplies the error of
# 1 - tanh by up to |v|^3. relu's derivative is exactly 0 or 1, so g * act'(v) is exact
# (g is float32 or narrower): only the scale's product rounds.
def dact_tol(d64, v64, g64, scale, activation="gelu_tanh"):
    if activation == "relu":
        return float(scale) * F32_ROUNDING * np.abs(g64 * d64)
    return float(scale) * np.abs(g64) * (1e-5 * np.abs(d64) + 1e-6 * (1 + np.abs(v64)) ** 3)


# ---------------------------------------------------------------- CPU: the quantize
@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_cast_is_the_recipes_quantize_and_rounds_to_nearest_even(dtype):
    """cast_transpose's reference is jax_ls2.fp8's clip-then-cast, and both equal an
    independent one (numpy float32 product, ml_dtypes' rounding) on values near every
    rounding midpoint, beyond the range, subnormal, infinite and NaN."""
    rng = np.random.default_rng(0)
    m = fp8_max(dtype)
    grid = np.array(sorted({float(v) for v in np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
                            if np.isfinite(v)}))
    mids = (grid[1:] + grid[:-1]) / 2
    near = np.concatenate([mids, np.nextafter(mids.astype(np.float32), np.inf), np.nextafter(mids.astype(np.float32), -np.inf)])
    special = np.array([0.0, -0.0, m, -m, m * 1.04, -m * 1.2, 1e30, np.inf, -np.inf, np.nan, 1e-9, -3e-7], np.float64)
    v = np.concatenate([near, special, rng.normal(size=997) * m / 3]).astype(np.float32)
    x = jnp.asarray(v.reshape(1, -1))
    scale = jnp.float32(1.0)
    q, q_t, amax = cast_transpose(x, scale, fp8_dtype=dtype)
    want = np.clip(v * np.float32(1.0), -m, m).astype(dtype)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8)[0][~np.isnan(v)], want.view(np.uint8)[~np.isnan(v)])
    assert np.isnan(np.asarray(q, np.float32)[0][np.isnan(v)]).all()
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(_quantize(x, scale, dtype)).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), np.asarray(q).view(np.uint8).T)
    assert np.isnan(float(amax))  # a NaN in the input makes the amax NaN, as jnp.max does
    finite = jnp.asarray(v[np.isfinite(v)].reshape(1, -1))
    assert float(cast_transpose(finite, scale, fp8_dtype=dtype)[2]) == float(np.max(np.abs(v[np.isfinite(v)])))


@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (3, 5, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_cast_transpose_reference(shape, dtype):
    x = (jax.random.normal(jax.random.key(shape[-1]), shape) * 3).astype(dtype)
    scale = scale_for(jnp.max(jnp.abs(x)), E4M3)
    q, q_t, amax = cast_transpose(x, scale)
    assert q.shape == shape and q_t.shape == (shape[-1], int(np.prod(shape[:-1]))) and q.dtype == q_t.dtype == E4M3
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(_quantize(x, scale, E4M3)).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), np.asarray(q).view(np.uint8).reshape(-1, shape[-1]).T)
    assert float(amax) == float(np.max(np.abs(f64(x))))


# ---------------------------------------------------------------- CPU: references against float64
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", [(1, 5), (7, 123), (2, 3, 769), (2, 4097)])
def test_layer_norm_fp8_reference_against_float64(shape, fmt):
    x, gamma, beta, _ = rows_inputs(shape, jnp.float32, seed=shape[-1])
    y64, mag, mu64, rstd64 = layer_norm64(x, gamma, beta)
    scale = scale_for(np.max(np.abs(y64)), fmt)
    q, amax, mean, rstd = jax.jit(lambda *a: layer_norm_fp8(*a, fp8_dtype=fmt))(x, gamma, beta, scale)
    assert q.shape == shape and q.dtype == fmt and mean.shape == rstd.shape == shape[:-1]
    assert_fp8_match("q", q, fp8_truth(y64, scale, fmt), y64 * float(scale), ln_tol(mag, scale))
    np.testing.assert_allclose(float(amax), np.max(np.abs(y64)), rtol=1e-5)
    np.testing.assert_allclose(mean, mu64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, rstd64, rtol=1e-5)
    # The same float32 value as layer_norm's forward, quantized as the FP8 GEMMs do.
    ym, _, _ = ln_ops._fwd_reference(x, gamma, beta, eps=1e-5)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(_quantize(ym, scale, fmt)).view(np.uint8))


def test_layer_norm_fp8_backward_is_layer_norms():
    x, gamma, beta, dy = rows_inputs((6, 96), jnp.float32, seed=3)
    _, _, mean, rstd = layer_norm_fp8(x, gamma, beta, jnp.float32(1.0))
    got = layer_norm_fp8_backward(dy, x, gamma, mean, rstd)
    _, vjp = jax.vjp(lambda x, g, b: ln_ops.layer_norm(x, g, b), x, gamma, beta)
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, vjp(dy)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (3, 2, 769)])
def test_bias_gelu_fp8_reference_against_float64(shape, activation):
    x, bias, _, _ = rows_inputs(shape, jnp.float32, seed=7)
    v64 = f64(x) + f64(bias)
    y64 = gelu64(v64, activation)
    scale = scale_for(max(np.max(np.abs(y64)), 1e-3), E4M3)
    q, amax = bias_gelu_fp8(x, bias, scale, activation=activation)
    assert q.shape == shape and q.dtype == E4M3
    assert_fp8_match("q", q, fp8_truth(y64, scale, E4M3), y64 * float(scale), act_tol(y64, v64, scale, activation))
    np.testing.assert_allclose(float(amax), np.max(np.abs(y64)), rtol=1e-5)


def test_bias_gelu_default_is_jax_tanh_gelu():
    x, bias, _, _ = rows_inputs((5, 64), jnp.float32, seed=8)
    scale = jnp.float32(20.0)
    q, _ = bias_gelu_fp8(x, bias, scale)
    want = _quantize(jax.nn.gelu(x + bias, approximate=True), scale, E4M3)
    y64 = gelu64(f64(x) + f64(bias), "gelu_tanh")
    assert_fp8_match("q", q, want, y64 * 20.0, act_tol(y64, f64(x) + f64(bias), scale))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (2, 3, 769)])
def test_dgelu_cast_transpose_dbias_reference_against_float64(shape, activation):
    pre, _, _, g = rows_inputs(shape, jnp.float32, seed=9)
    d64 = dgelu64(f64(pre), activation)
    dz64 = f64(g) * d64
    scale = scale_for(max(np.max(np.abs(dz64)), 1e-3), E5M2)
    q, q_t, amax, dbias = dgelu_cast_transpose_dbias(g, pre, scale, activation=activation)
    n = shape[-1]
    assert q.shape == shape and q_t.shape == (n, int(np.prod(shape[:-1]))) and dbias.shape == (n,)
    tol = dact_tol(d64, f64(pre), f64(g), scale, activation)
    assert_fp8_match("q", q, fp8_truth(dz64, scale, E5M2), dz64 * float(scale), tol)
    np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), np.asarray(q).view(np.uint8).reshape(-1, n).T)
    np.testing.assert_allclose(float(amax), np.max(np.abs(dz64)), rtol=1e-5)
    np.testing.assert_allclose(dbias, dz64.reshape(-1, n).sum(0), rtol=1e-4, atol=1e-5)
    assert dbias.dtype == jnp.float32
    assert dgelu_cast_transpose_dbias(g.astype(jnp.bfloat16), pre.astype(jnp.bfloat16), scale)[3].dtype == jnp.bfloat16


def test_fp8_comparison_takes_rounding_flips_only_where_the_truth_is_that_close():
    """assert_fp8_match accepts a value rounded the other way where a rounding midpoint
    lies within the tolerance of the truth, and rejects the pattern the dgelu kernel
    once gave (element 2 of every 4 a copy of element 0) and a flip anywhere else."""
    pre, _, _, g = rows_inputs((64, 64), jnp.float32, seed=9)
    d64 = dgelu64(f64(pre), "gelu_tanh")
    scale = scale_for(np.max(np.abs(f64(g) * d64)), E5M2)
    scaled, tol = f64(g) * d64 * float(scale), dact_tol(d64, f64(pre), f64(g), scale)
    want = fp8_truth(scaled, 1.0, E5M2)
    m = fp8_max(E5M2)
    lo = np.clip(scaled - tol, -m, m).astype(E5M2)
    hi = np.clip(scaled + tol, -m, m).astype(E5M2)
    ambiguous = ordered(lo) != ordered(hi)
    assert ambiguous.any()
    flipped = np.where(ambiguous & (ordered(want) == ordered(lo)), hi, np.where(ambiguous, lo, want))
    assert_fp8_match("flips", flipped, want, scaled, tol)
    copied = want.copy()
    copied[:, 2::4] = want[:, 0::4]
    with pytest.raises(AssertionError, match=r"copies: \d+ of \d+ differing FP8 values \(got\) are not a rounding"):
        assert_fp8_match("copies", copied, want, scaled, tol)
    sure = np.argwhere(~ambiguous & (np.abs(scaled) > 1))[0]
    off = want.copy()
    off[tuple(sure)] = -want[tuple(sure)]
    with pytest.raises(AssertionError, match="off: 1 of 1 differing"):
        assert_fp8_match("off", off, want, scaled, tol)


# ---------------------------------------------------------------- CPU: errors, autodiff, vmap, sharding
X = jnp.ones((4, 8), jnp.bfloat16)
V8 = jnp.ones((8,), jnp.bfloat16)
S = jnp.float32(1.0)
BAD = [
    (lambda: layer_norm_fp8(X, V8, V8, 1.0), TypeError, "layer_norm_fp8: scale must be an array, got float"),
    (lambda: layer_norm_fp8(X, V8, V8, jnp.ones((1,))), ValueError, r"layer_norm_fp8: scale must be a float32 scalar \(shape \(\)\), got shape \(1,\)"),
    (lambda: layer_norm_fp8(X, V8, V8, S.astype(jnp.bfloat16)), TypeError, r"layer_norm_fp8: scale must have dtype in \(float32\), got bfloat16"),
    (lambda: layer_norm_fp8(X, V8[:5], V8, S), ValueError, r"layer_norm_fp8: gamma must have shape \(8,\), got \(5,\)"),
    (lambda: layer_norm_fp8(X, V8, V8, S, fp8_dtype=jnp.bfloat16), ValueError, "layer_norm_fp8: fp8_dtype must be float8_e4m3fn or float8_e5m2, got"),
    (lambda: layer_norm_fp8(X, V8, V8, S, epsilon=0.0), ValueError, "layer_norm_fp8: epsilon must be a positive"),
    (lambda: layer_norm_fp8(X, V8, V8, S, epsilon=float("inf")), ValueError, "layer_norm_fp8: epsilon must be a positive finite Python float, got inf"),
    (lambda: layer_norm_fp8(X.astype(jnp.int32), V8, V8, S), TypeError, "layer_norm_fp8: x must have dtype in"),
    (lambda: bias_gelu_fp8(X, V8, S, activation="silu"), ValueError, r"bias_gelu_fp8: activation must be one of \('relu', 'gelu', 'gelu_tanh'\), got 'silu'"),
    (lambda: bias_gelu_fp8(X, V8[None], S), ValueError, r"bias_gelu_fp8: bias must have rank 1, got shape \(1, 8\)"),
    (lambda: cast_transpose(jnp.ones((4, 0)), S), ValueError, r"cast_transpose: x must have a non-empty last axis, got shape \(4, 0\)"),
    (lambda: cast_transpose(jnp.float32(1.0), S), ValueError, r"cast_transpose: x must have rank >= 1, got shape \(\)"),
    (lambda: cast_transpose(X, S, fp8_dtype="float8_e4m3fnuz"), ValueError, "cast_transpose: fp8_dtype must be float8_e4m3fn or float8_e5m2"),
    (lambda: dgelu_cast_transpose_dbias(X, X.astype(jnp.float32), S), TypeError, "dgelu_cast_transpose_dbias: pre must have dtype bfloat16"),
    (lambda: dgelu_cast_transpose_dbias(X, X[:2], S), ValueError, r"dgelu_cast_transpose_dbias: pre must have shape \(4, 8\), got \(2, 8\)"),
    (lambda: dgelu_cast_transpose_dbias(X, X, S, dbias_dtype=jnp.int8), TypeError, "dgelu_cast_transpose_dbias: dbias_dtype must be"),
    (lambda: layer_norm_fp8_backward(X, X, V8, jnp.ones((4,)), jnp.ones((3,))), ValueError, r"layer_norm_fp8_backward: rstd must have shape \(4,\), got \(3,\)"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_raises_a_named_error(i):
    call, exc, message = BAD[i]
    with pytest.raises(exc, match=message):
        call()


def test_no_derivative():
    x = jnp.ones((2, 8))
    with pytest.raises(NotImplementedError, match="cast_transpose: a forward-only FP8 cast has no derivative"):
        jax.grad(lambda x: cast_transpose(x, S)[2])(x)
    with pytest.raises(NotImplementedError, match="layer_norm_fp8: a forward-only"):
        jax.grad(lambda s: layer_norm_fp8(x, x[0], x[0], s)[1])(S)


def test_vmap_gives_each_example_its_own_amax_and_dbias():
    xs = jax.random.normal(jax.random.key(2), (3, 4, 16)) * jnp.arange(1.0, 4.0)[:, None, None]
    gamma, beta = jnp.ones(16), jnp.zeros(16)
    calls = {
        "layer_norm_fp8": lambda x: layer_norm_fp8(x, gamma, beta, S),
        "bias_gelu_fp8": lambda x: bias_gelu_fp8(x, beta, S),
        "cast_transpose": lambda x: cast_transpose(x, S),
        "dgelu_cast_transpose_dbias": lambda x: dgelu_cast_transpose_dbias(x, x, S),
    }
    for name, f in calls.items():
        batched = jax.vmap(f)(xs)
        for i in range(3):
            for b, o in zip(batched, f(xs[i])):
                b, o = np.asarray(b[i]), np.asarray(o)
                if o.dtype in (E4M3, E5M2):
                    np.testing.assert_array_equal(b.view(np.uint8), o.view(np.uint8), err_msg=name)
                else:  # XLA may fuse the mapped sums differently: ulps apart, not another example's
                    np.testing.assert_allclose(b, o, rtol=1e-5, atol=1e-5, err_msg=name)


def test_sharded_rows_are_not_gathered_and_amax_is_global():
    mesh = mesh8()
    x, gamma, beta, g = rows_inputs((64, 32), jnp.float32, seed=4)
    scale = jnp.float32(3.0)

    def all_ops(x, g):
        return (layer_norm_fp8(x, gamma, beta, scale), bias_gelu_fp8(x, beta, scale), cast_transpose(x, scale),
                dgelu_cast_transpose_dbias(g, x, scale))

    want = jax.jit(all_ops)(x, g)
    xs, gs = shard(x, mesh, "data"), shard(g, mesh, "data")
    got = jax.jit(all_ops)(xs, gs)
    for w, o in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        w, o = np.asarray(w), np.asarray(o)
        if w.dtype in (E4M3, E5M2):
            np.testing.assert_array_equal(o.view(np.uint8), w.view(np.uint8))
        else:
            np.testing.assert_allclose(o, w, rtol=1e-6, atol=1e-6)
    text = compiled_text(all_ops, xs, gs)
    assert "all-gather" not in text
    q_t = got[2][1]
    assert q_t.sharding.spec == P(None, "data")  # the transposed copy stays sharded along the rows


# ---------------------------------------------------------------- CPU: lowering for CUDA
OP_TARGETS = {
    "layer_norm_fp8": (lambda x: layer_norm_fp8(x, x[0], x[0], S), {"layer_norm_fp8_fwd"}),
    "layer_norm_fp8_backward": (lambda x: layer_norm_fp8_backward(x, x, x[0], *(x[:, 0].astype(jnp.float32),) * 2),
                                {"layer_norm_bwd"}),
    "bias_gelu_fp8": (lambda x: bias_gelu_fp8(x, x[0], S), {"bias_act_fp8"}),
    "cast_transpose": (lambda x: cast_transpose(x, S), {"cast_transpose_fp8"}),
    "dgelu_cast_transpose_dbias": (lambda x: dgelu_cast_transpose_dbias(x, x, S),
                                   {"dact_cast_transpose_dbias_fp8"}),
}


@pytest.fixture
def declared_targets(monkeypatch):
    """The module's targets declared registered, as if the extension were built:
    lowering only writes their names into the program."""
    names = frozenset(k.name for k in (fp8_ops._LN_FP8, fp8_ops._BIAS_ACT_FP8, fp8_ops._CAST_TRANSPOSE,
                                       fp8_ops._DACT, ln_ops._BWD))
    monkeypatch.setattr(_ffi, "_load", lambda: (names, None))
    forget_choices()
    yield names
    forget_choices()


@pytest.mark.parametrize("case", sorted(OP_TARGETS))
def test_lowering_for_cuda_calls_the_target(case, declared_targets):
    f, targets = OP_TARGETS[case]
    x = jnp.ones((16, 32), jnp.bfloat16)
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r"custom_call @jax_ls2_([a-z0-9_]+)", text)) == targets


def test_the_workspace_size_is_the_kernels_partial_row_bound():
    # mirrored with kMaxPartialRows in tests/test_contracts.py; here: the dgelu call asks
    # for that many partial rows.
    types = fp8_ops._dact_types(jnp.ones((4, 8)), jnp.ones((4, 8)), S, activation="gelu", fp8_dtype=E5M2)
    assert types[-1].shape == (fp8_ops.MAX_PARTS, 8)


# ---------------------------------------------------------------- GPU: kernels against references
GPU_DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
GPU_SHAPES = [(1, 123), (7, 769), (1025, 4097), (1025, 1024), (64, 4096)]


def _reference(kernel):
    """The op's pure-JAX reference, jitted (on the GPU here)."""
    return jax.jit(lambda *a, **s: kernel.reference(*a, **s), static_argnames=("eps", "fp8_dtype", "activation"))


# Each op jitted once, its static arguments (the FP8 format, the activation) named
# (jax.jit rejects a static name the function does not take).
_OPS = {"ln": (lambda x, g, b, s, fmt: layer_norm_fp8(x, g, b, s, fp8_dtype=fmt), ("fmt",)),
        "act": (lambda x, b, s, fmt, act: bias_gelu_fp8(x, b, s, fp8_dtype=fmt, activation=act), ("fmt", "act")),
        "ct": (lambda x, s, fmt: cast_transpose(x, s, fp8_dtype=fmt), ("fmt",)),
        "dact": (lambda g, p, s, fmt, act: dgelu_cast_transpose_dbias(g, p, s, fp8_dtype=fmt, activation=act),
                 ("fmt", "act"))}


@functools.lru_cache(maxsize=None)
def _compiled(name):
    fn, static = _OPS[name]
    return jax.jit(fn, static_argnames=static)


def test_the_gpu_tests_jitted_ops_take_their_static_arguments():
    """The GPU tests' jitted ops, run here on the references: every static name is an
    argument of its op (a GPU run is no place to find a harness error)."""
    x, gamma, beta, g = rows_inputs((3, 16), jnp.float32, seed=5)
    s = jnp.float32(2.0)
    want = {"ln": layer_norm_fp8(x, gamma, beta, s, fp8_dtype=E5M2)[0],
            "act": bias_gelu_fp8(x, beta, s, fp8_dtype=E5M2, activation="relu")[0],
            "ct": cast_transpose(x, s, fp8_dtype=E5M2)[0],
            "dact": dgelu_cast_transpose_dbias(g, x, s, fp8_dtype=E5M2, activation="relu")[0]}
    got = {"ln": _compiled("ln")(x, gamma, beta, s, fmt=E5M2)[0],
           "act": _compiled("act")(x, beta, s, fmt=E5M2, act="relu")[0],
           "ct": _compiled("ct")(x, s, fmt=E5M2)[0],
           "dact": _compiled("dact")(g, x, s, fmt=E5M2, act="relu")[0]}
    assert set(got) == set(_OPS)
    for name in _OPS:  # values, not bytes: a zero's sign may differ between jit and eager
        np.testing.assert_array_equal(ordered(got[name]), ordered(want[name]), err_msg=name)


def _nan_aware_equal(name, got, want):
    got, want = np.asarray(got), np.asarray(want)
    gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(gn, wn, err_msg=name)
    np.testing.assert_array_equal(got.view(np.uint8)[~gn], want.view(np.uint8)[~wn], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES + [(1, 1), (1024, 64)])
def test_gpu_cast_transpose_bit_exact(shape, dtype, fmt):
    """Bit for bit: the kernel and the reference cast the same float32 values. Any
    shape works; 16-byte loads need k % 8 == 0 (16-bit; k % 4 for float32) and 16-byte
    transposed stores m % 16 == 0, the other shapes take the narrower paths."""
    x = (jax.random.normal(jax.random.key(shape[0]), shape) * 4).astype(dtype)
    x = x.at[0, 0].set(jnp.inf).at[-1, -1].set(-1e30)
    scale = scale_for(8.0, fmt)
    q, q_t, amax = _compiled("ct")(x, scale, fmt=fmt)
    rq, rq_t, ramax = _reference(fp8_ops._CAST_TRANSPOSE)(x, scale, fp8_dtype=fmt)
    _nan_aware_equal("q", q, rq)
    _nan_aware_equal("q_t", q_t, rq_t)
    assert float(amax) == float(ramax)  # max is order independent: exact


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES + [(3, 20000)])
def test_gpu_layer_norm_fp8_against_reference(shape, dtype, fmt):
    """FP8 bytes equal, or one step apart at a rounding midpoint: the kernel's row sums
    add in another order than XLA's, so mean and rstd (and y) may differ by float32
    ulps. amax within those ulps; mean and rstd within 2x XLA's float32 error."""
    x, gamma, beta, _ = rows_inputs(shape, dtype, seed=shape[-1])
    y64, mag, mu64, rstd64 = layer_norm64(x, gamma, beta)
    scale = scale_for(np.max(np.abs(y64)), fmt)
    q, amax, mean, rstd = _compiled("ln")(x, gamma, beta, scale, fmt=fmt)
    rq, ramax, rmean, rrstd = _reference(fp8_ops._LN_FP8)(x, gamma, beta, scale, eps=1e-5, fp8_dtype=fmt)
    assert_fp8_match("q vs reference", q, rq, y64 * float(scale), ln_tol(mag, scale))
    np.testing.assert_allclose(float(amax), float(ramax), rtol=2e-5)
    assert_within_2x("mean", mean, rmean, mu64, floor=1e-6)
    assert_within_2x("rstd", rstd, rrstd, rstd64)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_bias_gelu_fp8_against_reference(shape, dtype, activation):
    """FP8 bytes equal, or one step apart where the float32 GELU values of the kernel
    (hardware exp/tanh approximations on bfloat16) and XLA's differ across a midpoint."""
    x, bias, _, _ = rows_inputs(shape, dtype, seed=11)
    v64 = f64(x) + f64(bias)
    y64 = gelu64(v64, activation)
    for fmt in FORMATS:
        scale = scale_for(np.max(np.abs(y64)), fmt)
        q, amax = _compiled("act")(x, bias, scale, fmt=fmt, act=activation)
        rq, ramax = _reference(fp8_ops._BIAS_ACT_FP8)(x, bias, scale, activation=activation, fp8_dtype=fmt)
        assert_fp8_match(f"q {fmt}", q, rq, y64 * float(scale), act_tol(y64, v64, scale, activation))
        np.testing.assert_allclose(float(amax), float(ramax), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES + [(20000, 64)])
def test_gpu_dgelu_cast_transpose_dbias_against_reference(shape, dtype, activation):
    """dz's FP8 bytes as for bias_gelu_fp8 (same activation derivative math), the
    transposed copy the transpose of the kernel's own bytes, dbias within 2x of XLA's
    error in the bias dtype against a float64 truth."""
    pre, _, _, g = rows_inputs(shape, dtype, seed=12)
    d64 = dgelu64(f64(pre), activation)
    dz64 = f64(g) * d64
    scale = scale_for(np.max(np.abs(dz64)), E5M2)
    q, q_t, amax, dbias = _compiled("dact")(g, pre, scale, fmt=E5M2, act=activation)
    rq, _, ramax, rdbias = _reference(fp8_ops._DACT)(g, pre, scale, activation=activation, fp8_dtype=E5M2)
    tol = dact_tol(d64, f64(pre), f64(g), scale, activation)
    assert_fp8_match("q", q, rq, dz64 * float(scale), tol)
    _nan_aware_equal("q_t", q_t, np.asarray(q).reshape(-1, shape[-1]).T)
    np.testing.assert_allclose(float(amax), float(ramax), rtol=1e-5)
    assert dbias.dtype == dtype
    assert_within_2x("dbias", dbias, rdbias.astype(dtype), dz64.sum(0), floor=1e-6)


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_small_cases_write_every_element_and_propagate_nan():
    """The handlers fill their outputs with NaN first (JAX_LS2_POISON_OUTPUTS=1, set by
    conftest): every equality above fails on an unwritten byte. Here: a NaN input gives
    NaN at its place and a NaN amax, as in the reference; the programs call the kernels."""
    x, gamma, beta, g = rows_inputs((37, 72), jnp.bfloat16, seed=13)
    x = x.at[3, 5].set(jnp.nan)
    scale = jnp.float32(10.0)
    outs = {"ln": _compiled("ln")(x, gamma, beta, scale, fmt=E4M3)[:2],
            "act": _compiled("act")(x, beta, scale, fmt=E4M3, act="gelu_tanh"),
            "ct": _compiled("ct")(x, scale, fmt=E4M3)[::2],
            "dact": _compiled("dact")(g, x, scale, fmt=E5M2, act="gelu")[::2]}
    for name, (q, amax) in outs.items():
        nan = np.isnan(np.asarray(q, np.float32))
        assert np.isnan(float(amax)), name
        assert nan[3].any() and nan.sum() == (72 if name == "ln" else 1), name
    text = compiled_text(lambda x, s: (cast_transpose(x, s), dgelu_cast_transpose_dbias(x, x, s)), x, scale)
    assert "jax_ls2_cast_transpose_fp8" in text and "jax_ls2_dact_cast_transpose_dbias_fp8" in text
