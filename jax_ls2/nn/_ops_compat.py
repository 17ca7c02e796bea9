"""The functional ops the layers are built on (all from :mod:`jax_ls2.ops`), plus
``xla_softmax_dropout``, the XLA reference of the attention softmax that the ``"xla"``
attention backend runs (same mask as the fused op, through ``ops.dropout``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ls2.ops import (bias_act_dropout, bias_dropout_residual, cross_entropy, dropout, embedding,
                         flash_attention, layer_norm, linear_cross_entropy, softmax_dropout)

__all__ = ["bias_act_dropout", "bias_dropout_residual", "cross_entropy", "dropout", "embedding",
           "flash_attention", "layer_norm", "linear_cross_entropy", "softmax_dropout", "xla_softmax_dropout"]

_NEG = -1e30


def xla_softmax_dropout(scores, *, scale=1.0, mask=None, causal=False, rate=0.0, key=None,
                        deterministic=False, shard_spec=None):
    """softmax(scale * scores) with masks and dropout in pure jnp (fp32 statistics).
    scores: (batch, heads, q_len, k_len); mask bool broadcastable, True = keep;
    causal aligned bottom-right; shard_spec as `softmax_dropout`'s (inside ``shard_map``).
    Returns probs in scores' dtype."""
    s = scores.astype(jnp.float32) * scale
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    if causal:
        q, k = s.shape[-2], s.shape[-1]
        s = jnp.where(jnp.arange(q)[:, None] + (k - q) >= jnp.arange(k)[None, :], s, _NEG)
    return dropout(jax.nn.softmax(s, axis=-1), rate=rate, key=key, deterministic=deterministic,
                   shard_spec=shard_spec).astype(scores.dtype)
