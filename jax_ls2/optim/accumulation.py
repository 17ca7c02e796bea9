"""Gradient accumulation into one flat float32 buffer in the parameters' flat layout,
one kernel launch per 256 leaves; the result feeds the fused step as `FlatGrads`.

With FP8 layers (``jax_ls2.fp8``) the params tree may hold FP8 metas beside the params
and each micro-batch's gradients their meta updates: those never enter the buffer;
the accumulator keeps them in ``FlatGrads.meta``, merged by elementwise max (the
amaxes of the whole optimizer step), for ``apply_updates(..., fp8=recipe)``."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jax_ls2.optim import _ffi_calls
from jax_ls2.optim._layout import float_leaves, layout_of, unflatten
from jax_ls2.optim._transformation import FlatGrads


def _split_fp8(tree):
    """(tree without FP8 metas, the metas or None) -- `jax_ls2.fp8.split_meta` where the
    tree holds any (none can exist unless jax_ls2.fp8 was imported)."""
    fp8 = sys.modules.get("jax_ls2.fp8")
    if fp8 is None or not fp8.count_metas(tree):
        return tree, None
    return fp8.split_meta(tree)


def init_accumulator(params) -> FlatGrads:
    """A zero (total,) float32 gradient accumulator in the flat layout of `params`. Where
    `params` holds FP8 metas, ``meta`` holds their empty (zero) meta updates."""
    params, metas = _split_fp8(params)
    leaves = jax.tree.leaves(params)
    leaves = float_leaves("init_accumulator", "params", leaves)
    meta = None if metas is None else sys.modules["jax_ls2.fp8"].meta_updates_like(metas)
    return FlatGrads(jnp.zeros((layout_of(leaves).total,), jnp.float32), meta)


def accumulate(acc: FlatGrads, grads, scale=1.0) -> FlatGrads:
    """``acc + scale * grads`` in float32 with one kernel launch (per 256 leaves); `grads`
    is a pytree of f32/f16/bf16 leaves, `scale` a float or traced scalar (e.g. 1 / the
    number of micro-batches). Donate `acc` to update it in place.

    FP8 meta updates in `grads` (`DotMeta` / ``FP8Meta`` nodes) are merged into
    ``acc.meta`` by elementwise max, unscaled (observed amaxes, not gradients)."""
    if not isinstance(acc, FlatGrads):
        raise TypeError(f"accumulate: acc must be a FlatGrads from init_accumulator, got {type(acc).__name__}")
    grads, meta_updates = _split_fp8(grads)
    if (meta_updates is None) != (acc.meta is None):
        raise ValueError("accumulate: grads " + ("hold FP8 meta updates but acc has no meta (make it with "
                                                 "init_accumulator from the params and metas together)"
                                                 if acc.meta is None else
                                                 "hold no FP8 meta updates but acc.meta expects them "
                                                 "(differentiate with respect to the metas too)"))
    leaves = jax.tree.leaves(grads)
    leaves = float_leaves("accumulate", "grads", leaves)
    layout = layout_of(leaves)
    if acc.buffer.shape != (layout.total,) or acc.buffer.dtype != jnp.float32:
        raise ValueError(f"accumulate: acc.buffer must be float32 of shape ({layout.total},), got "
                         f"{acc.buffer.dtype} {tuple(acc.buffer.shape)}")
    s = jnp.asarray(scale, jnp.float32).reshape((1,))
    meta = None if meta_updates is None else sys.modules["jax_ls2.fp8"].merge_meta_updates(acc.meta, meta_updates)
    return FlatGrads(_ffi_calls.accumulate(acc.buffer, s, leaves, layout=layout), meta)


def unflatten_grads(acc: FlatGrads, params):
    """The accumulated gradients as a float32 pytree like `params` (where `params` holds
    FP8 metas: with ``acc.meta``'s merged meta updates at their places)."""
    params, metas = _split_fp8(params)
    leaves, treedef = jax.tree.flatten(params)
    grads = jax.tree.unflatten(treedef, unflatten(acc.buffer, layout_of(leaves)))
    if metas is None or acc.meta is None:
        return grads
    return sys.modules["jax_ls2.fp8"].join_meta(grads, acc.meta)
