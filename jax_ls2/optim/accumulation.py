"""Gradient accumulation into one flat float32 buffer in the parameters' flat layout,
one kernel launch per 256 leaves; the result feeds the fused step as `FlatGrads`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ls2.optim import _ffi_calls
from jax_ls2.optim._layout import float_leaves, layout_of, unflatten
from jax_ls2.optim._transformation import FlatGrads


def init_accumulator(params) -> FlatGrads:
    """A zero (total,) float32 gradient accumulator in the flat layout of `params`."""
    leaves = jax.tree.leaves(params)
    leaves = float_leaves("init_accumulator", "params", leaves)
    return FlatGrads(jnp.zeros((layout_of(leaves).total,), jnp.float32))


def accumulate(acc: FlatGrads, grads, scale=1.0) -> FlatGrads:
    """``acc + scale * grads`` in float32 with one kernel launch (per 256 leaves); `grads`
    is a pytree of f32/f16/bf16 leaves, `scale` a float or traced scalar (e.g. 1 / the
    number of micro-batches). Donate `acc` to update it in place."""
    if not isinstance(acc, FlatGrads):
        raise TypeError(f"accumulate: acc must be a FlatGrads from init_accumulator, got {type(acc).__name__}")
    leaves = jax.tree.leaves(grads)
    leaves = float_leaves("accumulate", "grads", leaves)
    layout = layout_of(leaves)
    if acc.buffer.shape != (layout.total,) or acc.buffer.dtype != jnp.float32:
        raise ValueError(f"accumulate: acc.buffer must be float32 of shape ({layout.total},), got "
                         f"{acc.buffer.dtype} {tuple(acc.buffer.shape)}")
    s = jnp.asarray(scale, jnp.float32).reshape((1,))
    return FlatGrads(_ffi_calls.accumulate(acc.buffer, s, leaves, layout=layout))


def unflatten_grads(acc: FlatGrads, params):
    """The accumulated gradients as a float32 pytree like `params`."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, unflatten(acc.buffer, layout_of(leaves)))
