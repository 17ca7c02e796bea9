"""Flat layout of a parameter pytree: leaf ``i`` (``size[i]`` elements, row-major)
occupies ``[offset[i], offset[i] + size[i])`` of every flat optimizer buffer
(moments, master weights, accumulated gradients). Offsets are multiples of ``PAD``
elements so each leaf starts 64-byte aligned; padding elements stay zero.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2.optim._abi import MAX_LEAVES, NORM_BLOCKS, PAD

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


class Layout(NamedTuple):
    """Static description of the flat buffers: per-leaf shapes, sizes and offsets, and
    ``total``, the flat length (a multiple of PAD)."""
    shapes: tuple
    sizes: tuple
    offsets: tuple
    total: int


def layout_of(leaves: Sequence) -> Layout:
    shapes = tuple(tuple(x.shape) for x in leaves)
    sizes = tuple(int(math.prod(s)) for s in shapes)
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // PAD) * PAD
    return Layout(shapes, sizes, tuple(offsets), pos)


def check_float_leaves(fn: str, name: str, leaves) -> None:
    for i, x in enumerate(leaves):
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise TypeError(f"{fn}: {name} leaf {i} must be an array, got {type(x).__name__}")
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: {name} leaf {i} must have dtype float32, float16 or bfloat16, "
                            f"got {x.dtype}")


def flatten(leaves: Sequence, layout: Layout, dtype=jnp.float32) -> jax.Array:
    """(total,) `dtype` buffer holding every leaf at its offset, zeros in the padding."""
    parts = []
    for x, n in zip(leaves, layout.sizes):
        parts.append(jnp.ravel(x).astype(dtype))
        pad = -(-n // PAD) * PAD - n
        if pad:
            parts.append(jnp.zeros((pad,), dtype))
    if not parts:
        return jnp.zeros((0,), dtype)
    return jnp.concatenate(parts)


def leaf_view(flat: jax.Array, layout: Layout, i: int) -> jax.Array:
    """Leaf ``i`` of a flat buffer, shape ``layout.shapes[i]``."""
    off, n = layout.offsets[i], layout.sizes[i]
    return jax.lax.slice(flat, (off,), (off + n,)).reshape(layout.shapes[i])


def unflatten(flat: jax.Array, layout: Layout, dtypes=None) -> list:
    """The leaves of a flat buffer, cast to `dtypes` (one per leaf) when given."""
    out = []
    for i in range(len(layout.sizes)):
        x = leaf_view(flat, layout, i)
        out.append(x if dtypes is None else x.astype(dtypes[i]))
    return out


def launches(n_leaves: int) -> int:
    """Kernel launches per pass for a pytree of `n_leaves` leaves."""
    return max(1, -(-n_leaves // MAX_LEAVES))


def workspace_size(n_leaves: int) -> int:
    """f32 elements of the norm-pass workspace: per-block partials and 4 control words."""
    return launches(n_leaves) * NORM_BLOCKS * 2 + 4


def offsets_attr(layout: Layout) -> np.ndarray:
    return np.asarray(layout.offsets, dtype=np.int64)
