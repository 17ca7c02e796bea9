"""`DecoderLayer`: the pre-norm decoder block of LLaMA, Mistral and Gemma over the fused ops.

``x + attn(norm(x))`` then ``+ mlp(norm(.))``, no biases anywhere: RMSNorm (or
LayerNorm), rotary position embeddings on q and k (`jax_ls2.ops.rotary`), grouped-query
causal attention (cuDNN's fused attention where it applies, else
`jax_ls2.ops.flash_attention`, which also takes segment ids for packed sequences and
dropout), and a gated MLP (`jax_ls2.ops.gated_act_dropout` on one ``[gate | up]``
GEMM). The residual add before the MLP's norm is fused into that norm (``residual=``).

The families as settings (the rest as their checkpoints say)::

    LLaMA 2/3:  norm="rms", activation="swiglu", num_kv_heads < num_heads (GQA)
    Mistral:    as LLaMA (its sliding window is not modelled: exact up to the window length)
    Gemma:      norm="rms", unit_offset=True, activation="geglu_tanh", head_dim set apart
                from hidden_size // num_heads; the model scales its embeddings by sqrt(hidden)

Parameters (``nnx.Linear`` without bias, kernels (in, out)): ``attn_norm`` and
``mlp_norm`` (`RMSNorm` ``scale``, or `LayerNorm` ``scale``/``bias``), ``qkv`` (hidden,
(heads + 2 * num_kv_heads) * head_dim) laid out [q | k | v] heads-major, ``out`` (heads *
head_dim, hidden), ``gate_up`` (hidden, 2 * ffn) laid out [gate | up], ``down`` (ffn,
hidden). The plain-Flax twin ``flax_models.plain.DecoderLayer`` has the same tree.

Decoding: ``init_cache(batch, max_len, dtype)`` gives the layer a `KVCache`; then
``__call__(x, decode=True)`` appends x's keys and values to it and attends the cache by
one rule (`jax_ls2.nn.kv_cache.visible`): each token sees every cached position and the
earlier tokens of its own call. So a prompt may be prefilled in one call or in chunks,
and generation goes on one token per call. A call longer than ``max_len`` raises; a
call running past the end of the cache returns NaN (see `jax_ls2.nn.kv_cache.write`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ls2.nn import kv_cache
from jax_ls2.nn._common import (check_hidden, check_positive_int, check_rate, draw_key, resolve_deterministic,
                                rng_stream)
from jax_ls2.nn.config import EPSILON
from jax_ls2.nn.attention import cudnn_applies
from jax_ls2.nn.layers import LayerNorm
from jax_ls2.nn.rms_norm import RMSNorm
from jax_ls2.ops import dropout, flash_attention, gated_act_dropout, rotary
from jax_ls2.ops.gated_act import GATED_ACTIVATIONS
from jax_ls2.ops.rms_norm import RMS_EPSILON
from jax_ls2.ops.rotary import RotaryScaling

NORMS = ("rms", "layer")
ATTENTION_BACKENDS = ("auto", "flash", "cudnn")
# Hugging Face's LLaMA initializer_range: every projection kernel ~ N(0, 0.02).
INIT_STDDEV = 0.02


class DecoderLayer(nnx.Module):
    """Pre-norm decoder block (see the module docstring).

    Args:
      hidden_size, ffn_size, num_heads: model width, gated-MLP width (the ``up`` width),
        query heads.
      num_kv_heads: key/value heads (divides num_heads; default num_heads).
      head_dim: per-head width (default hidden_size // num_heads; Gemma sets its own).
      norm: "rms" (`RMSNorm`) or "layer" (`LayerNorm`); epsilon: its epsilon (default
        1e-6 for "rms", 1e-5 for "layer"); unit_offset: RMSNorm weight ``1 + scale``.
      activation: "swiglu", "geglu" or "geglu_tanh" (see `ops.gated_act_dropout`).
      rope_theta, rotary_dim, rope_scaling (a `jax_ls2.ops.RotaryScaling` or None),
        interleaved: the rotary embedding (see `ops.rotary`).
      attn_dropout, activation_dropout, hidden_dropout: dropout on the attention
        probabilities, after the gated activation, and on each branch before its
        residual add.
      attention_backend: "auto" (cuDNN through ``jax.nn.dot_product_attention`` when it
        takes the call: a GPU, fp16/bf16, head_dim a multiple of 8 up to 128, length a
        multiple of 64, no attention dropout, no segment ids, not decoding; XLA's
        attention over the masked cache when decoding; otherwise "flash"), "flash" (`jax_ls2.ops.flash_attention` always) or "cudnn" (an error
        where cuDNN does not take the call).
      deterministic: dropout default (``model.train()`` / ``model.eval()`` set it).
      dtype: compute dtype (None: promote inputs and params); param_dtype: storage dtype.
      kernel_init: the projections' initializer (N(0, 0.02) as Hugging Face's LLaMA).
      rngs: ``nnx.Rngs`` (params from ``params``, dropout keys from ``dropout``).

    ``__call__(x, *, positions=None, segment_ids=None, deterministic=None, rngs=None,
    decode=False)``: x (batch, len, hidden) -> same shape, in the compute dtype;
    positions int (batch, len) (default 0..len-1, or after the cached ones when
    decoding); segment_ids int (batch, len): packed sequences, a token attends only
    earlier tokens of its own segment (give positions restarting at each segment too).
    """

    def __init__(self, hidden_size: int, ffn_size: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, norm: str = "rms", activation: str = "swiglu",
                 epsilon: float | None = None, unit_offset: bool = False, rope_theta: float = 10000.0,
                 rotary_dim: int | None = None, rope_scaling: RotaryScaling | None = None,
                 interleaved: bool = False, attn_dropout: float = 0.0, activation_dropout: float = 0.0,
                 hidden_dropout: float = 0.0, attention_backend: str = "auto",
                 deterministic: bool | None = None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=nnx.initializers.normal(INIT_STDDEV), rngs: nnx.Rngs):
        o = "DecoderLayer"
        for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_heads", num_heads)):
            check_positive_int(o, name, value)
        check_positive_int(o, "num_kv_heads", num_kv_heads, allow_none=True)
        check_positive_int(o, "head_dim", head_dim, allow_none=True)
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{o}: num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"{o}: hidden_size ({hidden_size}) must be a multiple of num_heads "
                                 f"({num_heads}) unless head_dim is given")
            head_dim = hidden_size // num_heads
        if norm not in NORMS:
            raise ValueError(f"{o}: norm must be one of {NORMS}, got {norm!r}")
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"{o}: activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
        if unit_offset and norm != "rms":
            raise ValueError(f"{o}: unit_offset applies to norm='rms', got norm={norm!r}")
        if epsilon is None:
            epsilon = RMS_EPSILON if norm == "rms" else EPSILON
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(f"{o}: epsilon must be a positive float, got {epsilon!r}")
        rd = head_dim if rotary_dim is None else rotary_dim
        if isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2 or rd > head_dim:
            raise ValueError(f"{o}: rotary_dim must be an even int from 2 to head_dim ({head_dim}), got {rotary_dim!r}")
        self.hidden_size, self.ffn_size, self.num_heads = hidden_size, ffn_size, num_heads
        self.num_kv_heads, self.head_dim, self.norm, self.activation = num_kv_heads, head_dim, norm, activation
        self.rope_theta, self.rotary_dim, self.interleaved = float(rope_theta), rd, interleaved
        self.rope_scaling = rope_scaling
        self.attn_dropout = check_rate(o, "attn_dropout", attn_dropout)
        self.activation_dropout = check_rate(o, "activation_dropout", activation_dropout)
        self.hidden_dropout = check_rate(o, "hidden_dropout", hidden_dropout)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"{o}: attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        self.attention_backend = attention_backend
        self.deterministic, self.dtype = deterministic, dtype
        if norm == "rms":
            make_norm = lambda: RMSNorm(hidden_size, epsilon=epsilon, unit_offset=unit_offset, dtype=dtype,
                                        param_dtype=param_dtype)
        else:
            make_norm = lambda: LayerNorm(hidden_size, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype)
        lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.attn_norm = make_norm()
        self.qkv = nnx.Linear(hidden_size, q_size + 2 * kv_size, **lin)
        self.out = nnx.Linear(q_size, hidden_size, **lin)
        self.mlp_norm = make_norm()
        self.gate_up = nnx.Linear(hidden_size, 2 * ffn_size, **lin)
        self.down = nnx.Linear(ffn_size, hidden_size, **lin)
        self.rngs = rng_stream(rngs)
        self.cache_k = self.cache_v = self.cache_index = nnx.data(None)

    def init_cache(self, batch: int, max_len: int, dtype=None):
        """A zeroed `KVCache` for ``batch`` sequences of up to ``max_len`` positions, keys
        and values in ``dtype`` (default: the compute dtype, else the param dtype)."""
        dtype = dtype or self.dtype or self.qkv.kernel.dtype
        self.cache_k, self.cache_v, self.cache_index = kv_cache.new_cache(
            batch, max_len, self.num_kv_heads, self.head_dim, dtype, "DecoderLayer")

    def _keys(self, det, rngs):
        if det or not (self.attn_dropout or self.activation_dropout or self.hidden_dropout):
            return [None] * 4
        key = draw_key("DecoderLayer", self.rngs, rngs)
        return [jax.random.fold_in(key, i) for i in range(4)]

    def _check(self, x, positions, segment_ids, decode):
        o = "DecoderLayer"
        check_hidden(o, x, self.hidden_size)
        if x.ndim != 3:
            raise ValueError(f"{o}: x must have shape (batch, len, {self.hidden_size}), got {tuple(x.shape)}")
        for name, a in (("positions", positions), ("segment_ids", segment_ids)):
            if a is None:
                continue
            if tuple(a.shape) != x.shape[:2] or not jnp.issubdtype(a.dtype, jnp.integer):
                raise ValueError(f"{o}: {name} must be integer of shape {x.shape[:2]}, got {a.dtype}{tuple(a.shape)}")
        if decode:
            if self.cache_k is None:
                raise ValueError(f"{o}: decode=True needs a cache; call init_cache(batch, max_len) first")
            if self.cache_k.shape[0] != x.shape[0]:
                raise ValueError(f"{o}: x has batch {x.shape[0]}, the cache was made for {self.cache_k.shape[0]}")
            if segment_ids is not None:
                raise ValueError(f"{o}: segment_ids do not apply when decoding")

    def _use_cudnn(self, length, dtype, dropout_active, masked) -> bool:
        if self.attention_backend == "flash":
            return False
        applies = not (dropout_active or masked) and cudnn_applies(length, length, self.head_dim, dtype)
        if self.attention_backend == "cudnn" and not applies:
            raise ValueError("DecoderLayer: attention_backend='cudnn' does not take this call (it needs a GPU, "
                             "fp16/bf16, head_dim a multiple of 8 up to 128, a length multiple of 64, no attention "
                             f"dropout, no segment ids, no decoding); got length {length}, head_dim {self.head_dim}, "
                             f"dtype {jnp.dtype(dtype).name}, dropout {dropout_active}, segments/decode {masked}")
        return applies

    def __call__(self, x, *, positions=None, segment_ids=None, deterministic: bool | None = None, rngs=None,
                 decode: bool = False):
        self._check(x, positions, segment_ids, decode)
        det = resolve_deterministic("DecoderLayer", deterministic, self.deterministic)
        k_attn, k_act, k_res1, k_res2 = self._keys(det, rngs)
        b, t, _ = x.shape
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h, x = self.attn_norm(x, return_input=True)
        qkv = self.qkv(h)
        q = qkv[..., :nq * d].reshape(b, t, nq, d)
        k = qkv[..., nq * d:(nq + nkv) * d].reshape(b, t, nkv, d)
        v = qkv[..., (nq + nkv) * d:].reshape(b, t, nkv, d)
        start = self.cache_index[...] if decode else 0
        if positions is None:
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        q, k = rotary(q, k, positions, theta=self.rope_theta, rotary_dim=self.rotary_dim,
                      interleaved=self.interleaved, scaling=self.rope_scaling)
        attn = dict(causal=True, segment_ids=segment_ids)
        if decode:
            k_all, v_all = kv_cache.write(self.cache_k, self.cache_v, start, k, v, "DecoderLayer")
            self.cache_index[...] = start + t
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
            attn = dict(bias=kv_cache.visible_bias(start, t, k.shape[1]))
        dropout_active = not (det or k_attn is None) and self.attn_dropout > 0
        if decode and self.attention_backend == "auto" and not dropout_active:
            ctx = jax.nn.dot_product_attention(q, k, v, mask=kv_cache.visible(start, t, k.shape[1])[None, None],
                                               implementation="xla")
        elif self._use_cudnn(t, q.dtype, dropout_active, segment_ids is not None or decode):
            ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
            ctx = flash_attention(q, k, v, rate=self.attn_dropout, key=k_attn, deterministic=not dropout_active,
                                  **attn)
        if decode:
            ctx = kv_cache.nan_past_end(ctx, start, k.shape[1])
        a = self.out(ctx.reshape(b, t, nq * d))
        a = dropout(a, rate=self.hidden_dropout, key=k_res1, deterministic=det or not self.hidden_dropout)
        h, x = self.mlp_norm(a, residual=x.astype(a.dtype))
        y = gated_act_dropout(self.gate_up(h), activation=self.activation, rate=self.activation_dropout,
                              key=k_act, deterministic=det or not self.activation_dropout)
        y = self.down(y)
        return x + dropout(y, rate=self.hidden_dropout, key=k_res2, deterministic=det or not self.hidden_dropout)
