"""Fused bias + dropout + residual, and bias + activation + dropout.

Dropout masks come from the counter-based generator of :mod:`jax_ls2._random`
(bit for bit the same in CUDA and in the reference): element ``g`` of the flat
row-major ``(..., hidden)`` array (plus the seed's offset word) is kept iff its
16-bit draw is ``>= round(rate * 65536)``, and kept elements are scaled by
``keep_scale(rate)``. The backward pass regenerates the mask from the seed; nothing
per element is stored. ``rate == 0`` or ``deterministic=True`` skips the generator
and gives exactly the undropped result.

Sequence-first activations (``seq_first=True``: ``x`` is ``(len, batch, hidden)``) draw
the mask of their ``(batch, len, hidden)`` transpose, so both layouts drop the same
elements and a shard along batch (dim 1) keeps its rows.

Under ``vmap`` with dropout active, every example draws the mask it would draw on
its own (``vmap(f)(xs)[i] == f(xs[i])``), as with ``jax.random``; fold an index into
the key for different masks per example.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random
from jax_ls2._dispatch import PARAM, ROWS, SEED, SUM, FusedKernel, Role, match_varying, result_type
from jax_ls2.ops import _checks

F32 = jnp.float32
# Partial dbias rows in the backward workspace (at most one per CUDA block).
_MAX_PARTS = 264
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_SQRT_HALF = np.float32(0.7071067811865476)
_INV_SQRT_2PI = np.float32(0.3989422804014327)
_K_TANH = np.float32(0.7978845608028654)
_C_TANH = np.float32(0.044715)


# ---------------------------------------------------------------- reference math
def _act(v, activation):
    if activation == "relu":
        return jnp.maximum(v, np.float32(0))
    if activation == "gelu":
        return np.float32(0.5) * v * (np.float32(1) + jax.lax.erf(v * _SQRT_HALF))
    u = _K_TANH * (v + _C_TANH * v * v * v)
    return np.float32(0.5) * v * (np.float32(1) + jnp.tanh(u))


def _act_grad(v, activation):
    if activation == "relu":
        return (v > 0).astype(v.dtype)
    if activation == "gelu":
        cdf = np.float32(0.5) * (np.float32(1) + jax.lax.erf(v * _SQRT_HALF))
        return cdf + v * (_INV_SQRT_2PI * jnp.exp(np.float32(-0.5) * v * v))
    t = jnp.tanh(_K_TANH * (v + _C_TANH * v * v * v))
    return (np.float32(0.5) * (np.float32(1) + t)
            + np.float32(0.5) * v * (np.float32(1) - t * t) * _K_TANH * (np.float32(1) + np.float32(3) * _C_TANH * v * v))


def _drop(v, seed, threshold, scale, seq_first):
    """float32 ``v`` with the mask applied; threshold 0 returns ``v`` untouched. With
    ``seq_first`` ``v`` is (len, batch, hidden) and gets its transpose's mask."""
    if threshold == 0:
        return v
    if seq_first:
        keep = _random.keep_mask(seed, (v.shape[1], v.shape[0]) + v.shape[2:], threshold).swapaxes(0, 1)
    else:
        keep = _random.keep_mask(seed, v.shape, threshold)
    return jnp.where(keep, v * np.float32(scale), np.float32(0))


def _lead_axes(x):
    return tuple(range(x.ndim - 1))


def _bdr_fwd_ref(x, bias, residual, seed, *, threshold, scale, seq_first):
    v = _drop(x.astype(F32) + bias.astype(F32), seed, threshold, scale, seq_first)
    return ((residual.astype(F32) + v).astype(x.dtype),)


def _bdr_bwd_ref(dy, seed, *, threshold, scale, seq_first):
    dx = _drop(dy.astype(F32), seed, threshold, scale, seq_first)
    return dx.astype(dy.dtype), jnp.sum(dx, axis=_lead_axes(dy))


def _bad_fwd_ref(x, bias, seed, *, activation, threshold, scale, seq_first):
    a = _act(x.astype(F32) + bias.astype(F32), activation)
    return (_drop(a, seed, threshold, scale, seq_first).astype(x.dtype),)


def _bad_bwd_ref(dy, x, bias, seed, *, activation, threshold, scale, seq_first):
    g = dy.astype(F32) * _act_grad(x.astype(F32) + bias.astype(F32), activation)
    dx = _drop(g, seed, threshold, scale, seq_first)
    return dx.astype(x.dtype), jnp.sum(dx, axis=_lead_axes(x))


# ---------------------------------------------------------------- CUDA calls
def _attrs(x, *arrays, threshold, scale, seq_first, activation=None):
    # x (or dy) is the first operand of every kernel here.
    seq_batch = x.shape[1] if seq_first and threshold else 0
    attrs = dict(threshold=np.int64(threshold), scale=np.float32(scale), seq_batch=np.int64(seq_batch))
    if activation is not None:
        attrs["activation"] = np.int64(_ACT_CODE[activation])
    return attrs


def _fwd_types(x, *arrays, **static):
    return (result_type(x),)


def _bwd_types(x, *arrays, **static):
    # dx, dbias, then the workspace of partial dbias rows.
    h = x.shape[-1]
    return result_type(x), result_type(x, (h,), F32), result_type(x, (_MAX_PARTS, h), F32)


def _dropping(static) -> bool:
    return static["threshold"] != 0


_R1, _P, _S = Role(ROWS, 1), Role(PARAM), Role(SEED)
# With dropout active, vmap runs the examples one by one so each draws its own mask
# (see the module docstring).
_KERNEL_OPTIONS = dict(attrs=_attrs, per_example=_dropping)
_BDR_FWD = FusedKernel("jax_ls2_bias_dropout_residual_fwd", _bdr_fwd_ref, operands=(_R1, _P, _R1, _S),
                       results=(_R1,), result_types=_fwd_types, vmap_method="broadcast_all", **_KERNEL_OPTIONS)
_BDR_BWD = FusedKernel("jax_ls2_bias_dropout_residual_bwd", _bdr_bwd_ref, operands=(_R1, _S),
                       results=(_R1, Role(SUM)), result_types=_bwd_types, vmap_method="sequential",
                       **_KERNEL_OPTIONS)
_BAD_FWD = FusedKernel("jax_ls2_bias_act_dropout_fwd", _bad_fwd_ref, operands=(_R1, _P, _S),
                       results=(_R1,), result_types=_fwd_types, vmap_method="broadcast_all", **_KERNEL_OPTIONS)
_BAD_BWD = FusedKernel("jax_ls2_bias_act_dropout_bwd", _bad_bwd_ref, operands=(_R1, _R1, _P, _S),
                       results=(_R1, Role(SUM)), result_types=_bwd_types, vmap_method="sequential",
                       **_KERNEL_OPTIONS)


# ---------------------------------------------------------------- custom_vjp
# The forward rules call the kernels, not the custom_vjp functions: a custom_vjp
# called inside another's forward rule would end a second derivative in JAX's jvp
# error instead of the kernels' own "not supported".
def _bdr_forward(x, bias, residual, seed, threshold, scale, seq_first):
    return _BDR_FWD(x, bias.astype(x.dtype), residual, seed, threshold=threshold, scale=scale,
                    seq_first=seq_first)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _bias_dropout_residual(x, bias, residual, seed, threshold, scale, seq_first):
    return _bdr_forward(x, bias, residual, seed, threshold, scale, seq_first)


def _bdr_vjp_fwd(x, bias, residual, seed, threshold, scale, seq_first):
    y = _bdr_forward(x, bias, residual, seed, threshold, scale, seq_first)
    return y, (seed, jnp.zeros((0,), bias.dtype))


def _bdr_vjp_bwd(threshold, scale, seq_first, res, dy):
    seed, bias_like = res
    if threshold == 0:
        # No dropout: dx is dy itself, and a kernel would only copy it; XLA reduces dbias.
        db = jnp.sum(dy, axis=tuple(range(dy.ndim - 1)), dtype=jnp.float32)
        return dy, db.astype(bias_like.dtype), dy, None
    dx, db = _BDR_BWD(dy, seed, threshold=threshold, scale=scale, seq_first=seq_first)
    return dx, db.astype(bias_like.dtype), dy, None


_bias_dropout_residual.defvjp(_bdr_vjp_fwd, _bdr_vjp_bwd, optimize_remat=True)


def _bad_forward(x, bias, seed, activation, threshold, scale, seq_first):
    return _BAD_FWD(x, bias.astype(x.dtype), seed, activation=activation, threshold=threshold, scale=scale,
                    seq_first=seq_first)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _bias_act_dropout(x, bias, seed, activation, threshold, scale, seq_first):
    return _bad_forward(x, bias, seed, activation, threshold, scale, seq_first)


def _bad_vjp_fwd(x, bias, seed, activation, threshold, scale, seq_first):
    y = _bad_forward(x, bias, seed, activation, threshold, scale, seq_first)
    return y, (x, bias, seed)


def _bad_vjp_bwd(activation, threshold, scale, seq_first, res, dy):
    x, bias, seed = res
    dx, db = _BAD_BWD(dy, x, bias.astype(x.dtype), seed, activation=activation, threshold=threshold,
                      scale=scale, seq_first=seq_first)
    return dx, db.astype(bias.dtype), None


_bias_act_dropout.defvjp(_bad_vjp_fwd, _bad_vjp_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public API
def _seed_and_rate(op, rate, key, deterministic):
    deterministic = _checks.check_deterministic(op, deterministic)
    rate = _checks.check_rate(op, rate, key, deterministic)
    if deterministic or rate == 0.0:
        return jnp.zeros((3,), jnp.uint32), 0, 1.0
    threshold = _random.dropout_threshold(rate)
    if threshold == 0:  # rate below 1/131072 rounds to no dropout
        return jnp.zeros((3,), jnp.uint32), 0, 1.0
    return _random.seed_words(key), threshold, _random.keep_scale(rate)


def _check_x_bias(op, x, bias, seq_first):
    """Checks x and bias; returns the bias to add (zeros in x.dtype for ``bias=None``:
    a constant of the op, so no gradient is returned for it)."""
    if not isinstance(seq_first, bool):
        raise ValueError(f"{op}: seq_first must be a bool, got {seq_first!r}")
    _checks.check_array(op, "x", x, min_ndim=1)
    if seq_first and x.ndim != 3:
        raise ValueError(f"{op}: with seq_first, x must be (len, batch, hidden), got shape {tuple(x.shape)}")
    h = x.shape[-1]
    if h == 0:
        raise ValueError(f"{op}: x must have a non-empty last axis, got shape {tuple(x.shape)}")
    if bias is None:
        return jnp.zeros((h,), x.dtype)
    _checks.check_array(op, "bias", bias, ndim=1)
    _checks.check_shape(op, "bias", bias, (h,))
    return bias


def bias_dropout_residual(x, bias, residual, *, rate: float, key=None, deterministic: bool = False,
                          seq_first: bool = False):
    """``residual + dropout(x + bias)`` (the end of a Transformer sublayer).

    Args:
      x: ``(..., hidden)`` float32, float16 or bfloat16.
      bias: ``(hidden,)`` floating; read in ``x.dtype``, its gradient comes back in
        its own dtype (summed in float32). ``None``: no bias (nor bias gradient).
      residual: ``(..., hidden)`` in ``x.dtype``.
      rate: static Python float in [0, 1), quantised to 1/65536.
      key: a JAX PRNG key (required when ``rate > 0`` and not ``deterministic``).
      deterministic: no dropout (exactly ``residual + x + bias``).
      seq_first: ``x`` is ``(len, batch, hidden)``; the mask is the one the
        ``(batch, len, hidden)`` transpose would get.

    Returns:
      ``(..., hidden)`` in ``x.dtype``; all arithmetic in float32, rounded once.
      The backward keeps only the uint32[3] seed: ``dx = mask * scale * dy``,
      ``dbias = sum over rows of dx``, ``dresidual = dy``.
    """
    op = "bias_dropout_residual"
    bias = _check_x_bias(op, x, bias, seq_first)
    _checks.check_array(op, "residual", residual)
    _checks.check_shape(op, "residual", residual, x.shape)
    _checks.check_same_dtype(op, "residual", residual, x.dtype)
    seed, threshold, scale = _seed_and_rate(op, rate, key, deterministic)
    x, bias, residual = match_varying(x, bias, residual)
    return _bias_dropout_residual(x, bias, residual, seed, threshold, scale, seq_first)


def bias_act_dropout(x, bias, *, activation: str, rate: float, key=None, deterministic: bool = False,
                     seq_first: bool = False):
    """``dropout(act(x + bias))`` (the first half of a Transformer FFN).

    Args:
      x: ``(..., hidden)`` float32, float16 or bfloat16.
      bias: ``(hidden,)`` floating; read in ``x.dtype``, its gradient comes back in
        its own dtype (summed in float32). ``None``: no bias (nor bias gradient).
      activation: ``"relu"``, ``"gelu"`` (exact, erf) or ``"gelu_tanh"``.
      rate: static Python float in [0, 1), quantised to 1/65536.
      key: a JAX PRNG key (required when ``rate > 0`` and not ``deterministic``).
      deterministic: no dropout.
      seq_first: ``x`` is ``(len, batch, hidden)``; the mask is the one the
        ``(batch, len, hidden)`` transpose would get.

    Returns:
      ``(..., hidden)`` in ``x.dtype``; float32 math in registers. The backward keeps
      ``x``, ``bias`` and the seed: ``dx = mask * scale * dy * act'(x + bias)``,
      ``dbias = sum over rows of dx``.
    """
    op = "bias_act_dropout"
    bias = _check_x_bias(op, x, bias, seq_first)
    if not isinstance(activation, str) or activation not in _ACT_CODE:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    seed, threshold, scale = _seed_and_rate(op, rate, key, deterministic)
    x, bias = match_varying(x, bias)
    return _bias_act_dropout(x, bias, seed, activation, threshold, scale, seq_first)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dropout(x, seed, threshold, scale):
    return _drop(x.astype(F32), seed, threshold, scale, False).astype(x.dtype)


def _dropout_fwd(x, seed, threshold, scale):
    return _dropout(x, seed, threshold, scale), seed


def _dropout_bwd(threshold, scale, seed, dy):
    return _drop(dy.astype(F32), seed, threshold, scale, False).astype(dy.dtype), None


_dropout.defvjp(_dropout_fwd, _dropout_bwd)


def dropout(x, *, rate: float, key=None, deterministic: bool = False):
    """``dropout(x)`` alone, with the mask the fused ops draw (see the module docstring).

    Args:
      x: any shape, any floating dtype.
      rate: static Python float in [0, 1), quantised to 1/65536.
      key: a JAX PRNG key (required when ``rate > 0`` and not ``deterministic``).
      deterministic: no dropout (``x`` itself, as does ``rate == 0``).

    Returns:
      ``x``'s shape and dtype: kept elements times ``keep_scale(rate)`` in float32,
      rounded once; ``bias_dropout_residual(x, None, zeros, ...)`` gives the same
      result. Pure JAX (the mask is a few integer operations per element, which XLA
      fuses with the multiply into one pass), so it runs and shards like any jnp
      code; the backward regenerates the mask from the key and keeps nothing per
      element.
    """
    op = "dropout"
    _checks.check_array(op, "x", x, dtypes=None)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: x must have a floating dtype, got {x.dtype}")
    seed, threshold, scale = _seed_and_rate(op, rate, key, deterministic)
    if threshold == 0:
        return x
    return _dropout(x, seed, threshold, scale)
