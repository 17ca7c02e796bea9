"""Moving the FP8 meta from step to step in a training loop: the meta updates taken out of
the gradients before any optax transformation sees them, max-merged over micro-batches,
and applied once per optimizer step.

``model_or_state`` below is an NNX module (its `FP8Meta` variables are updated in place),
an ``nnx.State`` or any pytree holding `DotMeta` nodes or `FP8Meta` variables, beside
parameters or not. ``grads`` is the gradient of a loss with respect to it (or to a tree
holding its metas): ``jax.grad`` over the tree, or ``nnx.grad`` with
``argnums=nnx.DiffState(0, nnx.Any(nnx.Param, FP8Meta))``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ls2.fp8.state import FP8Meta, _check_recipe, is_meta, merge_meta_updates, split_meta, update_meta


def _meta_tree(model_or_state):
    """The part of ``model_or_state`` the recipe steps: an NNX module's `FP8Meta` state,
    or the tree itself."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, FP8Meta)
    return model_or_state


def count_metas(tree) -> int:
    """Number of `DotMeta` nodes and `FP8Meta` variables in ``tree`` (a pytree or an
    ``nnx.State``; an NNX module: its `FP8Meta` variables)."""
    return sum(map(is_meta, jax.tree.leaves(_meta_tree(tree), is_leaf=is_meta)))


def apply_meta_updates(model_or_state, grads, recipe, *, when=True):
    """One optimizer step of the FP8 meta: takes the meta updates out of ``grads`` and
    steps every meta of ``model_or_state`` by ``recipe`` (`update_meta`: the observed
    amaxes enter the history, scales recomputed).

    Args:
      model_or_state: an NNX module (updated in place), ``nnx.State`` or pytree holding
        the metas.
      grads: the gradient tree with the meta updates (a whole step's, or the
        observations of several micro-batches merged by `accumulate_meta_updates`).
      recipe: the `DelayedScaling` of the metas.
      when: a bool, traced or not; where False the metas stay as they are (an
        ``optax.MultiSteps`` micro-step that applied no update:
        ``tx.has_updated(opt_state)``).

    Returns:
      ``(param_grads, new_meta)``: ``param_grads`` is ``grads`` without the meta
      updates (`split_meta`), for optax; ``new_meta`` is ``model_or_state`` with its
      metas stepped (for a module: its `FP8Meta` state, already written back).

    Raises ValueError where ``model_or_state`` holds metas and ``grads`` carries no
    meta update (the loss was not differentiated with respect to them).
    """
    _check_recipe("apply_meta_updates", recipe)
    param_grads, updates = split_meta(grads)
    state = _meta_tree(model_or_state)
    if count_metas(state) and not count_metas(updates):
        raise ValueError("apply_meta_updates: model_or_state holds FP8 metas but grads carry no meta update; "
                         "differentiate with respect to the metas too (nnx.grad with argnums=nnx.DiffState(0, "
                         "nnx.Any(nnx.Param, fp8.FP8Meta)), or jax.grad over the tree holding them)")
    new = update_meta(state, updates, recipe)
    if when is not True:
        new = jax.tree.map(lambda n, o: jnp.where(when, n, o), new, state)
    if isinstance(model_or_state, nnx.Module):
        nnx.update(model_or_state, new)
    return param_grads, new


def accumulate_meta_updates(pending, grads, *, reset=False):
    """One micro-batch: takes the meta updates out of ``grads`` and merges them into
    ``pending`` by elementwise max (`merge_meta_updates`), never by a sum or a mean.

    Args:
      pending: the merged observations so far (None, or `meta_updates_like`'s zeros),
        structured as `split_meta`'s meta updates of ``grads``.
      grads: this micro-batch's gradient tree.
      reset: a bool, traced or not: start afresh from this micro-batch (the first of an
        optimizer step; with ``optax.MultiSteps``: ``opt_state.mini_step == 0``).

    Returns ``(param_grads, pending)``; pass ``pending`` as the grads of
    `apply_meta_updates` once per optimizer step.
    """
    param_grads, updates = split_meta(grads)
    if pending is not None and reset is not False:
        pending = jax.tree.map(lambda a: jnp.where(reset, jnp.zeros_like(a), a), pending)
    return param_grads, merge_meta_updates(pending, updates)


def meta_updates_like(model_or_state):
    """An empty ``pending`` for `accumulate_meta_updates`: the meta updates of
    ``model_or_state`` with zero observations (structured as `split_meta` gives them),
    for a jitted loop that carries it."""
    _, metas = split_meta(_meta_tree(model_or_state))
    return jax.tree.map(jnp.zeros_like, metas)
