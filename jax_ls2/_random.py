"""The counter-based dropout generator, bit for bit the same as ``csrc/kernels/common.cuh``.

Element ``g`` (global flat index, offset included) of a dropout mask is kept iff
its 16-bit draw ``u16(g) >= threshold`` with ``threshold = round(rate * 65536)``:
so the dropout rate is quantised to 1/65536 and the kept fraction is exactly
``1 - threshold / 65536``. ``u16(g)`` is the low (even g) or high (odd g) half of
``mix32(((g & ~1) * 0x9E3779B1 + k0) ^ k1)`` (uint32 arithmetic), ``k0, k1`` the two
32-bit words of the JAX key.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dropout_threshold(rate: float) -> int:
    """The 16-bit drop threshold for `rate` in [0, 1)."""
    return int(min(65535, round(float(rate) * 65536.0)))


def keep_scale(rate: float) -> float:
    """The scale applied to kept elements: 1 / kept fraction."""
    t = dropout_threshold(rate)
    return 65536.0 / (65536.0 - t)


def seed_words(key: jax.Array) -> jax.Array:
    """uint32[3] = (k0, k1, offset=0) from a JAX PRNG key (new-style or raw uint32[2])."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
    else:
        data = key
    data = jnp.asarray(data).reshape(-1).astype(jnp.uint32)
    if data.shape[0] < 2:
        data = jnp.concatenate([data, jnp.zeros((2 - data.shape[0],), jnp.uint32)])
    return jnp.concatenate([data[:2], jnp.zeros((1,), jnp.uint32)])


def mix32(x):
    """The 32-bit integer finaliser shared with the CUDA kernels (Mix32 in common.cuh)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return x


def keep_mask(seed: jax.Array, shape, threshold: int) -> jax.Array:
    """Boolean keep mask of `shape` for seed uint32[3], element order row-major."""
    n = int(np.prod(shape, dtype=np.int64))
    g = jnp.arange(n, dtype=jnp.uint32) + seed[2]
    h = mix32(((g & np.uint32(0xFFFFFFFE)) * np.uint32(0x9E3779B1) + seed[0]) ^ seed[1])
    u = jnp.where((g & 1) == 1, h >> 16, h & np.uint32(0xFFFF))
    return (u >= np.uint32(threshold)).reshape(shape)
