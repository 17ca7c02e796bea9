"""Flax Linen front ends of `jax_ls2.nn.RMSNorm` and `jax_ls2.nn.DecoderLayer`.

As in `jax_ls2.nn.linen`: each function returns a Linen module (``flax.nnx.bridge``)
whose ``params`` collection is the NNX module's parameter tree, leaf for leaf; dropout
keys come from the ``"dropout"`` stream of ``apply``::

    from jax_ls2.nn import linen_decoder

    layer = linen_decoder.DecoderLayer(2048, 8192, 32, num_kv_heads=8)
    variables = layer.init(jax.random.key(0), x, deterministic=True)   # x (batch, len, 2048)
    y = layer.apply(variables, x, segment_ids=seg, deterministic=True)

Decoding with a cache is an NNX feature (``DecoderLayer.init_cache``); these front ends
run the layer on whole sequences.
"""
from __future__ import annotations

from flax import linen as nn

from jax_ls2.nn import decoder as _decoder
from jax_ls2.nn import rms_norm as _rms_norm
from jax_ls2.nn.linen import _block


def RMSNorm(num_features: int, *, name: str | None = None, **kw) -> nn.Module:
    """Linen module of `jax_ls2.nn.RMSNorm` (same arguments, plus ``name``). Param
    ``scale`` (num_features,). ``__call__(x, residual=None, *, return_input=False,
    copies=1)``: x (..., num_features) -> RMSNorm(x) (see the NNX module for the other
    forms)."""
    return _block("linen.RMSNorm", _rms_norm.RMSNorm, (num_features,), name, kw)


def DecoderLayer(hidden_size: int, ffn_size: int, num_heads: int, *, name: str | None = None,
                 **kw) -> nn.Module:
    """Linen module of `jax_ls2.nn.DecoderLayer` (same arguments, plus ``name``). Params
    ``attn_norm``, ``qkv``, ``out``, ``mlp_norm``, ``gate_up``, ``down``.
    ``__call__(x, *, positions=None, segment_ids=None, deterministic=None)``: x (batch,
    len, hidden) -> same shape."""
    return _block("linen.DecoderLayer", _decoder.DecoderLayer, (hidden_size, ffn_size, num_heads), name, kw)


__all__ = ["DecoderLayer", "RMSNorm"]
