"""The fused apply: new params written by the optimizer's own pass, for a plain
pytree (`apply_updates`) or a Flax ``nnx.Optimizer`` (`update_nnx`).

Both see parameters only. For models with FP8 GEMMs, ``jax_ls2.fp8.apply_updates`` and
``jax_ls2.fp8.update_nnx`` take the FP8 meta updates out of the gradients, call these
on the parameters, and step the metas by their recipe."""
from __future__ import annotations

import warnings

from jax_ls2.optim._state_nodes import count_non_parameters
from jax_ls2.optim._transformation import FusedGradientTransformation, check_no_fp8_meta
from jax_ls2.optim.loss_scaling import find_state


def _moved_fp8_step(fn: str, fp8, *args):
    """The old ``jax_ls2.optim.<fn>(..., fp8=recipe)``: warns once that the step has moved
    to ``jax_ls2.fp8.<fn>`` and runs it there, through the recipe (so that ``optim``
    never imports ``fp8``). Returns None when `fp8` is None."""
    step = getattr(fp8, "_optimizer_step", None)
    if step is None:
        raise TypeError(f"{fn}: fp8 must be None or a jax_ls2.fp8.DelayedScaling, got {type(fp8).__name__}")
    if fn not in _warned_moved:
        _warned_moved.add(fn)
        warnings.warn(f"jax_ls2.optim.{fn}(..., fp8=recipe) is deprecated: call jax_ls2.fp8.{fn}(..., fp8=recipe), "
                      f"which splits the FP8 metas off and calls jax_ls2.optim.{fn} on the parameters",
                      DeprecationWarning, stacklevel=3)
    return step(fn)(*args, fp8=fp8)


_warned_moved: set = set()


def apply_updates(tx, grads, state, params, *, fp8=None):
    """Updates `params` with `grads` in one fused pass and returns ``(new_params,
    new_state)``: the same step as ``tx.update`` followed by ``optax.apply_updates``,
    but the new params are written directly (in place under ``jit`` when params and
    state are donated). `tx` must come from ``jax_ls2.optim.adamw/adam/sgd``; `grads` is
    a pytree like params or a `FlatGrads`.

    fp8: None; models with FP8 metas step through ``jax_ls2.fp8.apply_updates`` (passing
    the recipe here still works, with a DeprecationWarning, and runs that step).
    """
    if fp8 is not None:
        return _moved_fp8_step("apply_updates", fp8, tx, grads, state, params)
    if not isinstance(tx, FusedGradientTransformation):
        raise TypeError("apply_updates: tx must be a transformation made by jax_ls2.optim "
                        f"(adamw, adam or sgd), got {type(tx).__name__}")
    return tx.apply(grads, state, params)


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

    fp8: None; a model with FP8 layers steps through ``jax_ls2.fp8.update_nnx``, which
    takes the meta updates out of `grads` first (grads holding them are refused here;
    passing the recipe here still works, with a DeprecationWarning, and runs that step).
    """
    fn = "update_nnx"
    if fp8 is not None:
        return _moved_fp8_step(fn, fp8, optimizer, model, grads)
    graph = getattr(optimizer, "graph", None)
    refuse_metas_in_wrt(fn, optimizer, model)
    if count_non_parameters(grads):
        raise TypeError(f"{fn}: grads hold FP8 meta updates (FP8Meta); use jax_ls2.fp8.update_nnx and pass "
                        "fp8=<the model's jax_ls2.fp8.DelayedScaling> so that they step the metas")
    return update_params(optimizer, model, grads, graph)


def refuse_metas_in_wrt(fn: str, optimizer, model) -> None:
    """Raises where ``optimizer.wrt`` selects state that is not a parameter (FP8 metas)."""
    from flax import nnx  # noqa: PLC0415 (the optimizers themselves do not need flax)
    if count_non_parameters(nnx.state(model, optimizer.wrt, graph=getattr(optimizer, "graph", None))):
        raise TypeError(f"{fn}: optimizer.wrt selects FP8Meta variables, which are amax histories and "
                        "scales, not parameters; build the nnx.Optimizer with wrt=nnx.Param")


def update_params(optimizer, model, grads, graph):
    """The parameter step of `update_nnx` (``grads`` holding parameters only)."""
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
