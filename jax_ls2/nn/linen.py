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

With ``fp8=jax_ls2.fp8.DelayedScaling(...)`` the FP8 metas are a collection of their own,
``"FP8Meta"`` (`jax_ls2.fp8.DotMeta` nodes), beside an unchanged ``params``; differentiate
the loss with respect to both and step the metas with `jax_ls2.fp8.apply_meta_updates`::

    grads = jax.grad(loss)(variables, batch)   # variables: {"params": ..., "FP8Meta": ...}
    param_grads, variables = fp8.apply_meta_updates(variables, grads, recipe)

Megatron tensor and sequence parallelism (``tensor_axis="tensor"``, ``sequence_parallel``,
`LayerConfig` fields) work here too: the params come boxed with their partition specs
(``flax.linen.get_partition_spec(variables)``); call ``init`` and ``apply`` under
``jax.set_mesh(mesh)``.

The building blocks have Linen front ends too: `LayerNorm`, `Embedding` and
`MultiHeadAttention`, with the arguments of the NNX module of the same name (plus
``name``) and its parameter tree::

    ln = ls2_linen.LayerNorm(768, epsilon=1e-6)                 # Flax's default epsilon
    attn = ls2_linen.MultiHeadAttention(768, 12, attn_dropout=0.1)
    embed = ls2_linen.Embedding(50257, 768, max_positions=1024)
"""
from __future__ import annotations

import inspect

from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from jax_ls2.nn import attention as _attention
from jax_ls2.nn import embedding as _embedding
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


def _block(owner, cls, args, name, kw):
    """A ToLinen around `cls`, its arguments checked against `cls`'s constructor now (their
    values are checked by `cls` itself at ``init``)."""
    try:
        inspect.signature(cls.__init__).bind(None, *args, rngs=None, **kw)
    except TypeError as e:
        raise TypeError(f"{owner}: {e} (the arguments are those of jax_ls2.nn.{cls.__name__}, "
                        f"plus name)") from None
    return bridge.to_linen(_linen_rngs(cls), *args, name=name, **kw)


def LayerNorm(num_features: int, *, name: str | None = None, **kw) -> nn.Module:
    """Linen module of `jax_ls2.nn.LayerNorm` (same arguments, plus ``name``).

    Params ``scale`` and ``bias`` (num_features,), as ``flax.linen.LayerNorm``; epsilon
    defaults to 1e-5, where Flax's is 1e-6. ``__call__(x, residual=None, *,
    return_input=False, copies=1)``: x (..., num_features) -> LN(x) (see the NNX module
    for the other forms).
    """
    return _block("linen.LayerNorm", _layers.LayerNorm, (num_features,), name, kw)


def Embedding(vocab_size: int, hidden_size: int, *, name: str | None = None, **kw) -> nn.Module:
    """Linen module of `jax_ls2.nn.Embedding` (same arguments, plus ``name``).

    Params ``tokens.embedding`` (vocab_size, hidden_size) and, with ``max_positions``,
    ``positions.embedding``. ``__call__(ids, *, positions=None, deterministic=None)``:
    ids int (batch, len) -> (batch, len, hidden_size); embedding dropout keys from the
    ``"dropout"`` stream of ``apply``. The tied output projection:
    ``apply(variables, x, nnx_method="attend")``, x (..., hidden_size) -> (..., vocab_size).
    """
    return _block("linen.Embedding", _embedding.Embedding, (vocab_size, hidden_size), name, kw)


def MultiHeadAttention(hidden_size: int, num_heads: int, *, name: str | None = None,
                       **kw) -> nn.Module:
    """Linen module of `jax_ls2.nn.MultiHeadAttention` (same arguments, plus ``name``).

    Params: ``qkv`` (self-attention) or ``q`` and ``kv`` (``self_attention=False``), and
    ``out``. ``__call__(x, memory=None, *, padding_mask=None, causal=False, kv=None,
    deterministic=None)``: x (batch, q_len, hidden) -> same shape; attention-dropout keys
    from the ``"dropout"`` stream of ``apply``.
    """
    return _block("linen.MultiHeadAttention", _attention.MultiHeadAttention,
                  (hidden_size, num_heads), name, kw)


__all__ = ["Embedding", "LayerNorm", "MultiHeadAttention", "TransformerDecoderLayer",
           "TransformerEncoderLayer"]
