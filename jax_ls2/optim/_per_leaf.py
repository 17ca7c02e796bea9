"""The per-leaf path: parameter trees the fused kernel cannot take, updated leaf by
leaf with optax's own math.

The kernel takes float32, float16 and bfloat16 leaves. A tree holding any float64
(under ``jax_enable_x64``), complex, integer or bool leaf is updated as a whole by
optax's transformations (``scale_by_adam``, ``trace``, ``add_decayed_weights``'s
formula, ``scale_by_learning_rate``), so its numbers are optax's, dtype promotions
included (optax computes float updates for integer and bool leaves and its
``apply_updates`` casts the new params back to their dtypes; so does this path).
The state of such a tree is still a `FusedState`, but ``mu`` and ``nu`` are trees like
params in optax's dtypes (the params' own unless ``mu_dtype`` / ``accumulator_dtype`` /
``moment_dtype`` is given) instead of flat buffers. Loss scaling, clipping and the
finite check act as on the fused path; master weights and stochastic rounding, which
exist for float16/bfloat16 params, are refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_ls2.optim import _abi as A
from jax_ls2.optim._layout import FLOAT_DTYPES, float_leaves

KERNEL_DTYPES_TEXT = "float32, float16 or bfloat16"


def _per_leaf_dtype(dtype) -> bool:
    """float64, complex, integer and bool: the dtypes optax takes that the kernel does not."""
    dtype = jnp.dtype(dtype)
    return (dtype == jnp.dtype(np.float64) or jnp.issubdtype(dtype, jnp.complexfloating)
            or jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.dtype(jnp.bool_))


def as_arrays(leaves) -> list:
    """`leaves` as JAX arrays (NumPy arrays and Python scalars as ``jnp.asarray`` takes
    them, as optax's math does; other leaves unchanged)."""
    out = []
    for x in leaves:
        if isinstance(x, (np.ndarray, np.generic, float, int, complex, bool)) and not isinstance(x, jax.Array):
            x = jnp.asarray(x)
        out.append(x)
    return out


def takes_per_leaf(*leaf_lists) -> bool:
    """Whether any leaf has a dtype only the per-leaf path takes."""
    return any(hasattr(x, "dtype") and _per_leaf_dtype(x.dtype) for leaves in leaf_lists for x in leaves)


def checked_leaves(fn: str, name: str, leaves, per_leaf: bool) -> list:
    """`leaves` as arrays, checked for the path: the kernel's dtypes (``float_leaves``),
    or, on the per-leaf path, those and float64, complex, integer and bool."""
    leaves = as_arrays(leaves)
    for i, x in enumerate(leaves):
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise TypeError(f"{fn}: {name} leaf {i} must be an array, got {type(x).__name__}")
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES and not _per_leaf_dtype(x.dtype):
            raise TypeError(f"{fn}: {name} leaf {i} must have dtype {KERNEL_DTYPES_TEXT} (the fused kernel) or "
                            f"float64, complex, integer or bool (optax's per-leaf math), got {x.dtype}")
    return leaves if per_leaf else float_leaves(fn, name, leaves)


def refuse_kernel_only_options(fn: str, options, leaves) -> None:
    """Master weights and stochastic rounding exist for float16/bfloat16 params on the
    fused path; a tree on the per-leaf path refuses them, naming the leaf that sent it there."""
    for flag in ("master_weights", "stochastic_rounding"):
        if getattr(options, flag):
            i, x = next((i, x) for i, x in enumerate(leaves) if _per_leaf_dtype(x.dtype))
            raise ValueError(f"{fn}: {flag}=True needs params of dtype {KERNEL_DTYPES_TEXT} (the fused kernel's "
                             f"path); params leaf {i} is {x.dtype}, so the tree is updated by optax's "
                             f"per-leaf math, which has no {flag}")


def _direction(cfg, algo: int):
    """optax's transformation computing the direction before decay and learning rate."""
    moment = cfg.options.moment_dtype
    if algo == A.ADAM:
        return optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps, cfg.eps_root, mu_dtype=moment)
    return optax.trace(decay=cfg.b1, nesterov=cfg.nesterov, accumulator_dtype=moment)


def init_moments(cfg, p_leaves: list):
    """(mu, nu) as lists of leaves in optax's dtypes, or None where the algorithm keeps none."""
    if cfg.algo == A.ADAM:
        st = _direction(cfg, A.ADAM).init(p_leaves)
        return st.mu, st.nu
    if cfg.has_mu:
        return _direction(cfg, A.SGD).init(p_leaves).trace, None
    return None, None


def step(cfg, g_leaves: list, p_leaves: list, mu, nu, state, lr, decay: tuple, *, apply: bool, checked: bool):
    """One step of optax's math over lists of leaves.

    Returns (outs, mu, nu, grad_norm, finite): outs are the updates (optax's dtypes) or,
    with `apply`, the new params (``optax.apply_updates``); mu, nu lists of leaves or
    None; grad_norm () float32 (the state's when neither the check nor clipping is on);
    finite () bool.
    """
    o = cfg.options
    g = list(g_leaves)
    if o.loss_scale is not None:
        inv = 1 / state.loss_scale
        g = [x * inv.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x * inv for x in g]
    finite = jnp.bool_(True)
    for x in g:
        finite = finite & jnp.all(jnp.isfinite(x))
    if checked or o.max_grad_norm is not None:
        grad_norm = optax.tree.norm(g).astype(jnp.float32)
    else:
        grad_norm = state.grad_norm
    if o.max_grad_norm is not None:
        g, _ = optax.clip_by_global_norm(o.max_grad_norm).update(g, optax.EmptyState())
    if cfg.algo == A.ADAM:
        u, st = _direction(cfg, A.ADAM).update(g, optax.ScaleByAdamState(count=state.count, mu=mu, nu=nu))
        new_mu, new_nu = st.mu, st.nu
    elif cfg.has_mu:
        u, st = _direction(cfg, A.SGD).update(g, optax.TraceState(trace=mu))
        new_mu, new_nu = st.trace, None
    else:
        u, new_mu, new_nu = g, None, None
    # optax.add_decayed_weights's formula, on the leaves the mask selects.
    u = [x + cfg.weight_decay * p if d else x for x, p, d in zip(u, p_leaves, decay)]
    # optax.scale_by_learning_rate: a schedule's value is cast to each update's dtype.
    if callable(cfg.learning_rate):
        u = [jnp.array(-lr, dtype=x.dtype) * x for x in u]
    else:
        u = [-lr * x for x in u]
    if checked:
        keep = lambda old, new: jnp.where(finite, new, old)
        u = [keep(jnp.zeros((), x.dtype), x) for x in u]
        new_mu = None if new_mu is None else jax.tree.map(keep, mu, new_mu)
        new_nu = None if new_nu is None else jax.tree.map(keep, nu, new_nu)
    outs = optax.apply_updates(p_leaves, u) if apply else u
    return outs, new_mu, new_nu, grad_norm, finite
