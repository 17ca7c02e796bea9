"""Input validation shared by the ops: every message names the op, the argument,
what was expected and what came."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random

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


def check_deterministic(op: str, deterministic) -> bool:
    """``deterministic`` as a Python bool; it chooses the program, so it must be static."""
    if isinstance(deterministic, jax.core.Tracer):
        raise TypeError(f"{op}: deterministic must be a Python bool (static), got a traced value; "
                        f"pass it as a static argument of jit, or call the op under each branch")
    if isinstance(deterministic, (jax.Array, np.ndarray)) and deterministic.shape == () \
            and deterministic.dtype == np.bool_:
        deterministic = bool(deterministic)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"{op}: deterministic must be a Python bool (static), got {type(deterministic).__name__}")
    return bool(deterministic)


def check_key(op: str, key) -> None:
    """One JAX PRNG key: typed (``jax.random.key``, shape ``()``) or raw ``uint32[2]``."""
    expected = "a JAX PRNG key (jax.random.key) or uint32[2]"
    if not hasattr(key, "shape") or not hasattr(key, "dtype"):
        raise TypeError(f"{op}: key must be {expected}, got {type(key).__name__}")
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw_batch = not typed and jnp.dtype(key.dtype) == jnp.uint32 and key.ndim > 1 and key.shape[-1] == 2
    if (typed and key.shape != ()) or raw_batch:
        keys = key.shape if typed else key.shape[:-1]
        raise ValueError(f"{op}: key must be a single PRNG key (shape ()), got a batch of keys of shape "
                         f"{tuple(keys)}; vmap the op over the keys for one mask per key")
    if not typed and not (jnp.dtype(key.dtype) == jnp.uint32 and key.shape == (2,)):
        raise TypeError(f"{op}: key must be {expected}, got dtype {key.dtype} shape {tuple(key.shape)}")


def check_rate_in_range(owner: str, name: str, rate) -> float:
    """Raises unless ``rate`` (a number) is a dropout probability in [0, 1); returns it
    as a Python float. ``owner`` (the op or layer) and ``name`` go into the message."""
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {rate}")
    return rate


def check_rate(op: str, rate, key, deterministic) -> float:
    """Checks the dropout arguments (``deterministic`` with `check_deterministic`
    first); returns the rate as a Python float."""
    if isinstance(rate, jax.Array) and not isinstance(rate, jax.core.Tracer):
        rate = float(rate)
    if not isinstance(rate, (int, float, np.floating)):
        raise TypeError(f"{op}: rate must be a Python float (static), got {type(rate).__name__}")
    check_rate_in_range(op, "rate", rate)
    deterministic = check_deterministic(op, deterministic)
    if float(rate) > 0.0 and not deterministic and key is None:
        raise ValueError(f"{op}: key is required when rate > 0 and deterministic=False, got None")
    if key is not None:
        check_key(op, key)
    return float(rate)


def check_dropout(op: str, rate, key, deterministic):
    """Checks the dropout arguments (`check_rate`); returns ``(seed, threshold, scale)``:
    the uint32[3] seed words of ``key``, the 16-bit drop threshold and the keep scale, or
    ``(no_seed(), 0, 1.0)`` when nothing is dropped (deterministic, or a rate that rounds
    to 0)."""
    deterministic = check_deterministic(op, deterministic)
    rate = check_rate(op, rate, key, deterministic)
    threshold = 0 if deterministic else _random.dropout_threshold(rate)
    if threshold == 0:
        return _random.no_seed(), 0, 1.0
    return _random.seed_words(key), threshold, _random.keep_scale(rate)


def clamp_to_int32(x):
    """Integer ``x`` as int32, values beyond int32's range clamped to its ends rather
    than wrapped (an int64 id of 2**32 + 1 must not become 1)."""
    info = jnp.iinfo(x.dtype)
    lo, hi = max(int(info.min), -2**31), min(int(info.max), 2**31 - 1)
    if (lo, hi) != (int(info.min), int(info.max)):
        x = jnp.clip(x, np.array(lo, x.dtype), np.array(hi, x.dtype))
    return x.astype(jnp.int32)
