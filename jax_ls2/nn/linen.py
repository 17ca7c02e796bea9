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

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from jax_ls2.nn import layers as _layers


def _linen_rngs(cls):
    """``cls``'s constructor for ``ToLinen``: dropout keys only from a Linen ``"dropout"``
    stream. Without one (``init(key, ...)``, or ``apply`` without ``rngs={"dropout": ...}``)
    the layer keeps no dropout stream, so active dropout raises instead of silently using
    the bridge's fixed fallback key."""
    def make(*args, rngs: nnx.Rngs, **kw):
        if "dropout" in rngs:
            return cls(*args, rngs=rngs, **kw)
        params = rngs.params() if "params" in rngs else rngs.default()
        layer = cls(*args, rngs=nnx.Rngs(params=params, dropout=params), **kw)
        for sub in (layer, layer.attn, getattr(layer, "cross_attn", None)):
            if sub is not None:
                sub.rngs = nnx.data(None)
        return layer
    make.__name__ = make.__qualname__ = cls.__name__
    return make


def _wrap(owner, cls, hidden_size, ffn_size, num_heads, name, kw):
    for arg, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size),
                       ("num_heads", num_heads)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{owner}: {arg} must be an int, got {type(value).__name__}")
    return bridge.to_linen(_linen_rngs(cls), hidden_size, ffn_size, num_heads, name=name, **kw)


def TransformerEncoderLayer(hidden_size: int, ffn_size: int, num_heads: int, *,
                            pre_layer_norm: bool = True, activation: str = "relu",
                            attn_dropout: float = 0.0, activation_dropout: float = 0.0,
                            hidden_dropout: float = 0.0, layer_norm_eps: float = 1e-5,
                            attention_backend: str = "auto", deterministic: bool | None = None,
                            dtype=None, param_dtype=jnp.float32,
                            name: str | None = None) -> nn.Module:
    """Linen module of `jax_ls2.nn.TransformerEncoderLayer` (same arguments, plus ``name``).

    ``__call__(x, *, padding_mask=None, causal=False, deterministic=None)``: x (batch, len,
    hidden) -> same shape and dtype (``dtype``, or promoted from x and params);
    padding_mask bool (batch, len), True = token.
    """
    kw = dict(pre_layer_norm=pre_layer_norm, activation=activation, attn_dropout=attn_dropout,
              activation_dropout=activation_dropout, hidden_dropout=hidden_dropout,
              layer_norm_eps=layer_norm_eps, attention_backend=attention_backend,
              deterministic=deterministic, dtype=dtype, param_dtype=param_dtype)
    return _wrap("linen.TransformerEncoderLayer", _layers.TransformerEncoderLayer,
                 hidden_size, ffn_size, num_heads, name, kw)


def TransformerDecoderLayer(hidden_size: int, ffn_size: int, num_heads: int, *,
                            pre_layer_norm: bool = True, activation: str = "relu",
                            attn_dropout: float = 0.0, activation_dropout: float = 0.0,
                            hidden_dropout: float = 0.0, layer_norm_eps: float = 1e-5,
                            attention_backend: str = "auto", deterministic: bool | None = None,
                            dtype=None, param_dtype=jnp.float32,
                            name: str | None = None) -> nn.Module:
    """Linen module of `jax_ls2.nn.TransformerDecoderLayer` (same arguments, plus ``name``).

    ``__call__(x, memory=None, *, cross_kv=None, padding_mask=None, memory_padding_mask=None,
    deterministic=None)``: x (batch, tgt_len, hidden), memory (batch, src_len, hidden) ->
    (batch, tgt_len, hidden). Self-attention is causal.
    """
    kw = dict(pre_layer_norm=pre_layer_norm, activation=activation, attn_dropout=attn_dropout,
              activation_dropout=activation_dropout, hidden_dropout=hidden_dropout,
              layer_norm_eps=layer_norm_eps, attention_backend=attention_backend,
              deterministic=deterministic, dtype=dtype, param_dtype=param_dtype)
    return _wrap("linen.TransformerDecoderLayer", _layers.TransformerDecoderLayer,
                 hidden_size, ffn_size, num_heads, name, kw)


__all__ = ["TransformerDecoderLayer", "TransformerEncoderLayer"]
