"""Fused bias + dropout + residual, and bias + activation + dropout.

Dropout masks come from the counter-based generator of :mod:`jax_ls2._random`
(bit for bit the same in CUDA and in the reference): an element is numbered by its
global coordinates, ``g`` = its flat row-major index in the whole ``(..., hidden)``
array (64-bit, see `jax_ls2._random.keep_mask_at`), and is kept iff its 16-bit draw is
``>= round(rate * 65536)``; kept elements are scaled by ``keep_scale(rate)``. The
backward pass regenerates the mask from the seed; nothing per element is stored.
``rate == 0`` or ``deterministic=True`` skips the generator and gives exactly the
undropped result.

A shard knows its place in the whole array, so sharded inputs draw exactly the
unsharded mask with nothing gathered: under ``jit``, any dim (batch, sequence, hidden)
may be sharded, and the partitioner gives each shard its offsets; inside ``shard_map``,
pass ``shard_spec`` (the input's ``in_specs`` entry) and each device computes its
offsets from its mesh position.

Sequence-first activations (``seq_first=True``: ``x`` is ``(len, batch, hidden)``) draw
the mask of their ``(batch, len, hidden)`` transpose, so both layouts drop the same
elements.

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
from jax_ls2._dispatch import BCAST, BCAST_SUM, OFFSETS, ROWS, SEED, FusedKernel, Role, match_varying, result_type
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks
from jax_ls2.ops._limits import MAX_PARTS
from jax_ls2.ops._activations import C_TANH, INV_SQRT_2PI, K_TANH, SQRT_HALF

F32 = jnp.float32
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


# ---------------------------------------------------------------- reference math
def _act(v, activation):
    if activation == "relu":
        return jnp.maximum(v, np.float32(0))
    if activation == "gelu":
        return np.float32(0.5) * v * (np.float32(1) + jax.lax.erf(v * SQRT_HALF))
    u = K_TANH * (v + C_TANH * v * v * v)
    return np.float32(0.5) * v * (np.float32(1) + jnp.tanh(u))


def _act_grad(v, activation):
    if activation == "relu":
        return (v > 0).astype(v.dtype)
    if activation == "gelu":
        cdf = np.float32(0.5) * (np.float32(1) + jax.lax.erf(v * SQRT_HALF))
        return cdf + v * (INV_SQRT_2PI * jnp.exp(np.float32(-0.5) * v * v))
    t = jnp.tanh(K_TANH * (v + C_TANH * v * v * v))
    return (np.float32(0.5) * (np.float32(1) + t)
            + np.float32(0.5) * v * (np.float32(1) - t * t) * K_TANH * (np.float32(1) + np.float32(3) * C_TANH * v * v))


def _column_sum(dx):
    """dbias ``(1, ..., 1, hidden)``: dx summed over every dim but the last."""
    return jnp.sum(dx, axis=tuple(range(dx.ndim - 1)), keepdims=True)


def _bdr_fwd_ref(x, bias, residual, seed, offsets, *, threshold, scale, strides):
    v = _random.apply_mask(x.astype(F32) + bias.astype(F32), seed, offsets, threshold, scale, strides)
    return ((residual.astype(F32) + v).astype(x.dtype),)


def _bdr_bwd_ref(dy, seed, offsets, *, threshold, scale, strides):
    dx = _random.apply_mask(dy.astype(F32), seed, offsets, threshold, scale, strides)
    return dx.astype(dy.dtype), _column_sum(dx)


def _bad_fwd_ref(x, bias, seed, offsets, *, activation, threshold, scale, strides):
    a = _act(x.astype(F32) + bias.astype(F32), activation)
    return (_random.apply_mask(a, seed, offsets, threshold, scale, strides).astype(x.dtype),)


def _bad_bwd_ref(dy, x, bias, seed, offsets, *, activation, threshold, scale, strides):
    g = dy.astype(F32) * _act_grad(x.astype(F32) + bias.astype(F32), activation)
    dx = _random.apply_mask(g, seed, offsets, threshold, scale, strides)
    return dx.astype(x.dtype), _column_sum(dx)


# ---------------------------------------------------------------- CUDA calls
def _attrs(x, *arrays, threshold, scale, strides, activation=None):
    # x (or dy) is the first operand of every kernel here.
    attrs = dict(threshold=np.int64(threshold), scale=np.float32(scale), **_random.kernel_row_attrs(x.shape, threshold, strides))
    if activation is not None:
        attrs["activation"] = np.int64(_ACT_CODE[activation])
    return attrs


def _fwd_types(x, *arrays, **static):
    return (result_type(x),)


def _bwd_types(x, *arrays, **static):
    # dx, dbias (1, ..., 1, hidden), then the workspace of partial dbias rows.
    h = x.shape[-1]
    return (result_type(x), result_type(x, (1,) * (x.ndim - 1) + (h,), F32),
            result_type(x, (MAX_PARTS, h), F32))


# Every dim of x is shardable (hidden too: the ops are elementwise along it), the bias
# (1, ..., 1, hidden) is sharded with x's last dim and dbias summed over the others.
_R0, _B0, _S, _O = Role(ROWS, 0), Role(BCAST, 0), Role(SEED), Role(OFFSETS)
_KERNEL_OPTIONS = _random.kernel_options(_attrs)
_BDR_FWD = FusedKernel("jax_ls2_bias_dropout_residual_fwd", _bdr_fwd_ref, operands=(_R0, _B0, _R0, _S, _O),
                       results=(_R0,), result_types=_fwd_types, vmap_method="broadcast_all", **_KERNEL_OPTIONS)
_BDR_BWD = FusedKernel("jax_ls2_bias_dropout_residual_bwd", _bdr_bwd_ref, operands=(_R0, _S, _O),
                       results=(_R0, Role(BCAST_SUM)), result_types=_bwd_types, vmap_method="sequential",
                       **_KERNEL_OPTIONS)
_BAD_FWD = FusedKernel("jax_ls2_bias_act_dropout_fwd", _bad_fwd_ref, operands=(_R0, _B0, _S, _O),
                       results=(_R0,), result_types=_fwd_types, vmap_method="broadcast_all", **_KERNEL_OPTIONS)
_BAD_BWD = FusedKernel("jax_ls2_bias_act_dropout_bwd", _bad_bwd_ref, operands=(_R0, _R0, _B0, _S, _O),
                       results=(_R0, Role(BCAST_SUM)), result_types=_bwd_types, vmap_method="sequential",
                       **_KERNEL_OPTIONS)


# ---------------------------------------------------------------- custom_vjp
# The forward rules call the kernels, not the custom_vjp functions: a custom_vjp
# called inside another's forward rule would end a second derivative in JAX's jvp
# error instead of the kernels' own "not supported". ``num`` = (threshold, scale,
# strides), static; the bias travels as (hidden,) and meets the kernels as
# (1, ..., 1, hidden).
def _as_row(bias, x):
    return bias.astype(x.dtype).reshape((1,) * (x.ndim - 1) + bias.shape)


def _static(num):
    threshold, scale, strides = num
    return dict(threshold=threshold, scale=scale, strides=strides)


def _bdr_forward(x, bias, residual, seed, offsets, num):
    return _BDR_FWD(x, _as_row(bias, x), residual, seed, offsets, **_static(num))[0]


@functools.partial(fused_vjp, nondiff_argnums=(5,), op="bias_dropout_residual",
                   plain='jnp.where(keep, (x + bias) / (1 - rate), 0) + residual with keep from jax.random.bernoulli')
def _bias_dropout_residual(x, bias, residual, seed, offsets, num):
    return _bdr_forward(x, bias, residual, seed, offsets, num)


def _bdr_vjp_fwd(x, bias, residual, seed, offsets, num):
    y = _bdr_forward(x, bias, residual, seed, offsets, num)
    return y, (seed, offsets, jnp.zeros((0,), bias.dtype))


def _bdr_vjp_bwd(num, res, dy):
    seed, offsets, bias_like = res
    if num[0] == 0:
        # No dropout: dx is dy itself, and a kernel would only copy it; XLA reduces dbias.
        db = jnp.sum(dy, axis=tuple(range(dy.ndim - 1)), dtype=jnp.float32)
        return dy, db.astype(bias_like.dtype), dy, None, None
    dx, db = _BDR_BWD(dy, seed, offsets, **_static(num))
    return dx, db.reshape(-1).astype(bias_like.dtype), dy, None, None


_bias_dropout_residual.defvjp(_bdr_vjp_fwd, _bdr_vjp_bwd, optimize_remat=True)


def _bad_forward(x, bias, seed, offsets, activation, num):
    return _BAD_FWD(x, _as_row(bias, x), seed, offsets, activation=activation, **_static(num))[0]


@functools.partial(fused_vjp, nondiff_argnums=(4, 5), op="bias_act_dropout",
                   plain='jnp.where(keep, act(x + bias) / (1 - rate), 0) with keep from jax.random.bernoulli')
def _bias_act_dropout(x, bias, seed, offsets, activation, num):
    return _bad_forward(x, bias, seed, offsets, activation, num)


def _bad_vjp_fwd(x, bias, seed, offsets, activation, num):
    y = _bad_forward(x, bias, seed, offsets, activation, num)
    return y, (x, bias, seed, offsets)


def _bad_vjp_bwd(activation, num, res, dy):
    x, bias, seed, offsets = res
    dx, db = _BAD_BWD(dy, x, _as_row(bias, x), seed, offsets, activation=activation, **_static(num))
    return dx, db.reshape(-1).astype(bias.dtype), None, None


_bias_act_dropout.defvjp(_bad_vjp_fwd, _bad_vjp_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public API
def _order(seq_first):
    """The numbering's dim order: sequence-first (len, batch, hidden) as its transpose."""
    return (1, 0, 2) if seq_first else None


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
                          seq_first: bool = False, shard_spec=None):
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
      shard_spec: inside ``shard_map`` only: how ``x`` is split over the manual mesh
        axes, its ``in_specs`` entry (per dim None, an axis name or a tuple of names),
        so this device draws its block of the whole array's mask. Default: ``x`` is
        the whole array. Under plain ``jit`` leave it out; shardings are seen.

    Returns:
      ``(..., hidden)`` in ``x.dtype``; all arithmetic in float32, rounded once.
      The backward keeps only the uint32[3] seed and the offsets: ``dx = mask * scale * dy``,
      ``dbias = sum over rows of dx``, ``dresidual = dy``.
    """
    op = "bias_dropout_residual"
    bias = _check_x_bias(op, x, bias, seq_first)
    _checks.check_array(op, "residual", residual)
    _checks.check_shape(op, "residual", residual, x.shape)
    _checks.check_same_dtype(op, "residual", residual, x.dtype)
    seed, threshold, scale = _checks.check_dropout(op, rate, key, deterministic)
    offsets, strides = _random.numbering(op, x.shape, shard_spec, threshold, _order(seq_first))
    x, bias, residual = match_varying(x, bias, residual)
    return _bias_dropout_residual(x, bias, residual, seed, offsets, (threshold, scale, strides))


def bias_act_dropout(x, bias, *, activation: str, rate: float, key=None, deterministic: bool = False,
                     seq_first: bool = False, shard_spec=None):
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
      shard_spec: inside ``shard_map`` only: how ``x`` is split over the manual mesh
        axes, its ``in_specs`` entry (per dim None, an axis name or a tuple of names),
        so this device draws its block of the whole array's mask. Default: ``x`` is
        the whole array. Under plain ``jit`` leave it out; shardings are seen.

    Returns:
      ``(..., hidden)`` in ``x.dtype``; float32 math in registers. The backward keeps
      ``x``, ``bias`` and the seed: ``dx = mask * scale * dy * act'(x + bias)``,
      ``dbias = sum over rows of dx``.
    """
    op = "bias_act_dropout"
    bias = _check_x_bias(op, x, bias, seq_first)
    if not isinstance(activation, str) or activation not in _ACT_CODE:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    seed, threshold, scale = _checks.check_dropout(op, rate, key, deterministic)
    offsets, strides = _random.numbering(op, x.shape, shard_spec, threshold, _order(seq_first))
    x, bias = match_varying(x, bias)
    return _bias_act_dropout(x, bias, seed, offsets, activation, (threshold, scale, strides))


@functools.partial(fused_vjp, nondiff_argnums=(3,), op="dropout",
                   plain='jnp.where(keep, x / (1 - rate), 0) with keep from jax.random.bernoulli')
def _dropout(x, seed, offsets, num):
    return _random.apply_mask(x.astype(F32), seed, offsets, *num).astype(x.dtype)


def _dropout_fwd(x, seed, offsets, num):
    return _dropout(x, seed, offsets, num), (seed, offsets)


def _dropout_bwd(num, res, dy):
    seed, offsets = res
    return _random.apply_mask(dy.astype(F32), seed, offsets, *num).astype(dy.dtype), None, None


_dropout.defvjp(_dropout_fwd, _dropout_bwd)


def dropout(x, *, rate: float, key=None, deterministic: bool = False, shard_spec=None):
    """``dropout(x)`` alone, with the mask the fused ops draw (see the module docstring).

    Args:
      x: any shape, any floating dtype.
      rate: static Python float in [0, 1), quantised to 1/65536.
      key: a JAX PRNG key (required when ``rate > 0`` and not ``deterministic``).
      deterministic: no dropout (``x`` itself, as does ``rate == 0``).
      shard_spec: inside ``shard_map`` only: how ``x`` is split over the manual mesh
        axes, its ``in_specs`` entry (per dim None, an axis name or a tuple of names),
        so this device draws its block of the whole array's mask. Default: ``x`` is
        the whole array. Under plain ``jit`` leave it out; shardings are seen.

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
    seed, threshold, scale = _checks.check_dropout(op, rate, key, deterministic)
    if threshold == 0:
        return x
    offsets, strides = _random.numbering(op, x.shape, shard_spec, threshold)
    return _dropout(x, seed, offsets, (threshold, scale, strides))
