"""Functional fused ops. Arrays are positional, options keyword-only."""
from jax_ls2.ops.layer_norm import layer_norm

__all__ = ["layer_norm"]
