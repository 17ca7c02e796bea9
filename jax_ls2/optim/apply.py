"""Helpers around the fused optimizers: the fused apply, loss scaling, and gradient
accumulation into one flat float32 buffer."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ls2.optim import _kernels
from jax_ls2.optim._core import FlatGrads, FusedState
from jax_ls2.optim._layout import check_float_leaves, layout_of, unflatten


def apply_updates(tx, grads, state, params):
    """Updates `params` with `grads` in one fused pass and returns ``(new_params,
    new_state)``: the same step as ``tx.update`` followed by ``optax.apply_updates``,
    but the new params are written directly (in place under ``jit`` when params and
    state are donated). `tx` must come from ``jax_ls2.optim.adamw/adam/sgd``; `grads` is
    a pytree like params or a `FlatGrads`."""
    fused = getattr(getattr(tx, "update", None), "fused_apply", None)
    if fused is None:
        raise TypeError("apply_updates: tx must be a transformation made by jax_ls2.optim "
                        f"(adamw, adam or sgd), got {type(tx).__name__}")
    return fused(grads, state, params)


def update_nnx(optimizer, model, grads):
    """``optimizer.update(model, grads)`` for a Flax ``nnx.Optimizer`` whose ``tx`` comes
    from ``jax_ls2.optim``, with the new params written by the fused pass of
    `apply_updates`: one pass over params, gradients and state instead of ``tx.update``
    followed by a per-leaf ``optax.apply_updates``, and ``stochastic_rounding`` takes
    effect (the optax path adds the update in the param dtype, rounding to nearest).
    Updates `model`'s params (those of ``optimizer.wrt``), the optimizer state and
    ``optimizer.step`` in place, like ``nnx.Optimizer.update`` (no update tree is formed).
    Returns the step's ``finite`` flag (() bool: False when a gradient held inf/NaN, see
    `FusedState`). Any other ``tx`` goes through ``optimizer.update`` unchanged and the
    result is None."""
    if getattr(getattr(optimizer.tx, "update", None), "fused_apply", None) is None:
        optimizer.update(model, grads)
        return None
    from flax import nnx  # noqa: PLC0415 (the optimizers themselves do not need flax)
    graph = getattr(optimizer, "graph", None)
    params = nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph))
    grads = nnx.as_pure(nnx.state(grads, optimizer.wrt, graph=graph))
    new_params, new_state = apply_updates(optimizer.tx, grads, nnx.as_pure(optimizer.opt_state), params)
    nnx.update(model, new_params)
    nnx.update(optimizer.opt_state, nnx.state(new_state, graph=graph))
    optimizer.step[...] += 1
    return find_state(new_state).finite


def find_state(opt_state) -> FusedState:
    """The `FusedState` inside a (possibly chained or wrapped) optimizer state."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, FusedState))
             if isinstance(s, FusedState)]
    if len(found) != 1:
        raise ValueError(f"find_state: expected exactly one FusedState in the optimizer state, got {len(found)}")
    return found[0]


def loss_scale(opt_state) -> jax.Array:
    """The current loss scale () float32 (1 without loss scaling)."""
    return find_state(opt_state).loss_scale


def scale_loss(loss: jax.Array, opt_state) -> jax.Array:
    """`loss` multiplied by the current loss scale (differentiate this one)."""
    return loss * loss_scale(opt_state).astype(loss.dtype)


def init_accumulator(params) -> FlatGrads:
    """A zero (total,) float32 gradient accumulator in the flat layout of `params`."""
    leaves = jax.tree.leaves(params)
    check_float_leaves("init_accumulator", "params", leaves)
    return FlatGrads(jnp.zeros((layout_of(leaves).total,), jnp.float32))


def accumulate(acc: FlatGrads, grads, scale=1.0) -> FlatGrads:
    """``acc + scale * grads`` in float32 with one kernel launch (per 256 leaves); `grads`
    is a pytree of f32/f16/bf16 leaves, `scale` a float or traced scalar (e.g. 1 / the
    number of micro-batches). Donate `acc` to update it in place."""
    if not isinstance(acc, FlatGrads):
        raise TypeError(f"accumulate: acc must be a FlatGrads from init_accumulator, got {type(acc).__name__}")
    leaves = jax.tree.leaves(grads)
    check_float_leaves("accumulate", "grads", leaves)
    layout = layout_of(leaves)
    if acc.buffer.shape != (layout.total,) or acc.buffer.dtype != jnp.float32:
        raise ValueError(f"accumulate: acc.buffer must be float32 of shape ({layout.total},), got "
                         f"{acc.buffer.dtype} {tuple(acc.buffer.shape)}")
    s = jnp.asarray(scale, jnp.float32).reshape((1,))
    return FlatGrads(_kernels.accumulate(acc.buffer, s, leaves, layout=layout))


def unflatten_grads(acc: FlatGrads, params):
    """The accumulated gradients as a float32 pytree like `params`."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, unflatten(acc.buffer, layout_of(leaves)))
