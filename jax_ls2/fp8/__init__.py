"""FP8 GEMMs with delayed scaling (Transformer Engine's recipe), as explicit JAX state.

``DelayedScaling`` is the recipe; each GEMM owns a ``DotMeta`` (amax history, scale and
scale_inv for its input, weight and output gradient; float32), held in NNX models by an
``FP8Meta`` variable (not an ``nnx.Param``) inside an ``FP8DotMeta`` module;
``fp8_dot(x, w, meta, recipe)`` is the GEMM.

Why the meta's gradient carries the observation
-----------------------------------------------
Delayed scaling needs, after each step, the amaxes seen in that step, and the output
gradient's amax is only known in the backward pass. The only way out of a
``custom_vjp`` backward is a cotangent, so ``fp8_dot`` returns, as the "gradient" with
respect to its meta, a ``DotMeta`` whose ``amax_history[:, 0]`` holds this step's
observed amaxes (input, weight, output gradient) and zeros elsewhere. That value is an
observation, not a gradient to add or to apply: Flax's and Transformer Engine's
"overwrite with gradient" variant lets the optimizer or an accumulator treat it as a
gradient, which breaks under gradient accumulation (micro-batch observations get
averaged or summed). Here the update never reaches an optimizer:

    grads = jax.grad(loss)(params_and_meta, batch)       # or nnx.grad with
                                                         # nnx.DiffState(0, nnx.Any(nnx.Param, FP8Meta))
    param_grads, meta_updates = fp8.split_meta(grads)    # before optax, clipping, MultiSteps
                                                         # (and join_meta undoes a split)
    acc = fp8.merge_meta_updates(acc, meta_updates)      # per micro-batch: elementwise max
    meta = fp8.update_meta(meta, acc, recipe)            # once per optimizer step:
                                                         # roll the history, recompute scales

Rules that follow: one meta per GEMM call site (a meta used by two calls in one
differentiated function gets the sum of their observations from autodiff, which
overstates the amax); under ``jax.vmap`` with a shared meta the amax is taken over the
whole mapped batch; under ``shard_map`` pass the mesh axes as ``amax_axes`` so that the
amaxes are max-reduced (``recipe.reduce_amax``) and every replica keeps identical scales.
"""
from jax_ls2.fp8.dot import fp8_dot
from jax_ls2.fp8.recipe import (AMAX_COMPUTE_ALGOS, E4M3, E5M2, FORMATS, GRAD_OUTPUT, INPUT, WEIGHT,
                                DelayedScaling, fp8_max)
from jax_ls2.fp8.state import (DotMeta, FP8DotMeta, FP8Meta, is_meta, join_meta, merge_meta_updates,
                               split_meta, update_dot_meta, update_meta)

__all__ = ["AMAX_COMPUTE_ALGOS", "DelayedScaling", "DotMeta", "E4M3", "E5M2", "FORMATS", "FP8DotMeta", "FP8Meta",
           "GRAD_OUTPUT", "INPUT", "WEIGHT", "fp8_dot", "fp8_max", "is_meta", "join_meta", "merge_meta_updates", "split_meta",
           "update_dot_meta", "update_meta"]
