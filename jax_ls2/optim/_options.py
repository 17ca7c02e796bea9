"""The precision and scaling options shared by adamw, adam and sgd, defined once.

The factories take them as keywords after optax's own arguments
(``adamw(1e-3, master_weights=True, loss_scale="dynamic")``) and gather them into one
`PrecisionOptions`; `precision_keywords` writes the fields into the factory's signature,
so ``inspect.signature`` (and ``optax.inject_hyperparams``, which binds arguments by
it) sees each option by name.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

MOMENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class PrecisionOptions:
    """Precision modes and loss scaling of a fused optimizer.

    moment_dtype: float32 (default, None) or bfloat16, the dtype of every (total,) flat
      moment buffer (the kernel stores mu and nu in one dtype).
    master_weights: keep a float32 (total,) master copy of the params in the state.
    stochastic_rounding, seed: stochastic rounding of float16/bfloat16 params written by
      ``apply_updates`` without master weights, keyed by `seed` and the step.
    loss_scale: None, a positive number, or "dynamic" (non-finite gradients skip the step
      and multiply the scale by `backoff_factor`, never below `min_loss_scale`;
      `growth_interval` finite steps in a row multiply it by `growth_factor`; it starts
      at `initial_loss_scale`). Gradients are divided by the state's ``loss_scale``.
    max_grad_norm: clip by the global norm of the unscaled gradients (as
      ``optax.clip_by_global_norm``), or None.
    skip_nonfinite: skip the step (params and moments untouched) on inf/NaN gradients.
    """
    moment_dtype: Any = None
    master_weights: bool = False
    stochastic_rounding: bool = False
    seed: Any = 0
    loss_scale: Union[None, float, str] = None
    initial_loss_scale: float = 2.0 ** 15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_loss_scale: float = 1.0
    max_grad_norm: Optional[float] = None
    skip_nonfinite: bool = False

    @classmethod
    def from_keywords(cls, fn: str, keywords: dict) -> "PrecisionOptions":
        """The options named in `keywords`; an unknown name raises a TypeError naming `fn`."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(f"{fn}: unexpected keyword argument(s) {', '.join(unknown)}; the precision "
                            f"options are {', '.join(names)}")
        opts = cls(**keywords)
        opts.check(fn)
        return opts

    @property
    def moment(self) -> jnp.dtype:
        """The dtype of the flat moment buffers."""
        return jnp.dtype(self.moment_dtype) if self.moment_dtype is not None else jnp.dtype(jnp.float32)

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale is dynamic (a number may be traced, so compare strings only)."""
        return isinstance(self.loss_scale, str) and self.loss_scale == "dynamic"

    @property
    def checks_finite(self) -> bool:
        """Whether a step with inf/NaN gradients is skipped."""
        return bool(self.skip_nonfinite) or self.dynamic

    def check(self, fn: str) -> None:
        """Raise on a value that cannot work (numbers known now; traced values pass)."""
        if self.moment_dtype is not None and _as_dtype(self.moment_dtype) not in MOMENT_DTYPES:
            raise TypeError(f"{fn}: moment_dtype must be float32 or bfloat16 (or None), got "
                            f"{_dtype_text(self.moment_dtype)}")
        _check_seed(fn, self.seed)
        if isinstance(self.loss_scale, str) and self.loss_scale != "dynamic":
            raise ValueError(f"{fn}: loss_scale must be None, a number or 'dynamic', got {self.loss_scale!r}")
        if not isinstance(self.loss_scale, str):
            require(fn, "loss_scale", self.loss_scale, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)
        require(fn, "max_grad_norm", self.max_grad_norm, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)
        # The dynamic-scaling parameters are checked whatever loss_scale is: a value
        # that cannot work is a mistake even before it is used.
        require(fn, "initial_loss_scale", self.initial_loss_scale, "a finite number > 0",
                lambda v: math.isfinite(v) and v > 0)
        require(fn, "growth_factor", self.growth_factor, "a finite number > 1", lambda v: math.isfinite(v) and v > 1)
        require(fn, "backoff_factor", self.backoff_factor, "a number in (0, 1)", lambda v: 0 < v < 1)
        require(fn, "growth_interval", self.growth_interval, "an integer >= 1", lambda v: v.is_integer() and v >= 1)
        require(fn, "min_loss_scale", self.min_loss_scale, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)
        initial = concrete_number(self.initial_loss_scale)
        if initial is not None:
            # A floor above the start would raise the scale on an overflow.
            require(fn, "min_loss_scale", self.min_loss_scale, f"a number <= initial_loss_scale ({initial})",
                    lambda v: v <= initial)

    def with_moment_dtype(self, fn: str, argument: str, dtype) -> "PrecisionOptions":
        """These options with optax's `argument` (``mu_dtype`` / ``accumulator_dtype``)
        folded into ``moment_dtype``; a dtype the kernel cannot store, or one that
        contradicts ``moment_dtype``, raises."""
        if dtype is None:
            return self
        dt = _as_dtype(dtype)
        if dt not in MOMENT_DTYPES:
            raise TypeError(f"{fn}: {argument} must be None, float32 or bfloat16, got {_dtype_text(dtype)}")
        if self.moment_dtype is not None and self.moment != dt:
            raise ValueError(f"{fn}: {argument}={dt} contradicts moment_dtype={self.moment}")
        if argument == "mu_dtype" and dt != jnp.dtype(jnp.float32) and self.moment_dtype is None:
            raise ValueError(f"{fn}: mu_dtype={dt} alone is not supported (the fused kernel stores mu and nu "
                             f"in one dtype); pass moment_dtype=jnp.bfloat16 for bfloat16 mu and nu")
        return dataclasses.replace(self, moment_dtype=dt)


def _as_dtype(value):
    """`value` as a NumPy dtype, or None where it names none (``"foo"``, an object)."""
    try:
        return jnp.dtype(value)
    except (TypeError, ValueError):
        return None


def _dtype_text(value) -> str:
    dt = _as_dtype(value)
    return str(dt) if dt is not None else f"{type(value).__name__} {value!r}"


SEED_RANGE = "an int in [0, 2**32) or an integer scalar array"


def _check_seed(fn: str, seed) -> None:
    """The stochastic-rounding seed becomes one uint32 word: an int in [0, 2**32), or a
    scalar integer array (concrete or traced, taken modulo 2**32)."""
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"{fn}: seed must be {SEED_RANGE}, got bool {seed!r}")
    if isinstance(seed, (int, np.integer)):
        if not 0 <= int(seed) < 2 ** 32:
            raise ValueError(f"{fn}: seed must be {SEED_RANGE}, got {seed!r}")
        return
    if isinstance(seed, (np.ndarray, jax.Array, jax.core.Tracer)):
        if not jnp.issubdtype(seed.dtype, jnp.integer) or seed.size != 1:
            raise TypeError(f"{fn}: seed must be {SEED_RANGE}, got an array of {seed.dtype}{tuple(seed.shape)}")
        return
    raise TypeError(f"{fn}: seed must be {SEED_RANGE}, got {type(seed).__name__} {seed!r}")


def concrete_number(x) -> Optional[float]:
    """`x` as a Python float when its value is known now (a Python or NumPy number, a
    concrete one-element array); None for None and for traced values."""
    if x is None or isinstance(x, (bool, np.bool_)) or isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, (int, float, np.number)):
        return float(x)
    if isinstance(x, (np.ndarray, jax.Array)) and x.size == 1 and jnp.issubdtype(x.dtype, jnp.number) \
            and not jnp.iscomplexobj(x):
        return float(np.asarray(x).reshape(()))
    return None


def require(fn: str, argument: str, value, expected: str, ok) -> None:
    """ValueError ``"{fn}: {argument} must be {expected}, got {value}"`` when `value` is
    known now and ``ok(float value)`` is false (NaN fails every comparison)."""
    v = concrete_number(value)
    if v is not None and not ok(v):
        raise ValueError(f"{fn}: {argument} must be {expected}, got {value}")


def precision_keywords(factory):
    """Decorator: `factory`'s ``**options`` shown in its signature as one keyword-only
    parameter per `PrecisionOptions` field, with the field's default."""
    sig = inspect.signature(factory)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
               for f in dataclasses.fields(PrecisionOptions)]
    factory.__signature__ = sig.replace(parameters=params)
    return factory
