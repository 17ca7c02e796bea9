"""The decode cache of the decoder layers: `KVCache`, a variable type of its own.

A layer's cache is three `KVCache` variables: keys and values ``(batch, max_len,
kv_heads, head_dim)`` and the number of positions written so far (an int32 scalar).
They are state, never params: ``nnx.state(model, KVCache)`` selects them,
``nnx.split(model, nnx.Param, KVCache, ...)`` keeps them apart from the weights, and an
optimizer built on ``nnx.Param`` never sees them. `KVCache` is an ``nnx.Cache``, so code
that filters Flax's own cache type finds it too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class KVCache(nnx.Cache):
    """Keys, values or the write position of one attention layer's decode cache."""


def new_cache(batch: int, max_len: int, kv_heads: int, head_dim: int, dtype, owner: str):
    """Zeroed (keys, values, index) `KVCache` variables; checks the sizes with `owner`'s name."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}.init_cache: {name} must be a positive int, got {value!r}")
    shape = (batch, max_len, kv_heads, head_dim)
    return (KVCache(jnp.zeros(shape, dtype)), KVCache(jnp.zeros(shape, dtype)),
            KVCache(jnp.zeros((), jnp.int32)))


def write(keys: KVCache, values: KVCache, start, k, v):
    """Writes k, v ``(batch, t, kv_heads, head_dim)`` into the caches at position
    ``start`` (an int32 scalar) and returns all keys and values. The caller advances its
    index. Positions past ``max_len`` are not written (``dynamic_update_slice`` clamps
    the start): size the cache for the whole generation."""
    k_all = jax.lax.dynamic_update_slice(keys[...], k.astype(keys.dtype), (0, start, 0, 0))
    v_all = jax.lax.dynamic_update_slice(values[...], v.astype(values.dtype), (0, start, 0, 0))
    keys[...], values[...] = k_all, v_all
    return k_all, v_all


def filled_mask(batch: int, max_len: int, position):
    """bool (batch, max_len): the cache slots a token at ``position`` attends (0..position)."""
    return jnp.broadcast_to(jnp.arange(max_len) <= position, (batch, max_len))
