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

In a training loop the step helpers here do this, so that ``jax_ls2.optim`` sees
parameters only: `update_nnx` and `apply_updates` take ``fp8=recipe`` and a gradient
tree holding the meta updates and call ``jax_ls2.optim``'s functions of the same names
on the parameters; `init_flat_accumulator`, `accumulate_flat` and `unflatten_flat_grads`
accumulate such gradients in ``jax_ls2.optim``'s flat buffer. For a plain optax loop::

    grads = jax.grad(loss)(variables, batch)               # variables: params and metas
    param_grads, variables = fp8.apply_meta_updates(variables, grads, recipe)
    updates, opt_state = tx.update(param_grads, opt_state, params)   # no meta in sight

(an NNX model in place of ``variables`` has its `FP8Meta` variables updated in place).
Under gradient accumulation, merge each micro-batch's observations and apply them once
per optimizer step; with ``optax.MultiSteps``, inside the jitted micro-step::

    param_grads, pending = fp8.accumulate_meta_updates(pending, grads,
                                                       reset=opt_state.mini_step == 0)
    updates, opt_state = tx.update(param_grads, opt_state, params)
    _, meta = fp8.apply_meta_updates(meta, pending, recipe, when=tx.has_updated(opt_state))

with ``pending = fp8.meta_updates_like(meta)`` to start.

Fused: `layernorm_fp8_dot` (``LayerNorm(x) @ w``) and `fp8_mlp` (``act(h @ w1 + b1) @ w2``,
optionally after a LayerNorm) take the same metas and recipe, with every activation
quantized once by the kernel that produces it (`jax_ls2.fp8.fused`).

Layers: ``fp8=DelayedScaling(...)`` on `jax_ls2.nn`'s Transformer layers and stacks
puts every weight GEMM through FP8, one `FP8DotMeta` per weight (q, k and v share one):
pre-LN LayerNorms fused into the q|k|v and fc1 GEMMs, the FFN as one `fp8_mlp` where
no activation dropout is active, `fp8_dot` elsewhere.

Weight caching across micro-batches
-----------------------------------
Under gradient accumulation with one jitted call per micro-batch (``optax.MultiSteps``,
or a loop calling a jitted micro-step), every call would cast (and transpose) every
weight to FP8 again, though weights and scales only change once per optimizer step.
(Inside one jit over all micro-batches XLA already casts each weight once.)
``fp8.cache_weights(model, is_first_microbatch)`` (Transformer Engine's flag) makes the
first micro-batch of each optimizer step cast the weights and keep the FP8 copies (the
weight and its transpose, and its amax) in `FP8WeightCache` variables (neither
``nnx.Param`` nor `FP8Meta`: no optimizer or gradient sees them), and the later ones
read them; the results are bit-identical, the meta updates still carry the weights'
amaxes. With ``optax.MultiSteps`` the flag is the only change::

    @nnx.jit(static_argnames="first")
    def micro_step(model, optimizer, pending, x, y, first):
        with fp8.cache_weights(model, first):        # True: cast and keep; False: reuse
            grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta)))(model, x, y)
        ...                                          # as above, with nnx.as_pure(optimizer.opt_state)
        return pending
    for i, (x, y) in enumerate(batches):
        pending = micro_step(model, optimizer, pending, x, y, first=i % k == 0)

(``fp8.accumulate_flat`` loops alike; in a functional loop that merges the model inside
``jax.jit``, return ``nnx.state(model, fp8.FP8WeightCache)`` from the fill step.)

Reusing a cache never filled, or filled for another recipe or weight shape, raises
ValueError; ``cache_weights(model, None)`` turns caching off and empties the caches.

FP32 weight-gradient accumulation fusion
----------------------------------------
``fp8.accumulate_grads(loss, fuse_wgrad_accumulation=True)`` (`jax_ls2.fp8.accumulate`)
is one micro-batch of accumulation into float32 sums (`GradAccumulator`, from
`init_grad_accumulator`) with the meta updates max-merged. Differentiating with
respect to float32 copies of the parameters (same numbers, same FP8 casts), every FP8
weight-gradient GEMM writes float32 and its add into the sum follows it in the same
program, for XLA's GPU gemm rewriter to fold into the cuBLASLt call (C = the sum,
beta = 1; a ``gpu`` test in tests/test_fp8_cache.py checks it): no separate pass over
the accumulator, and no rounding of the micro-batch gradients to bfloat16::

    step = jax.jit(fp8.accumulate_grads(loss), donate_argnums=0)
    acc = fp8.init_grad_accumulator(variables)
    for x, y in micro_batches:
        value, acc = step(acc, variables, x, y)
    grads = fp8.join_meta(jax.tree.map(lambda g: g / len(micro_batches), acc.grads), acc.meta)
    param_grads, variables = fp8.apply_meta_updates(variables, grads, recipe)

Rules that follow: one meta per GEMM call site (a meta used by two calls in one
differentiated function gets the sum of their observations from autodiff, which
overstates the amax); under ``jax.vmap`` with a shared meta the amax is taken over the
whole mapped batch; under ``shard_map`` pass the mesh axes as ``amax_axes`` so that the
amaxes are max-reduced (``recipe.reduce_amax``) and every replica keeps identical scales.
"""
from jax_ls2.fp8.accumulate import (GradAccumulator, accumulate_flat, accumulate_grads, init_flat_accumulator,
                                    init_grad_accumulator, unflatten_flat_grads)
from jax_ls2.fp8.cache import WeightCaching, cache_weights
from jax_ls2.fp8.dot import fp8_dot
from jax_ls2.fp8.fused import fp8_mlp, layernorm_fp8_dot
from jax_ls2.fp8.optimizer import apply_updates, update_nnx
from jax_ls2.fp8.recipe import (AMAX_COMPUTE_ALGOS, E4M3, E5M2, FORMATS, GRAD_OUTPUT, INPUT, WEIGHT,
                                DelayedScaling, fp8_max)
from jax_ls2.fp8.state import (DotMeta, FP8DotMeta, FP8Meta, FP8WeightCache, WeightCopies, is_meta, join_meta,
                               merge_meta_updates, split_meta, update_dot_meta, update_meta)
from jax_ls2.fp8.step import accumulate_meta_updates, apply_meta_updates, count_metas, meta_updates_like

__all__ = ["accumulate_flat", "apply_updates", "init_flat_accumulator", "unflatten_flat_grads", "update_nnx",
           "GradAccumulator", "WeightCaching", "accumulate_grads", "cache_weights", "init_grad_accumulator", "FP8WeightCache",
           "WeightCopies", "accumulate_meta_updates", "apply_meta_updates", "count_metas", "meta_updates_like",
           "AMAX_COMPUTE_ALGOS", "DelayedScaling", "DotMeta", "E4M3", "E5M2", "FORMATS", "FP8DotMeta", "FP8Meta",
           "GRAD_OUTPUT", "INPUT", "WEIGHT", "fp8_dot", "fp8_max", "fp8_mlp", "layernorm_fp8_dot", "is_meta", "join_meta", "merge_meta_updates", "split_meta",
           "update_dot_meta", "update_meta"]
