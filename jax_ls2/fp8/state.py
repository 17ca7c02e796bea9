"""FP8 meta state of a GEMM and the helpers that move it from step to step.

One GEMM ``y = x @ w`` owns one `DotMeta`: per operand row (input, weight, output
gradient; see `recipe.INPUT`, `recipe.WEIGHT`, `recipe.GRAD_OUTPUT`) an amax history,
a scale and its inverse, all float32. In NNX models it lives in an `FP8Meta` variable
(never an ``nnx.Param``), owned by an `FP8DotMeta` module.

The gradient of a loss with respect to a `DotMeta` (the "meta update") is not a
gradient: it is a `DotMeta` whose ``amax_history[:, 0]`` holds the amaxes observed in
this step and whose other entries are zero. `split_meta` takes these updates out of a
gradient tree, `merge_meta_updates` combines micro-batches by elementwise max, and
`update_meta` rolls the histories and recomputes the scales.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ls2.fp8.recipe import NUM_OPERANDS, DelayedScaling
from jax_ls2.optim import NotAParameter


class DotMeta(NamedTuple):
    """FP8 meta of one GEMM, rows ordered (input, weight, output gradient).

    amax_history: (3, L) float32, newest entry first (column 0).
    scale: (3,) float32, multiplies an operand before its cast to FP8.
    scale_inv: (3,) float32, ``1 / scale``, multiplies the GEMM's result.
    """

    amax_history: jax.Array
    scale: jax.Array
    scale_inv: jax.Array

    @classmethod
    def create(cls, recipe: DelayedScaling) -> "DotMeta":
        """Fresh meta: empty (zero) histories, unit scales."""
        _check_recipe("DotMeta.create", recipe)
        return cls(jnp.zeros((NUM_OPERANDS, recipe.amax_history_len), jnp.float32),
                   jnp.ones((NUM_OPERANDS,), jnp.float32), jnp.ones((NUM_OPERANDS,), jnp.float32))

    @classmethod
    def observation(cls, amaxes, like: "DotMeta") -> "DotMeta":
        """The meta update carrying ``amaxes`` ((3,) float32) in shape of ``like``."""
        history = jnp.zeros_like(like.amax_history).at[..., 0].set(amaxes.astype(jnp.float32))
        return cls(history, jnp.zeros_like(like.scale), jnp.zeros_like(like.scale_inv))

    def observed_amax(self) -> jax.Array:
        """(3,) float32: the amaxes a meta update carries."""
        return self.amax_history[..., 0]


class FP8Meta(nnx.Variable):
    """NNX variable holding a `DotMeta`. Not an ``nnx.Param``: optimizers built with
    ``wrt=nnx.Param`` never see it; differentiate with
    ``nnx.DiffState(0, nnx.Any(nnx.Param, FP8Meta))`` to get its meta update."""


# The metas and their updates are state beside the parameters: jax_ls2.optim refuses them.
NotAParameter.register(DotMeta)
NotAParameter.register(FP8Meta)


class WeightCopies(NamedTuple):
    """The FP8 copies of one GEMM's weight w (K, N) that every micro-batch of an
    optimizer step reads: wq (K, N) and its transpose wq_t (N, K), both in the recipe's
    forward dtype (E4M3) with the meta's weight scale; amax: () float32, max |w| (as
    recorded in the meta update, max-reduced over the mesh axes where asked)."""

    wq: jax.Array
    wq_t: jax.Array
    amax: jax.Array


class FP8WeightCache(nnx.Variable):
    """NNX variable holding a `WeightCopies` (or None before the first fill), with the
    `DelayedScaling` it was filled for as its ``recipe`` metadata. Not an ``nnx.Param``
    and not an `FP8Meta`: no optimizer and no gradient sees it. See
    `jax_ls2.fp8.cache_weights`."""


# FP8DotMeta.weight_cache_mode values: cast the weight and keep the copies, or read them.
CACHE_FILL, CACHE_REUSE = "fill", "reuse"


class FP8DotMeta(nnx.Module):
    """The FP8 meta of one GEMM inside an NNX model: ``self.meta`` is an `FP8Meta`
    holding a `DotMeta` for ``recipe``; pass the module itself to `fp8_dot`.

    With weight caching on (`jax_ls2.fp8.cache_weights`), ``weight_cache_mode`` is
    ``"fill"`` or ``"reuse"`` and ``weight_cache`` an `FP8WeightCache` holding the
    weight's FP8 copies; off (None) by default."""

    weight_cache_mode = None

    def __init__(self, recipe: DelayedScaling):
        self.meta = FP8Meta(DotMeta.create(recipe))

    @classmethod
    def create(cls, recipe: DelayedScaling) -> "FP8DotMeta":
        return cls(recipe)

    def value(self) -> DotMeta:
        return self.meta.get_value()


def _check_recipe(op: str, recipe):
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"{op}: recipe must be a jax_ls2.fp8.DelayedScaling, got {type(recipe).__name__}")


def is_meta(node) -> bool:
    """True for a `DotMeta` or an `FP8Meta` variable (a node the helpers act on)."""
    return isinstance(node, (DotMeta, FP8Meta))


def _is_meta_or_none(node) -> bool:
    return node is None or is_meta(node)


def _dot_meta(node) -> DotMeta:
    return node.get_value() if isinstance(node, FP8Meta) else node


def _rebuild(node, value: DotMeta):
    return node.replace(value) if isinstance(node, FP8Meta) else value


def split_meta(grads):
    """Splits a gradient tree into ``(param_grads, meta_updates)``.

    ``grads``: a pytree (or ``nnx.State``) in which meta updates appear as `DotMeta`
    nodes or `FP8Meta` variables. ``param_grads`` is ``grads`` with each of them
    replaced by ``None`` (for an ``nnx.State``: with them left out), ready for an optax
    transformation; ``meta_updates`` is ``grads`` with every other leaf replaced by
    ``None`` (for an ``nnx.State``: only the `FP8Meta` entries), ready for
    `merge_meta_updates` and `update_meta`.
    """
    if isinstance(grads, nnx.State):
        meta_updates, param_grads = nnx.split_state(grads, FP8Meta, ...)
        return param_grads, meta_updates
    param_grads = jax.tree.map(lambda n: None if is_meta(n) else n, grads, is_leaf=is_meta)
    meta_updates = jax.tree.map(lambda n: n if is_meta(n) else None, grads, is_leaf=is_meta)
    return param_grads, meta_updates


def join_meta(param_tree, meta_tree):
    """Inverse of `split_meta`: the tree with ``param_tree``'s leaves and ``meta_tree``'s
    meta nodes (each position taken from whichever of the two is not ``None``; for
    ``nnx.State``s, their union)."""
    if isinstance(param_tree, nnx.State):
        return nnx.merge_state(param_tree, meta_tree)
    treedef, params, metas = _zip_meta("join_meta", param_tree, meta_tree)
    return jax.tree.unflatten(treedef, [p if m is None else m for p, m in zip(params, metas)])


def _zip_meta(op: str, first, second):
    """Flattens two trees down to meta nodes, ``None`` and other leaves, checking that
    they have one structure; returns (treedef, leaves of first, leaves of second)."""
    leaves_a, treedef_a = jax.tree.flatten(first, is_leaf=_is_meta_or_none)
    leaves_b, treedef_b = jax.tree.flatten(second, is_leaf=_is_meta_or_none)
    if treedef_a != treedef_b:
        raise ValueError(f"{op}: both trees must have one structure (meta nodes at the same "
                         f"paths), got {treedef_a} and {treedef_b}")
    return treedef_a, leaves_a, leaves_b


def merge_meta_updates(a, b):
    """Combines the meta updates of two micro-batches: elementwise max of their
    observations. ``a`` may be ``None`` (nothing accumulated yet), then ``b`` is returned.
    Use it instead of adding meta updates, which would overstate the amaxes."""
    if a is None:
        return b
    treedef, leaves_a, leaves_b = _zip_meta("merge_meta_updates", a, b)
    merged = []
    for x, y in zip(leaves_a, leaves_b):
        if is_meta(x) and is_meta(y):
            merged.append(_rebuild(x, DotMeta(*jax.tree.map(jnp.maximum, _dot_meta(x), _dot_meta(y)))))
        elif x is None or y is None:
            merged.append(y if x is None else x)
        else:
            raise TypeError(f"merge_meta_updates: expected meta updates (DotMeta or FP8Meta) or None "
                            f"at each leaf, got {type(x).__name__} and {type(y).__name__}")
    return jax.tree.unflatten(treedef, merged)


def update_dot_meta(meta: DotMeta, update: DotMeta, recipe: DelayedScaling) -> DotMeta:
    """One step of the recipe for one GEMM: the observed amaxes enter the history as its
    newest entry (the oldest drops out), then scale and scale_inv follow from it."""
    history = jnp.concatenate([update.observed_amax()[..., None].astype(jnp.float32),
                               meta.amax_history[..., :-1]], axis=-1)
    amax = recipe.amax_from_history(history)
    scale = recipe.compute_scale(amax, meta.scale, recipe.operand_fp8_max())
    return DotMeta(history, scale, (1.0 / scale).astype(jnp.float32))


def update_meta(meta_state, meta_updates, recipe: DelayedScaling):
    """New meta state after one optimizer step.

    ``meta_state``: a pytree (or ``nnx.State``) holding `DotMeta` nodes or `FP8Meta`
    variables, possibly beside parameters (left as they are). ``meta_updates``: the
    same structure with the meta updates at the meta nodes (from `split_meta`, merged
    over micro-batches with `merge_meta_updates`) and ``None`` elsewhere; a meta node
    whose update is ``None`` is left as it is. Returns ``meta_state``'s structure.
    """
    _check_recipe("update_meta", recipe)
    if isinstance(meta_state, nnx.State) and isinstance(meta_updates, nnx.State):
        # split_meta gives an nnx.State's meta updates as its FP8Meta entries alone: step
        # the metas of meta_state the same way and put its other entries back.
        metas, others = nnx.split_state(meta_state, FP8Meta, ...)
        if len(jax.tree.leaves(others)):
            return nnx.merge_state(others, update_meta(metas, meta_updates, recipe))
    treedef, states, updates = _zip_meta("update_meta", meta_state, meta_updates)
    out = []
    for s, u in zip(states, updates):
        if is_meta(s) and is_meta(u):
            out.append(_rebuild(s, update_dot_meta(_dot_meta(s), _dot_meta(u), recipe)))
        elif u is None:
            out.append(s)
        else:
            raise TypeError(f"update_meta: meta_updates must hold a meta update or None where meta_state "
                            f"holds {type(s).__name__}, got {type(u).__name__}")
    return jax.tree.unflatten(treedef, out)
