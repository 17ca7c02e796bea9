"""Gradient accumulation for models with FP8 layers: the parameters' gradients summed in
float32, the FP8 meta updates merged by elementwise max (`merge_meta_updates`, never a
sum), in one of two forms.

* `init_flat_accumulator` / `accumulate_flat` / `unflatten_flat_grads`: the parameters'
  gradients in ``jax_ls2.optim``'s flat float32 buffer (``optim.accumulate``: one
  kernel launch per 256 leaves), the merged meta updates in ``FlatGrads.meta``, for
  `jax_ls2.fp8.apply_updates`.
* `init_grad_accumulator` / `accumulate_grads`: per-leaf float32 sums whose FP8
  weight-gradient GEMMs add into the accumulators in their own epilogue (Transformer
  Engine's ``fuse_wgrad_accumulation``), described below.

XLA's GPU gemm rewriter folds ``acc + dot(a, b)`` into the cuBLASLt call (``acc`` as its
C matrix, beta = 1) when the add is in the same program as the GEMM, ``acc`` is float32
and the GEMM writes float32. A ``custom_vjp`` cotangent takes its primal's dtype, so
with bfloat16 weights the weight-gradient GEMM writes bfloat16 and the accumulation is a
second pass (convert, read, add, write). `accumulate_grads` with
``fuse_wgrad_accumulation=True`` differentiates the loss with respect to float32 copies
of the parameters instead: the same numbers (an FP8 cast reads any float weight through
float32, so the forward is bit-identical), but every weight-gradient GEMM now writes
float32, and the accumulator's add follows it directly in the same program.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ls2 import optim
from jax_ls2.fp8.state import join_meta, merge_meta_updates, split_meta
from jax_ls2.fp8.step import count_metas, meta_updates_like


class GradAccumulator(NamedTuple):
    """The sums of the micro-batches' gradients of one optimizer step.

    grads: float32, structured as the parameters (`split_meta`'s ``param_grads`` of the
      variables: None where metas are).
    meta: the merged (elementwise max) FP8 meta updates, structured as `split_meta`'s
      ``meta_updates``, or None where the variables hold no meta.
    """

    grads: Any
    meta: Any


def init_grad_accumulator(variables) -> GradAccumulator:
    """Zero sums for `accumulate_grads`: float32 zeros shaped as the floating leaves of
    ``variables`` (a pytree or ``nnx.State`` of parameters, with FP8 metas or without),
    and empty meta updates."""
    params, metas = _split(variables)
    _check_floating("init_grad_accumulator", params)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return GradAccumulator(zeros, None if metas is None else jax.tree.map(jnp.zeros_like, metas))


def accumulate_grads(fun, *, fuse_wgrad_accumulation: bool = True, has_aux: bool = False):
    """Turns a loss into one micro-batch of gradient accumulation.

    Args:
      fun: ``fun(variables, *args) -> scalar loss`` (``(loss, aux)`` with ``has_aux``);
        ``variables``: a pytree or ``nnx.State`` of parameters, possibly holding FP8
        metas (`DotMeta` nodes or `FP8Meta` variables), as ``jax.grad`` would take it.
      fuse_wgrad_accumulation: True: differentiate with respect to float32 copies of
        the parameters, so that each FP8 weight-gradient GEMM writes float32 and its
        add into the accumulator is folded into the GEMM on CUDA. Every parameter is
        copied, so a module computing in its parameters' dtype (``dtype=None``) would
        compute in float32: give the layers their compute ``dtype`` (say bfloat16) to
        keep the forward of bfloat16 parameters. False: differentiate
        with respect to the parameters as they are and add the gradients, cast to
        float32, afterwards (with bfloat16 weights a separate pass).
      has_aux: as for ``jax.value_and_grad``.

    Returns:
      ``step(acc, variables, *args) -> (value, acc)``: ``value`` is ``fun``'s output,
      ``acc`` a new `GradAccumulator` holding ``acc.grads + grads`` (float32; a sum, not
      a mean: scale it once per optimizer step) and the meta updates merged by max.
      Jit ``step`` (donate ``acc``) so that the adds share the backward's program.
      ``join_meta(acc.grads, acc.meta)`` is then a gradient tree for
      `apply_meta_updates` / `jax_ls2.fp8.apply_updates(..., fp8=recipe)`.
    """
    if not callable(fun):
        raise TypeError(f"accumulate_grads: fun must be callable, got {type(fun).__name__}")
    if not isinstance(fuse_wgrad_accumulation, bool):
        raise TypeError(f"accumulate_grads: fuse_wgrad_accumulation must be a bool, got "
                        f"{type(fuse_wgrad_accumulation).__name__}")

    def step(acc, variables, *args):
        if not isinstance(acc, GradAccumulator):
            raise TypeError(f"accumulate_grads: acc must be a GradAccumulator from init_grad_accumulator, got "
                            f"{type(acc).__name__}")
        params, metas = _split(variables)
        _check_floating("accumulate_grads", params)
        if jax.tree.structure(acc.grads) != jax.tree.structure(params) or (acc.meta is None) != (metas is None):
            raise ValueError("accumulate_grads: acc must be made by init_grad_accumulator from variables of this "
                             "structure (parameters and FP8 metas at the same paths)")
        for a, p in zip(jax.tree.leaves(acc.grads), jax.tree.leaves(params)):
            if a.shape != p.shape or a.dtype != jnp.float32:
                raise ValueError(f"accumulate_grads: acc.grads must be float32 shaped as the parameters, got "
                                 f"{a.dtype} {a.shape} for a parameter of shape {p.shape}")
        if fuse_wgrad_accumulation:
            params = jax.tree.map(lambda p: p.astype(jnp.float32), params)

        def loss(p, m):
            return fun(p if m is None else join_meta(p, m), *args)

        value, (grads, meta_updates) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=has_aux)(params, metas)
        sums = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc.grads, grads)
        meta = None if metas is None else merge_meta_updates(acc.meta, meta_updates)
        return value, GradAccumulator(sums, meta)

    return step


def _split(variables):
    """(parameters, metas or None)."""
    if not count_metas(variables):
        return variables, None
    return split_meta(variables)


def _check_floating(op, params):
    for p in jax.tree.leaves(params):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise TypeError(f"{op}: every parameter must be floating (float32/bfloat16/float16), got {p.dtype}")


def init_flat_accumulator(variables) -> optim.FlatGrads:
    """`jax_ls2.optim.init_accumulator` for ``variables`` (params, with FP8 metas or
    without): the (total,) float32 zeros of the params' flat layout and, where metas
    are, their empty (zero) meta updates in ``meta``."""
    params, metas = _split(variables)
    acc = optim.init_accumulator(params)
    return acc if metas is None else acc._replace(meta=meta_updates_like(metas))


def accumulate_flat(acc: optim.FlatGrads, grads, scale=1.0) -> optim.FlatGrads:
    """`jax_ls2.optim.accumulate` for gradients holding FP8 meta updates: the params'
    gradients added into ``acc.buffer`` (times `scale`), the meta updates merged into
    ``acc.meta`` by elementwise max, unscaled (observed amaxes, not gradients)."""
    if not isinstance(acc, optim.FlatGrads):
        raise TypeError(f"accumulate_flat: acc must be a FlatGrads from init_flat_accumulator, got "
                        f"{type(acc).__name__}")
    grads, meta_updates = _split(grads)
    if (meta_updates is None) != (acc.meta is None):
        raise ValueError("accumulate_flat: grads " + ("hold FP8 meta updates but acc has no meta (make it with "
                                                 "init_flat_accumulator from the params and metas together)"
                                                 if acc.meta is None else
                                                 "hold no FP8 meta updates but acc.meta expects them "
                                                 "(differentiate with respect to the metas too)"))
    summed = optim.accumulate(optim.FlatGrads(acc.buffer), grads, scale)
    return summed if meta_updates is None else summed._replace(meta=merge_meta_updates(acc.meta, meta_updates))


def unflatten_flat_grads(acc: optim.FlatGrads, variables):
    """The accumulated gradients as a float32 pytree like ``variables``, with
    ``acc.meta``'s merged meta updates where the metas are."""
    params, metas = _split(variables)
    grads = optim.unflatten_grads(acc, params)
    if metas is None or acc.meta is None:
        return grads
    return join_meta(grads, acc.meta)
