"""The fused apply: new params written by the optimizer's own pass, for a plain
pytree (`apply_updates`) or a Flax ``nnx.Optimizer`` (`update_nnx`).

Both take ``fp8=recipe`` (a ``jax_ls2.fp8.DelayedScaling``) for models with FP8 GEMMs:
the FP8 meta updates are taken out of the gradients before the optimizer sees them,
and the metas are stepped by the recipe once per call (see ``jax_ls2.fp8``)."""
from __future__ import annotations

import sys

from jax_ls2.optim._transformation import FlatGrads, FusedGradientTransformation, check_no_fp8_meta
from jax_ls2.optim.loss_scaling import find_state


def _fp8_module(fn: str, recipe):
    """jax_ls2.fp8, with ``recipe`` checked (imported here: the optimizers need no flax)."""
    from jax_ls2 import fp8  # noqa: PLC0415
    if not isinstance(recipe, fp8.DelayedScaling):
        raise TypeError(f"{fn}: fp8 must be None or a jax_ls2.fp8.DelayedScaling, got {type(recipe).__name__}")
    return fp8


def apply_updates(tx, grads, state, params, *, fp8=None):
    """Updates `params` with `grads` in one fused pass and returns ``(new_params,
    new_state)``: the same step as ``tx.update`` followed by ``optax.apply_updates``,
    but the new params are written directly (in place under ``jit`` when params and
    state are donated). `tx` must come from ``jax_ls2.optim.adamw/adam/sgd``; `grads` is
    a pytree like params or a `FlatGrads`.

    fp8: None, or the ``jax_ls2.fp8.DelayedScaling`` of the FP8 metas (`DotMeta` nodes
    or ``FP8Meta`` variables) that `params` holds beside its params. `grads` then holds
    their meta updates (a gradient of the whole tree, or a `FlatGrads` from `accumulate`
    whose ``meta`` holds the micro-batches' observations merged by max): they are taken
    out before `tx` sees anything, `tx` steps the params alone (its state made with
    ``tx.init(jax_ls2.fp8.split_meta(params)[0])``), and each meta is stepped once by
    the recipe (history rolled, scales recomputed). The result has `params`' structure.
    """
    fn = "apply_updates"
    if not isinstance(tx, FusedGradientTransformation):
        raise TypeError("apply_updates: tx must be a transformation made by jax_ls2.optim "
                        f"(adamw, adam or sgd), got {type(tx).__name__}")
    if fp8 is None:
        return tx.apply(grads, state, params)
    f8 = _fp8_module(fn, fp8)
    if isinstance(grads, FlatGrads):
        param_grads, meta_updates = FlatGrads(grads.buffer), grads.meta
        if meta_updates is None:
            raise ValueError(f"{fn}: fp8 is set but the FlatGrads carry no FP8 meta updates; accumulate "
                             "gradients that hold them into an accumulator made by init_accumulator from the "
                             "params and metas together")
    else:
        param_grads, meta_updates = f8.split_meta(grads)
    params_only, metas = f8.split_meta(params)
    new_params, new_state = tx.apply(param_grads, state, params_only)
    _, new_metas = f8.apply_meta_updates(metas, meta_updates, fp8)
    return f8.join_meta(new_params, new_metas), new_state


def _multi_steps(opt_state) -> bool:
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415
    return any(isinstance(n, optax.MultiStepsState)
               for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, optax.MultiStepsState)))


def update_nnx(optimizer, model, grads, *, fp8=None):
    """``optimizer.update(model, grads)`` for a Flax ``nnx.Optimizer`` whose ``tx`` comes
    from ``jax_ls2.optim``, with the new params written by the fused pass of
    `apply_updates`: one pass over params, gradients and state instead of ``tx.update``
    followed by a per-leaf ``optax.apply_updates``, and ``stochastic_rounding`` takes
    effect (the optax path adds the update in the param dtype, rounding to nearest).
    Updates `model`'s params (those of ``optimizer.wrt``), the optimizer state and
    ``optimizer.step`` in place, like ``nnx.Optimizer.update`` (no update tree is formed).
    Returns the step's ``finite`` flag (() bool: False when a gradient held inf/NaN, see
    `FusedState`). Any other ``tx`` goes through ``optimizer.update`` unchanged and the
    result is None.

    fp8: None, or the ``jax_ls2.fp8.DelayedScaling`` of the model's FP8 layers. `grads`
    must then hold the meta updates (``nnx.grad`` with ``argnums=nnx.DiffState(0,
    nnx.Any(nnx.Param, jax_ls2.fp8.FP8Meta))``): they are taken out before ``tx`` sees
    the gradients, and the model's ``FP8Meta`` variables are stepped once by the recipe.
    An ``optax.MultiSteps`` ``tx`` is refused with fp8 (it would see one call per
    micro-batch, the meta one step per call); accumulate with `accumulate` and
    `apply_updates`, or with ``jax_ls2.fp8.accumulate_meta_updates``.
    """
    from flax import nnx  # noqa: PLC0415 (the optimizers themselves do not need flax)
    fn = "update_nnx"
    graph = getattr(optimizer, "graph", None)
    f8 = sys.modules.get("jax_ls2.fp8") if fp8 is None else _fp8_module(fn, fp8)
    if f8 is None:  # no FP8 meta can exist without jax_ls2.fp8
        return _update_params(optimizer, model, grads, graph)
    if f8.count_metas(nnx.state(model, optimizer.wrt, graph=graph)):
        raise TypeError(f"{fn}: optimizer.wrt selects FP8Meta variables, which are amax histories and "
                        "scales, not parameters; build the nnx.Optimizer with wrt=nnx.Param")
    if fp8 is None:
        if f8.count_metas(grads):
            raise TypeError(f"{fn}: grads hold FP8 meta updates (FP8Meta); pass fp8=<the model's "
                            "jax_ls2.fp8.DelayedScaling> so that they step the metas")
        return _update_params(optimizer, model, grads, graph)
    if not f8.count_metas(model):
        raise ValueError(f"{fn}: fp8 is set but the model holds no FP8Meta variables (no layer built "
                         "with fp8=...)")
    if _multi_steps(optimizer.opt_state):
        raise ValueError(f"{fn}: optimizer.tx is an optax.MultiSteps, which applies one update per k calls "
                         "while the FP8 meta would step every call; accumulate micro-batches with "
                         "jax_ls2.optim.accumulate and apply_updates(..., fp8=recipe), or step the metas "
                         "with jax_ls2.fp8.accumulate_meta_updates and apply_meta_updates")
    param_grads, meta_updates = f8.split_meta(grads)
    finite = _update_params(optimizer, model, param_grads, graph)
    f8.apply_meta_updates(model, meta_updates, fp8)
    return finite


def _update_params(optimizer, model, grads, graph):
    if not isinstance(optimizer.tx, FusedGradientTransformation):
        optimizer.update(model, grads)
        return None
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    params = nnx.state(model, optimizer.wrt, graph=graph)
    grads = nnx.as_pure(nnx.state(grads, optimizer.wrt, graph=graph))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and not mesh.manual_axes:
        # Gradients laid out as their params (by the params' partition specs): left
        # free, the partitioner may lay out the backward pass so that a fused op's
        # custom_partitioning (the LayerNorm's, in a tensor-parallel BERT) receives a
        # sharding it cannot read (an AssertionError in explode_superdims).
        grads = jax.lax.with_sharding_constraint(grads, nnx.as_pure(nnx.get_partition_spec(params)))
    params = nnx.as_pure(params)
    check_no_fp8_meta("update_nnx", grads)
    new_params, new_state = apply_updates(optimizer.tx, grads, nnx.as_pure(optimizer.opt_state), params)
    nnx.update(model, new_params)
    nnx.update(optimizer.opt_state, nnx.state(new_state, graph=graph))
    optimizer.step[...] += 1
    return find_state(new_state).finite
