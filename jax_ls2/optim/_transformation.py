"""The fused transformation shared by adam, adamw and sgd: state, hyper-parameters,
loss scaling, and the standard (updates) and fused (new params) steps."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from jax_ls2.optim import _abi as A
from jax_ls2.optim import _kernels
from jax_ls2.optim._layout import HP_SIZE, Layout, check_float_leaves, flatten, layout_of

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]


class FusedState(NamedTuple):
    """State of a fused optimizer.

    count:       () int32, steps applied (a skipped step is not counted).
    mu, nu:      (total,) float32 or bfloat16 flat moments (``None`` when unused).
    master:      (total,) float32 flat master weights, or ``None``.
    rng:         (2,) uint32 key words of the stochastic rounding.
    loss_scale:  () float32, the factor the loss is multiplied by (1 without scaling).
    good_steps:  () int32, finite steps since the loss scale last changed.
    grad_norm:   () float32, global norm of the unscaled gradients at the last step
                 (0 unless clipping or the finite check is on).
    finite:      () bool, whether the last step's gradients were all finite. Always
                 computed (without ``skip_nonfinite`` / dynamic loss scaling a step
                 with inf/NaN gradients is applied, and this flag is how it is seen).
    """
    count: jax.Array
    mu: Optional[jax.Array]
    nu: Optional[jax.Array]
    master: Optional[jax.Array]
    rng: jax.Array
    loss_scale: jax.Array
    good_steps: jax.Array
    grad_norm: jax.Array
    finite: jax.Array


class FlatGrads(NamedTuple):
    """Gradients accumulated in one flat float32 buffer, shape (total,) in the
    parameters' flat layout (see ``jax_ls2.optim.accumulate``)."""
    buffer: jax.Array


class Config(NamedTuple):
    name: str
    algo: int
    learning_rate: Any
    b1: Any
    b2: Any
    eps: Any
    eps_root: Any
    weight_decay: Any
    mask: Any
    nesterov: bool
    has_mu: bool
    has_nu: bool
    moment_dtype: Any
    master_weights: bool
    stochastic_rounding: bool
    seed: Any
    loss_scale: Any          # None, a number, or "dynamic"
    initial_loss_scale: Any
    growth_interval: Any
    growth_factor: Any
    backoff_factor: Any
    min_loss_scale: Any
    max_grad_norm: Any
    skip_nonfinite: bool


def _check(cfg: Config) -> None:
    fn = cfg.name
    if cfg.moment_dtype is not None and jnp.dtype(cfg.moment_dtype) not in (jnp.dtype(jnp.float32),
                                                                           jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"{fn}: moment_dtype must be float32 or bfloat16, got {jnp.dtype(cfg.moment_dtype)}")
    if isinstance(cfg.loss_scale, str) and cfg.loss_scale != "dynamic":
        raise ValueError(f"{fn}: loss_scale must be None, a number or 'dynamic', got {cfg.loss_scale!r}")
    if cfg.loss_scale is not None and not isinstance(cfg.loss_scale, str):
        if isinstance(cfg.loss_scale, (int, float)) and not cfg.loss_scale > 0:
            raise ValueError(f"{fn}: loss_scale must be positive, got {cfg.loss_scale}")
    if cfg.mask is not None and cfg.weight_decay is None:
        raise ValueError(f"{fn}: mask given without weight_decay")
    if isinstance(cfg.learning_rate, (int, float)) and not cfg.learning_rate >= 0:
        raise ValueError(f"{fn}: learning_rate must be >= 0, got {cfg.learning_rate}")


def _moment_dtype(cfg: Config):
    return jnp.dtype(cfg.moment_dtype) if cfg.moment_dtype is not None else jnp.dtype(jnp.float32)


def _flags(cfg: Config, *, apply: bool, flat: bool) -> int:
    f = 0
    f |= A.APPLY if apply else 0
    f |= A.HAS_MU if cfg.has_mu else 0
    f |= A.HAS_NU if cfg.has_nu else 0
    f |= A.MASTER if cfg.master_weights else 0
    f |= A.CHECK if (cfg.skip_nonfinite or cfg.loss_scale == "dynamic") else 0
    f |= A.CLIP if cfg.max_grad_norm is not None else 0
    f |= A.SR if cfg.stochastic_rounding else 0
    f |= A.NESTEROV if cfg.nesterov else 0
    f |= A.MOMENT_BF16 if _moment_dtype(cfg) == jnp.dtype(jnp.bfloat16) else 0
    f |= A.FLAT_GRADS if flat else 0
    f |= A.REPORT if not f & (A.CHECK | A.CLIP) else 0
    return f


def _decay_mask(cfg: Config, params, n: int) -> tuple:
    if cfg.weight_decay is None:
        return (0,) * n
    if cfg.mask is None:
        return (1,) * n
    mask = cfg.mask(params) if callable(cfg.mask) else cfg.mask
    leaves = jax.tree.leaves(mask)
    if len(leaves) != n:
        raise ValueError(f"{cfg.name}: mask must have one bool per parameter leaf ({n}), got {len(leaves)}")
    out = []
    for i, m in enumerate(leaves):
        if isinstance(m, jax.core.Tracer):
            raise TypeError(f"{cfg.name}: mask leaf {i} must be a Python bool, got a traced value")
        out.append(int(bool(m)))
    return tuple(out)


def _initial_scale(cfg: Config):
    if cfg.loss_scale is None:
        return jnp.float32(1.0)
    if cfg.loss_scale == "dynamic":
        return jnp.asarray(cfg.initial_loss_scale, jnp.float32)
    return jnp.asarray(cfg.loss_scale, jnp.float32)


def init_state(cfg: Config, params) -> FusedState:
    _check(cfg)
    leaves = jax.tree.leaves(params)
    check_float_leaves(cfg.name, "params", leaves)
    layout = layout_of(leaves)
    mdt = _moment_dtype(cfg)
    zeros = lambda: jnp.zeros((layout.total,), mdt)
    seed = jnp.asarray(cfg.seed).astype(jnp.uint32).reshape(())
    return FusedState(
        count=jnp.zeros((), jnp.int32),
        mu=zeros() if cfg.has_mu else None,
        nu=zeros() if cfg.has_nu else None,
        master=flatten(leaves, layout, jnp.float32) if cfg.master_weights else None,
        rng=jnp.stack([seed, jnp.uint32(0x9E3779B9)]),
        loss_scale=_initial_scale(cfg),
        good_steps=jnp.zeros((), jnp.int32),
        grad_norm=jnp.zeros((), jnp.float32),
        finite=jnp.ones((), jnp.bool_),
    )


def _hyper(cfg: Config, state: FusedState, count_inc) -> jax.Array:
    lr = cfg.learning_rate(state.count) if callable(cfg.learning_rate) else cfg.learning_rate
    b1 = cfg.b1 if cfg.b1 is not None else 0.0
    b2 = cfg.b2 if cfg.b2 is not None else 0.0
    if cfg.algo == A.ADAM:
        # The expressions of optax.scale_by_adam, so the constants agree to the bit.
        bc1 = 1 - b1 ** count_inc
        bc2 = 1 - b2 ** count_inc
    else:
        bc1 = bc2 = 1.0
    vals = [0.0] * HP_SIZE
    vals[A.LR] = lr
    vals[A.B1] = b1
    vals[A.B2] = b2
    vals[A.ONE_MINUS_B1] = 1 - b1
    vals[A.ONE_MINUS_B2] = 1 - b2
    vals[A.EPS] = cfg.eps
    vals[A.EPS_ROOT] = cfg.eps_root
    vals[A.WD] = cfg.weight_decay if cfg.weight_decay is not None else 0.0
    # Reciprocals of the bias corrections: the kernel multiplies by them instead of
    # dividing every element (within an ulp of optax's division).
    vals[A.INV_BC1] = jnp.float32(1) / jnp.asarray(bc1, jnp.float32)
    vals[A.INV_BC2] = jnp.float32(1) / jnp.asarray(bc2, jnp.float32)
    vals[A.INV_SCALE] = 1.0 / state.loss_scale
    vals[A.MAX_NORM] = cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0
    vals[A.GRAD_MULT] = 1.0
    return jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in vals])


def _next_scale(cfg: Config, state: FusedState, finite):
    if cfg.loss_scale != "dynamic":
        return state.loss_scale, state.good_steps
    good = state.good_steps + 1
    grow = good >= cfg.growth_interval
    scale = state.loss_scale
    grown = jnp.where(grow, scale * cfg.growth_factor, scale)
    lowered = jnp.maximum(scale * cfg.backoff_factor, jnp.asarray(cfg.min_loss_scale, jnp.float32))
    new_scale = jnp.where(finite, grown, lowered).astype(jnp.float32)
    new_good = jnp.where(finite, jnp.where(grow, 0, good), 0).astype(jnp.int32)
    return new_scale, new_good


def step(cfg: Config, grads, state: FusedState, params, *, apply: bool):
    """One fused step. Returns (outs, new_state): outs are the updates (a pytree like
    params in the grads' dtypes) or, with ``apply``, the new params."""
    fn = cfg.name
    if params is None:
        raise ValueError(f"{fn}: params are required (the fused update reads them)")
    if not isinstance(state, FusedState):
        raise TypeError(f"{fn}: state must be a FusedState from this optimizer's init, got {type(state).__name__}")
    p_leaves, treedef = jax.tree.flatten(params)
    check_float_leaves(fn, "params", p_leaves)
    layout = layout_of(p_leaves)
    flat = isinstance(grads, FlatGrads)
    if flat:
        g_leaves = [grads.buffer]
        if grads.buffer.shape != (layout.total,) or grads.buffer.dtype != jnp.float32:
            raise ValueError(f"{fn}: FlatGrads buffer must be float32 of shape ({layout.total},), got "
                             f"{grads.buffer.dtype} {tuple(grads.buffer.shape)}")
    else:
        g_leaves, g_def = jax.tree.flatten(grads)
        if g_def != treedef:
            raise ValueError(f"{fn}: grads must have the structure of params; got {g_def}, expected {treedef}")
        check_float_leaves(fn, "grads", g_leaves)
        for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
            if tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"{fn}: grads leaf {i} must have shape {tuple(p.shape)}, got {tuple(g.shape)}")
    for name, buf in (("mu", state.mu), ("nu", state.nu), ("master", state.master)):
        if buf is not None and buf.shape != (layout.total,):
            raise ValueError(f"{fn}: state.{name} must have shape ({layout.total},) for these params, "
                             f"got {tuple(buf.shape)}")
    count_inc = numerics.safe_increment(state.count)
    hp = _hyper(cfg, state, count_inc)
    seed = jnp.concatenate([state.rng.astype(jnp.uint32),
                            jnp.stack([count_inc.astype(jnp.uint32), jnp.uint32(0)])])
    flags = _flags(cfg, apply=apply, flat=flat)
    outs, mu, nu, master, stats = _kernels.fused_update(
        g_leaves, p_leaves, state.mu, state.nu, state.master, hp, seed,
        algo=cfg.algo, flags=flags, layout=layout, decay=_decay_mask(cfg, params, len(p_leaves)))
    checked = bool(flags & A.CHECK)
    # Every mode reports whether the gradients were finite; only CHECK acts on it.
    finite = stats[1] > 0
    scale, good = _next_scale(cfg, state, finite)
    new_state = FusedState(
        count=jnp.where(finite, count_inc, state.count) if checked else count_inc,
        mu=mu, nu=nu, master=master, rng=state.rng, loss_scale=scale, good_steps=good,
        grad_norm=stats[0] if flags & (A.CHECK | A.CLIP) else state.grad_norm,
        finite=finite)
    return jax.tree.unflatten(treedef, outs), new_state


def make(cfg: Config) -> optax.GradientTransformationExtraArgs:
    _check(cfg)

    def init_fn(params):
        return init_state(cfg, params)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(cfg, updates, state, params, apply=False)

    def apply_fn(grads, state, params):
        return step(cfg, grads, state, params, apply=True)

    update_fn.fused_apply = apply_fn
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
