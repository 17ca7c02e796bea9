"""The plain twins' decode cache: Flax's own ``nnx.Cache`` variables, written and masked
by the same jnp rules as `jax_ls2.nn.kv_cache` (copied, so that the twins import no
jax_ls2 code; tests/test_plain_copies.py checks that both give the same results).

A layer's cache is keys and values ``(batch, max_len, num_kv_heads, head_dim)`` and the
number of positions written so far (an int32 scalar)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def new_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype, owner: str,
              variable=nnx.Cache):
    """Zeroed (keys, values, index) cache variables of type ``variable``; checks the sizes
    with ``owner``'s name."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.init_cache: {name} must be a positive int, got {value!r}")
    shape = (batch, max_len, num_kv_heads, head_dim)
    return (variable(jnp.zeros(shape, dtype)), variable(jnp.zeros(shape, dtype)),
            variable(jnp.zeros((), jnp.int32)))


def write(keys, values, start, k, v, owner: str):
    """Writes k, v ``(batch, t, num_kv_heads, head_dim)`` into the caches at positions
    ``start .. start + t - 1`` (``start`` an int32 scalar) and returns all keys and
    values ``(batch, max_len, num_kv_heads, head_dim)``; positions past the end are
    dropped (see `nan_past_end`). The caller advances its index."""
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
    """bool ``(t, max_len)``: query ``i`` of a decode call starting at ``start`` sees
    cache slot ``j`` iff ``j <= start + i``."""
    return jnp.arange(max_len)[None, :] <= start + jnp.arange(t)[:, None]


def nan_past_end(x, start, max_len: int):
    """x ``(batch, t, ...)``, or NaN everywhere when the call runs past the cache's end
    (``start + t > max_len``: its keys were not all written)."""
    return jnp.where(start + x.shape[1] <= max_len, x, jnp.asarray(jnp.nan, x.dtype))
