"""Fused casts to FP8 with the amax taken in the same pass over memory.

Every cast here is ``q = fp8(clip(v * scale, -fp8_max, fp8_max))`` of a float32 value
``v``, rounded to nearest even, NaN staying NaN (the clip-then-cast of
``jax_ls2.fp8``'s GEMMs), and ``amax = max |v|`` over the un-scaled float32 values
(NaN where any is NaN). ``scale`` is a float32 scalar array (a delayed scale changes
every step, so it is an operand, not a compile-time constant).

These are forward-only primitives for FP8 GEMM wrappers to compose: they define no
derivative (``jax.grad`` through them raises), and each of them is one FFI kernel on
CUDA, the pure-JAX reference of the same math elsewhere. Under ``vmap`` each example
gets its own amax; under a ``jit`` with inputs sharded along their leading dims the
amax is max-reduced across shards (and dbias summed) without gathering the inputs.

* `layer_norm_fp8`: LayerNorm whose output is written as FP8 (mean and rstd kept for
  `layer_norm_fp8_backward`, the LayerNorm backward of `jax_ls2.ops.layer_norm`).
* `bias_gelu_fp8`: ``gelu(x + bias)`` written as FP8.
* `cast_transpose`: ``x`` as FP8 in its own layout and transposed (Hopper's FP8 GEMMs
  take K-major operands, so a backward GEMM needs the transposed copy).
* `dgelu_cast_transpose_dbias`: GELU's backward ``dz = g * gelu'(pre)`` written as
  FP8 and transposed FP8, with ``dbias = sum over rows of dz``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2._dispatch import COLS, MAX, PARAM, ROWS, SUM, FusedKernel, Role, match_varying, result_type
from jax_ls2.ops import _checks, _normalization
from jax_ls2.ops._fp8_formats import E4M3, E5M2, quantize as _quantize
from jax_ls2.ops._limits import MAX_PARTS
from jax_ls2.ops.dropout import _ACT_CODE, ACTIVATIONS, _act, _act_grad
from jax_ls2.ops.layer_norm import _BWD as _LAYER_NORM_BWD, _stats

F32 = jnp.float32


# ---------------------------------------------------------------- reference math
def _amax(v):
    return jnp.max(jnp.abs(v), initial=np.float32(0)).astype(F32)


def _ln_fp8_ref(x, gamma, beta, scale, *, eps, fp8_dtype):
    mean, rstd = _stats(x, eps)
    y = (x.astype(F32) - mean[..., None]) * rstd[..., None] * gamma.astype(F32) + beta.astype(F32)
    return _quantize(y, scale, fp8_dtype), _amax(y), mean, rstd


def _bias_act_fp8_ref(x, bias, scale, *, activation, fp8_dtype):
    y = _act(x.astype(F32) + bias.astype(F32), activation)
    return _quantize(y, scale, fp8_dtype), _amax(y)


def _cast_transpose_ref(x, scale, *, fp8_dtype):
    q = _quantize(x.astype(F32), scale, fp8_dtype)
    return q, q.T, _amax(x.astype(F32))


def _dact_ref(g, pre, scale, *, activation, fp8_dtype):
    dz = g.astype(F32) * _act_grad(pre.astype(F32), activation)
    q = _quantize(dz, scale, fp8_dtype)
    return q, q.T, _amax(dz), jnp.sum(dz, axis=0)


# ---------------------------------------------------------------- CUDA calls
def _scalar(x):
    return result_type(x, (), F32)


def _ln_fp8_types(x, gamma, beta, scale, *, eps, fp8_dtype):
    lead = x.shape[:-1]
    return result_type(x, dtype=fp8_dtype), _scalar(x), result_type(x, lead, F32), result_type(x, lead, F32)


def _bias_act_fp8_types(x, bias, scale, *, activation, fp8_dtype):
    return result_type(x, dtype=fp8_dtype), _scalar(x)


def _cast_transpose_types(x, scale, *, fp8_dtype):
    m, k = x.shape
    return result_type(x, dtype=fp8_dtype), result_type(x, (k, m), fp8_dtype), _scalar(x)


def _dact_types(g, pre, scale, *, activation, fp8_dtype):
    m, n = g.shape
    return (result_type(g, dtype=fp8_dtype), result_type(g, (n, m), fp8_dtype), _scalar(g),
            result_type(g, (n,), F32), result_type(g, (MAX_PARTS, n), F32))


def _eps_attr(*arrays, eps, fp8_dtype):
    return dict(eps=np.float32(eps))


def _act_attr(*arrays, activation, fp8_dtype):
    return dict(activation=np.int32(_ACT_CODE[activation]))


_R1, _R0, _P, _MAX = Role(ROWS, 1), Role(ROWS, 0), Role(PARAM), Role(MAX)
# The amax is one value per call, so a vmapped FFI call must run example by example.
_LN_FP8 = FusedKernel("jax_ls2_layer_norm_fp8_fwd", _ln_fp8_ref, operands=(_R1, _P, _P, _P),
                      results=(_R1, _MAX, _R0, _R0), result_types=_ln_fp8_types, attrs=_eps_attr,
                      vmap_method="sequential")
_BIAS_ACT_FP8 = FusedKernel("jax_ls2_bias_act_fp8", _bias_act_fp8_ref, operands=(_R1, _P, _P),
                            results=(_R1, _MAX), result_types=_bias_act_fp8_types, attrs=_act_attr,
                            vmap_method="sequential")
_CAST_TRANSPOSE = FusedKernel("jax_ls2_cast_transpose_fp8", _cast_transpose_ref, operands=(_R1, _P),
                              results=(_R1, Role(COLS, 1), _MAX), result_types=_cast_transpose_types,
                              vmap_method="sequential")
_DACT = FusedKernel("jax_ls2_dact_cast_transpose_dbias_fp8", _dact_ref, operands=(_R1, _R1, _P),
                    results=(_R1, Role(COLS, 1), _MAX, Role(SUM)), result_types=_dact_types, attrs=_act_attr,
                    vmap_method="sequential")


# ---------------------------------------------------------------- validation
def _check_fp8_dtype(op, fp8_dtype):
    formats = E4M3, E5M2
    try:
        dt = jnp.dtype(fp8_dtype)
    except TypeError:
        dt = None
    if dt not in formats:
        raise ValueError(f"{op}: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype!r}")
    return dt


def _check_scale(op, scale):
    _checks.check_array(op, "scale", scale, dtypes=(jnp.dtype(F32),))
    if scale.shape != ():
        raise ValueError(f"{op}: scale must be a float32 scalar (shape ()), got shape {tuple(scale.shape)}")


def _check_activation(op, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_rows(op, name, x):
    _checks.check_array(op, name, x, min_ndim=1)
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: {name} must have a non-empty last axis, got shape {tuple(x.shape)}")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _forward_only(op, arrays):
    """``arrays`` unchanged, with a derivative rule that raises: these casts have none."""
    return arrays


@_forward_only.defjvp
def _forward_only_jvp(op, primals, tangents):
    raise NotImplementedError(f"{op}: a forward-only FP8 cast has no derivative; compose it inside a "
                              f"custom_vjp (an FP8 GEMM) whose backward is written out")


def _grad_free(op, *arrays):
    return _forward_only(op, arrays)


# ---------------------------------------------------------------- public ops
def layer_norm_fp8(x, gamma, beta, scale, *, fp8_dtype=jnp.float8_e4m3fn, epsilon: float = 1e-5):
    """LayerNorm over the last axis with its output written as FP8.

    ``y = (x - mean) * rstd * gamma + beta`` in float32 (the math of
    `jax_ls2.ops.layer_norm`'s forward), then ``q = fp8(clip(y * scale))`` and
    ``amax = max |y|``. Forward only: for the gradient use `layer_norm_fp8_backward`
    with the returned mean and rstd.

    Args:
      x: ``(..., hidden)`` float32, float16 or bfloat16.
      gamma, beta: ``(hidden,)`` floating; read in ``x.dtype``.
      scale: float32 scalar array, the FP8 scale of ``y``.
      fp8_dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
      epsilon: added to the variance.

    Returns:
      ``(q, amax, mean, rstd)``: ``q`` ``(..., hidden)`` in ``fp8_dtype``; ``amax``
      float32 ``()``; ``mean`` and ``rstd`` float32 ``(...)``.
    """
    op = "layer_norm_fp8"
    _check_rows(op, "x", x)
    h = x.shape[-1]
    for name, p in (("gamma", gamma), ("beta", beta)):
        _checks.check_array(op, name, p, ndim=1)
        _checks.check_shape(op, name, p, (h,))
    _check_scale(op, scale)
    dt = _check_fp8_dtype(op, fp8_dtype)
    _normalization.check_epsilon(op, epsilon)
    x, gamma, beta, scale = _grad_free(op, *match_varying(x, gamma.astype(x.dtype), beta.astype(x.dtype), scale))
    return _LN_FP8(x, gamma, beta, scale, eps=float(epsilon), fp8_dtype=dt)


def layer_norm_fp8_backward(dy, x, gamma, mean, rstd):
    """The LayerNorm backward (`jax_ls2.ops.layer_norm`'s kernel) for `layer_norm_fp8`.

    Args:
      dy: ``(..., hidden)`` cotangent of the LayerNorm output, in ``x.dtype``.
      x: ``(..., hidden)`` float32, float16 or bfloat16: the input of `layer_norm_fp8`.
      gamma: ``(hidden,)`` floating; read in ``x.dtype``.
      mean, rstd: float32 ``(...)`` as `layer_norm_fp8` returned them.

    Returns:
      ``(dx, dgamma, dbeta)``: ``dx`` like ``x``; ``dgamma`` and ``dbeta``
      ``(hidden,)`` in ``gamma.dtype`` (summed in float32).
    """
    op = "layer_norm_fp8_backward"
    _check_rows(op, "x", x)
    _checks.check_array(op, "dy", dy)
    _checks.check_shape(op, "dy", dy, x.shape)
    _checks.check_same_dtype(op, "dy", dy, x.dtype)
    _checks.check_array(op, "gamma", gamma, ndim=1)
    _checks.check_shape(op, "gamma", gamma, x.shape[-1:])
    for name, s in (("mean", mean), ("rstd", rstd)):
        _checks.check_array(op, name, s, dtypes=(jnp.dtype(F32),))
        _checks.check_shape(op, name, s, x.shape[:-1])
    dy, x, g, mean, rstd = match_varying(dy, x, gamma.astype(x.dtype), mean, rstd)
    dx, dg, db = _LAYER_NORM_BWD(dy, x, g, mean, rstd)
    return dx, dg.astype(gamma.dtype), db.astype(gamma.dtype)


def bias_gelu_fp8(x, bias, scale, *, fp8_dtype=jnp.float8_e4m3fn, activation: str = "gelu_tanh"):
    """``y = gelu(x + bias)`` in float32, written as FP8 with its amax.

    ``q = fp8(clip(y * scale))``, ``amax = max |y|``. Forward only (no derivative:
    `dgelu_cast_transpose_dbias` is the matching backward piece).

    Args:
      x: ``(..., n)`` float32, float16 or bfloat16.
      bias: ``(n,)`` floating; read in ``x.dtype``.
      scale: float32 scalar array.
      fp8_dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
      activation: ``"gelu_tanh"`` (default; ``jax.nn.gelu(approximate=True)``),
        ``"gelu"`` (erf; ``approximate=False``) or ``"relu"``, the activations of
        `jax_ls2.ops.bias_act_dropout` and the layers.

    Returns:
      ``(q, amax)``: ``q`` ``(..., n)`` in ``fp8_dtype``, ``amax`` float32 ``()``.
    """
    op = "bias_gelu_fp8"
    _check_rows(op, "x", x)
    _checks.check_array(op, "bias", bias, ndim=1)
    _checks.check_shape(op, "bias", bias, x.shape[-1:])
    _check_scale(op, scale)
    dt = _check_fp8_dtype(op, fp8_dtype)
    _check_activation(op, activation)
    x, bias, scale = _grad_free(op, *match_varying(x, bias.astype(x.dtype), scale))
    return _BIAS_ACT_FP8(x, bias, scale, activation=activation, fp8_dtype=dt)


def cast_transpose(x, scale, *, fp8_dtype=jnp.float8_e4m3fn):
    """``x`` cast to FP8 in its own layout and transposed, with its amax.

    Args:
      x: ``(..., k)`` float32, float16 or bfloat16; the leading dims are flattened to
        ``m`` rows. Any sizes; the kernel is fastest with ``k`` a multiple of 8
        (16-bit; 4 for float32) and ``m`` a multiple of 16.
      scale: float32 scalar array.
      fp8_dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.

    Returns:
      ``(q, q_t, amax)``: ``q = fp8(clip(x * scale))`` ``(..., k)``, ``q_t`` its
      transpose ``(k, m)`` (both ``fp8_dtype``), ``amax = max |x|`` float32 ``()``.
      Forward only (no derivative).
    """
    op = "cast_transpose"
    _check_rows(op, "x", x)
    _check_scale(op, scale)
    dt = _check_fp8_dtype(op, fp8_dtype)
    x, scale = _grad_free(op, *match_varying(x, scale))
    q, q_t, amax = _CAST_TRANSPOSE(x.reshape(-1, x.shape[-1]), scale, fp8_dtype=dt)
    return q.reshape(x.shape), q_t, amax


def dgelu_cast_transpose_dbias(g, pre, scale, *, fp8_dtype=jnp.float8_e5m2, activation: str = "gelu_tanh",
                               dbias_dtype=None):
    """GELU's backward ``dz = g * gelu'(pre)`` as FP8, transposed FP8, amax and dbias.

    Args:
      g: ``(..., n)`` float32, float16 or bfloat16: the gradient of ``gelu``'s output.
      pre: ``(..., n)`` in ``g.dtype``: ``gelu``'s input (``x + bias``).
      scale: float32 scalar array.
      fp8_dtype: ``jnp.float8_e5m2`` (default, the gradients' format) or
        ``jnp.float8_e4m3fn``.
      activation: as for `bias_gelu_fp8`.
      dbias_dtype: dtype of ``dbias`` (the bias's); default ``g.dtype``.

    Returns:
      ``(q, q_t, amax, dbias)``: ``q = fp8(clip(dz * scale))`` ``(..., n)``, ``q_t``
      its transpose ``(n, m)`` with ``m`` the leading dims flattened (both
      ``fp8_dtype``), ``amax = max |dz|`` float32 ``()``, ``dbias = sum over rows of
      dz`` ``(n,)`` (float32 sums, then ``dbias_dtype``). ``dz`` is float32 throughout.
      Forward only (no derivative). Fastest for the sizes `cast_transpose` names.
    """
    op = "dgelu_cast_transpose_dbias"
    _check_rows(op, "g", g)
    _checks.check_array(op, "pre", pre)
    _checks.check_shape(op, "pre", pre, g.shape)
    _checks.check_same_dtype(op, "pre", pre, g.dtype)
    _check_scale(op, scale)
    dt = _check_fp8_dtype(op, fp8_dtype)
    _check_activation(op, activation)
    out_dtype = jnp.dtype(g.dtype if dbias_dtype is None else dbias_dtype)
    if out_dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: dbias_dtype must be float32, float16 or bfloat16, got {dbias_dtype!r}")
    g, pre, scale = _grad_free(op, *match_varying(g, pre, scale))
    n = g.shape[-1]
    q, q_t, amax, dbias = _DACT(g.reshape(-1, n), pre.reshape(-1, n), scale, activation=activation, fp8_dtype=dt)
    return q.reshape(g.shape), q_t, amax, dbias.astype(out_dtype)
