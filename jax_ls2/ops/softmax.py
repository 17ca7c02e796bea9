"""Fused attention softmax: scale, additive bias, boolean and causal masks, dropout."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random
from jax_ls2._dispatch import BCAST, ROWS, SEED, FusedKernel, Role, match_varying, result_type
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


def _fwd_reference(scores, bias, mask, seed, *, scale, causal, threshold, keep_scale, has_bias, has_mask):
    x = _logits(scores, bias, mask, scale=scale, causal=causal, has_bias=has_bias, has_mask=has_mask)
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # fully masked rows: every exp is 0
    s = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    p = _probs(x, m, inv)
    if threshold:
        keep = _random.keep_mask(seed, scores.shape, threshold)
        p = jnp.where(keep, p * np.float32(keep_scale), 0.0)
    return p.astype(scores.dtype), jnp.concatenate([m, inv], axis=-1)


def _bwd_reference(dy, scores, bias, mask, stats, seed, *, scale, grad_scale, causal, threshold, keep_scale,
                   has_bias, has_mask):
    x = _logits(scores, bias, mask, scale=scale, causal=causal, has_bias=has_bias, has_mask=has_mask)
    p = _probs(x, stats[..., :1], stats[..., 1:])
    g = dy.astype(F32)
    if threshold:
        keep = _random.keep_mask(seed, scores.shape, threshold)
        g = jnp.where(keep, g * np.float32(keep_scale), 0.0)
    acc = jnp.sum(g * p, axis=-1, keepdims=True)
    return ((np.float32(grad_scale) * p * (g - acc)).astype(scores.dtype),)


# ---------------------------------------------------------------- CUDA calls
def _attrs(*arrays, scale, causal, threshold, keep_scale, has_bias, has_mask, grad_scale=None):
    attrs = dict(scale=np.float32(scale), threshold=np.int32(threshold), keep_scale=np.float32(keep_scale),
                 causal=bool(causal), has_bias=bool(has_bias), has_mask=bool(has_mask))
    if grad_scale is not None:
        attrs["grad_scale"] = np.float32(grad_scale)
    return attrs


def _fwd_types(scores, *arrays, **static):
    return result_type(scores), result_type(scores, scores.shape[:-1] + (2,), F32)


def _bwd_types(dy, scores, *arrays, **static):
    return (result_type(scores),)


# scores/dy/dx/y: (*batch, q, k) with the q and k dims processed whole (causal needs
# the true query index), so only the batch-like dims shard; bias and mask broadcast.
_R2, _B2, _S = Role(ROWS, 2), Role(BCAST, 2), Role(SEED)
_FWD = FusedKernel("jax_ls2_softmax_dropout_fwd", _fwd_reference, operands=(_R2, _B2, _B2, _S),
                   results=(_R2, _R2), result_types=_fwd_types, attrs=_attrs, vmap_method="sequential")
_BWD = FusedKernel("jax_ls2_softmax_dropout_bwd", _bwd_reference, operands=(_R2, _R2, _B2, _B2, _R2, _S),
                   results=(_R2,), result_types=_bwd_types, attrs=_attrs, vmap_method="sequential")


# ---------------------------------------------------------------- custom_vjp
# cfg = (scale, causal, threshold, keep_scale, has_bias, has_mask), all static.
def _static(cfg):
    scale, causal, threshold, keep_scale, has_bias, has_mask = cfg
    return dict(scale=scale, causal=causal, threshold=threshold, keep_scale=keep_scale, has_bias=has_bias,
                has_mask=has_mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _softmax_dropout(scores, bias, mask, seed, cfg):
    return _FWD(scores, bias, mask, seed, **_static(cfg))[0]


def _softmax_dropout_fwd(scores, bias, mask, seed, cfg):
    y, stats = _FWD(scores, bias, mask, seed, **_static(cfg))
    return y, (scores, bias, mask, seed, stats)


def _softmax_dropout_bwd(cfg, res, dy):
    scores, bias, mask, seed, stats = res
    scale, has_bias = cfg[0], cfg[4]
    # grad_scale = scale gives d scores directly; with scale == 0 the kernel returns
    # d logits instead (needed for the bias) and d scores is zero.
    grad_scale = scale if scale != 0.0 else 1.0
    (dx,) = _BWD(dy, scores, bias, mask, stats, seed, grad_scale=grad_scale, **_static(cfg))
    dbias = None
    if has_bias:
        axes = tuple(i for i, (b, s) in enumerate(zip(bias.shape, scores.shape)) if b == 1 and s != 1)
        dz = dx.astype(F32)
        if axes:
            dz = jnp.sum(dz, axis=axes, keepdims=True)
        dbias = (dz / np.float32(grad_scale)).reshape(bias.shape).astype(bias.dtype)
    if scale == 0.0:
        dx = jnp.zeros_like(dx)
    return dx, dbias, None, None


_softmax_dropout.defvjp(_softmax_dropout_fwd, _softmax_dropout_bwd, optimize_remat=True)


def softmax_dropout(scores, *, scale: float = 1.0, bias=None, mask=None, causal: bool = False,
                    rate: float = 0.0, key=None, deterministic: bool = False):
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
        ``scores``, so the same key gives the same mask on every backend.
      deterministic: no dropout (also when ``rate == 0``); the result is then exactly
        the undropped softmax.

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
        seed = jnp.zeros((3,), jnp.uint32)
        keep_scale = 1.0
    cfg = (float(scale), bool(causal), int(threshold), float(keep_scale), has_bias, has_mask)
    # Under shard_map, a replicated bias meeting per-device scores becomes per-device
    # too, and its gradient is summed over the devices (see match_varying).
    scores, bias = match_varying(scores, bias)
    return _softmax_dropout(scores, bias, mask, seed, cfg)
