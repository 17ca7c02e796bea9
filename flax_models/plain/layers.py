"""Plain-Flax NNX twins of the jax_ls2 layers: same constructors, same parameter trees,
built only from flax.nnx, jax and optax (no jax_ls2 code)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.plain.constants import EPSILON

BACKENDS = ("auto", "cudnn", "xla")
ACTIVATION_FNS = {"relu": jax.nn.relu, "gelu": lambda v: jax.nn.gelu(v, approximate=False),
        "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}


def LayerNorm(num_features, *, epsilon=EPSILON, dtype=None, param_dtype=jnp.float32, rngs=None):
    """``nnx.LayerNorm`` (params ``scale``, ``bias``)."""
    return nnx.LayerNorm(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs if rngs is not None else nnx.Rngs(0))


def Dropout(rate, *, deterministic=None, rngs=None):
    return nnx.Dropout(rate, deterministic=deterministic, rngs=rngs)


def attention_implementation(backend, dropout_active, q_len, k_len, head_dim, dtype):
    """The attention the twins run for ``backend`` ("auto", "cudnn" or "xla"): "manual"
    (einsum, softmax, nnx.Dropout) with active dropout, else the ``implementation`` of
    ``jax.nn.dot_product_attention``; "auto" picks cuDNN where it applies (a GPU, fp16 or
    bf16, head_dim a multiple of 8 up to 128, both lengths multiples of 64), else XLA."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if dropout_active:
        return "manual"
    if backend == "auto":
        ok = (jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
              and head_dim % 8 == 0 and head_dim <= 128 and q_len % 64 == 0 and k_len % 64 == 0)
        return "cudnn" if ok else "xla"
    return backend


class MultiHeadAttention(nnx.Module):
    """Fused-QKV (self) or Q + KV (cross) attention; jax.nn.dot_product_attention without
    dropout, einsum + softmax + nnx.Dropout with it."""

    def __init__(self, hidden_size, num_heads, *, self_attention=True, attn_dropout=0.0,
                 attention_backend="auto", deterministic=None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=nnx.initializers.lecun_normal(), rngs):
        if attention_backend == "fused":
            attention_backend = "xla"
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = hidden_size // num_heads
        self.self_attention, self.attention_backend = self_attention, attention_backend
        self.attn_dropout, self.deterministic, self.dtype = attn_dropout, deterministic, dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        if self_attention:
            self.qkv = nnx.Linear(hidden_size, 3 * hidden_size, **kw)
        else:
            self.q = nnx.Linear(hidden_size, hidden_size, **kw)
            self.kv = nnx.Linear(hidden_size, 2 * hidden_size, **kw)
        self.out = nnx.Linear(hidden_size, hidden_size, **kw)
        self.drop = nnx.Dropout(attn_dropout, deterministic=deterministic, rngs=rngs)

    def __call__(self, x, memory=None, *, padding_mask=None, causal=False, kv=None,
                 deterministic=None):
        heads = lambda t, p: t.reshape(*t.shape[:-1], p, self.num_heads, self.head_dim)
        if self.self_attention:
            qkv = heads(self.qkv(x), 3)
            q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        else:
            q = heads(self.q(x), 1)[..., 0, :, :]
            kv = heads(self.kv(memory) if kv is None else kv, 2)
            k, v = kv[..., 0, :, :], kv[..., 1, :, :]
        det = deterministic if deterministic is not None else self.deterministic
        active = (not det) and self.attn_dropout > 0
        impl = attention_implementation(self.attention_backend, active, q.shape[1], k.shape[1], self.head_dim, q.dtype)
        mask = None if padding_mask is None else padding_mask[:, None, None, :].astype(bool)
        if impl != "manual":
            ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                               implementation=impl)
        else:
            s = jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32) / math.sqrt(self.head_dim)
            if mask is not None:
                s = jnp.where(mask, s, -1e30)
            if causal:
                tq, tk = s.shape[-2:]
                s = jnp.where(jnp.arange(tq)[:, None] + tk - tq >= jnp.arange(tk), s, -1e30)
            p = self.drop(jax.nn.softmax(s, axis=-1), deterministic=det).astype(v.dtype)
            ctx = jnp.einsum("bnts,bsnh->btnh", p, v)
        return self.out(ctx.reshape(*ctx.shape[:-2], self.hidden_size))


class _Block(nnx.Module):
    _cross = False

    def __init__(self, hidden_size, ffn_size, num_heads, *, pre_layer_norm=True,
                 activation="relu", attn_dropout=0.0, activation_dropout=0.0,
                 hidden_dropout=0.0, epsilon=EPSILON, attention_backend="auto",
                 deterministic=None, dtype=None, param_dtype=jnp.float32, rngs):
        self.hidden_size, self.pre_layer_norm, self.activation = hidden_size, pre_layer_norm, activation
        self.deterministic = deterministic
        ln = dict(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        attn = dict(attn_dropout=attn_dropout, attention_backend=attention_backend,
                    deterministic=deterministic, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        lin = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn_ln = LayerNorm(hidden_size, **ln)
        self.attn = MultiHeadAttention(hidden_size, num_heads, self_attention=True, **attn)
        if self._cross:
            self.cross_ln = LayerNorm(hidden_size, **ln)
            self.cross_attn = MultiHeadAttention(hidden_size, num_heads, self_attention=False, **attn)
        self.ffn_ln = LayerNorm(hidden_size, **ln)
        self.fc1 = nnx.Linear(hidden_size, ffn_size, **lin)
        self.fc2 = nnx.Linear(ffn_size, hidden_size, **lin)
        self.act_drop = nnx.Dropout(activation_dropout, deterministic=deterministic, rngs=rngs)
        self.hidden_drop = nnx.Dropout(hidden_dropout, deterministic=deterministic, rngs=rngs)

    def _residual(self, sub, x, ln, det):
        h = ln(x) if self.pre_layer_norm else x
        y = sub(h)
        out = x.astype(y.dtype) + self.hidden_drop(y, deterministic=det)
        return out if self.pre_layer_norm else ln(out)

    def _ffn(self, h, det):
        y = self.fc1(h)
        y = ACTIVATION_FNS[self.activation](y.astype(jnp.float32)).astype(y.dtype)
        y = self.act_drop(y, deterministic=det)
        return self.fc2(y)


class TransformerEncoderLayer(_Block):
    """Plain twin of jax_ls2.nn.TransformerEncoderLayer."""

    def __call__(self, x, *, padding_mask=None, causal=False, deterministic=None):
        det = deterministic if deterministic is not None else self.deterministic
        x = self._residual(lambda h: self.attn(h, padding_mask=padding_mask, causal=causal,
                                               deterministic=det), x, self.attn_ln, det)
        return self._residual(lambda h: self._ffn(h, det), x, self.ffn_ln, det)


class TransformerDecoderLayer(_Block):
    """Plain twin of jax_ls2.nn.TransformerDecoderLayer."""
    _cross = True

    def __call__(self, x, memory=None, *, cross_kv=None, padding_mask=None,
                 memory_padding_mask=None, deterministic=None):
        det = deterministic if deterministic is not None else self.deterministic
        x = self._residual(lambda h: self.attn(h, padding_mask=padding_mask, causal=True,
                                               deterministic=det), x, self.attn_ln, det)
        x = self._residual(lambda h: self.cross_attn(h, memory, kv=cross_kv,
                                                     padding_mask=memory_padding_mask,
                                                     deterministic=det), x, self.cross_ln, det)
        return self._residual(lambda h: self._ffn(h, det), x, self.ffn_ln, det)


_TE_ALIASES = {"ffn_hidden_size": "ffn_size", "num_attention_heads": "num_heads",
               "attention_dropout": "attn_dropout", "layernorm_epsilon": "epsilon"}


def TransformerLayer(hidden_size, ffn_size=None, num_heads=None, *, layer_type="encoder", rngs,
                     **options):
    """Twin of jax_ls2.nn.TransformerLayer (Transformer Engine's defaults and aliases)."""
    cls = {"encoder": TransformerEncoderLayer, "decoder": TransformerDecoderLayer}[layer_type]
    named = dict(options, **{k: v for k, v in (("ffn_size", ffn_size), ("num_heads", num_heads))
                             if v is not None})
    for alias, name in _TE_ALIASES.items():
        if alias in named:
            if name in named:
                raise TypeError(f"TransformerLayer: got both {name}= and its alias {alias}=")
            named[name] = named.pop(alias)
    named.setdefault("hidden_dropout", 0.1)
    named.setdefault("attn_dropout", 0.1)
    named.setdefault("activation", "gelu")
    named.setdefault("activation_dropout", named["hidden_dropout"])
    return cls(hidden_size, named.pop("ffn_size"), named.pop("num_heads"), rngs=rngs, **named)
