"""FP8 weight caching across the micro-batches of one optimizer step (Transformer Engine's
``is_first_microbatch``), as explicit NNX state.

Under gradient accumulation the weights and their scales stay fixed for all the
micro-batches of an optimizer step (the meta is stepped once per optimizer step), so
their FP8 copies are too. `cache_weights` switches every `FP8DotMeta` of a model: on the
first micro-batch each FP8 GEMM casts its weight and keeps the copies (`WeightCopies`:
the weight (K, N) and its transpose (N, K) in E4M3, and its amax) in the module's
`FP8WeightCache` variable; on the later ones it reads them instead of casting. The
results are bit-identical to casting every time (the same GEMMs read the same numbers)
and the meta update still records the weight's amax.
"""
from __future__ import annotations

from flax import nnx

from jax_ls2.fp8.state import CACHE_FILL, CACHE_REUSE, FP8DotMeta, FP8WeightCache


# A mode never set on the instance (the class attribute applies).
_CLASS_DEFAULT = object()


class WeightCaching:
    """What `cache_weights` returns: the `FP8DotMeta` modules it set (``metas``) and,
    used as a context manager, their previous modes, put back on exit."""

    def __init__(self, metas, previous):
        self.metas, self._previous = metas, previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for meta, mode in zip(self.metas, self._previous):
            if mode is _CLASS_DEFAULT:
                del meta.weight_cache_mode  # back to the class attribute: the graph as it was
            else:
                meta.weight_cache_mode = mode
        return False


def cache_weights(model, is_first_microbatch) -> WeightCaching:
    """Sets how the FP8 GEMMs of ``model`` get their weights' FP8 copies.

    Args:
      model: an NNX module holding `FP8DotMeta` modules (a layer or model built with
        ``fp8=DelayedScaling(...)``).
      is_first_microbatch: a Python bool or None, static (the fill and the reuse
        micro-step are two compiled programs: pass it to the jitted micro-step as a
        static argument, ``nnx.jit(..., static_argnames=...)``):
        True: the first micro-batch of an optimizer step; each GEMM casts its weight
        and keeps the copies in its `FP8WeightCache`.
        False: a later micro-batch of the same step; each GEMM reads the copies (no
        weight cast, no transpose) and raises ValueError if its cache was never filled,
        or was filled for another recipe or weight shape.
        None: caching off; each call casts its weight, and the caches are emptied.

    Returns a `WeightCaching`; the modes are set at once. Used as a context manager
    around the forward (and its gradient) inside the jitted micro-step::

        with fp8.cache_weights(model, first):
            grads = nnx.grad(loss, argnums=...)(model, x, y)

    the previous modes come back on exit, so that the model leaves the step with the
    graph structure it entered with and ``nnx.jit`` compiles one fill and one reuse
    program, not one more per change of mode. The caches hold one FP8 byte per weight
    element twice (the weight and its transpose); they are not parameters: keep them out
    of checkpoints (``nnx.state(model, nnx.Not(fp8.FP8WeightCache))``).
    """
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(f"cache_weights: is_first_microbatch must be a Python bool or None (a static value; "
                        f"with optax.MultiSteps pass `i % k == 0` computed outside jit as a static argument), "
                        f"got {type(is_first_microbatch).__name__}")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"cache_weights: model must be an NNX module, got {type(model).__name__}")
    mode = None if is_first_microbatch is None else CACHE_FILL if is_first_microbatch else CACHE_REUSE
    metas = [node for _, node in nnx.iter_graph(model) if isinstance(node, FP8DotMeta)]
    if not metas:
        raise ValueError("cache_weights: model holds no FP8DotMeta (no layer was built with fp8=DelayedScaling(...))")
    previous = [vars(meta).get("weight_cache_mode", _CLASS_DEFAULT) for meta in metas]
    for meta in metas:
        if mode is not None and not isinstance(getattr(meta, "weight_cache", None), FP8WeightCache):
            meta.weight_cache = FP8WeightCache(None, recipe=None)
        elif mode is None and hasattr(meta, "weight_cache"):
            meta.weight_cache = FP8WeightCache(None, recipe=None)
        meta.weight_cache_mode = mode
    return WeightCaching(metas, previous)
