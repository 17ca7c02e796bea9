"""Multi-head attention with selectable backends.

Backends (``attention_backend``):

* ``"cudnn"``: cuDNN fused attention through ``jax.nn.dot_product_attention``; only
  without attention dropout (cuDNN's dropout is not exposed by JAX).
* ``"fused"``: ``q k^T`` GEMM, the jax_ls2 fused ``softmax_dropout`` op, ``p v`` GEMM.
* ``"xla"``: the XLA reference (``jax.nn.dot_product_attention(implementation="xla")``
  without dropout; the same GEMMs and a pure-jnp softmax + the shared dropout mask with
  it, so ``"xla"`` and ``"fused"`` draw identical masks).
* ``"flash"``: ``jax_ls2.ops.flash_attention`` (tiled, nothing of size q_len x k_len in
  memory on the GPU; padding masks, causal, dropout inside with its own mask numbering,
  so its masks are not the ``"fused"`` / ``"xla"`` ones).
* ``"auto"`` (default): cuDNN on a GPU where it applies (no active dropout, fp16/bf16,
  head_dim a multiple of 8 up to 128, lengths multiples of 64), otherwise ``"fused"``
  when dropout is active, otherwise ``"xla"``. It never picks ``"flash"``, which is not
  yet faster than those on the GPU.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2.fp8 import FP8DotMeta
from jax_ls2 import ops
from jax.sharding import PartitionSpec as P

from jax_ls2.nn._common import (FP8Gemm, check_fp8, check_fp8_device, check_heads, check_hidden, check_rate, draw_key,
                                check_sequence_axis, check_sequence_balance, check_tensor_parallel, matmul,
                                promoted_dtype, require_tensor_axis, resolve_deterministic, rng_stream,
                                tensor_axis_size)
from jax_ls2.parallel.ring_attention import from_zigzag_chunks, ring_attention, to_zigzag_chunks
from jax_ls2.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, bound_axis_size,
                                     column_parallel_linear, row_parallel_linear)

BACKENDS = ("auto", "cudnn", "fused", "xla", "flash")


def cudnn_applies(q_len: int, k_len: int, head_dim: int, dtype) -> bool:
    """Whether cuDNN fused attention takes this problem (conservative)."""
    return (jax.default_backend() == "gpu"
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim % 8 == 0 and head_dim <= 128
            and q_len % 64 == 0 and k_len % 64 == 0)


def select_backend(requested: str, *, dropout_active: bool, q_len: int, k_len: int,
                   head_dim: int, dtype) -> str:
    """The backend that runs: `requested` unless "auto" (see the module docstring)."""
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "cudnn" and dropout_active:
        raise ValueError("attention_backend='cudnn' has no attention-probability dropout; use "
                         "'fused' or 'auto', or set attn_dropout=0 / deterministic=True")
    if requested != "auto":
        return requested
    if not dropout_active and cudnn_applies(q_len, k_len, head_dim, dtype):
        return "cudnn"
    return "fused" if dropout_active else "xla"


def explicit_gemm_path(requested: str, *, dropout_active: bool, q_len: int, k_len: int,
                       head_dim: int, dtype) -> bool:
    """Whether attention runs as two XLA GEMMs around a softmax (the "fused" backend, or
    "xla" with dropout) rather than one fused attention call: the case where the
    sequence-first layout spares XLA the transposes around the GEMMs."""
    impl = select_backend(requested, dropout_active=dropout_active, q_len=q_len, k_len=k_len,
                          head_dim=head_dim, dtype=dtype)
    return impl == "fused" or (impl == "xla" and dropout_active)


def attention_core(q, k, v, *, padding_mask=None, causal=False, rate=0.0, key=None,
                   deterministic=True, backend="auto", seq_first: bool = False, shard_spec=None):
    """Scaled dot-product attention.

    q: (batch, q_len, heads, head_dim); k, v: (batch, k_len, heads, head_dim), same dtype;
    with ``seq_first`` all three (and the result) are (len, batch, heads, head_dim)
    instead. The attention GEMMs, batched over (batch, heads), read sequence-first
    operands in place (one stride between consecutive (batch, head) pairs), where
    batch-first ones are transposed to (batch, heads, len, head_dim) first and back after.
    padding_mask: optional bool (batch, k_len), True = attend. causal: bottom-right aligned.
    Softmax statistics are fp32. Returns q's layout and dtype. The dropout mask is drawn
    over the (batch, heads, q_len, k_len) probabilities in either layout; inside
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
    impl = select_backend(backend, dropout_active=active, q_len=tq, k_len=tk, head_dim=h,
                          dtype=q.dtype)
    if impl == "flash":
        if shard_spec is not None and active:
            raise ValueError("attention: attention_backend='flash' with dropout inside shard_map over the heads "
                             "is not supported (its masks are numbered over the whole heads dim); use 'fused'")
        if seq_first:
            q, k, v = (t.swapaxes(0, 1) for t in (q, k, v))
        mask = None if padding_mask is None else padding_mask.astype(bool)
        out = ops.flash_attention(q, k, v, padding_mask=mask, causal=causal, rate=rate, key=key,
                                  deterministic=not active)
        return out.swapaxes(0, 1) if seq_first else out
    mask = None if padding_mask is None else padding_mask[:, None, None, :].astype(bool)
    if impl in ("cudnn", "xla") and not active:
        if causal and tq != tk:
            raise ValueError(f"attention: causal needs q_len == k_len here, got {tq} and {tk}")
        if seq_first:
            q, k, v = (t.swapaxes(0, 1) for t in (q, k, v))
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=impl)
        return out.swapaxes(0, 1) if seq_first else out
    lay = "tbnh" if seq_first else "btnh"
    scores = jnp.einsum(f"{lay},{lay.replace('t', 's')}->bnts", q, k)
    softmax = ops.softmax_dropout if impl == "fused" else ops.xla_softmax_dropout
    probs = softmax(scores, scale=1.0 / math.sqrt(h), mask=mask, causal=causal, rate=rate,
                    key=key, deterministic=not active, shard_spec=shard_spec if active else None)
    return jnp.einsum(f"bnts,{lay.replace('t', 's')}->{lay}", probs.astype(v.dtype), v)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention with a fused QKV projection (self) or Q + fused KV (cross).

    Parameters: self-attention ``qkv`` (hidden, 3*hidden) laid out [q | k | v], each
    heads-major; cross-attention ``q`` (hidden, hidden) and ``kv`` (hidden, 2*hidden);
    ``out`` (hidden, hidden). All ``nnx.Linear`` with biases.

    With ``fp8`` (a `jax_ls2.fp8.DelayedScaling`) each projection GEMM runs through
    `jax_ls2.fp8.fp8_dot` with its own meta: ``qkv_fp8`` (one `FP8DotMeta` for q, k and
    v: their input and the ``qkv`` kernel are quantized once, ``fp8_dot(splits=3)``) or
    ``q_fp8`` and ``kv_fp8``, and ``out_fp8``; their ``FP8Meta`` variables sit beside
    the params, which stay those of the bf16 module. Attention itself stays in the
    compute dtype.

    Args:
      hidden_size, num_heads: model width and heads (hidden_size % num_heads == 0).
      self_attention: True for self-attention (fused QKV), False for cross-attention.
      attn_dropout: attention-probability dropout rate.
      attention_backend: "auto", "cudnn", "fused", "xla" or "flash" (see module docstring).
      dtype: compute dtype (None: promote inputs and params); param_dtype: storage dtype.
      fp8: None or a `jax_ls2.fp8.DelayedScaling` (hidden_size a multiple of 16).
      fp8_amax_axes: mesh axes of the amax reduction inside ``shard_map`` (see
        `jax_ls2.fp8.fp8_dot`'s ``amax_axes``).
      tensor_axis: None, or the mesh axis Megatron tensor parallelism splits the heads
        over (num_heads a multiple of its size): ``qkv`` (``q``, ``kv``) become
        `jax_ls2.parallel.ColumnParallelLinear` s with kernels ``(hidden, 3, hidden)``
        (``(hidden, hidden)``, ``(hidden, 2, hidden)``) and biases ``(3, hidden)``,
        split on the last dim (whole heads per device), and ``out`` a
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
    """

    def __init__(self, hidden_size: int, num_heads: int, *, self_attention: bool = True,
                 attn_dropout: float = 0.0, attention_backend: str = "auto",
                 deterministic: bool | None = None, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), fp8=None, fp8_amax_axes=(),
                 tensor_axis: str | None = None, sequence_parallel: bool = False,
                 sequence_axis: str | None = None, sequence_balance: str = "none", rngs: nnx.Rngs):
        self.head_dim = check_heads("MultiHeadAttention", hidden_size, num_heads)
        check_sequence_axis("MultiHeadAttention", sequence_axis, attention_backend, fp8, sequence_parallel)
        if sequence_axis is not None and not self_attention:
            raise ValueError("MultiHeadAttention: sequence_axis applies to self-attention only")
        self.sequence_axis = sequence_axis
        self.sequence_balance = check_sequence_balance("MultiHeadAttention", sequence_balance)
        check_tensor_parallel("MultiHeadAttention", tensor_axis, sequence_parallel, {"num_heads": num_heads})
        if tensor_axis is not None and fp8 is not None:
            raise ValueError("MultiHeadAttention: fp8 with tensor_axis is not supported; leave one of them unset")
        self.tensor_axis, self.sequence_parallel = tensor_axis, sequence_parallel
        if attention_backend not in BACKENDS:
            raise ValueError(f"MultiHeadAttention: attention_backend must be one of {BACKENDS}, "
                             f"got {attention_backend!r}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.self_attention = self_attention
        self.attn_dropout = check_rate("MultiHeadAttention", "attn_dropout", attn_dropout)
        self.attention_backend = attention_backend
        self.deterministic = deterministic
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        if tensor_axis is not None:
            tp = dict(kw, tensor_axis=tensor_axis, sequence_dim=self._seq_dim)
            if self_attention:
                self.qkv = ColumnParallelLinear(hidden_size, (3, hidden_size), **tp)
            else:
                self.q = ColumnParallelLinear(hidden_size, hidden_size, **tp)
                self.kv = ColumnParallelLinear(hidden_size, (2, hidden_size), **tp)
            self.out = RowParallelLinear(hidden_size, hidden_size, **tp)
        elif self_attention:
            self.qkv = nnx.Linear(hidden_size, 3 * hidden_size, **kw)
        else:
            self.q = nnx.Linear(hidden_size, hidden_size, **kw)
            self.kv = nnx.Linear(hidden_size, 2 * hidden_size, **kw)
        if tensor_axis is None:
            self.out = nnx.Linear(hidden_size, hidden_size, **kw)
        self.rngs = rng_stream(rngs)
        self.fp8 = fp8
        self.fp8_amax_axes = check_fp8("MultiHeadAttention", fp8, fp8_amax_axes, {"hidden_size": hidden_size})
        if fp8 is not None:
            self._setup_fp8(fp8)

    @property
    def _seq_dim(self) -> int | None:
        """The sequence dim of x under Megatron sequence parallelism, else None."""
        return 1 if self.sequence_parallel else None

    def _column(self, x, linear):
        """Tensor parallelism: ``x @ kernel + bias`` of a column-parallel projection,
        (..., hidden) -> (..., [parts,] this device's or the sharded heads * head_dim)."""
        return column_parallel_linear(x, linear.kernel[...], linear.bias[...], axis_name=self.tensor_axis,
                                      sequence_dim=self._seq_dim, dtype=self.dtype)

    def _heads(self, y):
        """(..., heads * head_dim) -> (..., heads, head_dim); heads are this device's inside
        ``shard_map``."""
        return y.reshape(*y.shape[:-1], y.shape[-1] // self.head_dim, self.head_dim)

    def output(self, ctx):
        """The ``out`` projection without its bias, and the bias: ctx (..., hidden) -> (y
        (..., hidden), bias (hidden,)), the bias left for a fused epilogue. With
        ``tensor_axis`` the row-parallel product, reduced (or reduce-scattered along the
        sequence) over the tensor axis."""
        if self.tensor_axis is None:
            return matmul(ctx, self.out, self.dtype, self._fp8_gemm("out"))
        kernel, bias = self.out.kernel[...], self.out.bias[...]
        y = row_parallel_linear(ctx, kernel, None, axis_name=self.tensor_axis, sequence_dim=self._seq_dim,
                                dtype=self.dtype)
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
        y, b = matmul(memory, self.kv, self.dtype, self._fp8_gemm("kv"))
        return y + b

    def add_bias_parts(self, ys, bias):
        """The column blocks ``ys`` (each (..., hidden)) of a projection plus the matching
        blocks of its ``bias`` ((len(ys) * hidden,)), as (..., heads, head_dim) arrays."""
        h = self.hidden_size
        bias = bias.astype(ys[0].dtype)
        return [(y + bias[i * h:(i + 1) * h]).reshape(*y.shape[:-1], self.num_heads, self.head_dim)
                for i, y in enumerate(ys)]

    def _split(self, y, parts):
        return jnp.split(y.reshape(*y.shape[:-1], parts, self.num_heads, self.head_dim), parts,
                         axis=-3)

    def _project_parts(self, xs, linear, parts):
        """``x @ kernel + bias`` split into `parts` (batch, len, heads, head_dim) arrays,
        as one GEMM per part on a column slice of the kernel: slicing the kernel (and
        joining its gradient) moves hidden x hidden weights, where slicing the fused
        output (and concatenating the three activation gradients in the backward) moves
        batch x len x hidden activations each time. `xs`: one input per part (copies of
        the same activations, see `context`)."""
        kernel, bias = linear.kernel[...], linear.bias[...]
        h = self.hidden_size
        if self.fp8 is not None:
            # The input and the kernel quantized once (not once per part), one GEMM per
            # part writing its own result; in the backward one dgrad and one wgrad GEMM
            # on the parts' gradients, concatenated by the pass that quantizes them.
            # xs[1:] are copies of xs[0].
            ys = self._fp8_gemm("qkv")(xs[0], kernel, self.dtype, splits=parts)
            return self.add_bias_parts(ys, bias)
        *xs, kernel, bias = dtypes.promote_dtype((*xs, kernel, bias), dtype=self.dtype)
        return [(jnp.dot(x, kernel[:, i * h:(i + 1) * h]) + bias[i * h:(i + 1) * h]).reshape(
            *x.shape[:-1], self.num_heads, self.head_dim) for i, x in enumerate(xs)]

    def explicit_gemm_path(self, q_len: int, k_len: int, dropout_active: bool, dtype) -> bool:
        """Whether this module's attention runs as XLA GEMMs around a softmax for these
        lengths (see `explicit_gemm_path`); dtype: the compute dtype."""
        return explicit_gemm_path(self.attention_backend, dropout_active=dropout_active and self.attn_dropout > 0,
                                  q_len=q_len, k_len=k_len, head_dim=self.head_dim, dtype=dtype)

    def context(self, x, memory=None, *, padding_mask=None, causal=False, kv=None, qkv=None, key=None,
                deterministic=True, seq_first: bool = False):
        """Attention output before the ``out`` projection: (batch, q_len, hidden).

        With ``seq_first``, x, memory, kv and the result are (len, batch, ...) instead
        (see `attention_core`); padding_mask stays (batch, k_len).

        x: (batch, q_len, hidden); for self-attention also a tuple of three such arrays,
        the inputs of the q, k and v projections (equal values: copies from
        ``LayerNorm(..., copies=3)``, whose backward then sums their gradients).
        memory: (batch, k_len, hidden) for cross-attention, or kv: its precomputed
        ``memory @ kv.kernel + kv.bias`` (batch, k_len, 2*hidden).
        qkv: self-attention only, the precomputed projections (q, k, v), each (batch,
        q_len, heads, head_dim) (say from `jax_ls2.fp8.fused.layernorm_fp8_dot` and
        `add_bias_parts`); x then only gives the shapes.
        """
        xs = tuple(x) if isinstance(x, (tuple, list)) else None
        if xs is not None:
            if not self.self_attention or len(xs) != 3:
                raise ValueError("MultiHeadAttention: a tuple x must hold the 3 inputs of the q, k, v "
                                 f"projections of self-attention, got {len(xs)} arrays"
                                 + ("" if self.self_attention else " for cross-attention"))
            for name, xi in zip(("x[0]", "x[1]", "x[2]"), xs):
                check_hidden("MultiHeadAttention", xi, self.hidden_size, name)
            if any(xi.shape != xs[0].shape for xi in xs):
                raise ValueError(f"MultiHeadAttention: the q, k, v inputs must share one shape, got "
                                 f"{[tuple(xi.shape) for xi in xs]}")
            x = xs[0]
        check_hidden("MultiHeadAttention", x, self.hidden_size)
        if qkv is not None:
            shape = (*x.shape[:-1], self.num_heads, self.head_dim)
            if not self.self_attention or len(qkv) != 3 or any(tuple(t.shape) != shape for t in qkv):
                raise ValueError(f"MultiHeadAttention: qkv must be self-attention's (q, k, v), each of shape "
                                 f"{shape}, got {[tuple(t.shape) for t in qkv]}"
                                 + ("" if self.self_attention else " for cross-attention"))
            q, k, v = qkv
        elif self.tensor_axis is not None:
            q, k, v = self._tensor_parallel_qkv(x, memory, kv)
        elif self.self_attention:
            q, k, v = self._project_parts(xs or (x,) * 3, self.qkv, 3)
        else:
            if self.fp8 is None:
                q = self.q(x)
            else:
                q, q_bias = matmul(x, self.q, self.dtype, self._fp8_gemm("q"))
                q = q + q_bias
            q = q.reshape(*x.shape[:-1], self.num_heads, self.head_dim)
            if kv is None:
                if memory is None:
                    raise ValueError("MultiHeadAttention: cross-attention needs memory or kv")
                check_hidden("MultiHeadAttention", memory, self.hidden_size, "memory")
                kv = self.project_kv(memory)
            elif kv.shape[-1] != 2 * self.hidden_size:
                raise ValueError(f"MultiHeadAttention: kv must have shape (..., {2 * self.hidden_size}) "
                                 f"(batch, k_len, ...; k_len first with seq_first), got {tuple(kv.shape)}")
            k, v = (t[..., 0, :, :] for t in self._split(kv.astype(q.dtype), 2))
        if self.sequence_axis is not None:
            if seq_first:
                raise ValueError("MultiHeadAttention: sequence_axis needs batch-first x (seq_first=False)")
            ctx = self._ring(q, k, v, padding_mask=padding_mask, causal=causal, key=key, deterministic=deterministic)
            return ctx.reshape(*ctx.shape[:-2], ctx.shape[-2] * self.head_dim)
        spec = None
        if self.tensor_axis is not None:
            require_tensor_axis("MultiHeadAttention", self.tensor_axis, {"num_heads": self.num_heads})
            if seq_first:
                raise ValueError("MultiHeadAttention: tensor_axis needs batch-first x (seq_first=False)")
            if bound_axis_size(self.tensor_axis) is not None:  # this device's heads of the probabilities
                spec = (None, self.tensor_axis, None, None)
        ctx = attention_core(q, k, v, padding_mask=padding_mask, causal=causal,
                             rate=self.attn_dropout, key=key, deterministic=deterministic,
                             backend=self.attention_backend, seq_first=seq_first, shard_spec=spec)
        return ctx.reshape(*ctx.shape[:-2], ctx.shape[-2] * self.head_dim)

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
            return [self._heads(y[..., i, :]) for i in range(3)]
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
                 deterministic: bool | None = None, rngs=None, seq_first: bool = False):
        """x: (batch, q_len, hidden) -> (batch, q_len, hidden), ``out`` bias included;
        (q_len, batch, hidden) in and out with ``seq_first``."""
        det = resolve_deterministic("MultiHeadAttention", deterministic, self.deterministic)
        key = None
        if not det and self.attn_dropout > 0:
            key = draw_key("MultiHeadAttention", self.rngs, rngs)
        ctx = self.context(x, memory, padding_mask=padding_mask, causal=causal, kv=kv, key=key,
                           deterministic=det, seq_first=seq_first)
        y, b = self.output(ctx)
        return y + b
