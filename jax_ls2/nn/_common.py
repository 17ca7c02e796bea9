"""Helpers shared by the jax_ls2 Flax NNX layers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


def check_rate(owner: str, name: str, rate: float) -> float:
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {rate}")
    return rate


def check_activation(owner: str, activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def check_heads(owner: str, hidden_size: int, num_heads: int) -> int:
    if hidden_size <= 0 or num_heads <= 0 or hidden_size % num_heads:
        raise ValueError(f"{owner}: hidden_size ({hidden_size}) must be a positive multiple of "
                         f"num_heads ({num_heads})")
    return hidden_size // num_heads


def check_hidden(owner: str, x, hidden_size: int, name: str = "x"):
    if x.ndim < 2 or x.shape[-1] != hidden_size:
        raise ValueError(f"{owner}: {name} must have shape (..., {hidden_size}), got {tuple(x.shape)}")


def matmul(x: jax.Array, linear: nnx.Linear, dtype):
    """``x @ linear.kernel`` without the bias, and the bias, both in the promoted dtype.

    x: (..., in); returns y: (..., out) and bias: (out,) -- the bias is left for a fused
    epilogue op (bias + dropout + residual, bias + activation + dropout).
    """
    kernel = linear.kernel[...]
    bias = linear.bias[...]
    x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=dtype)
    return jnp.dot(x, kernel), bias


def rng_stream(rngs, collection: str = "dropout"):
    """A forked stream of ``rngs[collection]`` to keep on a module (or None)."""
    if rngs is None:
        return nnx.data(None)
    if isinstance(rngs, nnx.Rngs):
        return rngs[collection].fork()
    if isinstance(rngs, nnx.RngStream):
        return rngs.fork()
    raise TypeError(f"rngs must be nnx.Rngs, nnx.RngStream or None, got {type(rngs).__name__}")


def draw_key(owner: str, stored, rngs, collection: str = "dropout"):
    """One PRNG key from the call's ``rngs`` (Rngs, RngStream or key) or the stored stream."""
    src = rngs if rngs is not None else stored
    if src is None:
        raise ValueError(f"{owner}: dropout is active (deterministic=False, rate > 0) but no rngs "
                         f"were given; pass rngs=nnx.Rngs(dropout=...) at construction or call time")
    if isinstance(src, nnx.Rngs):
        return src[collection]()
    if isinstance(src, nnx.RngStream):
        return src()
    return src


def resolve_deterministic(owner: str, call_value, attr_value) -> bool:
    value = call_value if call_value is not None else attr_value
    if value is None:
        raise ValueError(f"{owner}: deterministic is not set; pass deterministic=True/False or "
                         f"call model.train() / model.eval()")
    return bool(value)
