"""RMSNorm (LLaMA, Mistral, Gemma) over the fused ``rms_norm`` op."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2.nn._common import check_hidden, check_positive_int
from jax_ls2.ops import rms_norm
from jax_ls2.ops.rms_norm import RMS_EPSILON


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis: ``x * rsqrt(mean(x**2) + epsilon) * w``; epsilon
    defaults to `jax_ls2.ops.rms_norm.RMS_EPSILON` (1e-6).

    Param ``scale`` (num_features,): ones, or with ``unit_offset`` (Gemma, ``w = 1 +
    scale``) zeros. x: (..., num_features); statistics and math in float32; the output
    in ``dtype`` (None: promote x and the param).

    ``__call__(x)`` -> y; ``__call__(x, residual=r)`` -> ``(RMSNorm(x + r), x + r)`` (the
    sum feeds the next residual branch); ``__call__(x, return_input=True)`` -> ``(y, x)``
    and ``copies=k`` -> k copies of y: the multi-consumer forms of ``ops.rms_norm``, whose
    backward kernel adds the consumers' gradients.
    """

    def __init__(self, num_features: int, *, epsilon: float = RMS_EPSILON, unit_offset: bool = False,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        del rngs
        check_positive_int("RMSNorm", "num_features", num_features)
        self.num_features, self.epsilon, self.unit_offset = num_features, float(epsilon), unit_offset
        self.dtype = dtype
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = nnx.Param(init((num_features,), param_dtype))

    def __call__(self, x, residual=None, *, return_input: bool = False, copies: int = 1):
        check_hidden("RMSNorm", x, self.num_features)
        dtype = self.dtype or dtypes.promote_dtype((x, self.scale[...]), dtype=None)[0].dtype
        x = x.astype(dtype)
        if residual is not None:
            residual = residual.astype(dtype)
        return rms_norm(x, self.scale[...], epsilon=self.epsilon, residual=residual, copies=copies,
                        return_input=return_input, unit_offset=self.unit_offset)
