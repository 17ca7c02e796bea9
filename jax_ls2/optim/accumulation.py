"""Gradient accumulation into one flat float32 buffer in the parameters' flat layout,
one kernel launch per 256 leaves; the result feeds the fused step as `FlatGrads`.

Only parameters and their gradients enter: a tree holding FP8 metas or their updates
(``jax_ls2.fp8``) is refused; ``jax_ls2.fp8.init_flat_accumulator`` /
``accumulate_flat`` split them off and keep their merged updates in ``FlatGrads.meta``."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ls2.optim import _ffi_calls
from jax_ls2.optim._layout import float_leaves, layout_of, unflatten
from jax_ls2.optim._state_nodes import count_non_parameters
from jax_ls2.optim._transformation import FlatGrads


def _refuse_non_parameters(fn: str, name: str, tree) -> None:
    if count_non_parameters(tree):
        raise ValueError(f"{fn}: {name} hold FP8 meta updates but acc has no meta; accumulate gradients that "
                         "hold them with jax_ls2.fp8.accumulate_flat into an accumulator made by "
                         "jax_ls2.fp8.init_flat_accumulator from the params and metas together")


def init_accumulator(params) -> FlatGrads:
    """A zero (total,) float32 gradient accumulator in the flat layout of `params` (a
    pytree of f32/f16/bf16 leaves, no FP8 metas)."""
    if count_non_parameters(params):
        raise ValueError("init_accumulator: params hold FP8 metas; make the accumulator with "
                         "jax_ls2.fp8.init_flat_accumulator")
    leaves = float_leaves("init_accumulator", "params", jax.tree.leaves(params))
    return FlatGrads(jnp.zeros((layout_of(leaves).total,), jnp.float32))


def accumulate(acc: FlatGrads, grads, scale=1.0) -> FlatGrads:
    """``acc + scale * grads`` in float32 with one kernel launch (per 256 leaves); `grads`
    is a pytree of f32/f16/bf16 leaves, `scale` a float or traced scalar (e.g. 1 / the
    number of micro-batches). Donate `acc` to update it in place."""
    if not isinstance(acc, FlatGrads):
        raise TypeError(f"accumulate: acc must be a FlatGrads from init_accumulator, got {type(acc).__name__}")
    if acc.meta is not None:
        raise ValueError("accumulate: acc carries FP8 meta updates (FlatGrads.meta); accumulate into it with "
                         "jax_ls2.fp8.accumulate_flat")
    _refuse_non_parameters("accumulate", "grads", grads)
    leaves = float_leaves("accumulate", "grads", jax.tree.leaves(grads))
    layout = layout_of(leaves)
    if acc.buffer.shape != (layout.total,) or acc.buffer.dtype != jnp.float32:
        raise ValueError(f"accumulate: acc.buffer must be float32 of shape ({layout.total},), got "
                         f"{acc.buffer.dtype} {tuple(acc.buffer.shape)}")
    s = jnp.asarray(scale, jnp.float32).reshape((1,))
    return FlatGrads(_ffi_calls.accumulate(acc.buffer, s, leaves, layout=layout))


def unflatten_grads(acc: FlatGrads, params):
    """The accumulated gradients as a float32 pytree like `params` (no FP8 metas: see
    ``jax_ls2.fp8.unflatten_flat_grads``)."""
    if count_non_parameters(params):
        raise ValueError("unflatten_grads: params hold FP8 metas; use jax_ls2.fp8.unflatten_flat_grads")
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, unflatten(acc.buffer, layout_of(leaves)))
