"""The fused apply: new params written by the optimizer's own pass, for a plain
pytree (`apply_updates`) or a Flax ``nnx.Optimizer`` (`update_nnx`)."""
from __future__ import annotations

from jax_ls2.optim._transformation import FusedGradientTransformation
from jax_ls2.optim.loss_scaling import find_state


def apply_updates(tx, grads, state, params):
    """Updates `params` with `grads` in one fused pass and returns ``(new_params,
    new_state)``: the same step as ``tx.update`` followed by ``optax.apply_updates``,
    but the new params are written directly (in place under ``jit`` when params and
    state are donated). `tx` must come from ``jax_ls2.optim.adamw/adam/sgd``; `grads` is
    a pytree like params or a `FlatGrads`."""
    if not isinstance(tx, FusedGradientTransformation):
        raise TypeError("apply_updates: tx must be a transformation made by jax_ls2.optim "
                        f"(adamw, adam or sgd), got {type(tx).__name__}")
    return tx.apply(grads, state, params)


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
    if not isinstance(optimizer.tx, FusedGradientTransformation):
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
