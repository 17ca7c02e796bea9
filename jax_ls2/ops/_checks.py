"""Input validation shared by the ops: every message names the op, the argument,
what was expected and what came."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _desc(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def check_array(op: str, name: str, x, *, dtypes=FLOAT_DTYPES, min_ndim: int = 0, ndim: int | None = None):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
    if dtypes is not None and jnp.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in ({_desc(dtypes)}), got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim}, got shape {tuple(x.shape)}")
    if x.ndim < min_ndim:
        raise ValueError(f"{op}: {name} must have rank >= {min_ndim}, got shape {tuple(x.shape)}")


def check_shape(op: str, name: str, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_same_dtype(op: str, name: str, x, dtype):
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{op}: {name} must have dtype {jnp.dtype(dtype)} (the input's), got {x.dtype}")


def check_broadcastable(op: str, name: str, x, shape):
    if x.ndim != len(shape) or any(a not in (1, b) for a, b in zip(x.shape, shape)):
        raise ValueError(f"{op}: {name} must be broadcastable to {tuple(shape)} "
                         f"(same rank, each dim 1 or equal), got {tuple(x.shape)}")


def check_rate(op: str, rate, key, deterministic: bool):
    if isinstance(rate, jax.Array) and not isinstance(rate, jax.core.Tracer):
        rate = float(rate)
    if not isinstance(rate, (int, float, np.floating)):
        raise TypeError(f"{op}: rate must be a Python float (static), got {type(rate).__name__}")
    if not 0.0 <= float(rate) < 1.0:
        raise ValueError(f"{op}: rate must be in [0, 1), got {rate}")
    if float(rate) > 0.0 and not deterministic and key is None:
        raise ValueError(f"{op}: key is required when rate > 0 and deterministic=False, got None")
    if key is not None and not deterministic and float(rate) > 0.0:
        ok = jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (
            jnp.dtype(key.dtype) == jnp.uint32 and key.shape == (2,))
        if not ok:
            raise TypeError(f"{op}: key must be a JAX PRNG key (jax.random.key) or uint32[2], "
                            f"got dtype {key.dtype} shape {tuple(key.shape)}")
    return float(rate)
