"""Multi-head attention for every layer family: multi-head or grouped-query heads,
optional biases and rotary embeddings, padding masks, packed sequences (segment ids and
positions), a KV cache for decoding, Megatron tensor parallelism, FP8 projections and the
sequence axis through ring attention. The backend is chosen by
`jax_ls2.nn.backend.select_backend` (its docstring holds the table of ``"auto"``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2.fp8 import FP8DotMeta
from jax_ls2 import ops
from jax_ls2.nn import kv_cache
from jax.sharding import PartitionSpec as P

from jax_ls2.nn._common import (FP8Gemm, check_fp8, check_fp8_device, check_heads, check_hidden, check_rate, draw_key,
                                check_sequence_axis, check_sequence_balance, check_tensor_parallel, matmul,
                                promoted_dtype, require_tensor_axis, resolve_deterministic, rng_stream,
                                tensor_axis_size)
from jax_ls2.nn.backend import BACKENDS, cudnn_applies, explicit_gemm_path, select_backend
from jax_ls2.nn.rope import RotaryConfig
from jax_ls2.ops import rotary as apply_rotary
from jax_ls2.parallel.ring_attention import from_zigzag_chunks, ring_attention, to_zigzag_chunks
from jax_ls2.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, bound_axis_size,
                                     column_parallel_linear, row_parallel_linear)

__all__ = ["BACKENDS", "MultiHeadAttention", "RotaryConfig", "attention_core", "cudnn_applies",
           "explicit_gemm_path", "select_backend"]


def grouped_qkv(a, groups):
    """A fused ``[q | k | v]`` kernel (..., (r + 2) * m * d) (or its bias) in the
    tensor-parallel grouped layout (..., r + 2, m * d), ``groups = (r, m, d)``: part j < r
    holds query head g * r + j of each kv group g, then the keys and the values."""
    r, m, d = groups
    lead = a.shape[:-1]
    q = jnp.swapaxes(a[..., :r * m * d].reshape(*lead, m, r, d), -3, -2).reshape(*lead, r, m * d)
    kv = a[..., r * m * d:].reshape(*lead, 2, m * d)
    return jnp.concatenate([q, kv], axis=-2)


def ungrouped_qkv(a, groups):
    """The inverse of `grouped_qkv`: (..., r + 2, m * d) -> (..., (r + 2) * m * d)."""
    r, m, d = groups
    lead = a.shape[:-2]
    q = jnp.swapaxes(a[..., :r, :].reshape(*lead, r, m, d), -3, -2).reshape(*lead, r * m * d)
    return jnp.concatenate([q, a[..., r:, :].reshape(*lead, 2 * m * d)], axis=-1)


def _segment_mask(segment_ids):
    """bool (batch, 1, len, len): a token sees the tokens of its own segment."""
    return (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])


def attention_core(q, k, v, *, padding_mask=None, segment_ids=None, cache_mask=None, causal=False, rate=0.0,
                   key=None, deterministic=True, backend="auto", seq_first: bool = False, shard_spec=None,
                   owner: str = "attention"):
    """Scaled dot-product attention.

    q: (batch, q_len, heads, head_dim); k, v: (batch, k_len, kv_heads, head_dim), q's
    dtype, kv_heads dividing heads (grouped-query: query head h reads kv head h //
    (heads // kv_heads)); with ``seq_first`` all three (and the result) are (len, batch,
    heads, head_dim) instead. The attention GEMMs, batched over (batch, heads), read
    sequence-first operands in place (one stride between consecutive (batch, head)
    pairs), where batch-first ones are transposed to (batch, heads, len, head_dim) first
    and back after.
    padding_mask: optional bool (batch, k_len), True = attend. causal: bottom-right aligned.
    segment_ids: optional int (batch, len) (q_len == k_len): a token attends only tokens
    of its own segment (packed sequences). cache_mask: optional bool (q_len, k_len), the
    cache slots each query of a decode call sees (`jax_ls2.nn.kv_cache.visible`).
    Softmax statistics are fp32. Returns q's layout and dtype. The backend is
    `select_backend`'s (``owner`` names the caller in its errors). The dropout mask is
    drawn over the (batch, heads, q_len, k_len) probabilities in either layout; inside
    ``shard_map``, ``shard_spec`` says how those probabilities are split (as
    `jax_ls2.ops.softmax_dropout`'s), so each device draws its block of the whole mask.
    """
    if seq_first:
        tq, b, n, h = q.shape
        tk = k.shape[0]
    else:
        b, tq, n, h = q.shape
        tk = k.shape[1]
    active = (not deterministic) and rate > 0.0
    grouped = k.shape[2] != n
    impl = select_backend(backend, dropout_active=active, q_len=tq, k_len=tk, head_dim=h, dtype=q.dtype,
                          grouped=grouped, segments=segment_ids is not None, cache_mask=cache_mask is not None,
                          owner=owner)
    if impl == "flash":
        if shard_spec is not None and active:
            raise ValueError("attention: attention_backend='flash' with dropout inside shard_map over the heads "
                             "is not supported (its masks are numbered over the whole heads dim); use 'fused'")
        if seq_first:
            q, k, v = (t.swapaxes(0, 1) for t in (q, k, v))
        mask = None if padding_mask is None else padding_mask.astype(bool)
        bias = None if cache_mask is None else jnp.where(cache_mask, 0.0, -jnp.inf).astype(jnp.float32)[None, None]
        out = ops.flash_attention(q, k, v, padding_mask=mask, causal=causal, rate=rate, key=key,
                                  deterministic=not active, **({} if bias is None else {"bias": bias}),
                                  **({} if segment_ids is None else {"segment_ids": segment_ids}))
        return out.swapaxes(0, 1) if seq_first else out
    mask = None if padding_mask is None else padding_mask[:, None, None, :].astype(bool)
    if impl in ("cudnn", "xla") and not active:
        if causal and tq != tk:
            raise ValueError(f"attention: causal needs q_len == k_len here, got {tq} and {tk}")
        for extra in (None if segment_ids is None else _segment_mask(segment_ids),
                      None if cache_mask is None else cache_mask[None, None]):
            if extra is not None:
                mask = extra if mask is None else mask & extra
        if seq_first:
            q, k, v = (t.swapaxes(0, 1) for t in (q, k, v))
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=impl)
        return out.swapaxes(0, 1) if seq_first else out
    if grouped:  # the GEMM path reads one kv head per query head
        axis = 2
        k, v = (jnp.repeat(t, n // t.shape[axis], axis=axis) for t in (k, v))
    lay = "tbnh" if seq_first else "btnh"
    scores = jnp.einsum(f"{lay},{lay.replace('t', 's')}->bnts", q, k)
    softmax = ops.softmax_dropout if impl == "fused" else ops.xla_softmax_dropout
    probs = softmax(scores, scale=1.0 / math.sqrt(h), mask=mask, causal=causal, rate=rate,
                    key=key, deterministic=not active, shard_spec=shard_spec if active else None)
    return jnp.einsum(f"bnts,{lay.replace('t', 's')}->{lay}", probs.astype(v.dtype), v)


class MultiHeadAttention(nnx.Module):
    """Multi-head (or grouped-query) attention with a fused QKV projection (self) or Q +
    fused KV (cross).

    Parameters (d = head_dim, n = num_heads, m = num_kv_heads): self-attention ``qkv``
    (hidden, (n + 2m) * d) laid out [q | k | v], each heads-major; cross-attention ``q``
    (hidden, n * d) and ``kv`` (hidden, 2 * m * d); ``out`` (n * d, hidden). All
    ``nnx.Linear``, with biases unless ``use_bias=False``. With the defaults (m = n, d =
    hidden / n) these are (hidden, 3*hidden), (hidden, hidden), (hidden, 2*hidden) and
    (hidden, hidden).

    With ``fp8`` (a `jax_ls2.fp8.DelayedScaling`) each projection GEMM runs through
    `jax_ls2.fp8.fp8_dot` with its own meta: ``qkv_fp8`` (one `FP8DotMeta` for q, k and
    v: their input and the ``qkv`` kernel are quantized once) or ``q_fp8`` and
    ``kv_fp8``, and ``out_fp8``; their ``FP8Meta`` variables sit beside the params,
    which stay those of the bf16 module. Attention itself stays in the compute dtype.

    Args:
      hidden_size, num_heads: model width and query heads (hidden_size % num_heads == 0
        unless head_dim is given).
      num_kv_heads: key/value heads (divides num_heads; default num_heads).
      head_dim: per-head width (default hidden_size // num_heads).
      use_bias: biases on the projections (LightSeq2, GPT, BERT) or none (LLaMA).
      rotary: None or a `jax_ls2.nn.RotaryConfig`: q and k rotated at their positions
        (`jax_ls2.ops.rotary`) before attention.
      self_attention: True for self-attention (fused QKV), False for cross-attention.
      attn_dropout: attention-probability dropout rate.
      attention_backend: one of `BACKENDS` (see `jax_ls2.nn.backend`).
      dtype: compute dtype (None: promote inputs and params); param_dtype: storage dtype.
      fp8: None or a `jax_ls2.fp8.DelayedScaling` (hidden_size a multiple of 16).
      fp8_amax_axes: mesh axes of the amax reduction inside ``shard_map`` (see
        `jax_ls2.fp8.fp8_dot`'s ``amax_axes``).
      tensor_axis: None, or the mesh axis Megatron tensor parallelism splits the heads
        over (num_kv_heads a multiple of its size): ``qkv`` (``q``, ``kv``) become
        `jax_ls2.parallel.ColumnParallelLinear` s with kernels ``(hidden, 3, hidden)``
        (``(hidden, hidden)``, ``(hidden, 2, hidden)``) and biases ``(3, hidden)``,
        split on the last dim (whole heads per device); with r = num_heads /
        num_kv_heads > 1 the ``qkv`` kernel is ``(hidden, r + 2, m * d)``: part j < r
        holds query head ``g * r + j`` of each kv group g, parts r and r + 1 the keys
        and values (`grouped_qkv`), so each device holds whole groups; ``out`` a
        `jax_ls2.parallel.RowParallelLinear`; each device attends with its heads and
        draws its heads' block of the unsplit layer's attention-dropout mask.
      sequence_parallel: with ``tensor_axis``, x and memory come split along the
        sequence (dim 1) over the tensor axis and are all-gathered before the
        projections; the output projection reduce-scatters along the sequence.
      sequence_balance: with ``sequence_axis``, "none" (default): the ring runs on the
        contiguous chunks the layers hold; "zigzag": under causal attention the chunks
        are exchanged for the zigzag layout before the ring and back after (two
        half-chunk ``ppermute``s each way), so every device does the same attention
        work; the sequence length must then be a multiple of 2 x the axis size.
      sequence_axis: self-attention only: None, or the mesh axis the sequence is split
        over (see `jax_ls2.nn.LayerConfig`): attention then runs as
        `jax_ls2.parallel.ring_attention` (flash blocks, contiguous chunks) inside
        ``shard_map`` over that axis (directly where the axis is already manual), and
        as ``attention_backend="flash"`` where the mesh does not split it. With
        ``tensor_axis`` the ring runs on this device's heads (the tensor axis left to
        the partitioner inside the ``shard_map``).

    Decoding (self-attention): ``init_cache(batch, max_len, dtype)`` gives the module a
    `jax_ls2.nn.KVCache`; then a call with ``decode=True`` appends x's keys and values
    to it and attends the cache by one rule (`jax_ls2.nn.kv_cache.visible`).
    """

    _owner = "MultiHeadAttention"

    def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, use_bias: bool = True, rotary: RotaryConfig | None = None,
                 self_attention: bool = True,
                 attn_dropout: float = 0.0, attention_backend: str = "auto",
                 deterministic: bool | None = None, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), fp8=None, fp8_amax_axes=(),
                 tensor_axis: str | None = None, sequence_parallel: bool = False,
                 sequence_axis: str | None = None, sequence_balance: str = "none", rngs: nnx.Rngs):
        o = self._owner
        self.head_dim = check_heads(o, hidden_size, num_heads) if head_dim is None else head_dim
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{o}: num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if rotary is not None and not isinstance(rotary, RotaryConfig):
            raise TypeError(f"{o}: rotary must be None or a jax_ls2.nn.RotaryConfig, got {type(rotary).__name__}")
        self.rotary_dim = None if rotary is None else rotary.check(o, self.head_dim)
        self.rotary, self.use_bias, self.num_kv_heads = rotary, bool(use_bias), num_kv_heads
        check_sequence_axis(o, sequence_axis, attention_backend, fp8, sequence_parallel)
        if sequence_axis is not None and not self_attention:
            raise ValueError(f"{o}: sequence_axis applies to self-attention only")
        self.sequence_axis = sequence_axis
        self.sequence_balance = check_sequence_balance(o, sequence_balance)
        check_tensor_parallel(o, tensor_axis, sequence_parallel, {"num_heads": num_heads})
        if tensor_axis is not None and fp8 is not None:
            raise ValueError(f"{o}: fp8 with tensor_axis is not supported; leave one of them unset")
        self.tensor_axis, self.sequence_parallel = tensor_axis, sequence_parallel
        if attention_backend not in BACKENDS:
            raise ValueError(f"{o}: attention_backend must be one of {BACKENDS}, "
                             f"got {attention_backend!r}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.self_attention = self_attention
        self.attn_dropout = check_rate(o, "attn_dropout", attn_dropout)
        self.attention_backend = attention_backend
        self.deterministic = deterministic
        self.dtype = dtype
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        kw = dict(use_bias=self.use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        if tensor_axis is not None:
            tp = dict(kw, tensor_axis=tensor_axis, sequence_dim=self._seq_dim)
            r = num_heads // num_kv_heads
            if self_attention:
                self.qkv = ColumnParallelLinear(hidden_size, (r + 2, kv_size), **tp)
                if r > 1:  # the grouped layout, told to tensor_parallel_state
                    for var in (self.qkv.kernel, self.qkv.bias):
                        if var is not None:
                            var.set_metadata(qkv_groups=(r, num_kv_heads, self.head_dim))
            else:
                self.q = ColumnParallelLinear(hidden_size, q_size, **tp)
                self.kv = ColumnParallelLinear(hidden_size, (2, kv_size), **tp)
            self.out = RowParallelLinear(q_size, hidden_size, **tp)
        elif self_attention:
            self.qkv = nnx.Linear(hidden_size, q_size + 2 * kv_size, **kw)
        else:
            self.q = nnx.Linear(hidden_size, q_size, **kw)
            self.kv = nnx.Linear(hidden_size, 2 * kv_size, **kw)
        if tensor_axis is None:
            self.out = nnx.Linear(q_size, hidden_size, **kw)
        self.rngs = rng_stream(rngs)
        self.fp8 = fp8
        self.fp8_amax_axes = check_fp8(o, fp8, fp8_amax_axes, {"hidden_size": hidden_size})
        if fp8 is not None:
            self._setup_fp8(fp8)
        self.cache_k = self.cache_v = self.cache_index = nnx.data(None)

    @property
    def _widths(self) -> tuple:
        """The q, k, v column widths of the fused ``qkv`` kernel."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return q, kv, kv

    @property
    def _part_heads(self) -> tuple:
        return self.num_heads, self.num_kv_heads, self.num_kv_heads

    def init_cache(self, batch: int, max_len: int, dtype=None):
        """A zeroed `KVCache` for ``batch`` sequences of up to ``max_len`` positions, keys
        and values (batch, max_len, num_kv_heads, head_dim) in ``dtype`` (default: the
        compute dtype, else the param dtype)."""
        if not self.self_attention:
            raise ValueError(f"{self._owner}: init_cache applies to self-attention only")
        if self.tensor_axis is not None:
            raise ValueError(f"{self._owner}: init_cache with tensor_axis is not supported (the cache holds every "
                             "head); decode with a module built with tensor_axis=None")
        dtype = dtype or self.dtype or self.qkv.kernel.dtype
        self.cache_k, self.cache_v, self.cache_index = kv_cache.new_cache(
            batch, max_len, self.num_kv_heads, self.head_dim, dtype, self._owner)

    @property
    def _seq_dim(self) -> int | None:
        """The sequence dim of x under Megatron sequence parallelism, else None."""
        return 1 if self.sequence_parallel else None

    def _column(self, x, linear):
        """Tensor parallelism: ``x @ kernel + bias`` of a column-parallel projection,
        (..., hidden) -> (..., [parts,] this device's or the sharded heads * head_dim)."""
        bias = None if linear.bias is None else linear.bias[...]
        return column_parallel_linear(x, linear.kernel[...], bias, axis_name=self.tensor_axis,
                                      sequence_dim=self._seq_dim, dtype=self.dtype)

    def _heads(self, y):
        """(..., heads * head_dim) -> (..., heads, head_dim); heads are this device's inside
        ``shard_map``."""
        return y.reshape(*y.shape[:-1], y.shape[-1] // self.head_dim, self.head_dim)

    def output(self, ctx):
        """The ``out`` projection without its bias, and the bias: ctx (..., heads * head_dim)
        -> (y (..., hidden), bias (hidden,) or None without biases), the bias left for a
        fused epilogue. With
        ``tensor_axis`` the row-parallel product, reduced (or reduce-scattered along the
        sequence) over the tensor axis."""
        if self.tensor_axis is None and not self.use_bias:
            fp8 = self._fp8_gemm("out")
            if fp8 is not None:
                return fp8(ctx, self.out.kernel[...], self.dtype), None
            return self.out(ctx), None
        if self.tensor_axis is None:
            return matmul(ctx, self.out, self.dtype, self._fp8_gemm("out"))
        kernel = self.out.kernel[...]
        y = row_parallel_linear(ctx, kernel, None, axis_name=self.tensor_axis, sequence_dim=self._seq_dim,
                                dtype=self.dtype)
        if not self.use_bias:
            return y, None
        bias = self.out.bias[...]
        return y, bias.astype(promoted_dtype(self.dtype, ctx, kernel, bias))

    def _setup_fp8(self, recipe):
        check_fp8_device("MultiHeadAttention")
        if self.self_attention:
            self.qkv_fp8 = FP8DotMeta(recipe)
        else:
            self.q_fp8, self.kv_fp8 = FP8DotMeta(recipe), FP8DotMeta(recipe)
        self.out_fp8 = FP8DotMeta(recipe)

    def _fp8_gemm(self, name: str):
        """The `FP8Gemm` of the projection ``name`` ("qkv", "q", "kv", "out"), or None
        without fp8."""
        if self.fp8 is None:
            return None
        return FP8Gemm(getattr(self, f"{name}_fp8"), self.fp8, self.fp8_amax_axes)

    def project_kv(self, memory):
        """Cross-attention keys and values: ``memory @ kv.kernel + kv.bias``, memory
        (..., hidden) -> (..., 2*hidden); with ``tensor_axis`` (..., 2, hidden) split on
        the last dim over the tensor axis."""
        if self.tensor_axis is not None:
            return self._column(memory, self.kv)
        if self.fp8 is None:
            return self.kv(memory)
        if not self.use_bias:
            return self._fp8_gemm("kv")(memory, self.kv.kernel[...], self.dtype)
        y, b = matmul(memory, self.kv, self.dtype, self._fp8_gemm("kv"))
        return y + b

    def add_bias_parts(self, ys, bias):
        """The column blocks ``ys`` (q, k, v: (..., heads * head_dim), (..., kv_heads *
        head_dim) twice) of the ``qkv`` projection plus the matching blocks of its
        ``bias`` (None: no bias), as (..., heads, head_dim) and (..., kv_heads, head_dim)
        arrays."""
        out, start = [], 0
        for y, w, n in zip(ys, self._widths, self._part_heads):
            if bias is not None:
                y = y + bias.astype(y.dtype)[start:start + w]
            out.append(y.reshape(*y.shape[:-1], n, self.head_dim))
            start += w
        return out

    def _project_parts(self, xs, linear, parts):
        """``x @ kernel + bias`` split into `parts` (batch, len, heads, head_dim) arrays,
        as one GEMM per part on a column slice of the kernel: slicing the kernel (and
        joining its gradient) moves hidden x hidden weights, where slicing the fused
        output (and concatenating the three activation gradients in the backward) moves
        batch x len x hidden activations each time. `xs`: one input per part (copies of
        the same activations, see `context`)."""
        kernel, bias = linear.kernel[...], None if linear.bias is None else linear.bias[...]
        widths = self._widths
        if self.fp8 is not None:
            # The input and the kernel quantized once (not once per part), one GEMM per
            # part writing its own result; in the backward one dgrad and one wgrad GEMM
            # on the parts' gradients, concatenated by the pass that quantizes them.
            # xs[1:] are copies of xs[0].
            gemm = self._fp8_gemm("qkv")
            if len(set(widths)) == 1:
                ys = gemm(xs[0], kernel, self.dtype, splits=parts)
            else:  # grouped-query parts of unequal widths: one GEMM, its columns split
                y = gemm(xs[0], kernel, self.dtype)
                ys = jnp.split(y, [widths[0], widths[0] + widths[1]], axis=-1)
            return self.add_bias_parts(ys, bias)
        if bias is None:
            *xs, kernel = dtypes.promote_dtype((*xs, kernel), dtype=self.dtype)
        else:
            *xs, kernel, bias = dtypes.promote_dtype((*xs, kernel, bias), dtype=self.dtype)
        ys, start = [], 0
        for x, w in zip(xs, widths):
            ys.append(jnp.dot(x, kernel[:, start:start + w]))
            start += w
        return self.add_bias_parts(ys, bias)

    def explicit_gemm_path(self, q_len: int, k_len: int, dropout_active: bool, dtype) -> bool:
        """Whether this module's attention runs as XLA GEMMs around a softmax for these
        lengths (see `explicit_gemm_path`); dtype: the compute dtype."""
        return explicit_gemm_path(self.attention_backend, dropout_active=dropout_active and self.attn_dropout > 0,
                                  q_len=q_len, k_len=k_len, head_dim=self.head_dim, dtype=dtype)

    def context(self, x, memory=None, *, padding_mask=None, causal=False, kv=None, qkv=None, key=None,
                deterministic=True, seq_first: bool = False, positions=None, segment_ids=None,
                decode: bool = False):
        """Attention output before the ``out`` projection: (batch, q_len, heads * head_dim).

        With ``seq_first``, x, memory, kv and the result are (len, batch, ...) instead
        (see `attention_core`); padding_mask stays (batch, k_len).

        x: (batch, q_len, hidden); for self-attention also a tuple of three such arrays,
        the inputs of the q, k and v projections (equal values: copies from
        ``LayerNorm(..., copies=3)``, whose backward then sums their gradients).
        memory: (batch, k_len, hidden) for cross-attention, or kv: its precomputed
        ``memory @ kv.kernel + kv.bias`` (batch, k_len, 2 * kv_heads * head_dim).
        qkv: self-attention only, the precomputed projections (q, k, v), each (batch,
        q_len, heads, head_dim) (say from `jax_ls2.fp8.fused.layernorm_fp8_dot` and
        `add_bias_parts`); x then only gives the shapes.
        positions: int (batch, q_len), the rotary positions (default 0..q_len-1, after
        the cached ones when decoding, offset by the chunk under a bound sequence axis).
        segment_ids: int (batch, q_len): packed sequences, a token attends only tokens of
        its own segment. decode: append k, v to the cache (`init_cache`) and attend it.
        """
        o = self._owner
        xs = tuple(x) if isinstance(x, (tuple, list)) else None
        if xs is not None:
            if not self.self_attention or len(xs) != 3:
                raise ValueError(f"{o}: a tuple x must hold the 3 inputs of the q, k, v "
                                 f"projections of self-attention, got {len(xs)} arrays"
                                 + ("" if self.self_attention else " for cross-attention"))
            for name, xi in zip(("x[0]", "x[1]", "x[2]"), xs):
                check_hidden(o, xi, self.hidden_size, name)
            if any(xi.shape != xs[0].shape for xi in xs):
                raise ValueError(f"{o}: the q, k, v inputs must share one shape, got "
                                 f"{[tuple(xi.shape) for xi in xs]}")
            x = xs[0]
        check_hidden(o, x, self.hidden_size)
        self._check_extras(x, positions, segment_ids, decode, seq_first)
        if qkv is not None:
            shapes = [(*x.shape[:-1], n, self.head_dim) for n in self._part_heads]
            if not self.self_attention or len(qkv) != 3 or [tuple(t.shape) for t in qkv] != shapes:
                raise ValueError(f"{o}: qkv must be self-attention's (q, k, v), of shapes "
                                 f"{shapes}, got {[tuple(t.shape) for t in qkv]}"
                                 + ("" if self.self_attention else " for cross-attention"))
            q, k, v = qkv
        elif self.tensor_axis is not None:
            q, k, v = self._tensor_parallel_qkv(x, memory, kv)
        elif self.self_attention:
            q, k, v = self._project_parts(xs or (x,) * 3, self.qkv, 3)
        else:
            if self.fp8 is None:
                q = self.q(x)
            elif not self.use_bias:
                q = self._fp8_gemm("q")(x, self.q.kernel[...], self.dtype)
            else:
                q, q_bias = matmul(x, self.q, self.dtype, self._fp8_gemm("q"))
                q = q + q_bias
            q = q.reshape(*x.shape[:-1], self.num_heads, self.head_dim)
            kv_width = 2 * self.num_kv_heads * self.head_dim
            if kv is None:
                if memory is None:
                    raise ValueError(f"{o}: cross-attention needs memory or kv")
                check_hidden(o, memory, self.hidden_size, "memory")
                kv = self.project_kv(memory)
            elif kv.shape[-1] != kv_width:
                raise ValueError(f"{o}: kv must have shape (..., {kv_width}) "
                                 f"(batch, k_len, ...; k_len first with seq_first), got {tuple(kv.shape)}")
            kv = kv.astype(q.dtype).reshape(*kv.shape[:-1], 2, self.num_kv_heads, self.head_dim)
            k, v = (t[..., 0, :, :] for t in jnp.split(kv, 2, axis=-3))
        start = self.cache_index[...] if decode else 0
        if self.rotary is not None:
            q, k = self._rotate(q, k, positions, start)
        cache_mask = None
        if decode:
            k_all, v_all = kv_cache.write(self.cache_k, self.cache_v, start, k, v, o)
            self.cache_index[...] = start + q.shape[1]
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
            cache_mask = kv_cache.visible(start, q.shape[1], k.shape[1])
            causal = False
        if self.sequence_axis is not None:
            if seq_first:
                raise ValueError(f"{o}: sequence_axis needs batch-first x (seq_first=False)")
            if segment_ids is not None:
                raise ValueError(f"{o}: segment_ids with sequence_axis are not supported; pack the sequences "
                                 "without a sequence axis or leave segment_ids unset")
            ctx = self._ring(q, k, v, padding_mask=padding_mask, causal=causal, key=key, deterministic=deterministic)
            return ctx.reshape(*ctx.shape[:-2], ctx.shape[-2] * self.head_dim)
        spec = None
        if self.tensor_axis is not None:
            require_tensor_axis(o, self.tensor_axis, {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads})
            if seq_first:
                raise ValueError(f"{o}: tensor_axis needs batch-first x (seq_first=False)")
            if bound_axis_size(self.tensor_axis) is not None:  # this device's heads of the probabilities
                spec = (None, self.tensor_axis, None, None)
        ctx = attention_core(q, k, v, padding_mask=padding_mask, segment_ids=segment_ids, cache_mask=cache_mask,
                             causal=causal, rate=self.attn_dropout, key=key, deterministic=deterministic,
                             backend=self.attention_backend, seq_first=seq_first, shard_spec=spec, owner=o)
        if decode:
            ctx = kv_cache.nan_past_end(ctx, start, k.shape[1])
        return ctx.reshape(*ctx.shape[:-2], ctx.shape[-2] * self.head_dim)

    def _check_extras(self, x, positions, segment_ids, decode, seq_first):
        """Checks positions, segment_ids and decode against x (batch, len, hidden)."""
        o = self._owner
        for name, a in (("positions", positions), ("segment_ids", segment_ids)):
            if a is None:
                continue
            if seq_first or tuple(a.shape) != x.shape[:2] or not jnp.issubdtype(a.dtype, jnp.integer):
                raise ValueError(f"{o}: {name} must be integer of shape {x.shape[:2]} (batch, len; batch-first x), "
                                 f"got {a.dtype}{tuple(a.shape)}")
        if positions is not None and self.rotary is None:
            raise ValueError(f"{o}: positions apply to rotary embeddings; build the module with rotary=RotaryConfig()")
        if not decode:
            return
        if self.cache_k is None:
            raise ValueError(f"{o}: decode=True needs a cache; call init_cache(batch, max_len) first")
        if seq_first:
            raise ValueError(f"{o}: decode=True needs batch-first x (seq_first=False)")
        if self.cache_k.shape[0] != x.shape[0]:
            raise ValueError(f"{o}: x has batch {x.shape[0]}, the cache was made for {self.cache_k.shape[0]}")
        if segment_ids is not None:
            raise ValueError(f"{o}: segment_ids do not apply when decoding")

    def _rotate(self, q, k, positions, start):
        """q, k (batch, len, heads, head_dim) rotated at ``positions`` (default ``start +
        0..len-1``, plus this chunk's offset under a bound sequence axis)."""
        b, t = q.shape[:2]
        if positions is None:
            offset = start
            if self.sequence_axis is not None and bound_axis_size(self.sequence_axis) is not None:
                offset = offset + jax.lax.axis_index(self.sequence_axis) * t
            positions = jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))
        r = self.rotary
        return apply_rotary(q, k, positions, theta=float(r.theta), rotary_dim=self.rotary_dim,
                          interleaved=r.interleaved, scaling=r.scaling)

    def _ring(self, q, k, v, *, padding_mask, causal, key, deterministic):
        """Attention over the sequence split across ``sequence_axis``: q, k, v (batch, len,
        heads, head_dim), whole arrays under ``jit`` (split along len by the partitioner)
        or this device's chunk inside ``shard_map`` over the axis."""
        axis = self.sequence_axis
        kw = dict(causal=causal, rate=self.attn_dropout, deterministic=deterministic or self.attn_dropout == 0)
        if tensor_axis_size(axis) in (None, 1):  # no split: the single-device equivalent
            return attention_core(q, k, v, padding_mask=padding_mask, key=key, backend="flash", **kw)
        n, bound = tensor_axis_size(axis), bound_axis_size(axis) is not None
        zigzag = causal and self.sequence_balance == "zigzag"
        heads_bound = self.tensor_axis is not None and (bound_axis_size(self.tensor_axis) or 1) > 1
        if heads_bound and not kw["deterministic"]:
            raise ValueError("MultiHeadAttention: attention dropout with sequence_axis inside shard_map over the "
                             "tensor axis is not supported (the ring's masks are numbered over the heads it is given); "
                             "call the layer under jit with the mesh set, or inside shard_map over the sequence axis")
        if not bound and q.shape[1] % (2 * n if zigzag else n):  # inside shard_map q holds one chunk
            what = f"2 x the size ({n}) of mesh axis {axis!r} (sequence_axis, zigzag balance)" if zigzag else \
                f"the size ({n}) of mesh axis {axis!r} (sequence_axis)"
            raise ValueError(f"MultiHeadAttention: the sequence length ({q.shape[1]}) must be a multiple of {what}; "
                             f"pad the sequence or change the mesh")
        split = P(None, axis)
        args, specs = [q, k, v], [split] * 3
        if padding_mask is not None:
            args.append(padding_mask)
            specs.append(split)
        if key is not None:
            args.append(key)
            specs.append(P())

        def ring(q, k, v, *rest):
            mask = rest[0] if padding_mask is not None else None
            if zigzag:
                q, k, v = (to_zigzag_chunks(t, axis) for t in (q, k, v))
                mask = None if mask is None else to_zigzag_chunks(mask, axis)
            out = ring_attention(q, k, v, axis_name=axis, padding_mask=mask, key=rest[-1] if key is not None else None,
                                 impl="flash", balance="zigzag" if zigzag else "none", **kw)
            return from_zigzag_chunks(out, axis) if zigzag else out
        if bound:
            return ring(*args)
        return jax.shard_map(ring, in_specs=tuple(specs), out_specs=split, axis_names={axis})(*args)

    def _tensor_parallel_qkv(self, x, memory, kv):
        """q, k, v (batch, len, heads here, head_dim) from column-parallel projections."""
        if self.self_attention:
            y = self._column(x, self.qkv)
            r = self.num_heads // self.num_kv_heads
            if r == 1:
                return [self._heads(y[..., i, :]) for i in range(3)]
            q = y[..., :r, :].reshape(*y.shape[:-2], r, -1, self.head_dim)  # (..., r, groups here, d)
            q = jnp.swapaxes(q, -3, -2).reshape(*y.shape[:-2], -1, self.head_dim)  # head g * r + j
            return [q, self._heads(y[..., r, :]), self._heads(y[..., r + 1, :])]
        q = self._heads(self._column(x, self.q))
        if kv is None:
            if memory is None:
                raise ValueError("MultiHeadAttention: cross-attention needs memory or kv")
            check_hidden("MultiHeadAttention", memory, self.hidden_size, "memory")
            kv = self.project_kv(memory)
        elif kv.ndim < 3 or kv.shape[-2] != 2:
            raise ValueError(f"MultiHeadAttention: with tensor_axis kv must be project_kv's (..., 2, hidden), "
                             f"got {tuple(kv.shape)}")
        return [q] + [self._heads(kv[..., i, :].astype(q.dtype)) for i in range(2)]

    def __call__(self, x, memory=None, *, padding_mask=None, causal=False, kv=None,
                 deterministic: bool | None = None, rngs=None, seq_first: bool = False, positions=None,
                 segment_ids=None, decode: bool = False):
        """x: (batch, q_len, hidden) -> (batch, q_len, hidden), ``out`` bias included;
        (q_len, batch, hidden) in and out with ``seq_first``. positions, segment_ids,
        decode: see `context`."""
        det = resolve_deterministic(self._owner, deterministic, self.deterministic)
        key = None
        if not det and self.attn_dropout > 0:
            key = draw_key(self._owner, self.rngs, rngs)
        ctx = self.context(x, memory, padding_mask=padding_mask, causal=causal, kv=kv, key=key,
                           deterministic=det, seq_first=seq_first, positions=positions, segment_ids=segment_ids,
                           decode=decode)
        y, b = self.output(ctx)
        return y if b is None else y + b
