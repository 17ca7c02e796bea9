"""Fused attention softmax: scale, additive bias, boolean and causal masks, dropout.

The dropout mask numbers an element by its global coordinates (the flat row-major
index in the whole ``scores`` array, 64-bit; `jax_ls2._random.keep_mask_at`), so a shard
draws exactly its block of the unsharded mask: under ``jit`` the batch-like dims
(batch, heads) may stay sharded, and the query dim too without ``causal``; inside
``shard_map`` pass ``shard_spec``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random
from jax_ls2._dispatch import BCAST, OFFSETS, ROWS, SEED, FusedKernel, Role, match_varying, result_type
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks

F32 = jnp.float32


# ---------------------------------------------------------------- reference math
def _logits(scores, bias, mask, *, scale, causal, has_bias, has_mask):
    """float32 logits with -inf where masked."""
    x = scores.astype(F32) * np.float32(scale)
    if has_bias:
        x = x + bias.astype(F32)
    valid = None
    if has_mask:
        valid = mask
    if causal:
        q, k = scores.shape[-2], scores.shape[-1]
        tri = jnp.arange(k)[None, :] <= jnp.arange(q)[:, None] + (k - q)
        valid = tri if valid is None else jnp.logical_and(valid, tri)
    if valid is not None:
        x = jnp.where(valid, x, -jnp.inf)
    return x


def _probs(x, m, inv):
    return jnp.exp(x - m) * inv


def _fwd_reference(scores, bias, mask, seed, offsets, *, scale, causal, threshold, keep_scale, has_bias, has_mask,
                   strides):
    x = _logits(scores, bias, mask, scale=scale, causal=causal, has_bias=has_bias, has_mask=has_mask)
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # fully masked rows: every exp is 0
    s = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    p = _probs(x, m, inv)
    if threshold:
        keep = _random.keep_mask_at(seed, offsets, scores.shape, strides, threshold)
        p = jnp.where(keep, p * np.float32(keep_scale), 0.0)
    return p.astype(scores.dtype), jnp.concatenate([m, inv], axis=-1)


def _bwd_reference(dy, scores, bias, mask, stats, seed, offsets, *, scale, grad_scale, causal, threshold,
                   keep_scale, has_bias, has_mask, strides):
    x = _logits(scores, bias, mask, scale=scale, causal=causal, has_bias=has_bias, has_mask=has_mask)
    p = _probs(x, stats[..., :1], stats[..., 1:])
    g = dy.astype(F32)
    if threshold:
        keep = _random.keep_mask_at(seed, offsets, scores.shape, strides, threshold)
        g = jnp.where(keep, g * np.float32(keep_scale), 0.0)
    acc = jnp.sum(g * p, axis=-1, keepdims=True)
    return ((np.float32(grad_scale) * p * (g - acc)).astype(scores.dtype),)


# ---------------------------------------------------------------- CUDA calls
def _attrs(x, *arrays, scale, causal, threshold, keep_scale, has_bias, has_mask, strides, grad_scale=None):
    # x: scores (forward) or dy (backward), of the scores' shape.
    attrs = dict(scale=np.float32(scale), threshold=np.int32(threshold), keep_scale=np.float32(keep_scale),
                 causal=bool(causal), has_bias=bool(has_bias), has_mask=bool(has_mask),
                 **_random.kernel_row_attrs(x.shape, threshold, strides))
    if grad_scale is not None:
        attrs["grad_scale"] = np.float32(grad_scale)
    return attrs


def _fwd_types(scores, *arrays, **static):
    return result_type(scores), result_type(scores, scores.shape[:-1] + (2,), F32)


def _bwd_types(dy, scores, *arrays, **static):
    return (result_type(scores),)


@functools.lru_cache(maxsize=None)
def _kernels(causal: bool):
    """(forward, backward). scores/dy/dx/y: (*batch, q, k), the k dim processed whole;
    the q dim is batch-like (shardable) unless causal, whose mask needs the query's
    index in the whole q dim. bias and mask broadcast; stats (*batch, q, 2). With
    dropout active, vmap runs the examples one by one, each drawing its own mask."""
    tail = 2 if causal else 1
    r, b, s, o = Role(ROWS, tail), Role(BCAST, tail), Role(SEED), Role(OFFSETS)
    options = dict(attrs=_attrs, ffi_operands=_random.kernel_operands, vmap_method="sequential",
                   per_example=_random.dropping)
    fwd = FusedKernel("jax_ls2_softmax_dropout_fwd", _fwd_reference, operands=(r, b, b, s, o), results=(r, r),
                      result_types=_fwd_types, **options)
    bwd = FusedKernel("jax_ls2_softmax_dropout_bwd", _bwd_reference, operands=(r, r, b, b, r, s, o),
                      results=(r,), result_types=_bwd_types, **options)
    return fwd, bwd


# ---------------------------------------------------------------- custom_vjp
# cfg = (scale, causal, threshold, keep_scale, has_bias, has_mask, strides), all static.
def _static(cfg):
    scale, causal, threshold, keep_scale, has_bias, has_mask, strides = cfg
    return dict(scale=scale, causal=causal, threshold=threshold, keep_scale=keep_scale, has_bias=has_bias,
                has_mask=has_mask, strides=strides)


@functools.partial(fused_vjp, nondiff_argnums=(5,), op="softmax_dropout",
                   plain='jax.nn.softmax(scores * scale + bias, axis=-1) (masked with jnp.where)')
def _softmax_dropout(scores, bias, mask, seed, offsets, cfg):
    return _kernels(cfg[1])[0](scores, bias, mask, seed, offsets, **_static(cfg))[0]


def _softmax_dropout_fwd(scores, bias, mask, seed, offsets, cfg):
    y, stats = _kernels(cfg[1])[0](scores, bias, mask, seed, offsets, **_static(cfg))
    return y, (scores, bias, mask, seed, offsets, stats)


def _softmax_dropout_bwd(cfg, res, dy):
    scores, bias, mask, seed, offsets, stats = res
    scale, has_bias = cfg[0], cfg[4]
    # grad_scale = scale gives d scores directly; with scale == 0 the kernel returns
    # d logits instead (needed for the bias) and d scores is zero.
    grad_scale = scale if scale != 0.0 else 1.0
    (dx,) = _kernels(cfg[1])[1](dy, scores, bias, mask, stats, seed, offsets, grad_scale=grad_scale,
                                **_static(cfg))
    dbias = None
    if has_bias:
        axes = tuple(i for i, (b, s) in enumerate(zip(bias.shape, scores.shape)) if b == 1 and s != 1)
        dz = dx.astype(F32)
        if axes:
            dz = jnp.sum(dz, axis=axes, keepdims=True)
        dbias = (dz / np.float32(grad_scale)).reshape(bias.shape).astype(bias.dtype)
    if scale == 0.0:
        dx = jnp.zeros_like(dx)
    return dx, dbias, None, None, None


_softmax_dropout.defvjp(_softmax_dropout_fwd, _softmax_dropout_bwd, optimize_remat=True)


def softmax_dropout(scores, *, scale: float = 1.0, bias=None, mask=None, causal: bool = False,
                    rate: float = 0.0, key=None, deterministic: bool = False, shard_spec=None):
    """Attention probabilities ``dropout(softmax(scale * scores + bias, masked))``.

    Args:
      scores: ``(batch, heads, q_len, k_len)`` float32, float16 or bfloat16; any rank
        >= 2 works, the last two dims being ``(q_len, k_len)`` and the leading ones
        batch-like. Any ``k_len >= 1`` (rows up to 8192 keys stay in registers, longer
        rows take a looped path).
      scale: static Python float multiplying the scores (e.g. ``1 / sqrt(head_dim)``).
      bias: optional additive bias of any float dtype, same rank as ``scores``, each dim
        1 or equal (``(1, heads, q_len, k_len)``, ``(batch, 1, 1, k_len)``, ...). Used in
        float32 unless it already has ``scores.dtype``; its gradient is summed over the
        broadcast dims and returned in its own dtype.
      mask: optional bool, same rank as ``scores``, each dim 1 or equal; True = attend.
        Broadcast in the kernel, never materialised.
      causal: query ``i`` attends keys ``j <= i + (k_len - q_len)`` (queries are the last
        ``q_len`` positions of the key sequence; the usual lower triangle when
        ``q_len == k_len``).
      rate: dropout rate in [0, 1), quantised to 1/65536 (see ``jax_ls2._random``).
      key: JAX PRNG key (traced), required when ``rate > 0`` and not deterministic. The
        mask is the shared counter-based one: element index = flat row-major index of
        ``scores`` in the whole array, so the same key gives the same mask on every
        backend and under any sharding.
      deterministic: no dropout (also when ``rate == 0``); the result is then exactly
        the undropped softmax.
      shard_spec: inside ``shard_map`` only: how ``scores`` is split over the manual
        mesh axes, its ``in_specs`` entry, so this device draws its block of the whole
        mask. The batch-like dims may be split, the query dim only without ``causal``,
        the key dim never. Default: ``scores`` is the whole array.

    Returns:
      Probabilities of ``scores``' shape and dtype. Rows with no attended key (fully
      masked) are all zeros, and their gradients are zeros, never NaN.

    Logits, max and sum are float32. Memory traffic is kept to the minimum: the
    forward reads ``scores`` and writes the output plus 8 bytes per row (float32 row
    max and 1 / sum); it does not write the undropped probabilities. The backward
    keeps ``scores`` (the op's own input, alive already) and those row statistics,
    recomputes the undropped ``p`` exactly and regenerates the dropout mask from the
    key: it reads ``dy`` and ``scores`` and writes ``d scores`` (3 passes), where
    saving ``p`` instead would cost an extra full write in the forward (2 + 3 vs
    3 + 3 tensor passes). Gradient:
    ``d scores = scale * p * (g - sum(g * p))``, ``g = dy * keep / (1 - rate)``.
    """
    op = "softmax_dropout"
    _checks.check_array(op, "scores", scores, min_ndim=2)
    shape = tuple(scores.shape)
    if shape[-1] == 0:
        raise ValueError(f"{op}: scores must have a non-empty last axis (k_len), got shape {shape}")
    if isinstance(scale, (jax.Array, np.ndarray)) and not isinstance(scale, jax.core.Tracer):
        scale = float(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not np.isfinite(scale):
        raise TypeError(f"{op}: scale must be a finite Python float (static), got {scale!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{op}: causal must be a Python bool, got {type(causal).__name__}")
    deterministic = _checks.check_deterministic(op, deterministic)
    has_bias = bias is not None
    if has_bias:
        _checks.check_array(op, "bias", bias, dtypes=None)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"{op}: bias must have a floating dtype, got {bias.dtype}")
        _checks.check_broadcastable(op, "bias", bias, shape)
        if jnp.dtype(bias.dtype) not in (jnp.dtype(scores.dtype), jnp.dtype(F32)):
            bias = bias.astype(F32)
    else:
        bias = jnp.zeros((1,) * len(shape), scores.dtype)
    has_mask = mask is not None
    if has_mask:
        _checks.check_array(op, "mask", mask, dtypes=(jnp.dtype(bool),))
        _checks.check_broadcastable(op, "mask", mask, shape)
    else:
        mask = jnp.ones((1,) * len(shape), bool)
    rate = _checks.check_rate(op, rate, key, deterministic)
    threshold = 0 if deterministic else _random.dropout_threshold(rate)
    if threshold:
        seed = _random.seed_words(key)
        keep_scale = _random.keep_scale(rate)
    else:
        seed = _random.no_seed()
        keep_scale = 1.0
    if shard_spec is not None:
        spec = tuple(shard_spec) + (None,) * (len(shape) - len(tuple(shard_spec)))
        whole = (len(shape) - 2, len(shape) - 1) if causal else (len(shape) - 1,)
        if any(spec[d] is not None for d in whole if d < len(spec)):
            raise ValueError(f"{op}: shard_spec must not split the key dim{' or, with causal, the query dim' if causal else ''} "
                             f"(rows are normalised whole), got {shard_spec!r}")
    offsets, strides = _random.numbering(op, shape, shard_spec, threshold)
    cfg = (float(scale), bool(causal), int(threshold), float(keep_scale), has_bias, has_mask, strides)
    # Under shard_map, a replicated bias meeting per-device scores becomes per-device
    # too, and its gradient is summed over the devices (see match_varying).
    scores, bias = match_varying(scores, bias)
    return _softmax_dropout(scores, bias, mask, seed, offsets, cfg)
