"""The FP8 formats and the one saturating cast every FP8 path shares (the fused casts
here and the GEMMs of `jax_ls2.fp8`)."""
from __future__ import annotations

import jax.numpy as jnp

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for e4m3fn, 57344 for e5m2."""
    return float(jnp.finfo(dtype).max)


def quantize(t, scale, fp8_dtype):
    """``t * scale`` in float32, saturated to the FP8 range, cast to ``fp8_dtype`` (round
    to nearest even, NaN staying NaN). t: any shape and float dtype; scale: float32
    scalar or broadcastable; returns t's shape in ``fp8_dtype``."""
    limit = fp8_max(fp8_dtype)
    return jnp.clip(t.astype(jnp.float32) * scale, -limit, limit).astype(fp8_dtype)
