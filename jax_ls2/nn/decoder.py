"""`DecoderLayer`: the pre-norm decoder block of LLaMA, Mistral and Gemma over the fused ops.

``x + attn(norm(x))`` then ``+ mlp(norm(.))``, no biases anywhere: RMSNorm (or
LayerNorm), rotary position embeddings on q and k (`jax_ls2.ops.rotary`), grouped-query
causal attention (`jax_ls2.nn.MultiHeadAttention`, its backend chosen by
`jax_ls2.nn.backend.select_backend`), and a gated MLP (`jax_ls2.ops.gated_act_dropout` on one ``[gate | up]``
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

from jax_ls2.fp8 import FP8DotMeta
from jax_ls2.nn._common import (FP8Gemm, check_fp8, check_hidden, check_positive_int, check_rate, draw_key,
                                require_tensor_axis, resolve_deterministic)
from jax_ls2.parallel.tensor import ColumnParallelLinear, RowParallelLinear, bound_axis_size
from jax_ls2.nn.attention import MultiHeadAttention
from jax_ls2.nn.config import EPSILON
from jax_ls2.nn.layers import LayerNorm
from jax_ls2.nn.mlp import mlp_forward
from jax_ls2.nn.rms_norm import RMSNorm
from jax_ls2.nn.rope import RotaryConfig
from jax_ls2.ops import dropout
from jax_ls2.ops._normalization import check_epsilon
from jax_ls2.ops.gated_act import GATED_ACTIVATIONS
from jax_ls2.ops.rms_norm import RMS_EPSILON
from jax_ls2.ops.rotary import RotaryScaling

NORMS = ("rms", "layer")
# The backends the decoder layer offers: its packed sequences and grouped-query heads
# run through flash or cuDNN; the explicit-GEMM paths ("fused", "xla") are the
# LightSeq2 layers'.
ATTENTION_BACKENDS = ("auto", "flash", "cudnn")
# Hugging Face's LLaMA initializer_range: every projection kernel ~ N(0, 0.02).
INIT_STDDEV = 0.02


class DecoderLayer(MultiHeadAttention):
    """Pre-norm decoder block (see the module docstring): a `MultiHeadAttention` (its
    ``qkv`` and ``out`` at the layer's top level, the checkpoints' layout) with its
    norms and gated MLP (`jax_ls2.nn.mlp.mlp_forward` over ``gate_up`` and ``down``)
    around it.

    Args:
      hidden_size, ffn_size, num_heads: model width, gated-MLP width (the ``up`` width),
        query heads.
      num_kv_heads: key/value heads (divides num_heads; default num_heads).
      head_dim: per-head width (default hidden_size // num_heads; Gemma sets its own).
      norm: "rms" (`RMSNorm`) or "layer" (`LayerNorm`); epsilon: its epsilon (default
        1e-6 for "rms", 1e-5 for "layer"); unit_offset: RMSNorm weight ``1 + scale``.
      activation: "swiglu", "geglu" or "geglu_tanh" (see `ops.gated_act_dropout`).
      rope_theta, rotary_dim, rope_scaling (a `jax_ls2.ops.RotaryScaling` or None),
        interleaved: the rotary embedding (see `ops.rotary`, `jax_ls2.nn.RotaryConfig`).
      attn_dropout, activation_dropout, hidden_dropout: dropout on the attention
        probabilities, after the gated activation, and on each branch before its
        residual add.
      attention_backend: one of `ATTENTION_BACKENDS`, chosen as every attention's
        (`jax_ls2.nn.backend.select_backend`: "auto" is cuDNN where it takes the call,
        XLA's attention over the masked cache when decoding, flash for grouped-query
        heads or segment ids; "cudnn" raises where cuDNN does not take the call).
      deterministic: dropout default (``model.train()`` / ``model.eval()`` set it).
      dtype: compute dtype (None: promote inputs and params); param_dtype: storage dtype.
      kernel_init: the projections' initializer (N(0, 0.02) as Hugging Face's LLaMA).
      fp8: None or a `jax_ls2.fp8.DelayedScaling`: the four weight GEMMs (qkv, out,
        gate_up, down) through `jax_ls2.fp8.fp8_dot`, metas ``qkv_fp8``, ``out_fp8``,
        ``gate_up_fp8``, ``down_fp8`` (``FP8Meta`` variables, not params);
        fp8_amax_axes: their amax reduction axes inside ``shard_map``.
      sequence_axis, sequence_balance: the sequence split over that mesh axis, attention
        through ring attention (as `MultiHeadAttention`'s; "zigzag" balances the causal
        work).
      tensor_axis, sequence_parallel: Megatron tensor (and sequence) parallelism over
        that mesh axis: the attention's as `MultiHeadAttention`'s (num_kv_heads a
        multiple of its size), ``gate_up`` a `jax_ls2.parallel.ColumnParallelLinear`
        (hidden, (2, ffn)) and ``down`` a `RowParallelLinear`; under
        ``sequence_parallel`` x comes split along the sequence over the tensor axis.
      rngs: ``nnx.Rngs`` (params from ``params``, dropout keys from ``dropout``).

    ``__call__(x, *, positions=None, segment_ids=None, deterministic=None, rngs=None,
    decode=False)``: x (batch, len, hidden) -> same shape, in the compute dtype;
    positions int (batch, len) (default 0..len-1, or after the cached ones when
    decoding); segment_ids int (batch, len): packed sequences, a token attends only
    earlier tokens of its own segment (give positions restarting at each segment too).
    """

    _owner = "DecoderLayer"

    def __init__(self, hidden_size: int, ffn_size: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, norm: str = "rms", activation: str = "swiglu",
                 epsilon: float | None = None, unit_offset: bool = False, rope_theta: float = 10000.0,
                 rotary_dim: int | None = None, rope_scaling: RotaryScaling | None = None,
                 interleaved: bool = False, attn_dropout: float = 0.0, activation_dropout: float = 0.0,
                 hidden_dropout: float = 0.0, attention_backend: str = "auto",
                 deterministic: bool | None = None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=nnx.initializers.normal(INIT_STDDEV), fp8=None,
                 fp8_amax_axes=(), sequence_axis: str | None = None, sequence_balance: str = "none",
                 tensor_axis: str | None = None, sequence_parallel: bool = False, rngs: nnx.Rngs):
        o = self._owner
        for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_heads", num_heads)):
            check_positive_int(o, name, value)
        check_positive_int(o, "num_kv_heads", num_kv_heads, allow_none=True)
        check_positive_int(o, "head_dim", head_dim, allow_none=True)
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"{o}: hidden_size ({hidden_size}) must be a multiple of num_heads "
                             f"({num_heads}) unless head_dim is given")
        if norm not in NORMS:
            raise ValueError(f"{o}: norm must be one of {NORMS}, got {norm!r}")
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"{o}: activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
        if unit_offset and norm != "rms":
            raise ValueError(f"{o}: unit_offset applies to norm='rms', got norm={norm!r}")
        if epsilon is None:
            epsilon = RMS_EPSILON if norm == "rms" else EPSILON
        check_epsilon(o, epsilon)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"{o}: attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        rotary = RotaryConfig(theta=float(rope_theta), rotary_dim=rotary_dim, scaling=rope_scaling,
                              interleaved=interleaved)
        super().__init__(hidden_size, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, use_bias=False,
                         rotary=rotary, attn_dropout=attn_dropout, attention_backend=attention_backend,
                         deterministic=deterministic, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                         fp8=fp8, fp8_amax_axes=fp8_amax_axes, sequence_axis=sequence_axis,
                         sequence_balance=sequence_balance, tensor_axis=tensor_axis,
                         sequence_parallel=sequence_parallel, rngs=rngs)
        self.ffn_size, self.norm, self.activation = ffn_size, norm, activation
        self.rope_theta, self.interleaved, self.rope_scaling = float(rope_theta), interleaved, rope_scaling
        self.activation_dropout = check_rate(o, "activation_dropout", activation_dropout)
        self.hidden_dropout = check_rate(o, "hidden_dropout", hidden_dropout)
        if norm == "rms":
            make_norm = lambda: RMSNorm(hidden_size, epsilon=epsilon, unit_offset=unit_offset, dtype=dtype,
                                        param_dtype=param_dtype)
        else:
            make_norm = lambda: LayerNorm(hidden_size, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype)
        lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.attn_norm = make_norm()
        self.mlp_norm = make_norm()
        if tensor_axis is None:
            self.gate_up = nnx.Linear(hidden_size, 2 * ffn_size, **lin)
            self.down = nnx.Linear(ffn_size, hidden_size, **lin)
        else:
            tp = dict(lin, tensor_axis=tensor_axis, sequence_dim=self._seq_dim)
            self.gate_up = ColumnParallelLinear(hidden_size, (2, ffn_size), **tp)
            self.down = RowParallelLinear(ffn_size, hidden_size, **tp)
        if fp8 is not None:
            check_fp8(o, fp8, fp8_amax_axes, {"ffn_size": ffn_size})
            self.gate_up_fp8, self.down_fp8 = FP8DotMeta(fp8), FP8DotMeta(fp8)

    def _shard_spec(self, ndim: int, mlp: bool = False):
        """Inside ``shard_map``, the fused dropout ops' ``shard_spec`` of a (batch, len,
        ..., features) activation: its sequence dim over the sequence axis where that is
        bound, or (not for the MLP's gathered rows) over the tensor axis under sequence
        parallelism, so each device draws its block of the unsplit layer's mask; None
        under ``jit`` (the ops see the sharding)."""
        spec = [None] * ndim
        if self.sequence_axis is not None and bound_axis_size(self.sequence_axis) is not None:
            spec[1] = self.sequence_axis
        elif not mlp and self.sequence_parallel and bound_axis_size(self.tensor_axis) is not None:
            spec[1] = self.tensor_axis
        return tuple(spec) if any(spec) else None

    def _mlp_gemms(self):
        """The `FP8Gemm` s of ``gate_up`` and ``down`` (Nones without fp8)."""
        if self.fp8 is None:
            return None, None
        return tuple(FP8Gemm(m, self.fp8, self.fp8_amax_axes) for m in (self.gate_up_fp8, self.down_fp8))

    def _keys(self, det, rngs):
        if det or not (self.attn_dropout or self.activation_dropout or self.hidden_dropout):
            return [None] * 4
        key = draw_key(self._owner, self.rngs, rngs)
        return [jax.random.fold_in(key, i) for i in range(4)]

    def __call__(self, x, *, positions=None, segment_ids=None, deterministic: bool | None = None, rngs=None,
                 decode: bool = False):
        o = self._owner
        check_hidden(o, x, self.hidden_size)
        if x.ndim != 3:
            raise ValueError(f"{o}: x must have shape (batch, len, {self.hidden_size}), got {tuple(x.shape)}")
        if self.tensor_axis is not None:
            require_tensor_axis(o, self.tensor_axis, {"ffn_size": self.ffn_size})
        det = resolve_deterministic(o, deterministic, self.deterministic)
        k_attn, k_act, k_res1, k_res2 = self._keys(det, rngs)
        h, x = self.attn_norm(x, return_input=True)
        ctx = self.context(h, causal=True, key=k_attn, deterministic=det or k_attn is None, positions=positions,
                           segment_ids=segment_ids, decode=decode)
        a = self.output(ctx)[0]
        spec = self._shard_spec(a.ndim)
        a = dropout(a, rate=self.hidden_dropout, key=k_res1, deterministic=det or not self.hidden_dropout,
                    shard_spec=spec)
        h, x = self.mlp_norm(a, residual=x.astype(a.dtype))
        y = mlp_forward(h, self.gate_up, self.down, activation=self.activation, rate=self.activation_dropout,
                        key=k_act, deterministic=det or not self.activation_dropout, dtype=self.dtype,
                        fp8=self._mlp_gemms(), tensor_axis=self.tensor_axis, sequence_dim=self._seq_dim,
                        shard_spec=lambda ndim, dim: self._shard_spec(ndim, mlp=True))[0]
        return x + dropout(y, rate=self.hidden_dropout, key=k_res2, deterministic=det or not self.hidden_dropout,
                           shard_spec=spec)
