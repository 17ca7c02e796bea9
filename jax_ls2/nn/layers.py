"""LightSeq2-style Transformer layers (Flax NNX) over the jax_ls2 fused ops.

Parameter trees match the plain-Flax twins in ``flax_models.plain`` leaf for leaf:
``attn_ln``/``ffn_ln`` (and ``cross_ln``) are LayerNorms with ``scale``/``bias``,
``attn``/``cross_attn`` are `MultiHeadAttention`, ``fc1``/``fc2`` are ``nnx.Linear``.
With ``fp8`` set, the FP8 metas (``FP8Meta`` variables, not params) sit beside them:
``attn.qkv_fp8`` (one meta for q, k and v), ``attn.out_fp8``, ``cross_attn.q_fp8``, ``cross_attn.kv_fp8``,
``cross_attn.out_fp8``, ``fc1_fp8``, ``fc2_fp8``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2.fp8 import FP8DotMeta
from jax_ls2.fp8.fused import fp8_mlp, layernorm_fp8_dot
from jax_ls2 import ops
from jax_ls2.nn._common import (FP8Gemm, check_fp8_device, check_hidden, check_rate, draw_key, promoted_dtype,
                                require_tensor_axis, resolve_deterministic, rng_stream, split_sequence,
                                tensor_axis_size)
from jax_ls2.parallel.tensor import ColumnParallelLinear, RowParallelLinear, bound_axis_size
from jax_ls2.nn.attention import MultiHeadAttention, grouped_qkv, ungrouped_qkv
from jax_ls2.nn.mlp import mlp_forward
from jax_ls2.nn.config import EPSILON, LayerConfig, layer_config


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis through the fused ``layer_norm`` op.

    Params ``scale`` (ones) and ``bias`` (zeros), shape (num_features,), as ``nnx.LayerNorm``.
    x: (..., num_features); statistics fp32; output in ``dtype`` (None: promote x and params).
    ``epsilon`` defaults to 1e-5 (PyTorch's, LightSeq2's and Transformer Engine's);
    ``nnx.LayerNorm``'s default is 1e-6, so pass ``epsilon=1e-6`` to reproduce a Flax
    model built with the default.
    ``__call__(x, residual=r)`` returns (LN(x + r), x + r); ``__call__(x, return_input=True)``
    returns (LN(x), x) in the compute dtype, for a residual branch whose gradient the
    backward kernel then adds (see ``ops.layer_norm``). ``copies=k`` returns LN(x) k
    times (then x with ``return_input``), one per consumer, whose gradients the backward
    kernel sums.
    """

    def __init__(self, num_features: int, *, epsilon: float = EPSILON, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        del rngs
        self.num_features, self.epsilon, self.dtype = num_features, float(epsilon), dtype
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype))

    def __call__(self, x, residual=None, *, return_input: bool = False, copies: int = 1):
        check_hidden("LayerNorm", x, self.num_features)
        dtype = self.dtype or dtypes.promote_dtype((x, self.scale[...]), dtype=None)[0].dtype
        x = x.astype(dtype)
        if residual is not None:
            residual = residual.astype(dtype)
        return ops.layer_norm(x, self.scale[...], self.bias[...], epsilon=self.epsilon,
                              residual=residual, return_input=return_input, copies=copies)


class Dropout(nnx.Module):
    """Dropout with the jax_ls2 counter-based mask (same mask as the fused kernels)."""

    def __init__(self, rate: float, *, deterministic: bool | None = None,
                 rngs: nnx.Rngs | None = None):
        self.rate = check_rate("Dropout", "rate", rate)
        self.deterministic = deterministic
        self.rngs = rng_stream(rngs)

    def __call__(self, x, *, deterministic: bool | None = None, rngs=None):
        det = resolve_deterministic("Dropout", deterministic, self.deterministic)
        if det or self.rate == 0.0:
            return x
        return ops.dropout(x, rate=self.rate, key=draw_key("Dropout", self.rngs, rngs))


class _Block(nnx.Module):
    """Shared construction and the FFN / residual sub-blocks of the layers."""

    _owner = "TransformerLayer"

    def _setup(self, config: LayerConfig, rngs):
        self.config = config
        self.deterministic = config.deterministic
        c = config
        ln = dict(epsilon=c.epsilon, dtype=c.dtype, param_dtype=c.param_dtype)
        attn = dict(attn_dropout=c.attn_dropout, attention_backend=c.attention_backend,
                    deterministic=c.deterministic, dtype=c.dtype, param_dtype=c.param_dtype,
                    rngs=rngs)
        if c.fp8 is not None:
            check_fp8_device(self._owner)
            attn.update(fp8=c.fp8, fp8_amax_axes=c.fp8_amax_axes)
        if c.tensor_axis is not None:
            attn.update(tensor_axis=c.tensor_axis, sequence_parallel=c.sequence_parallel)
        lin = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        if c.sequence_axis is not None and self._cross:
            raise ValueError(f"{self._owner}: sequence_axis is not supported in layers with cross-attention yet")
        self.attn_ln = LayerNorm(c.hidden_size, **ln)
        self.attn = MultiHeadAttention(c.hidden_size, c.num_heads, self_attention=True,
                                       sequence_axis=c.sequence_axis, sequence_balance=c.sequence_balance, **attn)
        if self._cross:
            self.cross_ln = LayerNorm(c.hidden_size, **ln)
            self.cross_attn = MultiHeadAttention(c.hidden_size, c.num_heads, self_attention=False,
                                                 **attn)
        self.ffn_ln = LayerNorm(c.hidden_size, **ln)
        if c.tensor_axis is None:
            self.fc1 = nnx.Linear(c.hidden_size, c.ffn_size, **lin)
            self.fc2 = nnx.Linear(c.ffn_size, c.hidden_size, **lin)
        else:
            tp = dict(lin, tensor_axis=c.tensor_axis, sequence_dim=self._seq_dim)
            self.fc1 = ColumnParallelLinear(c.hidden_size, c.ffn_size, **tp)
            self.fc2 = RowParallelLinear(c.ffn_size, c.hidden_size, **tp)
        self.rngs = rng_stream(rngs)
        if c.fp8 is not None:
            self.fc1_fp8, self.fc2_fp8 = FP8DotMeta(c.fp8), FP8DotMeta(c.fp8)

    @property
    def _qkv_uses(self) -> int:
        """Copies of the pre-LN LayerNorm output the self-attention projections take: one
        per q, k, v GEMM in bf16, one for FP8 (quantized once for the three GEMMs) and for
        tensor parallelism (one column-parallel GEMM, one all-gather with sequence
        parallelism)."""
        return 3 if self.config.fp8 is None and self.config.tensor_axis is None else 1

    @property
    def _seq_dim(self) -> int | None:
        """The sequence dim of x under Megatron sequence parallelism, else None."""
        return 1 if self.config.sequence_parallel else None

    def _check_tensor_axis(self, x, seq_first: bool):
        c = self.config
        axis = c.sequence_axis
        if axis is not None and bound_axis_size(axis) is None:
            n, length = tensor_axis_size(axis), (x[0] if isinstance(x, tuple) else x).shape[1]
            if n and length % n:
                raise ValueError(f"{self._owner}: the sequence length ({length}) must be a multiple of the size ({n}) "
                                 f"of mesh axis {axis!r} (sequence_axis); pad the sequence or change the mesh")
        if c.tensor_axis is None:
            return
        require_tensor_axis(self._owner, c.tensor_axis, {"num_heads": c.num_heads, "ffn_size": c.ffn_size})
        if seq_first:
            raise ValueError(f"{self._owner}: tensor_axis needs batch-first x (seq_first=False)")
        if c.sequence_parallel:
            split_sequence(x[0] if isinstance(x, tuple) else x, c.tensor_axis)  # checks the length

    def _fc_gemm(self, name: str):
        """The `FP8Gemm` of ``fc1`` or ``fc2``, or None without fp8."""
        c = self.config
        return None if c.fp8 is None else FP8Gemm(getattr(self, f"{name}_fp8"), c.fp8, c.fp8_amax_axes)

    # The layer's hyper-parameters, read from its config.
    hidden_size = property(lambda self: self.config.hidden_size)
    ffn_size = property(lambda self: self.config.ffn_size)
    num_heads = property(lambda self: self.config.num_heads)
    pre_layer_norm = property(lambda self: self.config.pre_layer_norm)
    activation = property(lambda self: self.config.activation)
    activation_dropout = property(lambda self: self.config.activation_dropout)
    hidden_dropout = property(lambda self: self.config.hidden_dropout)
    dtype = property(lambda self: self.config.dtype)

    def _keys(self, deterministic, rngs, n):
        det = resolve_deterministic(self._owner, deterministic, self.deterministic)
        rates = (self.attn.attn_dropout, self.activation_dropout, self.hidden_dropout)
        if det or not any(rates):
            return det, [None] * n
        key = draw_key(self._owner, self.rngs, rngs)
        return det, [jax.random.fold_in(key, i) for i in range(n)]

    def _residual(self, sub, x, ln, det, key, *, uses: int = 1, next_uses: int = 1, seq_first: bool = False,
                  fused=None):
        """Pre-LN: x + drop(sub(LN(x))); post-LN: LN(x + drop(sub(x))). sub returns (y, bias).

        Pre-LN with ``fused`` (FP8: the LayerNorm fused into the sub-block's first GEMM),
        ``fused(x)`` computes LN and sub together and returns (y, bias, x for the residual).

        Each consumer of a LayerNorm output gets its own copy (``copies`` of the op), so
        the backward kernel sums their gradients instead of a separate pass: pre-LN, `sub`
        takes LN(x) `uses` times (a tuple when > 1; the q, k, v projections) and the
        residual branch gets x; post-LN, `x` may be a tuple of copies from the previous
        LayerNorm, the inputs of sub then the residual (a pair, or four for the q, k, v
        projections and the residual), and with ``next_uses=k`` this one returns k copies
        for the next.
        """
        if self.pre_layer_norm and fused is not None:
            y, b, x_res = fused(x)
        else:
            if self.pre_layer_norm:
                *hs, x_res = ln(x, return_input=True, copies=uses)
            else:
                *hs, x_res = x if isinstance(x, tuple) else (x, x)
            h = tuple(hs) if len(hs) > 1 else hs[0]
            y, b = sub(h)
        out = self._bias_dropout_residual(y, b, x_res.astype(y.dtype), det, key, seq_first)
        return out if self.pre_layer_norm else ln(out, copies=next_uses)

    def _bias_dropout_residual(self, y, b, residual, det, key, seq_first):
        """``residual + dropout(y + b)`` through the fused op; its mask is numbered by
        global coordinates, so under sequence parallelism the sequence parts keep their
        shards and draw the unsplit layer's mask."""
        spec = self._shard_spec(y.ndim, 1 if self.config.sequence_parallel else None)
        return ops.bias_dropout_residual(y, b, residual, rate=self.hidden_dropout, key=key, deterministic=det,
                                         seq_first=seq_first, shard_spec=spec)

    def _shard_spec(self, ndim: int, dim: int | None):
        """Inside ``shard_map``, the ``shard_spec`` of a (batch, len, ..., features)
        activation: its sequence dim over the sequence axis when that axis is bound, and
        ``dim`` (None: none) over the tensor axis when that one is, so the fused ops draw
        this device's block of the unsplit mask; None when neither is (under ``jit`` the
        ops see the sharding). A batch split over other manual axes draws each part's
        mask as a whole array's, unless an enclosing `jax_ls2._random.batch_rows_from`
        says where its rows lie (as the pipeline does)."""
        c = self.config
        spec = [None] * ndim
        if c.sequence_axis is not None and bound_axis_size(c.sequence_axis) is not None:
            spec[1] = c.sequence_axis
        if c.tensor_axis is not None and dim is not None and bound_axis_size(c.tensor_axis) is not None:
            spec[dim] = c.tensor_axis
        return tuple(spec) if any(spec) else None

    def _check_copies(self, x, output_copies):
        """x, checked: an array, or (post-LN) the four copies a previous layer returned
        with ``output_copies=4``."""
        o = self._owner
        if isinstance(output_copies, bool) or output_copies not in (1, 4):
            raise ValueError(f"{o}: output_copies must be 1 or 4, got {output_copies!r}")
        if output_copies > 1 and self.pre_layer_norm:
            raise ValueError(f"{o}: output_copies applies to post-LN layers (pre_layer_norm=False)")
        if isinstance(x, (tuple, list)):
            if self.pre_layer_norm or len(x) != 4:
                raise ValueError(f"{o}: x may be a tuple only of the 4 copies a post-LN layer returns "
                                 f"with output_copies=4, got {len(x)} arrays"
                                 + (" for a pre-LN layer" if self.pre_layer_norm else ""))
            for i, xi in enumerate(x):
                check_hidden(o, xi, self.hidden_size, f"x[{i}]")
                if xi.shape != x[0].shape:
                    raise ValueError(f"{o}: the copies in x must share one shape, got "
                                     f"{[tuple(a.shape) for a in x]}")
            return tuple(x)
        check_hidden(o, x, self.hidden_size)
        return x

    def _fp8_fusable_ffn(self, det) -> bool:
        """Whether the FFN runs as one `fp8_mlp` (FP8, no active activation dropout)."""
        return self.config.fp8 is not None and (det or self.activation_dropout == 0.0)

    def _fp8_mlp(self, h, ln=None):
        """The FFN as `jax_ls2.fp8.fused.fp8_mlp` (with the pre-LN LayerNorm ``ln``):
        (y, fc2 bias, x for the residual or None)."""
        c = self.config
        w1, b1, w2, b2 = (a[...] for a in (self.fc1.kernel, self.fc1.bias, self.fc2.kernel, self.fc2.bias))
        kw = dict(activation=self.activation, dtype=promoted_dtype(self.dtype, h, w1), amax_axes=c.fp8_amax_axes)
        if ln is None:
            y, x_res = fp8_mlp(h, w1, b1, w2, self.fc1_fp8, self.fc2_fp8, c.fp8, **kw), None
        else:
            h, params = self._ln_input(ln, h)
            y, x_res = fp8_mlp(h, w1, b1, w2, self.fc1_fp8, self.fc2_fp8, c.fp8, ln=params, epsilon=ln.epsilon,
                               return_input=True, **kw)
        return y, b2.astype(promoted_dtype(self.dtype, y, w2, b2)), x_res

    @staticmethod
    def _ln_input(ln, x):
        """x in the LayerNorm module's compute dtype, and its (scale, bias)."""
        dtype = ln.dtype or dtypes.promote_dtype((x, ln.scale[...]), dtype=None)[0].dtype
        return x.astype(dtype), (ln.scale[...], ln.bias[...])

    def _ffn_fused(self, det):
        """Pre-LN FP8 FFN: LayerNorm, fc1, activation and fc2 as one op (see `_residual`)."""
        if not (self.pre_layer_norm and self._fp8_fusable_ffn(det)):
            return None
        return lambda x: self._fp8_mlp(x, ln=self.ffn_ln)

    def _attn_fused(self, mha, det, key, **kw):
        """Pre-LN FP8 self-attention: the LayerNorm writes FP8 for the q, k, v GEMMs (one op),
        then attention and the output GEMM (see `_residual`)."""
        c = self.config
        if c.fp8 is None or not self.pre_layer_norm:
            return None

        def fused(x):
            h, (gamma, beta) = self._ln_input(self.attn_ln, x)
            kernel, bias = mha.qkv.kernel[...], mha.qkv.bias[...]
            ys, x_res = layernorm_fp8_dot(h, gamma, beta, kernel, mha.qkv_fp8, c.fp8, epsilon=self.attn_ln.epsilon,
                                          dtype=promoted_dtype(self.dtype, h, kernel), amax_axes=c.fp8_amax_axes,
                                          return_input=True, splits=3)
            ctx = mha.context(h, qkv=mha.add_bias_parts(ys, bias), key=key, deterministic=det, **kw)
            out, b = mha.output(ctx)
            return out, b, x_res
        return fused

    def _ffn(self, h, det, key, seq_first):
        """The FFN as `jax_ls2.nn.mlp.mlp_forward` (Megatron's with ``tensor_axis``: the
        fused bias + activation + dropout on the FFN features split over the tensor axis,
        the unsplit layer's mask, nothing gathered), or one `fp8_mlp` (FP8 without
        activation dropout). Returns (y, fc2 bias) as `matmul`."""
        c = self.config
        if c.tensor_axis is None and self._fp8_fusable_ffn(det):
            return self._fp8_mlp(h)[:2]
        return mlp_forward(h, self.fc1, self.fc2, activation=self.activation, rate=self.activation_dropout, key=key,
                           deterministic=det, dtype=self.dtype, fp8=(self._fc_gemm("fc1"), self._fc_gemm("fc2")),
                           tensor_axis=c.tensor_axis, sequence_dim=self._seq_dim, shard_spec=self._shard_spec,
                           seq_first=seq_first)

    def _attn_sub(self, mha, det, key, **kw):
        def sub(h):
            ctx = mha.context(h, key=key, deterministic=det, **kw)
            return mha.output(ctx)
        return sub


_DOC_ARGS = """
    Args:
      hidden_size: an int, with ``ffn_size`` and ``num_heads``; or a `LayerConfig`
        (then leave ``ffn_size`` and ``num_heads`` out).
      ffn_size, num_heads: FFN width and attention heads.
      **options: the other `LayerConfig` fields (``pre_layer_norm``, ``activation``,
        ``attn_dropout``, ``activation_dropout``, ``hidden_dropout``, ``epsilon``,
        ``attention_backend``, ``deterministic``, ``dtype``, ``param_dtype``, ``fp8``,
        ``fp8_amax_axes``, ``tensor_axis``, ``sequence_parallel``); with a `LayerConfig`,
        they override its fields.
      tensor_axis, sequence_parallel: Megatron tensor and sequence parallelism over that
        mesh axis (see `LayerConfig`): ``attn`` as `MultiHeadAttention`'s, ``fc1`` a
        `jax_ls2.parallel.ColumnParallelLinear`, ``fc2`` a `RowParallelLinear`.
      fp8: None (default) or a `jax_ls2.fp8.DelayedScaling`: every weight GEMM (q, k, v,
        attention output, fc1, fc2; cross-attention's q, kv and output) runs in FP8
        through `jax_ls2.fp8` (`fp8_dot`; pre-LN LayerNorms fused into the q, k, v and fc1
        GEMMs, the FFN one `fp8_mlp` without activation dropout), one meta per weight
        (q, k and v share the qkv kernel's; ``FP8Meta`` variables, not params: the
        parameter tree is the bf16 layer's); attention and biases stay in
        ``dtype``. Train with the meta updated every step: differentiate with
        ``nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta))`` and pass the gradients to
        ``jax_ls2.fp8.update_nnx(..., fp8=recipe)`` or `jax_ls2.fp8.apply_meta_updates`.
        hidden_size and ffn_size must be multiples of 16; a CUDA GPU needs sm_89+.
      rngs: ``nnx.Rngs``; params from ``params``, dropout keys from ``dropout``.

    The layer keeps its `LayerConfig` as ``config``.
"""


class TransformerEncoderLayer(_Block):
    __doc__ = """Encoder layer: self-attention + FFN, each with a residual.

    ``__call__(x, *, padding_mask=None, causal=False, deterministic=None, rngs=None,
    output_copies=1, seq_first=False, decode=False)``: x (batch, len, hidden) -> same
    shape, or (len,
    batch, hidden) with ``seq_first`` (the layout whose attention GEMMs need no
    transposes when attention is not one fused call; `TransformerEncoder` picks it);
    padding_mask bool (batch, len), True = token. Post-LN, ``output_copies=4`` returns the closing LayerNorm's
    output four times, which the next post-LN layer takes as its x (the inputs of its q,
    k, v projections and its residual): the backward kernel of that LayerNorm then sums
    the four gradients instead of a separate pass. ``decode=True``: self-attention on
    ``attn``'s KV cache (``attn.init_cache(batch, max_len)`` first; see
    `MultiHeadAttention`), as a causal language model decodes.
    """ + _DOC_ARGS
    _owner = "TransformerEncoderLayer"
    _cross = False

    def __init__(self, hidden_size: int | LayerConfig, ffn_size: int | None = None,
                 num_heads: int | None = None, *, rngs: nnx.Rngs, **options):
        self._setup(layer_config(self._owner, hidden_size, ffn_size, num_heads, options), rngs)

    def __call__(self, x, *, padding_mask=None, causal: bool = False,
                 deterministic: bool | None = None, rngs=None, output_copies: int = 1,
                 seq_first: bool = False, decode: bool = False):
        x = self._check_copies(x, output_copies)
        self._check_tensor_axis(x, seq_first)
        det, (k_attn, k_r1, k_act, k_r2) = self._keys(deterministic, rngs, 4)
        attn_kw = dict(padding_mask=padding_mask, causal=causal, seq_first=seq_first)
        if decode:
            attn_kw["decode"] = True
        x = self._residual(self._attn_sub(self.attn, det, k_attn, **attn_kw), x, self.attn_ln, det, k_r1,
                           uses=self._qkv_uses, next_uses=2, seq_first=seq_first,
                           fused=self._attn_fused(self.attn, det, k_attn, **attn_kw))
        return self._residual(lambda h: self._ffn(h, det, k_act, seq_first), x, self.ffn_ln, det, k_r2,
                              next_uses=output_copies, seq_first=seq_first, fused=self._ffn_fused(det))


class TransformerDecoderLayer(_Block):
    __doc__ = """Decoder layer: causal self-attention, cross-attention, FFN.

    ``__call__(x, memory=None, *, cross_kv=None, padding_mask=None, memory_padding_mask=None,
    deterministic=None, rngs=None, output_copies=1, seq_first=False)``: x (batch, tgt_len,
    hidden); memory (batch, src_len, hidden) or cross_kv, its precomputed
    ``cross_attn.kv`` projection (batch, src_len, 2*hidden), as `TransformerDecoder`
    computes for all layers in one GEMM. With
    ``seq_first`` x, memory, cross_kv and the result are (len, batch, ...).
    ``output_copies=4`` (post-LN): as in `TransformerEncoderLayer`.
    """ + _DOC_ARGS
    _owner = "TransformerDecoderLayer"
    _cross = True

    def __init__(self, hidden_size: int | LayerConfig, ffn_size: int | None = None,
                 num_heads: int | None = None, *, rngs: nnx.Rngs, **options):
        self._setup(layer_config(self._owner, hidden_size, ffn_size, num_heads, options), rngs)

    def __call__(self, x, memory=None, *, cross_kv=None, padding_mask=None,
                 memory_padding_mask=None, deterministic: bool | None = None, rngs=None,
                 output_copies: int = 1, seq_first: bool = False):
        x = self._check_copies(x, output_copies)
        self._check_tensor_axis(x, seq_first)
        det, keys = self._keys(deterministic, rngs, 6)
        attn_kw = dict(padding_mask=padding_mask, causal=True, seq_first=seq_first)
        x = self._residual(self._attn_sub(self.attn, det, keys[0], **attn_kw), x, self.attn_ln, det, keys[1],
                           uses=self._qkv_uses, next_uses=2, seq_first=seq_first,
                           fused=self._attn_fused(self.attn, det, keys[0], **attn_kw))
        x = self._residual(self._attn_sub(self.cross_attn, det, keys[2], memory=memory,
                                          kv=cross_kv, padding_mask=memory_padding_mask,
                                          seq_first=seq_first),
                           x, self.cross_ln, det, keys[3], next_uses=2, seq_first=seq_first)
        return self._residual(lambda h: self._ffn(h, det, keys[4], seq_first), x, self.ffn_ln, det, keys[5],
                              next_uses=output_copies, seq_first=seq_first, fused=self._ffn_fused(det))


# Transformer Engine's names of LayerConfig fields, accepted by `TransformerLayer`.
TE_ALIASES = {"ffn_hidden_size": "ffn_size", "num_attention_heads": "num_heads",
              "attention_dropout": "attn_dropout", "layernorm_epsilon": "epsilon"}


def TransformerLayer(hidden_size: int, ffn_size: int | None = None, num_heads: int | None = None, *,
                     layer_type: str = "encoder", rngs: nnx.Rngs, **options):
    """One module for the common Transformer block, with Transformer Engine's defaults.

    ``layer_type="encoder"`` gives a `TransformerEncoderLayer` (pass ``causal=True`` at call
    time for a decoder-only/GPT block), ``"decoder"`` a `TransformerDecoderLayer`. The
    arguments are those of the layers (`LayerConfig` fields) with Transformer Engine's
    defaults: ``hidden_dropout=0.1``, ``attn_dropout=0.1``, ``activation="gelu"``, and
    ``activation_dropout`` equal to ``hidden_dropout`` unless given (a `LayerConfig`
    given as ``hidden_size`` keeps its own values).

    Transformer Engine's names are accepted as aliases: ``ffn_hidden_size`` for
    ``ffn_size``, ``num_attention_heads`` for ``num_heads``, ``attention_dropout`` for
    ``attn_dropout`` and ``layernorm_epsilon`` for ``epsilon``. Giving a name and its
    alias together raises TypeError. ``fp8=jax_ls2.fp8.DelayedScaling(...)`` runs the
    layer's weight GEMMs in FP8, as in `TransformerEncoderLayer`.
    """
    owner = "TransformerLayer"
    kinds = {"encoder": TransformerEncoderLayer, "decoder": TransformerDecoderLayer}
    if layer_type not in kinds:
        raise ValueError(f"{owner}: layer_type must be 'encoder' or 'decoder', got {layer_type!r}")
    named = dict(options, **{k: v for k, v in (("ffn_size", ffn_size), ("num_heads", num_heads))
                             if v is not None})
    for alias, name in TE_ALIASES.items():
        if alias in named:
            if name in named:
                raise TypeError(f"{owner}: got both {name}= and its alias {alias}=; pass one")
            named[name] = named.pop(alias)
    if not isinstance(hidden_size, LayerConfig):
        named.setdefault("hidden_dropout", 0.1)
        named.setdefault("attn_dropout", 0.1)
        named.setdefault("activation", "gelu")
        named.setdefault("activation_dropout", named["hidden_dropout"])
    config = layer_config(owner, hidden_size, named.pop("ffn_size", None),
                          named.pop("num_heads", None), named)
    return kinds[layer_type](config, rngs=rngs)


def tensor_parallel_state(state, like):
    """``state`` (a module's ``nnx.State``) with each leaf reshaped to ``like``'s leaf at the
    same path: an unsplit model's parameters in the layout of the same model built with
    ``tensor_axis`` (``like``: its state; the fused projections' ``(hidden, parts *
    hidden)`` kernels become ``(hidden, parts, hidden)``, a grouped-query ``qkv`` its
    grouped layout, see `jax_ls2.nn.attention.grouped_qkv`), or back. Values are unchanged."""
    def groups(tree):
        return {path: v.get_metadata()["qkv_groups"] for path, v in nnx.to_flat_state(tree)
                if isinstance(v, nnx.Variable) and "qkv_groups" in v.get_metadata()}
    to_split, from_split = groups(like), groups(state)

    def convert(path, a, b):
        key = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        if key in to_split and key not in from_split:
            return grouped_qkv(a, to_split[key])
        if key in from_split and key not in to_split:
            return ungrouped_qkv(a, from_split[key])
        return a.reshape(b.shape)
    values = jax.tree_util.tree_map_with_path(convert, nnx.to_pure_dict(state), nnx.to_pure_dict(like))
    out = jax.tree.map(lambda a: a, like)
    nnx.replace_by_pure_dict(out, values)
    return out
