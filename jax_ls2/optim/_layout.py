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


def float_leaves(fn: str, name: str, leaves) -> list:
    """`leaves` as JAX arrays, checked to be float32, float16 or bfloat16. NumPy arrays
    and Python scalars are taken as ``jnp.asarray`` takes them (as optax's own math
    does: without x64, a float64 NumPy array becomes float32, JAX's rule); any other
    dtype raises a TypeError naming `fn`, `name` and the leaf."""
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, (np.ndarray, np.generic, float, int)) and not isinstance(x, jax.Array):
            x = jnp.asarray(x)
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise TypeError(f"{fn}: {name} leaf {i} must be an array, got {type(x).__name__}")
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: {name} leaf {i} must have dtype float32, float16 or bfloat16, "
                            f"got {x.dtype}")
        axes = _explicit_axes(x)
        if axes:
            raise ValueError(f"{fn}: {name} leaf {i} is sharded over the explicit mesh axes {axes} "
                             f"({jax.typeof(x)}); the fused optimizer keeps its state in flat buffers that "
                             "such leaves cannot be concatenated into: use a mesh with AxisType.Auto axes "
                             "(sharding then follows from the inputs) or run the step inside jax.shard_map")
        out.append(x)
    return out


def _explicit_axes(x) -> tuple:
    """The mesh axes of AxisType.Explicit that shard `x`'s type (empty for Auto meshes)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or not getattr(mesh, "axis_names", None):
        return ()
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
    used = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
    return tuple(a for a in used if a in explicit)


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


def padding_index(layout: Layout) -> np.ndarray:
    """(n_pad,) int32 positions of the padding elements of a flat buffer, ascending."""
    ends = np.asarray(layout.offsets, np.int64) + np.asarray(layout.sizes, np.int64)
    nexts = np.append(np.asarray(layout.offsets[1:], np.int64), layout.total)
    if not len(ends):
        return np.zeros((0,), np.int32)
    return np.concatenate([np.arange(a, b) for a, b in zip(ends, nexts)]).astype(np.int32)


def launches(n_leaves: int) -> int:
    """Kernel launches per pass for a pytree of `n_leaves` leaves."""
    return max(1, -(-n_leaves // MAX_LEAVES))


def workspace_size(n_leaves: int) -> int:
    """f32 elements of the norm-pass workspace: per-block partials and 4 control words."""
    return launches(n_leaves) * NORM_BLOCKS * 2 + 4


def offsets_attr(layout: Layout) -> np.ndarray:
    return np.asarray(layout.offsets, dtype=np.int64)
