"""The delayed-scaling recipe: which FP8 format each GEMM operand takes, and how a
scale follows from an amax history."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_ls2.ops._fp8_formats import E4M3, E5M2, fp8_max  # noqa: F401 (re-exported)

FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")

# Row of each GEMM operand in the per-GEMM meta arrays (amax_history: (3, L), scale: (3,)).
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
NUM_OPERANDS = 3

# The largest margin for which 2**margin and 2**-margin are both normal float32 values:
# 2**128 is inf (every scale becomes 0), and at 127 XLA divides by multiplying with the
# subnormal 2**-127, which flushes to zero with the same result.
MAX_MARGIN = -int(jnp.finfo(jnp.float32).minexp)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed per-tensor scaling of FP8 GEMM operands (Transformer Engine's recipe).

    Each operand's scale comes from amaxes seen in earlier steps:
    ``scale = (fp8_max / amax) / 2**margin``, with ``amax`` the maximum of the amax
    history (``amax_compute_algo="max"``) or its newest entry (``"most_recent"``). The
    history rolls by one entry every step (`jax_ls2.fp8.update_meta`). Where that amax
    is 0 or not finite the previous scale is kept; where the quotient overflows float32
    the scale is float32's largest value.

    Args:
      margin: an int from 0 to `MAX_MARGIN` (126, so that ``2**margin`` and its
        reciprocal are normal float32 values); each scale is divided by ``2**margin``.
      fp8_format: ``"hybrid"`` (E4M3 for inputs and weights in the forward, E5M2 for
        output gradients in the backward) or ``"e4m3"`` (E4M3 everywhere).
      amax_history_len: entries kept per operand, at least 1.
      amax_compute_algo: ``"max"`` or ``"most_recent"``.
      reduce_amax: max-reduce every amax over the mesh axes given to `fp8_dot`
        (``amax_axes``), so that all replicas use the same scales.
    """

    margin: int = 0
    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def _optimizer_step(self, fn: str):
        """``jax_ls2.fp8.<fn>`` (``apply_updates`` or ``update_nnx``): how the deprecated
        ``jax_ls2.optim.<fn>(..., fp8=recipe)`` reaches the FP8 step without ``optim``
        importing ``fp8``."""
        from jax_ls2.fp8 import optimizer
        return getattr(optimizer, fn)

    def __post_init__(self):
        def bad(arg, expected, got):
            raise ValueError(f"DelayedScaling: {arg} must be {expected}, got {got!r}")

        if isinstance(self.margin, bool) or not isinstance(self.margin, int) \
                or not 0 <= self.margin <= MAX_MARGIN:
            bad("margin", f"an int from 0 to {MAX_MARGIN} (2**margin a normal float32)", self.margin)
        if self.fp8_format not in FORMATS:
            bad("fp8_format", f"one of {FORMATS}", self.fp8_format)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            bad("amax_history_len", "an int >= 1", self.amax_history_len)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            bad("amax_compute_algo", f"one of {AMAX_COMPUTE_ALGOS}", self.amax_compute_algo)
        if not isinstance(self.reduce_amax, bool):
            bad("reduce_amax", "a bool", self.reduce_amax)

    @property
    def forward_dtype(self):
        """FP8 dtype of the inputs and weights: float8_e4m3fn."""
        return E4M3

    @property
    def backward_dtype(self):
        """FP8 dtype of the output gradients: float8_e5m2 (hybrid) or float8_e4m3fn."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    def operand_dtypes(self) -> tuple:
        """FP8 dtype per operand row (input, weight, output gradient)."""
        return (self.forward_dtype, self.forward_dtype, self.backward_dtype)

    def operand_fp8_max(self):
        """(3,) float32: the largest FP8 value of each operand row's format."""
        return jnp.asarray([fp8_max(d) for d in self.operand_dtypes()], jnp.float32)

    def amax_from_history(self, amax_history):
        """(..., L) float32 history, newest first -> (...,) float32 amax by the algorithm."""
        if self.amax_compute_algo == "max":
            return jnp.max(amax_history, axis=-1)
        return amax_history[..., 0]

    def compute_scale(self, amax, previous_scale, max_value):
        """New scales, float32, elementwise over amax, previous_scale and max_value.

        ``(max_value / amax) / 2**margin`` where amax is positive and finite, the
        previous scale elsewhere, float32's largest value where the quotient overflows.
        """
        amax = amax.astype(jnp.float32)
        usable = (amax > 0) & jnp.isfinite(amax)
        scale = (max_value / jnp.where(usable, amax, 1.0)) / jnp.float32(2.0 ** self.margin)
        scale = jnp.where(jnp.isinf(scale), jnp.finfo(jnp.float32).max, scale)
        return jnp.where(usable, scale, previous_scale).astype(jnp.float32)
