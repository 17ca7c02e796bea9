"""What LayerNorm and RMSNorm share: the multi-consumer outputs (``copies``,
``return_input``), the float32 sum of their cotangents, and the option checks."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_ls2.ops._limits import MAX_COPIES


def distinct_copies(y, copies: int) -> tuple:
    """`copies` references to y's buffer that XLA treats as different values: without
    the barrier it would see one operand shared by the consumers' GEMMs and merge them
    (q, k, v projections into one GEMM whose bias add and column slices, and whose
    weight gradient's concatenated dq|dk|dv, cost full activation passes)."""
    return (y,) if copies == 1 else tuple(jax.lax.optimization_barrier((y,) * copies))


def sum_cotangents(cts, has_dsum: bool):
    """``cts = dy_0 .. dy_{n-1} [, dsum]``: the cotangents of y summed in float32 in this
    order (as the kernels add them while loading), and dsum (the cotangent of the input's
    other use) or None."""
    dys = cts[:len(cts) - has_dsum]
    dy = dys[0].astype(jnp.float32)
    for d in dys[1:]:
        dy = dy + d.astype(jnp.float32)
    return dy, (cts[-1] if has_dsum else None)


def check_epsilon(op: str, epsilon) -> None:
    """Checks a norm's epsilon: a finite positive Python number, not a bool (an infinite
    one would turn every output into zeros, or into beta)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) \
            or not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"{op}: epsilon must be a positive finite Python float, got {epsilon!r}")


def check_options(op: str, *, epsilon, copies, return_input, residual) -> None:
    """Checks a norm's epsilon (`check_epsilon`), ``copies`` (1 to MAX_COPIES) and
    ``return_input`` (a bool), and that neither of the last two is asked for with
    ``residual``."""
    check_epsilon(op, epsilon)
    if not isinstance(return_input, bool):
        raise TypeError(f"{op}: return_input must be a Python bool, got {type(return_input).__name__}")
    if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= MAX_COPIES:
        raise ValueError(f"{op}: copies must be a Python int from 1 to {MAX_COPIES}, got {copies!r}")
    if residual is not None and copies > 1:
        raise ValueError(f"{op}: copies applies without residual (with residual, the sum is returned)")
    if residual is not None and return_input:
        raise ValueError(f"{op}: return_input applies without residual (with residual, the sum is returned)")
