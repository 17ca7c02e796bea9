"""Flax Linen front ends of the jax_ls2 Transformer layers.

Each function returns a Linen module (``flax.nnx.bridge.ToLinen``) around the NNX layer of
the same name, so ``init`` / ``apply`` work as for any Linen module and it can be a
submodule of a ``@nn.compact`` model. The ``params`` collection is the NNX layer's
parameter tree, leaf for leaf (``attn.qkv``, ``attn.out``, ``attn_ln``, ``ffn_ln``,
``fc1``, ``fc2``, and ``cross_ln`` / ``cross_attn.q`` / ``cross_attn.kv`` for the decoder),
so params move between the two APIs unchanged::

    import jax, jax.numpy as jnp
    from jax_ls2.nn import linen as ls2_linen

    layer = ls2_linen.TransformerEncoderLayer(768, 3072, 12, hidden_dropout=0.1)
    x = jnp.zeros((8, 128, 768), jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    y = layer.apply(variables, x, deterministic=False,
                    rngs={"dropout": jax.random.key(1)})       # training step
    y = layer.apply(variables, x, deterministic=True)          # evaluation

Dropout keys come from the Linen ``"dropout"`` RNG stream of ``apply``; active dropout
without one raises ``ValueError``. ``deterministic``
must be given at call time (or fixed with ``deterministic=`` here). Keyword arguments of the
call are those of the NNX layer (``padding_mask``, ``causal``, ``memory``, ``cross_kv``,
``memory_padding_mask``, ``deterministic``).

The same path works for any other jax_ls2 NNX module:
``flax.nnx.bridge.to_linen(jax_ls2.nn.MultiHeadAttention, hidden, heads, ...)``.
"""
from __future__ import annotations

from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from jax_ls2.nn import layers as _layers
from jax_ls2.nn.config import LayerConfig, layer_config


def _linen_rngs(cls):
    """``cls``'s constructor for ``ToLinen``: dropout keys only from a Linen ``"dropout"``
    stream. Without one (``init(key, ...)``, or ``apply`` without ``rngs={"dropout": ...}``)
    the module keeps no dropout stream, so active dropout raises instead of silently using
    the bridge's fixed fallback key."""
    def make(*args, rngs: nnx.Rngs, **kw):
        if "dropout" in rngs:
            return cls(*args, rngs=rngs, **kw)
        params = rngs.params() if "params" in rngs else rngs.default()
        module = cls(*args, rngs=nnx.Rngs(params=params, dropout=params), **kw)
        for _, sub in nnx.iter_modules(module):
            if isinstance(getattr(sub, "rngs", None), nnx.RngStream):
                sub.rngs = nnx.data(None)
        return module
    make.__name__ = make.__qualname__ = cls.__name__
    return make


def _layer(owner, cls, hidden_size, ffn_size, num_heads, name, options):
    config = layer_config(owner, hidden_size, ffn_size, num_heads, options)
    return bridge.to_linen(_linen_rngs(cls), config, name=name)


def TransformerEncoderLayer(hidden_size: int | LayerConfig, ffn_size: int | None = None,
                            num_heads: int | None = None, *, name: str | None = None,
                            **options) -> nn.Module:
    """Linen module of `jax_ls2.nn.TransformerEncoderLayer` (same arguments: a `LayerConfig`
    or its fields, plus ``name``).

    ``__call__(x, *, padding_mask=None, causal=False, deterministic=None)``: x (batch, len,
    hidden) -> same shape and dtype (``dtype``, or promoted from x and params);
    padding_mask bool (batch, len), True = token.
    """
    return _layer("linen.TransformerEncoderLayer", _layers.TransformerEncoderLayer,
                  hidden_size, ffn_size, num_heads, name, options)


def TransformerDecoderLayer(hidden_size: int | LayerConfig, ffn_size: int | None = None,
                            num_heads: int | None = None, *, name: str | None = None,
                            **options) -> nn.Module:
    """Linen module of `jax_ls2.nn.TransformerDecoderLayer` (same arguments: a `LayerConfig`
    or its fields, plus ``name``).

    ``__call__(x, memory=None, *, cross_kv=None, padding_mask=None, memory_padding_mask=None,
    deterministic=None)``: x (batch, tgt_len, hidden), memory (batch, src_len, hidden) ->
    (batch, tgt_len, hidden). Self-attention is causal.
    """
    return _layer("linen.TransformerDecoderLayer", _layers.TransformerDecoderLayer,
                  hidden_size, ffn_size, num_heads, name, options)


__all__ = ["TransformerDecoderLayer", "TransformerEncoderLayer"]
