"""Fused optimizers for optax: adamw, adam, sgd.

Each factory returns an ``optax.GradientTransformationExtraArgs`` whose state is a
`FusedState` holding the optimizer state as flat buffers, so one custom call updates
the whole pytree. Use ``tx.update`` (standard optax contract: updates, then
``optax.apply_updates``) or ``jax_ls2.optim.apply_updates(tx, grads, state, params)``,
which writes the new params in the same pass (in place under ``jit`` with donation).

Precision modes (every element is computed in float32 registers):
  * float32 params: classic mode, no master copy needed.
  * ``master_weights=True``: a float32 master copy of float16/bfloat16 params lives in
    the state; params are the master rounded to nearest.
  * ``master_weights=False`` with float16/bfloat16 params: no master; params are read
    and written in their dtype; ``stochastic_rounding=True`` rounds the written params
    stochastically (keyed by ``seed`` and the step) so small updates are not lost
    (only in ``apply_updates``; the standard contract returns updates).
  * ``moment_dtype=jnp.bfloat16`` stores both moments in bfloat16.

Mixed precision extras, in the same passes: ``loss_scale`` (a number, or "dynamic":
non-finite gradients skip the step and multiply the scale by ``backoff_factor``;
``growth_interval`` finite steps in a row multiply it by ``growth_factor``),
``max_grad_norm`` (clip by the global norm of the unscaled gradients) and
``skip_nonfinite`` (skip steps whose gradients hold inf/NaN).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax.numpy as jnp
import optax

from jax_ls2.optim import _abi as A
from jax_ls2.optim._core import Config, ScalarOrSchedule, make


def _common(name, algo, learning_rate, *, b1, b2, eps, eps_root, weight_decay, mask, nesterov, has_mu,
            has_nu, moment_dtype, master_weights, stochastic_rounding, seed, loss_scale, initial_loss_scale,
            growth_interval, growth_factor, backoff_factor, min_loss_scale, max_grad_norm, skip_nonfinite):
    return make(Config(
        name=name, algo=algo, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay, mask=mask, nesterov=bool(nesterov), has_mu=has_mu, has_nu=has_nu,
        moment_dtype=moment_dtype, master_weights=bool(master_weights),
        stochastic_rounding=bool(stochastic_rounding), seed=seed, loss_scale=loss_scale,
        initial_loss_scale=initial_loss_scale, growth_interval=growth_interval, growth_factor=growth_factor,
        backoff_factor=backoff_factor, min_loss_scale=min_loss_scale, max_grad_norm=max_grad_norm,
        skip_nonfinite=bool(skip_nonfinite)))


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, weight_decay: float = 1e-4, mask: Optional[Union[Any, Callable]] = None, *,
          moment_dtype=None, master_weights: bool = False, stochastic_rounding: bool = False, seed: int = 0,
          loss_scale: Union[None, float, str] = None, initial_loss_scale: float = 2.0 ** 15,
          growth_interval: int = 2000, growth_factor: float = 2.0, backoff_factor: float = 0.5,
          min_loss_scale: float = 1.0, max_grad_norm: Optional[float] = None,
          skip_nonfinite: bool = False) -> optax.GradientTransformationExtraArgs:
    """Fused AdamW; with the defaults of the float32 path the same math as ``optax.adamw``.

    Args:
      learning_rate: float, schedule ``count -> lr`` or traced scalar.
      b1, b2, eps, eps_root, weight_decay: as in optax (may be traced).
      mask: pytree of Python bools like params (or a callable params -> such a pytree):
        True where weight decay applies.
      moment_dtype: float32 (default) or bfloat16 for both moments, shape (total,).
      master_weights: keep a float32 (total,) master copy of the params in the state.
      stochastic_rounding, seed: stochastic rounding of float16/bfloat16 params written by
        ``apply_updates`` without master weights.
      loss_scale, initial_loss_scale, growth_interval, growth_factor, backoff_factor,
        min_loss_scale: loss scaling (see the module docstring); gradients are divided by
        the state's ``loss_scale``.
      max_grad_norm: clip by global norm (as ``optax.clip_by_global_norm``), or None.
      skip_nonfinite: skip the step (params and moments untouched) on inf/NaN gradients.
    """
    return _common("adamw", A.ADAM, learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                   weight_decay=weight_decay, mask=mask, nesterov=False, has_mu=True, has_nu=True,
                   moment_dtype=moment_dtype, master_weights=master_weights,
                   stochastic_rounding=stochastic_rounding, seed=seed, loss_scale=loss_scale,
                   initial_loss_scale=initial_loss_scale, growth_interval=growth_interval,
                   growth_factor=growth_factor, backoff_factor=backoff_factor, min_loss_scale=min_loss_scale,
                   max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite)


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, *, moment_dtype=None, master_weights: bool = False,
         stochastic_rounding: bool = False, seed: int = 0, loss_scale: Union[None, float, str] = None,
         initial_loss_scale: float = 2.0 ** 15, growth_interval: int = 2000, growth_factor: float = 2.0,
         backoff_factor: float = 0.5, min_loss_scale: float = 1.0, max_grad_norm: Optional[float] = None,
         skip_nonfinite: bool = False) -> optax.GradientTransformationExtraArgs:
    """Fused Adam (``adamw`` without weight decay); the same math as ``optax.adam``."""
    return _common("adam", A.ADAM, learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                   weight_decay=None, mask=None, nesterov=False, has_mu=True, has_nu=True,
                   moment_dtype=moment_dtype, master_weights=master_weights,
                   stochastic_rounding=stochastic_rounding, seed=seed, loss_scale=loss_scale,
                   initial_loss_scale=initial_loss_scale, growth_interval=growth_interval,
                   growth_factor=growth_factor, backoff_factor=backoff_factor, min_loss_scale=min_loss_scale,
                   max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite)


def sgd(learning_rate: ScalarOrSchedule, momentum: Optional[float] = None, nesterov: bool = False, *,
        weight_decay: Optional[float] = None, mask: Optional[Union[Any, Callable]] = None,
        moment_dtype=None, master_weights: bool = False, stochastic_rounding: bool = False, seed: int = 0,
        loss_scale: Union[None, float, str] = None, initial_loss_scale: float = 2.0 ** 15,
        growth_interval: int = 2000, growth_factor: float = 2.0, backoff_factor: float = 0.5,
        min_loss_scale: float = 1.0, max_grad_norm: Optional[float] = None,
        skip_nonfinite: bool = False) -> optax.GradientTransformationExtraArgs:
    """Fused SGD with optional (Nesterov) momentum, the same math as ``optax.sgd``
    (momentum buffer ``t = g + momentum * t``); ``weight_decay`` adds ``wd * p`` to the
    direction before the learning rate, on leaves selected by ``mask``."""
    return _common("sgd", A.SGD, learning_rate, b1=momentum, b2=None, eps=0.0, eps_root=0.0,
                   weight_decay=weight_decay, mask=mask, nesterov=nesterov, has_mu=momentum is not None,
                   has_nu=False, moment_dtype=moment_dtype, master_weights=master_weights,
                   stochastic_rounding=stochastic_rounding, seed=seed, loss_scale=loss_scale,
                   initial_loss_scale=initial_loss_scale, growth_interval=growth_interval,
                   growth_factor=growth_factor, backoff_factor=backoff_factor, min_loss_scale=min_loss_scale,
                   max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite)
