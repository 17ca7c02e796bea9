"""KV-cache decoding of the zoo's causal language models (LLaMA family and GPT), with
either layer library.

A decoder holds one key/value cache per attention layer (``jax_ls2.nn.KVCache``
variables with jax_ls2 layers, Flax's ``nnx.Cache`` in the plain-Flax twin) and the
number of positions written. ``decoder(ids, decode=True)`` appends ``ids`` (batch, t)
to the cache and returns their logits (batch, t, vocab): the prompt in one call or in
chunks, then one token per call; each token attends the cached positions and the
earlier tokens of its call (`jax_ls2.nn.kv_cache.visible`). A call of more than
``max_len`` tokens raises; one that runs past the end of the cache returns NaN logits.

* `for_decoding(model)`: the model itself for `flax_models.llama.Llama` (its
  ``DecoderLayer`` s own their caches), a `GPTDecoding` around a
  `flax_models.gpt.GPT` (the GPT's own modules and params, a cache beside them).
* `init_cache(model, batch, max_len)`: that decoder with zeroed caches.
* `generate(model, prompt, steps, temperature=0.0, key=None)`: prefill and ``steps``
  sampled tokens in one compiled program (greedy at temperature 0, else softmax
  sampling of ``logits / temperature``).

The rows of a batch share one position: prompts of equal length (no left padding).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_ls2.nn as ls2_nn
from flax_models.gpt import GPT
from flax_models.llama import Llama
from flax_models.plain import layers as plain
from jax_ls2.nn import kv_cache


def _library(gpt: GPT) -> str:
    """"ls2" or "plain": the library of ``gpt``'s layers; raises for what decoding does not
    cover (FP8 GEMMs, tensor parallelism, other layer types)."""
    o, cfg = "GPTDecoding", gpt.cfg
    if cfg.fp8 is not None:
        raise ValueError(f"{o}: cfg.fp8 is not supported (decoding runs the GEMMs in the compute dtype, not "
                         f"through the layers' FP8 metas); load its params into a GPT built with fp8=None to decode")
    if cfg.tensor_axis is not None or cfg.sequence_parallel:
        raise ValueError(f"{o}: cfg.tensor_axis / cfg.sequence_parallel are not supported (the cache holds "
                         f"every head); load its params into a GPT built with tensor_axis=None to decode")
    layers = list(gpt.decoder.layers)
    if all(isinstance(layer, ls2_nn.TransformerEncoderLayer) for layer in layers):
        return "ls2"
    if all(isinstance(layer, plain.TransformerEncoderLayer) for layer in layers):
        return "plain"
    raise TypeError(f"{o}: the GPT's layers must all be jax_ls2.nn or all flax_models.plain "
                    f"TransformerEncoderLayer, got {sorted({type(layer).__name__ for layer in layers})}")


class GPTDecoding(nnx.Module):
    """A `GPT` with a decode cache: ``__call__(ids, decode=True)`` runs the GPT's own
    embedding, layers and tied output on the cache, the final LayerNorm where the stack
    has one. With jax_ls2 layers each layer runs itself on its attention's KV cache
    (``layer(x, decode=True)``); the plain-Flax twin's layers, which have no cache, are
    run here as their settings say (pre-LN or post-LN, their FFN activation). The GPT's
    params are shared, not copied. FP8 and tensor-parallel GPTs raise."""

    def __init__(self, gpt: GPT):
        self.gpt = gpt
        self.library = _library(gpt)
        self.keys = self.values = self.index = nnx.data(None)
        self.max_len = None

    def init_cache(self, batch: int, max_len: int, dtype=None):
        cfg = self.gpt.cfg
        if max_len > cfg.max_len:
            raise ValueError(f"GPTDecoding.init_cache: max_len must be at most the model's max_len "
                             f"({cfg.max_len}, its learned positions), got {max_len}")
        layers = self.gpt.decoder.layers
        dtype = dtype or self.gpt.embed.dtype or layers[0].attn.qkv.kernel.dtype
        if self.library == "ls2":
            kv_cache.new_cache(batch, max_len, 1, 1, dtype, "GPTDecoding")  # checks the sizes
            for layer in layers:
                layer.attn.init_cache(batch, max_len, dtype)
            self.index, self.max_len = kv_cache.KVCache(jnp.zeros((), jnp.int32)), max_len
            return
        caches = [kv_cache.new_cache(batch, max_len, cfg.num_heads, cfg.hidden_size // cfg.num_heads, dtype,
                                     "GPTDecoding", variable=nnx.Cache) for _ in layers]
        self.keys = nnx.List([k for k, _, _ in caches])
        self.values = nnx.List([v for _, v, _ in caches])
        self.index = nnx.Cache(jnp.zeros((), jnp.int32))

    def _attention(self, i, layer, h):
        """The plain twin's attention on this decoder's cache."""
        b, t, hidden = h.shape
        heads = self.gpt.cfg.num_heads
        qkv = layer.attn.qkv(h).reshape(b, t, 3, heads, hidden // heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        start = self.index[...]
        k_all, v_all = kv_cache.write(self.keys[i], self.values[i], start, k, v, "GPTDecoding")
        k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
        max_len = k.shape[1]
        ctx = jax.nn.dot_product_attention(q, k, v, mask=kv_cache.visible(start, t, max_len)[None, None],
                                           implementation="xla")
        ctx = kv_cache.nan_past_end(ctx, start, max_len)
        return layer.attn.out(ctx.reshape(b, t, hidden))

    @staticmethod
    def _ffn(layer, h):
        y = layer.fc1(h)
        y = plain.ACTIVATION_FNS[layer.activation](y.astype(jnp.float32)).astype(y.dtype)
        return layer.fc2(y)

    @staticmethod
    def _residual(layer, sub, ln, x):
        """Pre-LN ``x + sub(ln(x))``, post-LN ``ln(x + sub(x))``, as the layer runs."""
        if layer.pre_layer_norm:
            return x + sub(ln(x)).astype(x.dtype)
        y = sub(x)
        return ln(x.astype(y.dtype) + y)

    def __call__(self, ids, *, decode: bool = True):
        if not decode:
            return self.gpt(ids)
        if self.index is None:
            raise ValueError("GPTDecoding: decode=True needs a cache; call init_cache(batch, max_len) first")
        b, t = ids.shape
        if self.max_len is not None and t > self.max_len:
            raise ValueError(f"GPTDecoding: a decode call of {t} tokens does not fit the cache's max_len "
                             f"({self.max_len}); call init_cache with a larger max_len or pass fewer tokens per call")
        start = self.index[...]
        x = self.gpt.embed(ids, positions=jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t)),
                           deterministic=True)
        for i, layer in enumerate(self.gpt.decoder.layers):
            if self.library == "ls2":
                x = layer(x, causal=True, deterministic=True, decode=True)
                continue
            x = self._residual(layer, lambda h, i=i, layer=layer: self._attention(i, layer, h), layer.attn_ln, x)
            x = self._residual(layer, lambda h, layer=layer: self._ffn(layer, h), layer.ffn_ln, x)
        self.index[...] = start + t
        final_ln = self.gpt.decoder.final_ln
        return self.gpt.embed.attend(x if final_ln is None else final_ln(x))


def for_decoding(model):
    """The decoder of ``model``: a `Llama` itself, a `GPT` wrapped in `GPTDecoding`."""
    if isinstance(model, Llama):
        return model
    if isinstance(model, GPT):
        return GPTDecoding(model)
    raise TypeError(f"for_decoding: model must be a flax_models Llama or GPT, got {type(model).__name__}")


def init_cache(model, batch: int, max_len: int, dtype=None):
    """`for_decoding(model)` in eval mode with zeroed caches for ``batch`` sequences of at
    most ``max_len`` positions (keys and values in ``dtype``, default the compute dtype)."""
    decoder = for_decoding(model)
    decoder.eval()
    decoder.init_cache(batch, max_len, dtype)
    return decoder


@nnx.jit
def decode(decoder, ids):
    """``decoder(ids, decode=True)``: ids int (batch, t) -> logits (batch, t, vocab), the
    cache advanced by t."""
    return decoder(ids, decode=True)


def sample(logits, key, temperature: float):
    """Next tokens int32 (batch,) from logits (batch, vocab): argmax at temperature 0,
    else drawn from softmax(logits / temperature)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "temperature"))
def _generate(graphdef, cache, rest, prompt, key, *, steps, temperature):
    def logits_of(cache, ids):
        decoder = nnx.merge(graphdef, cache, rest)
        logits = decoder(ids, decode=True)[:, -1]
        return nnx.state(decoder, nnx.Cache), logits

    keys = jax.random.split(key, steps)
    cache, logits = logits_of(cache, prompt)
    first = sample(logits, keys[0], temperature)

    def step(carry, k):
        cache, token = carry
        cache, logits = logits_of(cache, token[:, None])
        token = sample(logits, k, temperature)
        return (cache, token), token

    (cache, _), rest_tokens = jax.lax.scan(step, (cache, first), keys[1:])
    return jnp.concatenate([first[:, None], rest_tokens.T], axis=1), cache


def _check_key(key):
    """One JAX PRNG key: a typed scalar key (``jax.random.key``) or a legacy uint32[2]."""
    if not isinstance(key, (jax.Array, np.ndarray)):
        raise TypeError(f"generate: key must be one JAX PRNG key (jax.random.key(seed)), got "
                        f"{type(key).__name__} {key!r}")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"generate: key must be one JAX PRNG key (shape ()), got a batch of keys of shape "
                             f"{tuple(key.shape)}")
    elif key.dtype != np.uint32 or key.shape != (2,):
        raise ValueError(f"generate: key must be one JAX PRNG key (jax.random.key(seed), or a legacy uint32[2] "
                         f"from jax.random.PRNGKey), got {key.dtype}{tuple(key.shape)}")


def generate(model, prompt, steps: int, *, temperature: float = 0.0, key=None, max_len: int | None = None,
             cache_dtype=None):
    """Tokens int32 (batch, steps) following ``prompt`` int (batch, t).

    One compiled program: the prompt's prefill, then ``steps - 1`` one-token steps in a
    ``lax.scan``. ``temperature`` 0 is greedy (argmax); above 0, tokens are drawn from
    ``softmax(logits / temperature)`` with ``key`` (required then). The cache holds
    ``max_len`` positions (default ``t + steps``).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"generate: steps must be a positive int, got {steps!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise TypeError(f"generate: temperature must be a Python or NumPy real number, got "
                        f"{type(temperature).__name__} {temperature!r}")
    if not temperature >= 0.0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature!r}")
    if temperature > 0.0 and key is None:
        raise ValueError("generate: temperature > 0 samples and needs key (a JAX PRNG key)")
    if key is not None:
        _check_key(key)
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"generate: prompt must be integer (batch, len), got {prompt.dtype}{tuple(prompt.shape)}")
    b, t = prompt.shape
    if b == 0 or t == 0:
        raise ValueError(f"generate: prompt must hold at least one row and one token, got shape {(b, t)}")
    if max_len is not None and max_len < t + steps:
        raise ValueError(f"generate: max_len must hold the prompt and the new tokens ({t} + {steps}), got {max_len}")
    decoder = init_cache(model, b, max_len or t + steps, cache_dtype)
    graphdef, cache, rest = nnx.split(decoder, nnx.Cache, ...)
    key = jax.random.key(0) if key is None else key
    tokens, cache = _generate(graphdef, cache, rest, prompt.astype(jnp.int32), key, steps=steps,
                              temperature=float(temperature))
    nnx.update(decoder, cache)
    return tokens
