"""Fused optimizers for optax: adamw, adam, sgd.

Each factory takes optax's arguments in optax's order, then jax_ls2's precision
options as keywords (`PrecisionOptions`), and returns a `FusedGradientTransformation`
(an ``optax.GradientTransformationExtraArgs``) whose state is a `FusedState` holding
the optimizer state as flat buffers, so one custom call updates the whole pytree. Use ``tx.update`` (standard optax contract: updates, then
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

from jax_ls2.optim import _abi as A
from jax_ls2.optim._options import PrecisionOptions, precision_keywords
from jax_ls2.optim._transformation import Config, FusedGradientTransformation, ScalarOrSchedule, make


@precision_keywords
def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Any = None, weight_decay: float = 1e-4,
          mask: Optional[Union[Any, Callable]] = None, *, nesterov: bool = False,
          **options) -> FusedGradientTransformation:
    """Fused AdamW; with float32 params the same math as ``optax.adamw``, with optax's
    arguments in optax's order.

    Args:
      learning_rate: float, schedule ``count -> lr`` or traced scalar; finite and >= 0
        (a number is checked here, a traced or scheduled value when the step runs).
      b1, b2, eps, eps_root, weight_decay: as in optax (may be traced); weight_decay
        finite and >= 0, checked as the learning rate is.
      mu_dtype: None or float32 (float32 moments), or bfloat16 together with
        ``moment_dtype=jnp.bfloat16`` (the kernel stores both moments in one dtype).
      mask: pytree of Python bools like params (or a callable params -> such a pytree):
        True where weight decay applies.
      nesterov: not supported by the fused kernel (True raises).
      **options: the precision options, see `PrecisionOptions`.
    """
    return _adam("adamw", learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov, options)


@precision_keywords
def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: Any = None, *, nesterov: bool = False,
         **options) -> FusedGradientTransformation:
    """Fused Adam (``adamw`` without weight decay); the same math as ``optax.adam``.
    ``**options``: the precision options, see `PrecisionOptions`."""
    return _adam("adam", learning_rate, b1, b2, eps, eps_root, mu_dtype, None, None, nesterov, options)


def _adam(name, learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov, options):
    if nesterov:
        raise ValueError(f"{name}: nesterov=True is not supported by the fused kernel (use optax.{name})")
    opts = PrecisionOptions.from_keywords(name, options).with_moment_dtype(name, "mu_dtype", mu_dtype)
    return make(Config(name=name, algo=A.ADAM, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                       eps_root=eps_root, weight_decay=weight_decay, mask=mask, nesterov=False, has_mu=True,
                       has_nu=True, options=opts))


@precision_keywords
def sgd(learning_rate: ScalarOrSchedule, momentum: Optional[float] = None, nesterov: bool = False,
        accumulator_dtype: Any = None, *, weight_decay: Optional[float] = None,
        mask: Optional[Union[Any, Callable]] = None, **options) -> FusedGradientTransformation:
    """Fused SGD with optional (Nesterov) momentum, the same math as ``optax.sgd``
    (momentum buffer ``t = g + momentum * t``), with optax's arguments in optax's order.

    Args:
      accumulator_dtype: None, float32 or bfloat16: the momentum buffer's dtype (the
        same as ``moment_dtype``).
      weight_decay, mask: ``wd * p`` added to the direction before the learning rate,
        on leaves selected by ``mask`` (jax_ls2's addition).
      **options: the precision options, see `PrecisionOptions`.
    """
    opts = PrecisionOptions.from_keywords("sgd", options).with_moment_dtype("sgd", "accumulator_dtype",
                                                                          accumulator_dtype)
    return make(Config(name="sgd", algo=A.SGD, learning_rate=learning_rate, b1=momentum, b2=None, eps=0.0,
                       eps_root=0.0, weight_decay=weight_decay, mask=mask, nesterov=bool(nesterov),
                       has_mu=momentum is not None, has_nu=False, options=opts))
