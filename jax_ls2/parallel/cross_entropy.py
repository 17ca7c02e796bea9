"""Softmax cross entropy over logits split by vocabulary over a mesh axis (inside ``shard_map``).

Each device holds a contiguous ``(..., vocab / n)`` slice of the logits (device ``i`` of
the axis holds classes ``[i * vocab / n, (i + 1) * vocab / n)``, the layout of a
column-parallel output head). The log-sum-exp is combined across the slices from
per-token statistics alone: the max by ``pmax``, the sum of ``exp(x - max)`` by ``psum``;
the label's logit is picked on the device that holds it and shared by ``psum``. Only
``(...)``-shaped fp32 values cross devices; the full logits are never gathered.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks
from jax_ls2.ops.cross_entropy import _check_common, _count, _mean_scale
from jax_ls2.parallel.mesh import TENSOR
from jax_ls2.parallel.tensor import bound_axis_size

F32 = jnp.float32
_OP = "vocab_parallel_cross_entropy"


def _shard_stats(logits, labels, axis_name):
    """fp32 logits, the global log-sum-exp, the label's column in this shard (or -1) and the vocab."""
    x = logits.astype(F32)
    local_vocab = x.shape[-1]
    vocab = local_vocab * jax.lax.axis_size(axis_name)
    m = jax.lax.pmax(jnp.max(x, axis=-1), axis_name)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # every logit -inf: lse is -inf, not NaN
    lse = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(x - m[..., None]), axis=-1), axis_name))
    column = labels - jax.lax.axis_index(axis_name) * local_vocab
    column = jnp.where((column >= 0) & (column < local_vocab), column, -1)
    return x, lse, column, vocab


def _token_masks(labels, vocab, cfg):
    _, _, ignore_index, has_ignore = cfg
    ignored = (labels == ignore_index) if has_ignore else jnp.zeros(labels.shape, bool)
    valid = (labels >= 0) & (labels < vocab)
    return ignored, valid


@functools.partial(fused_vjp, nondiff_argnums=(2, 3), op="vocab_parallel_cross_entropy",
                   plain='optax.softmax_cross_entropy_with_integer_labels on the gathered logits')
def _vp_ce(logits, labels, axis_name, cfg):
    return _vp_ce_fwd(logits, labels, axis_name, cfg)[0]


def _vp_ce_fwd(logits, labels, axis_name, cfg):
    smoothing, z_loss, _, _ = cfg
    x, lse, column, vocab = _shard_stats(logits, labels, axis_name)
    mine = jnp.take_along_axis(x, jnp.maximum(column, 0)[..., None], axis=-1)[..., 0]
    picked = jax.lax.psum(jnp.where(column >= 0, mine, 0.0), axis_name)
    loss = lse - (1.0 - smoothing) * picked + z_loss * lse * lse
    if smoothing:  # left out, not multiplied by 0: a -inf logit (a masked class) makes it NaN
        loss = loss - smoothing * jax.lax.psum(jnp.sum(x, axis=-1), axis_name) / vocab
    ignored, valid = _token_masks(labels, vocab, cfg)
    loss = jnp.where(ignored, 0.0, jnp.where(valid, loss, jnp.nan))
    return loss, (logits, labels, lse)


def _vp_ce_bwd(axis_name, cfg, res, dloss):
    smoothing, z_loss, _, _ = cfg
    logits, labels, lse = res
    x = logits.astype(F32)
    local_vocab = x.shape[-1]
    vocab = local_vocab * jax.lax.axis_size(axis_name)
    column = labels - jax.lax.axis_index(axis_name) * local_vocab
    onehot = jnp.arange(local_vocab, dtype=column.dtype) == column[..., None]
    target = (1.0 - smoothing) * onehot + smoothing / vocab
    ignored, valid = _token_masks(labels, vocab, cfg)
    scale = jnp.where(ignored, 0.0, jnp.where(valid, dloss, jnp.nan))
    p = jnp.exp(x - lse[..., None])
    g = scale[..., None] * (p * (1.0 + 2.0 * z_loss * lse)[..., None] - target)
    return g.astype(logits.dtype), None


_vp_ce.defvjp(_vp_ce_fwd, _vp_ce_bwd)


def vocab_parallel_cross_entropy(logits_shard, labels, axis_name: str = TENSOR, *, label_smoothing: float = 0.0,
                                 ignore_index: int | None = None, z_loss: float = 0.0,
                                 reduction: str | None = None):
    """`jax_ls2.ops.cross_entropy` on logits split by vocabulary over ``axis_name``; call inside ``shard_map``.

    Args:
      logits_shard: ``(..., vocab / n)`` float32, float16 or bfloat16: this device's
        contiguous slice of the classes (device ``i`` along ``axis_name``, of ``n``, holds
        ``[i * vocab / n, (i + 1) * vocab / n)``); varying over ``axis_name``.
      labels: ``(...)`` integer global class ids in ``[0, vocab)`` or ``ignore_index``, the
        same on every device of ``axis_name`` (replicated over it). A label outside the
        range (and not ignored) gives a NaN loss and a NaN gradient row.
      axis_name: the manual mesh axis the vocabulary is split over (default ``"tensor"``).
      label_smoothing, ignore_index, z_loss: as for ``ops.cross_entropy``; the smoothing
        target is spread over the full ``vocab``.
      reduction: ``None``/``"none"``: per-token loss; ``"sum"`` / ``"mean"``: over this
        device's tokens (psum over the batch's mesh axes for a global figure).

    Returns:
      ``(loss, count)`` as ``ops.cross_entropy``: ``loss`` float32 ``labels.shape`` (or a
      scalar when reduced), identical on every device of ``axis_name``; ``count`` the
      int32 number of this device's counted tokens.

    Forward: per token, one ``pmax`` and two ``psum``s of fp32 scalars over ``axis_name``
    (three with smoothing). The backward pass keeps the logits shard and the fp32
    log-sum-exp and forms ``(softmax - target) * dloss`` for the shard, in the logits
    dtype, with no collective.
    """
    _checks.check_array(_OP, "logits_shard", logits_shard, min_ndim=1)
    _checks.check_array(_OP, "labels", labels, dtypes=None)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{_OP}: labels must have an integer dtype, got {labels.dtype}")
    _checks.check_shape(_OP, "labels", labels, logits_shard.shape[:-1])
    if not isinstance(axis_name, str):
        raise TypeError(f"{_OP}: axis_name must be a mesh axis name (str), got {axis_name!r}")
    size = bound_axis_size(axis_name)
    if size is None:
        raise ValueError(f"{_OP}: must run inside shard_map with {axis_name!r} a manual mesh axis (the axis the "
                         f"vocabulary is split over); outside it use jax_ls2.ops.cross_entropy")
    _check_common(_OP, logits_shard.shape[-1] * size, labels, label_smoothing, ignore_index, z_loss, reduction)
    cfg = (float(label_smoothing), float(z_loss), int(ignore_index or 0), ignore_index is not None)
    labels = _checks.clamp_to_int32(labels)
    loss = _vp_ce(logits_shard, labels, axis_name, cfg)
    count = _count(labels, ignore_index)
    if reduction in (None, "none"):
        return loss, count
    total = jnp.sum(loss)
    return (total * _mean_scale(count) if reduction == "mean" else total), count
