"""The fused transformation shared by adam, adamw and sgd: its type
(`FusedGradientTransformation`), state, hyper-parameters, loss scaling, and the
standard (updates) and fused (new params) steps."""
from __future__ import annotations

import functools
import math
import sys
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_ls2.optim import _abi as A
from jax_ls2.optim import _ffi_calls, _per_leaf
from jax_ls2.optim._layout import flatten, layout_of
from jax_ls2.optim._options import PrecisionOptions, concrete_number, require

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]


class FusedState(NamedTuple):
    """State of a fused optimizer.

    count:       () int32, steps applied (a skipped step is not counted).
    mu, nu:      (total,) float32 or bfloat16 flat moments (``None`` when unused); for
                 params holding a float64, complex, integer or bool leaf, trees like
                 params in optax's dtypes instead (the per-leaf path, ``_per_leaf.py``).
    master:      (total,) float32 flat master weights, or ``None``.
    rng:         (2,) uint32 key words of the stochastic rounding.
    loss_scale:  () float32, the factor the loss is multiplied by (1 without scaling).
    good_steps:  () int32, finite steps since the loss scale last changed.
    grad_norm:   () float32, global norm of the unscaled gradients at the last step
                 (0 unless clipping or the finite check is on).
    finite:      () bool, whether the last step's gradients were all finite and its
                 traced learning rate and weight decay finite and >= 0. Always
                 computed (without ``skip_nonfinite`` / dynamic loss scaling a step
                 with inf/NaN gradients is applied, and this flag is how it is seen;
                 a step with a bad traced rate takes the rates as 0, so the params
                 keep their values while the moments advance).
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
    parameters' flat layout (see ``jax_ls2.optim.accumulate``). ``meta``: None, or the
    FP8 meta updates of the accumulated micro-batches merged by max (a tree like
    ``jax_ls2.fp8.split_meta`` gives), which only ``apply_updates(..., fp8=recipe)``
    takes."""
    buffer: jax.Array
    meta: Any = None


def check_no_fp8_meta(fn: str, grads) -> None:
    """Raises where FP8 meta updates (``jax_ls2.fp8``) would reach the optimizer's math."""
    if isinstance(grads, FlatGrads):
        if grads.meta is not None:
            raise TypeError(f"{fn}: the FlatGrads carry FP8 meta updates (FlatGrads.meta); apply them with "
                            "jax_ls2.optim.apply_updates(..., fp8=recipe), or pass FlatGrads(acc.buffer)")
        return
    fp8 = sys.modules.get("jax_ls2.fp8")  # none can exist unless jax_ls2.fp8 was imported
    if fp8 is not None and fp8.count_metas(grads):
        raise TypeError(f"{fn}: grads hold FP8 meta updates (DotMeta / FP8Meta), which are amax observations, "
                        "not gradients; take them out first with jax_ls2.fp8.apply_meta_updates (or "
                        "split_meta), or use jax_ls2.optim.apply_updates / update_nnx with fp8=recipe")


class Config(NamedTuple):
    """What one factory call fixed: the algorithm, its hyper-parameters (optax's
    arguments; numbers, traced scalars or, for the learning rate, a schedule) and the
    precision options."""
    name: str
    algo: int
    learning_rate: Any
    b1: Any
    b2: Any
    eps: Any
    eps_root: Any
    weight_decay: Any        # None: no decay term at all
    mask: Any
    nesterov: bool
    has_mu: bool
    has_nu: bool
    options: PrecisionOptions


def _check(cfg: Config) -> None:
    fn = cfg.name
    cfg.options.check(fn)
    if cfg.mask is not None and cfg.weight_decay is None:
        raise ValueError(f"{fn}: mask given without weight_decay")
    for argument in ("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay"):
        _check_number_like(fn, argument, getattr(cfg, argument), schedule=argument == "learning_rate")
    # Numbers known now; traced values are checked in the step (`_traced_rates_ok`).
    for argument in ("learning_rate", "weight_decay"):
        require(fn, argument, getattr(cfg, argument), NON_NEGATIVE, _non_negative)
    if cfg.algo == A.ADAM:
        # b = 1 never forgets (the bias correction divides by 1 - b**t = 0): NaN params.
        for argument in ("b1", "b2"):
            require(fn, argument, getattr(cfg, argument), "a number in [0, 1)", lambda v: 0 <= v < 1)


def _check_number_like(fn: str, argument: str, value, *, schedule: bool) -> None:
    """TypeError unless `value` is a real number, an array (concrete or traced) or, for a
    `schedule` argument, a callable; None is allowed where the factory's default is None
    (every argument here but the learning rate)."""
    if value is None and not schedule:
        return
    if isinstance(value, (bool, np.bool_)) or not (
            isinstance(value, (int, float, np.number, np.ndarray, jax.Array, jax.core.Tracer))
            or (schedule and callable(value))):
        what = "a number, a scalar array or a schedule (count -> value)" if schedule else "a number or a scalar array"
        raise TypeError(f"{fn}: {argument} must be {what}, got {type(value).__name__} {value!r}")
    if isinstance(value, (np.ndarray, jax.Array)) and (jnp.iscomplexobj(value)
                                                       or not jnp.issubdtype(value.dtype, jnp.number)):
        raise TypeError(f"{fn}: {argument} must be a real number, got an array of {value.dtype}")


NON_NEGATIVE = "a finite number >= 0"


def _non_negative(v: float) -> bool:
    return math.isfinite(v) and v >= 0


def _traced_rates_ok(cfg: Config, lr):
    """() bool on the device: whether this step's traced learning rate (a schedule's
    value, ``inject_hyperparams``) and weight decay are finite and >= 0; None when both
    are numbers known now (`_check` checked them). No host callback and no conditional:
    the step goes on without stalling the stream, and `step` takes both rates as 0 and
    reports ``finite=False`` when they are bad."""
    oks = []
    for argument, value in (("learning_rate", lr), ("weight_decay", cfg.weight_decay)):
        if value is None or not callable(getattr(cfg, argument)) and concrete_number(value) is not None:
            continue
        v = jnp.asarray(value)
        oks.append(jnp.all(jnp.isfinite(v) & (v >= 0)))
    return functools.reduce(jnp.logical_and, oks) if oks else None


def _flags(cfg: Config, *, apply: bool, flat: bool) -> int:
    o = cfg.options
    f = 0
    f |= A.APPLY if apply else 0
    f |= A.HAS_MU if cfg.has_mu else 0
    f |= A.HAS_NU if cfg.has_nu else 0
    f |= A.MASTER if o.master_weights else 0
    f |= A.CHECK if o.checks_finite else 0
    f |= A.CLIP if o.max_grad_norm is not None else 0
    f |= A.SR if o.stochastic_rounding else 0
    f |= A.NESTEROV if cfg.nesterov else 0
    f |= A.MOMENT_BF16 if o.moment == jnp.dtype(jnp.bfloat16) else 0
    f |= A.FLAT_GRADS if flat else 0
    f |= A.REPORT if not f & (A.CHECK | A.CLIP) else 0
    return f


def _decay_mask(cfg: Config, params, n: int) -> tuple:
    if cfg.weight_decay is None:
        return (0,) * n
    if cfg.mask is None:
        return (1,) * n
    mask = cfg.mask(params) if callable(cfg.mask) else cfg.mask
    # As optax's masks: a prefix of the params tree, each bool covering its subtree.
    try:
        per_leaf = jax.tree.map(lambda m, sub: [m] * len(jax.tree.leaves(sub)), mask, params)
    except ValueError as e:
        raise ValueError(f"{cfg.name}: mask must be a prefix of the params tree (one bool per leaf or per "
                         f"subtree): {e}") from None
    leaves = jax.tree.leaves(per_leaf)
    if len(leaves) != n:
        raise ValueError(f"{cfg.name}: mask must give one bool per parameter leaf ({n}), got {len(leaves)}")
    out = []
    for i, m in enumerate(leaves):
        if isinstance(m, jax.core.Tracer):
            raise TypeError(f"{cfg.name}: mask leaf {i} must be a Python bool, got a traced value")
        out.append(int(bool(m)))
    return tuple(out)


def _initial_scale(options: PrecisionOptions):
    if options.loss_scale is None:
        return jnp.float32(1.0)
    if options.dynamic:
        return jnp.asarray(options.initial_loss_scale, jnp.float32)
    return jnp.asarray(options.loss_scale, jnp.float32)


def init_state(cfg: Config, params) -> FusedState:
    _check(cfg)
    o = cfg.options
    leaves, treedef = jax.tree.flatten(params)
    per_leaf = _per_leaf.takes_per_leaf(_per_leaf.as_arrays(leaves))
    leaves = _per_leaf.checked_leaves(cfg.name, "params", leaves, per_leaf)
    if per_leaf:
        _per_leaf.refuse_kernel_only_options(cfg.name, o, leaves)
        mu, nu = (None if m is None else jax.tree.unflatten(treedef, m)
                  for m in _per_leaf.init_moments(cfg, leaves))
    else:
        total = layout_of(leaves).total
        mu = jnp.zeros((total,), o.moment) if cfg.has_mu else None
        nu = jnp.zeros((total,), o.moment) if cfg.has_nu else None
    # An int seed is in [0, 2**32) (checked): as uint32 directly, which int32 cannot hold.
    seed = jnp.asarray(np.uint32(o.seed) if isinstance(o.seed, (int, np.integer)) else o.seed)
    seed = seed.astype(jnp.uint32).reshape(())
    return FusedState(
        count=jnp.zeros((), jnp.int32),
        mu=mu,
        nu=nu,
        master=flatten(leaves, layout_of(leaves), jnp.float32) if o.master_weights else None,
        rng=jnp.stack([seed, jnp.uint32(0x9E3779B9)]),
        loss_scale=_initial_scale(o),
        good_steps=jnp.zeros((), jnp.int32),
        grad_norm=jnp.zeros((), jnp.float32),
        finite=jnp.ones((), jnp.bool_),
    )


@jax.jit
def _bias_correction(decay, count):
    """``1 - decay ** count``, optax's expression, compiled as optax compiles it (its
    bias correction is a jitted function): evaluated op by op outside ``jit`` the power
    rounds differently, and the steps drift from optax's by many ulps."""
    return 1 - decay ** count


def _learning_rate(cfg: Config, state: FusedState):
    """The learning rate of this step (a schedule is read at the state's count, as optax's)."""
    return cfg.learning_rate(state.count) if callable(cfg.learning_rate) else cfg.learning_rate


def _hyper(cfg: Config, state: FusedState, lr, count_inc) -> jax.Array:
    b1 = cfg.b1 if cfg.b1 is not None else 0.0
    b2 = cfg.b2 if cfg.b2 is not None else 0.0
    if cfg.algo == A.ADAM:
        bc1 = _bias_correction(b1, count_inc)
        bc2 = _bias_correction(b2, count_inc)
    else:
        bc1 = bc2 = 1.0
    vals = [0.0] * A.HP_SIZE
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
    vals[A.MAX_NORM] = cfg.options.max_grad_norm if cfg.options.max_grad_norm is not None else 0.0
    vals[A.GRAD_MULT] = 1.0
    return jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in vals])


def _next_scale(options: PrecisionOptions, state: FusedState, finite):
    if not options.dynamic:
        return state.loss_scale, state.good_steps
    good = state.good_steps + 1
    grow = good >= options.growth_interval
    scale = state.loss_scale
    grown = jnp.where(grow, scale * options.growth_factor, scale)
    lowered = jnp.maximum(scale * options.backoff_factor, jnp.asarray(options.min_loss_scale, jnp.float32))
    new_scale = jnp.where(finite, grown, lowered).astype(jnp.float32)
    new_good = jnp.where(finite, jnp.where(grow, 0, good), 0).astype(jnp.int32)
    return new_scale, new_good


def _params_stand_in(cfg: Config, grads, *, apply: bool):
    """Without params (optax allows ``update(grads, state)`` where the math does not
    read them) the kernel's params operands are the grads themselves: it reads params
    only for weight decay, master weights and the fused apply, refused here."""
    fn = cfg.name
    if apply:
        raise ValueError(f"{fn}: params are required to apply the update")
    if cfg.options.master_weights:
        raise ValueError(f"{fn}: params are required with master_weights=True (the update is the new master "
                         "minus the params)")
    if isinstance(grads, FlatGrads):
        raise ValueError(f"{fn}: params are required with FlatGrads (they give the tree structure)")
    if cfg.weight_decay is not None and not (isinstance(cfg.weight_decay, (int, float)) and cfg.weight_decay == 0):
        raise ValueError(f"{fn}: params are required with weight decay (the decay term reads them)")
    return grads


def step(cfg: Config, grads, state: FusedState, params, *, apply: bool):
    """One fused step. Returns (outs, new_state): outs are the updates (a pytree like
    params in the grads' dtypes) or, with ``apply``, the new params."""
    fn = cfg.name
    if not isinstance(state, FusedState):
        raise TypeError(f"{fn}: state must be a FusedState from this optimizer's init, got {type(state).__name__}")
    _check_state_kind(cfg, state)
    check_no_fp8_meta(fn, grads)
    given = params is not None
    if params is None:
        params = _params_stand_in(cfg, grads, apply=apply)
    p_leaves, treedef = jax.tree.flatten(params)
    flat = isinstance(grads, FlatGrads)
    g_leaves, g_def = ([grads.buffer], None) if flat else jax.tree.flatten(grads)
    if not flat:
        _check_grads_fit_the_path(cfg, grads, state, _per_leaf.takes_per_leaf(_per_leaf.as_arrays(p_leaves))
                                  if given else None)
    per_leaf = _per_leaf.takes_per_leaf(_per_leaf.as_arrays(p_leaves), _per_leaf.as_arrays(g_leaves))
    p_leaves = _per_leaf.checked_leaves(fn, "params", p_leaves, per_leaf)
    layout = layout_of(p_leaves)
    if flat:
        if per_leaf:
            raise ValueError(f"{fn}: FlatGrads need params of dtype {_per_leaf.KERNEL_DTYPES_TEXT} (the fused "
                             "kernel's path)")
        if grads.buffer.shape != (layout.total,) or grads.buffer.dtype != jnp.float32:
            raise ValueError(f"{fn}: FlatGrads buffer must be float32 of shape ({layout.total},), got "
                             f"{grads.buffer.dtype} {tuple(grads.buffer.shape)}")
    else:
        if g_def != treedef:
            raise ValueError(f"{fn}: grads must have the structure of params; got {g_def}, expected {treedef}")
        g_leaves = _per_leaf.checked_leaves(fn, "grads", g_leaves, per_leaf)
        for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
            if tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"{fn}: grads leaf {i} must have shape {tuple(p.shape)}, got {tuple(g.shape)}")
    moments = _state_moments(cfg, state, treedef, layout, per_leaf)
    count_inc = optax.safe_increment(state.count)
    lr = _learning_rate(cfg, state)
    rates_ok = _traced_rates_ok(cfg, lr)
    if rates_ok is not None:
        lr = jnp.where(rates_ok, lr, 0)
        if cfg.weight_decay is not None:
            cfg = cfg._replace(weight_decay=jnp.where(rates_ok, cfg.weight_decay, 0))
    decay = _decay_mask(cfg, params, len(p_leaves))
    flags = _flags(cfg, apply=apply, flat=flat)
    checked = bool(flags & A.CHECK)
    if per_leaf:
        _per_leaf.refuse_kernel_only_options(fn, cfg.options, p_leaves)
        outs, mu, nu, grad_norm, finite = _per_leaf.step(cfg, g_leaves, p_leaves, *moments, state, lr, decay,
                                                         apply=apply, checked=checked)
        mu, nu = (None if m is None else jax.tree.unflatten(treedef, m) for m in (mu, nu))
        master = None
    else:
        hp = _hyper(cfg, state, lr, count_inc)
        seed = jnp.concatenate([state.rng.astype(jnp.uint32),
                                jnp.stack([count_inc.astype(jnp.uint32), jnp.uint32(0)])])
        outs, mu, nu, master, stats = _ffi_calls.fused_update(
            g_leaves, p_leaves, state.mu, state.nu, state.master, hp, seed,
            algo=cfg.algo, flags=flags, layout=layout, decay=decay)
        # Every mode reports whether the gradients were finite; only CHECK acts on it.
        finite = stats[1] > 0
        grad_norm = stats[0] if flags & (A.CHECK | A.CLIP) else state.grad_norm
    scale, good = _next_scale(cfg.options, state, finite)
    new_state = FusedState(
        count=jnp.where(finite, count_inc, state.count) if checked else count_inc,
        mu=mu, nu=nu, master=master, rng=state.rng, loss_scale=scale, good_steps=good,
        grad_norm=grad_norm, finite=finite if rates_ok is None else finite & rates_ok)
    return jax.tree.unflatten(treedef, outs), new_state


def _check_state_kind(cfg: Config, state: FusedState) -> None:
    """A FusedState made by another optimizer's init (sgd's passed to adamw's update, say)
    holds other buffers: refused, naming the one that differs."""
    fn = cfg.name
    for name, wanted, what in (("mu", cfg.has_mu, ("a", "first moment")), ("nu", cfg.has_nu, ("a", "second moment")),
                               ("master", cfg.options.master_weights, ("", "master weights"))):
        held = getattr(state, name) is not None
        if held != wanted:
            keeps = f"keeps {' '.join(what).strip()} (state.{name})" if wanted else f"keeps no {what[1]}"
            raise ValueError(f"{fn}: state.{name} is {'None' if wanted else 'set'}, but this {fn} {keeps}: the "
                             f"state was made by another optimizer's init (an sgd state passed to adamw's update, "
                             f"say); pass the state this optimizer's init made")


def _check_grads_fit_the_path(cfg: Config, grads, state: FusedState, params_per_leaf) -> None:
    """Float params (the kernel's dtypes) take float32, float16 or bfloat16 gradients: an
    integer, bool, complex or float64 (x64) gradient leaf is refused by its path (it would
    otherwise send the step down optax's per-leaf math against a flat state). Without
    params, the state's moments say which path init chose."""
    if params_per_leaf is None:  # no params: flat moment buffers mean float params
        moments = [m for m in (state.mu, state.nu) if m is not None]
        if not moments or not all(isinstance(m, (jax.Array, jax.core.Tracer)) for m in moments):
            return
    elif params_per_leaf:
        return
    leaves, _ = jax.tree_util.tree_flatten_with_path(grads)
    for path, g in leaves:
        g = _per_leaf.as_arrays([g])[0]
        if hasattr(g, "dtype") and _per_leaf.takes_per_leaf([g]):
            raise TypeError(f"{cfg.name}: grads leaf {jax.tree_util.keystr(path) or '(root)'} has dtype {g.dtype}, "
                            f"but the params are all {_per_leaf.KERNEL_DTYPES_TEXT}: their gradients must be "
                            f"{_per_leaf.KERNEL_DTYPES_TEXT} too (cast the gradient; a float64 one comes from "
                            f"jax_enable_x64 or NumPy)")


def _state_moments(cfg: Config, state: FusedState, treedef, layout, per_leaf: bool) -> tuple:
    """(mu, nu) of `state` checked against the params: (total,) flat buffers on the
    fused path (returned as they are), lists of params-shaped leaves on the per-leaf path."""
    fn = cfg.name
    if per_leaf:
        out = []
        for name, tree in (("mu", state.mu), ("nu", state.nu)):
            leaves, tdef = jax.tree.flatten(tree)
            if tree is not None and tdef != treedef:
                raise ValueError(f"{fn}: state.{name} must be a tree like params for params with float64, complex, "
                                 f"integer or bool leaves (made by init from such params), got {tdef}")
            out.append(None if tree is None else leaves)
        return tuple(out)
    for name, buf in (("mu", state.mu), ("nu", state.nu), ("master", state.master)):
        if buf is not None and getattr(buf, "shape", None) != (layout.total,):
            raise ValueError(f"{fn}: state.{name} must have shape ({layout.total},) for these params, "
                             f"got {getattr(buf, 'shape', type(buf).__name__)}")
    return state.mu, state.nu


class FusedUpdate:
    """The ``update`` of a fused transformation, ``(updates, state, params=None,
    **extra_args) -> (updates, state)`` as optax calls it, plus `apply`, the fused step
    that writes the new params."""

    def __init__(self, cfg: Config):
        self.config = cfg

    def __call__(self, updates, state, params=None, **extra_args):
        del extra_args
        return step(self.config, updates, state, params, apply=False)

    def apply(self, grads, state, params):
        return step(self.config, grads, state, params, apply=True)


class FusedGradientTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation whose step can also write the new params in the same
    pass; ``jax_ls2.optim.apply_updates`` takes only this type. ``init`` and ``update``
    are optax's; ``update`` is a `FusedUpdate`."""
    __slots__ = ()

    def apply(self, grads, state, params):
        """``(new_params, new_state)`` in one fused pass (see ``apply_updates``)."""
        return self.update.apply(grads, state, params)


def make(cfg: Config) -> FusedGradientTransformation:
    _check(cfg)
    return FusedGradientTransformation(functools.partial(init_state, cfg), FusedUpdate(cfg))
