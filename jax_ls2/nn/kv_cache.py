"""The decode cache of the decoder layers: `KVCache`, a variable type of its own.

A layer's cache is three `KVCache` variables: keys and values ``(batch, max_len,
num_kv_heads, head_dim)`` and the number of positions written so far (an int32 scalar).
They are state, never params: ``nnx.state(model, KVCache)`` selects them,
``nnx.split(model, nnx.Param, KVCache, ...)`` keeps them apart from the weights, and an
optimizer built on ``nnx.Param`` never sees them. `KVCache` is an ``nnx.Cache``, so code
that filters Flax's own cache type finds it too.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_ls2._deprecation import renamed_keywords
from jax_ls2.nn._common import check_positive_int


class KVCache(nnx.Cache):
    """Keys, values or the write position of one attention layer's decode cache."""


@renamed_keywords("new_cache", kv_heads="num_kv_heads")  # kv_heads= until 265ec64
def new_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype, owner: str, variable=KVCache):
    """Zeroed (keys, values, index) cache variables of type ``variable`` (`KVCache`, or
    ``nnx.Cache`` for the plain-Flax twins); checks the sizes with ``owner``'s name."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        check_positive_int(f"{owner}.init_cache", name, value)
    shape = (batch, max_len, num_kv_heads, head_dim)
    return (variable(jnp.zeros(shape, dtype)), variable(jnp.zeros(shape, dtype)),
            variable(jnp.zeros((), jnp.int32)))


def write(keys: KVCache, values: KVCache, start, k, v, owner: str):
    """Writes k, v ``(batch, t, num_kv_heads, head_dim)`` into the caches at positions
    ``start .. start + t - 1`` (``start`` an int32 scalar) and returns all keys and
    values ``(batch, max_len, num_kv_heads, head_dim)``. The caller advances its index.

    ``t <= max_len`` is checked here (a ValueError naming ``owner``); ``start + t <=
    max_len`` cannot be checked while ``start`` is traced: positions past the end are
    dropped (the slots before them keep their keys), and `nan_past_end` turns that
    call's outputs (and every later call's) into NaN. Size the cache for the whole
    generation (``flax_models.decode.generate`` does)."""
    t, max_len = k.shape[1], keys.shape[1]
    if t > max_len:
        raise ValueError(f"{owner}: a decode call of {t} tokens does not fit the cache's max_len ({max_len}); "
                         f"call init_cache with a larger max_len or pass fewer tokens per call")
    slots = start + jnp.arange(t, dtype=jnp.int32)
    k_all = keys[...].at[:, slots].set(k.astype(keys.dtype), mode="drop")
    v_all = values[...].at[:, slots].set(v.astype(values.dtype), mode="drop")
    keys[...], values[...] = k_all, v_all
    return k_all, v_all


def visible(start, t: int, max_len: int):
    """bool ``(t, max_len)``: the cache slots each query of a decode call attends. The
    call's tokens sit at positions ``start .. start + t - 1``; query ``i`` sees slot
    ``j`` iff ``j <= start + i`` (the cached positions and its own call's earlier
    tokens). One rule for a prefill from an empty cache, a chunk after cached positions
    and a single new token."""
    return jnp.arange(max_len)[None, :] <= start + jnp.arange(t)[:, None]


def visible_bias(start, t: int, max_len: int):
    """`visible` as an additive attention bias, float32 ``(1, 1, t, max_len)``: 0 where
    a slot is seen, -inf elsewhere (``flash_attention``'s ``bias=``)."""
    return jnp.where(visible(start, t, max_len), 0.0, -jnp.inf).astype(jnp.float32)[None, None]


def nan_past_end(x, start, max_len: int):
    """x ``(batch, t, ...)``, the attention output of a decode call starting at
    ``start``, or NaN everywhere when the call runs past the cache's end (``start + t >
    max_len``): its keys were not all written, so its results would be wrong."""
    return jnp.where(start + x.shape[1] <= max_len, x, jnp.asarray(jnp.nan, x.dtype))
