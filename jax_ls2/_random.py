"""The counter-based dropout generator, bit for bit the same as ``csrc/kernels/common.cuh``.

Element ``g`` (global flat index, offset included) of a dropout mask is kept iff
its 16-bit draw ``u16(g) >= threshold`` with ``threshold = round(rate * 65536)``:
so the dropout rate is quantised to 1/65536 and the kept fraction is exactly
``1 - threshold / 65536``. ``u16(g)`` is the low (even g) or high (odd g) half of
``mix32(((g & ~1) * 0x9E3779B1 + k0) ^ k1)`` (uint32 arithmetic), ``k0, k1`` the two
32-bit words of the JAX key.

`keep_mask_wide` numbers elements by a 64-bit index ``g = hi * 2**32 + lo`` (flash
attention's masks reach 2**39 elements): with ``c = mix32(hi * 0x9E3779B1 + k1) ^
mix32(k1)`` (zero for ``hi = 0``), the draw is the half of ``mix32(((lo & ~1) *
0x9E3779B1 + k0) ^ k1 ^ c) ^ c``. Below 2**32 it is the 32-bit generator bit for bit;
above, each 2**32 block gets its own input and output whitening, so no block repeats
another.
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


def _wide_word(hi, k1):
    """The per-2**32-block word c(hi) of the 64-bit index (0 for hi = 0)."""
    hi = jnp.asarray(hi, jnp.uint32)
    k1 = jnp.asarray(k1, jnp.uint32)
    return mix32(hi * np.uint32(0x9E3779B1) + k1) ^ mix32(k1)


def keep_bits_wide(k0, k1, hi, lo, threshold: int) -> jax.Array:
    """Keep flags of the elements with 64-bit indices ``hi * 2**32 + lo`` (uint32 arrays
    of one shape, broadcast); ``k0, k1`` the key words."""
    hi, lo = jnp.broadcast_arrays(jnp.asarray(hi, jnp.uint32), jnp.asarray(lo, jnp.uint32))
    c = _wide_word(hi, k1)
    w = ((lo & np.uint32(0xFFFFFFFE)) * np.uint32(0x9E3779B1) + jnp.asarray(k0, jnp.uint32)) ^ \
        jnp.asarray(k1, jnp.uint32) ^ c
    h = mix32(w) ^ c
    u = jnp.where((lo & 1) == 1, h >> 16, h & np.uint32(0xFFFF))
    return u >= np.uint32(threshold)


def mul_wide(a, b):
    """(hi, lo) uint32 words of the 64-bit product of uint32 arrays a and b."""
    a = jnp.asarray(a, jnp.uint32)
    b = jnp.asarray(b, jnp.uint32)
    m16 = np.uint32(0xFFFF)
    a0, a1, b0, b1 = a & m16, a >> 16, b & m16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & m16) + (p10 & m16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, a * b


def add_wide(hi, lo, x):
    """(hi, lo) + x for a uint32 x, the carry into hi."""
    x = jnp.asarray(x, jnp.uint32)
    s = lo + x
    return hi + (s < lo).astype(jnp.uint32), s
