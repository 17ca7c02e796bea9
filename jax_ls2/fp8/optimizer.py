"""The optimizer step of a model with FP8 layers: the FP8 meta (`DotMeta` nodes or
`FP8Meta` variables, and their updates in the gradients) is split off here, once, so
that ``jax_ls2.optim`` sees parameters only; the metas are stepped by their recipe.

* `apply_updates` / `update_nnx`: ``jax_ls2.optim``'s fused steps for a pytree or an
  ``nnx.Optimizer``, with the metas stepped once per call.

Gradient accumulation for such models (the flat buffer of ``jax_ls2.optim`` or
per-leaf sums) is in `jax_ls2.fp8.accumulate`.
"""
from __future__ import annotations

import jax
import optax

from jax_ls2 import optim
from jax_ls2.fp8.recipe import DelayedScaling
from jax_ls2.fp8.state import join_meta, split_meta
from jax_ls2.fp8.step import apply_meta_updates, count_metas
from jax_ls2.optim.apply import refuse_metas_in_wrt, update_params


def _check_fp8(fn: str, recipe) -> None:
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"{fn}: fp8 must be None or a jax_ls2.fp8.DelayedScaling, got {type(recipe).__name__}")


def apply_updates(tx, grads, state, params, *, fp8=None):
    """`jax_ls2.optim.apply_updates` for `params` holding FP8 metas beside the params.

    fp8: the ``DelayedScaling`` of the metas (`DotMeta` nodes or `FP8Meta` variables);
    None: plain ``jax_ls2.optim.apply_updates``. `grads` holds the meta updates (a
    gradient of the whole tree, or a `FlatGrads` from `accumulate_flat` whose ``meta``
    holds the micro-batches' observations merged by max): they are taken out, `tx`
    steps the params alone (its state made with ``tx.init(split_meta(params)[0])``), and
    each meta is stepped once by the recipe (history rolled, scales recomputed).
    Returns ``(new_params, new_state)``, new_params with `params`' structure.
    """
    fn = "apply_updates"
    if fp8 is None:
        return optim.apply_updates(tx, grads, state, params)
    _check_fp8(fn, fp8)
    if not isinstance(tx, optim.FusedGradientTransformation):
        raise TypeError("apply_updates: tx must be a transformation made by jax_ls2.optim "
                        f"(adamw, adam or sgd), got {type(tx).__name__}")
    if isinstance(grads, optim.FlatGrads):
        param_grads, meta_updates = optim.FlatGrads(grads.buffer), grads.meta
        if meta_updates is None:
            raise ValueError(f"{fn}: fp8 is set but the FlatGrads carry no FP8 meta updates; accumulate "
                             "gradients that hold them with accumulate_flat into an accumulator made by "
                             "init_flat_accumulator from the params and metas together")
    else:
        param_grads, meta_updates = split_meta(grads)
    params_only, metas = split_meta(params)
    new_params, new_state = optim.apply_updates(tx, param_grads, state, params_only)
    _, new_metas = apply_meta_updates(metas, meta_updates, fp8)
    return join_meta(new_params, new_metas), new_state


def _multi_steps(opt_state) -> bool:
    return any(isinstance(n, optax.MultiStepsState)
               for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, optax.MultiStepsState)))


def update_nnx(optimizer, model, grads, *, fp8=None):
    """`jax_ls2.optim.update_nnx` for a model with FP8 layers: the params step by the
    fused pass, the model's `FP8Meta` variables once by the recipe, both in place.

    fp8: the ``DelayedScaling`` of the model's FP8 layers; None: plain
    ``jax_ls2.optim.update_nnx``. `grads` must hold the meta updates (``nnx.grad`` with
    ``argnums=nnx.DiffState(0, nnx.Any(nnx.Param, FP8Meta))``); they are taken out before
    ``optimizer.tx`` sees the gradients. An ``optax.MultiSteps`` ``tx`` is refused (it
    would see one call per micro-batch, the meta one step per call); accumulate with
    `accumulate_flat` and `apply_updates`, or with `accumulate_meta_updates`.
    Returns the step's ``finite`` flag as ``jax_ls2.optim.update_nnx`` does.
    """
    fn = "update_nnx"
    if fp8 is None:
        return optim.update_nnx(optimizer, model, grads)
    _check_fp8(fn, fp8)
    refuse_metas_in_wrt(fn, optimizer, model)
    if not count_metas(model):
        raise ValueError(f"{fn}: fp8 is set but the model holds no FP8Meta variables (no layer built "
                         "with fp8=...)")
    if _multi_steps(optimizer.opt_state):
        raise ValueError(f"{fn}: optimizer.tx is an optax.MultiSteps, which applies one update per k calls "
                         "while the FP8 meta would step every call; accumulate micro-batches with "
                         "jax_ls2.fp8.accumulate_flat and apply_updates(..., fp8=recipe), or step the metas "
                         "with jax_ls2.fp8.accumulate_meta_updates and apply_meta_updates")
    param_grads, meta_updates = split_meta(grads)
    finite = update_params(optimizer, model, param_grads, getattr(optimizer, "graph", None))
    apply_meta_updates(model, meta_updates, fp8)
    return finite


__all__ = ["apply_updates", "update_nnx"]
