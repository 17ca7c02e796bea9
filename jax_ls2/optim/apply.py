"""The fused apply: new params written by the optimizer's own pass, for a plain
pytree (`apply_updates`) or a Flax ``nnx.Optimizer`` (`update_nnx`).

Both see parameters only. For models with FP8 GEMMs, ``jax_ls2.fp8.apply_updates`` and
``jax_ls2.fp8.update_nnx`` take the FP8 meta updates out of the gradients, call these
on the parameters, and step the metas by their recipe."""
from __future__ import annotations

from jax_ls2.optim._state_nodes import count_non_parameters
from jax_ls2.optim._transformation import FusedGradientTransformation, check_no_fp8_meta
from jax_ls2.optim.loss_scaling import find_state


def _refuse_fp8_keyword(fn: str, fp8) -> None:
    if fp8 is not None:
        raise TypeError(f"{fn}: fp8= has moved: call jax_ls2.fp8.{fn}(..., fp8=recipe), which splits the FP8 "
                        f"metas off and calls jax_ls2.optim.{fn} on the parameters")


def apply_updates(tx, grads, state, params, *, fp8=None):
    """Updates `params` with `grads` in one fused pass and returns ``(new_params,
    new_state)``: the same step as ``tx.update`` followed by ``optax.apply_updates``,
    but the new params are written directly (in place under ``jit`` when params and
    state are donated). `tx` must come from ``jax_ls2.optim.adamw/adam/sgd``; `grads` is
    a pytree like params or a `FlatGrads`.

    fp8: must be None; models with FP8 metas step through ``jax_ls2.fp8.apply_updates``.
    """
    _refuse_fp8_keyword("apply_updates", fp8)
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

    fp8: must be None; a model with FP8 layers steps through ``jax_ls2.fp8.update_nnx``,
    which takes the meta updates out of `grads` first (grads holding them are refused
    here).
    """
    fn = "update_nnx"
    _refuse_fp8_keyword(fn, fp8)
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
