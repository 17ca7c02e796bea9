"""Flash attention: tiled attention with an online softmax, masks, bias, in-kernel
dropout and the per-row log-sum-exp; and `merge_attention`, which combines two
partial attentions over disjoint key sets.

The CUDA kernels (``csrc/kernels/flash_attention.cu``) never hold a ``(q_len, kv_len)``
array in memory: the forward keeps ``out`` and the float32 log-sum-exp, and the
backward recomputes the probabilities tile by tile from them. Elsewhere (the CPU, or
where the extension is absent) the pure-JAX reference below runs the same math with
the whole ``(batch, heads, q_len, kv_len)`` logits in float32, so it is meant for
testing and short sequences.

Dropout masks come from the counter-based generator of :mod:`jax_ls2._random`: the
element at ``(b, h, i, j)`` of the probabilities (batch, query head, query, key) has
the 64-bit index ``((b * heads + h) * q_total + q_offset + i) * kv_total + kv_offset +
j`` (`jax_ls2._random.keep_bits_wide`) and is kept iff its 16-bit draw is ``>=
round(rate * 65536)``; kept probabilities are scaled by ``keep_scale(rate)``. By default
``q_offset = kv_offset = 0``, ``q_total = q_len`` and ``kv_total = kv_len``, and below
2**32 elements the draws are those of the 32-bit generator of the other ops, so the
same key gives the same mask as ``softmax_dropout`` on the ``(batch, heads, q_len,
kv_len)`` scores; beyond 2**32 (a 131072-token sequence with 32 heads has 2**39) the
index keeps counting, so no mask repeats. With the offsets and totals, a call on the
block ``[q_offset, q_offset + q_len) x [kv_offset, kv_offset + kv_len)`` of a larger
``q_total x kv_total`` attention draws that block of the larger attention's mask (ring
attention's blocks). Under ``jit`` with the batch sharded, a shard's seed offset word
counts the query elements before it (see `jax_ls2._dispatch`), from which the kernel and
the reference derive the shard's first batch index, so shards draw the unsharded mask;
inside `jax_ls2._random.batch_rows_from` (a pipeline's micro-batches) the same word
carries the block's first row. That count is 32-bit: the rows before a shard times
``q_len * heads * head_dim`` must stay below 2**32.

The CUDA kernels take float16 and bfloat16 with head_dim 64 or 128 (KERNEL_DTYPES,
KERNEL_HEAD_DIMS); other dtypes and head dims run the reference, with a warning on a
CUDA backend, or raise under ``JAX_LS2_IMPL=cuda``.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _dispatch, _ffi, _random
from jax_ls2._dispatch import BCAST, ROWS, SEED, SUM, FusedKernel, Role, match_varying, result_type
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks

F32 = jnp.float32
# What the CUDA kernels take; other head dims and dtypes run the reference.
KERNEL_HEAD_DIMS = (64, 128)
KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# ---------------------------------------------------------------- reference math
def _compute_dtype(dtype):
    return jnp.promote_types(dtype, F32)


def _batch_offset(seed, q_shape):
    """First global batch index of this shard: seed[2] counts the query elements before
    it (0 when unsharded)."""
    b, lq, h, d = q_shape
    return seed[2] // np.uint32(min(lq * h * d, 2**32 - 1))


def attention_keep_mask(seed, q_shape, kv_len: int, threshold: int, q_total: int | None = None,
                        kv_total: int | None = None):
    """The dropout keep mask ``(batch, heads, q_len, kv_len)`` bool for the query shape
    ``q_shape = (batch, q_len, heads, head_dim)``, as the kernels draw it: ``seed`` is
    the uint32[5] ``(k0, k1, shard_offset, q_offset, kv_offset)`` (a uint32[3] one means
    offsets 0), ``q_total, kv_total`` the lengths of the attention the call is a block
    of (default ``q_len, kv_len``); see the module docstring."""
    b, lq, h, _ = q_shape
    q_total = lq if q_total is None else int(q_total)
    kv_total = kv_len if kv_total is None else int(kv_total)
    seed = jnp.asarray(seed, jnp.uint32)
    q_off, kv_off = (seed[3], seed[4]) if seed.shape[0] >= 5 else (np.uint32(0), np.uint32(0))
    u32 = lambda x: jnp.asarray(x, jnp.uint32)
    bh = (_batch_offset(seed, q_shape) + jnp.arange(b, dtype=jnp.uint32))[:, None] * np.uint32(h) + \
        jnp.arange(h, dtype=jnp.uint32)[None, :]
    # Row index (b, h, i) = bh * q_total + q_offset + i, then its first element
    # row * kv_total + kv_offset, as (hi, lo) uint32 words.
    hi, lo = _random.mul_wide(bh[:, :, None], u32(q_total))
    hi, lo = _random.add_wide(hi, lo, u32(q_off) + jnp.arange(lq, dtype=jnp.uint32))
    hi2, lo = _random.mul_wide(lo, u32(kv_total))
    hi, lo = _random.add_wide(hi * np.uint32(kv_total) + hi2, lo, u32(kv_off))
    lo_e = lo[..., None] + jnp.arange(kv_len, dtype=jnp.uint32)
    hi_e = hi[..., None] + (lo_e < lo[..., None]).astype(jnp.uint32)
    return _random.keep_bits_wide(seed[0], seed[1], hi_e, lo_e, threshold)


def _valid(q_shape, kv_len, q_seg, kv_seg, *, causal, has_seg):
    """bool (batch|1, 1, q_len, kv_len): which (query, key) pairs attend."""
    lq = q_shape[1]
    valid = jnp.ones((1, 1, lq, kv_len), bool)
    if causal:
        valid = valid & (jnp.arange(kv_len)[None, :] <= jnp.arange(lq)[:, None] + (kv_len - lq))[None, None]
    if has_seg:
        valid = valid & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    return valid


def _logits(q, k, bias, q_seg, kv_seg, *, scale, causal, has_bias, has_seg):
    """(batch, heads, q_len, kv_len) logits in the compute dtype, -inf where masked."""
    ct = _compute_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    kx = jnp.repeat(k, groups, axis=2) if groups > 1 else k
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(ct), kx.astype(ct), precision=jax.lax.Precision.HIGHEST)
    s = s * jnp.asarray(scale, ct)
    if has_bias:
        s = s + bias.astype(ct)
    valid = _valid(q.shape, k.shape[1], q_seg, kv_seg, causal=causal, has_seg=has_seg)
    return jnp.where(valid, s, -jnp.inf)


def _probs(s, lse):
    """exp(s - lse), 0 on rows whose lse is -inf (no attended key)."""
    safe = jnp.where(jnp.isneginf(lse), jnp.inf, lse)[..., None]
    return jnp.exp(s - safe)


def _dropped(p, seed, q_shape, *, threshold, keep_scale, q_total, kv_total):
    if not threshold:
        return p
    keep = attention_keep_mask(seed, q_shape, p.shape[-1], threshold, q_total, kv_total)
    return jnp.where(keep, p * jnp.asarray(keep_scale, p.dtype), jnp.zeros((), p.dtype))


def _fwd_reference(q, k, v, bias, q_seg, kv_seg, seed, *, scale, causal, threshold, keep_scale, has_bias,
                   has_seg, q_total, kv_total):
    s = _logits(q, k, bias, q_seg, kv_seg, scale=scale, causal=causal, has_bias=has_bias, has_seg=has_seg)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isneginf(m), jnp.zeros((), s.dtype), m)
    total = jnp.sum(jnp.exp(s - m[..., None]), axis=-1)
    # total == 0: no attended key (lse -inf); a NaN total (a NaN logit) keeps lse NaN.
    lse = jnp.where(total == 0, -jnp.inf, m + jnp.log(jnp.where(total == 0, 1, total)))
    p = _dropped(_probs(s, lse), seed, q.shape, threshold=threshold, keep_scale=keep_scale, q_total=q_total,
                 kv_total=kv_total)
    groups = q.shape[2] // k.shape[2]
    vx = jnp.repeat(v, groups, axis=2) if groups > 1 else v
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vx.astype(p.dtype), precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype), lse


def _group_sum(x, kv_heads):
    """(batch, len, heads, d) summed over each kv head's group of query heads."""
    b, n, h, d = x.shape
    return x.reshape(b, n, kv_heads, h // kv_heads, d).sum(axis=3)


def _bwd_reference(dout, dlse, q, k, v, out, lse, bias, q_seg, kv_seg, seed, *, scale, causal, threshold,
                   keep_scale, has_bias, has_seg, q_total, kv_total):
    hi = jax.lax.Precision.HIGHEST
    s = _logits(q, k, bias, q_seg, kv_seg, scale=scale, causal=causal, has_bias=has_bias, has_seg=has_seg)
    ct = s.dtype
    p = _probs(s, lse.astype(ct))
    groups = q.shape[2] // k.shape[2]
    kx = jnp.repeat(k, groups, axis=2).astype(ct)
    vx = jnp.repeat(v, groups, axis=2).astype(ct)
    do = dout.astype(ct)
    drop = functools.partial(_dropped, seed=seed, q_shape=q.shape, threshold=threshold, keep_scale=keep_scale,
                             q_total=q_total, kv_total=kv_total)
    pz = drop(p)
    dpz = drop(jnp.einsum("bqhd,bkhd->bhqk", do, vx, precision=hi))
    delta = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(ct), precision=hi) - dlse.astype(ct)
    ds = p * (dpz - delta[..., None])
    sc = jnp.asarray(scale, ct)
    dq = sc * jnp.einsum("bhqk,bkhd->bqhd", ds, kx, precision=hi)
    dk = sc * jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(ct), precision=hi)
    dv = jnp.einsum("bhqk,bqhd->bkhd", pz, do, precision=hi)
    dk, dv = _group_sum(dk, k.shape[2]), _group_sum(dv, k.shape[2])
    if has_bias:
        axes = tuple(i for i, (a, b) in enumerate(zip(bias.shape, ds.shape)) if a == 1 and b != 1)
        dbias = jnp.sum(ds, axis=axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)
    else:
        dbias = jnp.zeros(bias.shape, bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


# ---------------------------------------------------------------- CUDA calls
def _attrs(*arrays, scale, causal, threshold, keep_scale, has_bias, has_seg, q_total, kv_total):
    return dict(scale=np.float32(scale), causal=bool(causal), threshold=np.int32(threshold),
                keep_scale=np.float32(keep_scale), has_bias=bool(has_bias), has_seg=bool(has_seg),
                q_total=np.int64(q_total), kv_total=np.int64(kv_total))


def _fwd_types(q, k, v, *arrays, **static):
    b, lq, h, _ = q.shape
    return result_type(q), result_type(q, (b, h, lq), F32)


def _bwd_types(dout, dlse, q, k, v, out, lse, bias, *arrays, **static):
    # dq, dk, dv, dbias (float32, bias' shape), then the workspace: delta (batch, heads,
    # q_len) float32 = rowsum(dout * out) - dlse.
    return (result_type(q), result_type(k), result_type(v), result_type(bias, bias.shape, F32),
            result_type(lse))


def _always(static) -> bool:
    return True


# q, k, v, out, dq, dk, dv: (batch, len, heads, head_dim): the batch dim is the only
# batch-like one (the kernels see whole sequences and heads). lse, dlse: (batch, heads,
# q_len). bias (batch|1, heads|1, q_len|1, kv_len|1) and segment ids (batch|1, len|1)
# broadcast. Under vmap the examples run one by one, each drawing its own dropout mask.
_R3, _R2, _B3, _B1, _S = Role(ROWS, 3), Role(ROWS, 2), Role(BCAST, 3), Role(BCAST, 1), Role(SEED)
_FWD = FusedKernel("jax_ls2_flash_attention_fwd", _fwd_reference, operands=(_R3, _R3, _R3, _B3, _B1, _B1, _S),
                   results=(_R3, _R2), result_types=_fwd_types, attrs=_attrs, vmap_method="sequential",
                   per_example=_always)
_BWD_TARGET = "jax_ls2_flash_attention_bwd"


@functools.lru_cache(maxsize=None)
def _bwd_kernel(bias_batched: bool) -> FusedKernel:
    """The backward; dbias is per example when the bias has the batch dim, else summed
    over the batch (and over batch shards)."""
    dbias_role = _R3 if bias_batched else Role(SUM)
    return FusedKernel(_BWD_TARGET, _bwd_reference,
                       operands=(_R3, _R2, _R3, _R3, _R3, _R3, _R2, _B3, _B1, _B1, _S),
                       results=(_R3, _R3, _R3, dbias_role), result_types=_bwd_types, attrs=_attrs,
                       vmap_method="sequential", per_example=_always)


# ---------------------------------------------------------------- custom_vjp
# cfg = (scale, causal, threshold, keep_scale, has_bias, has_seg, q_total, kv_total,
# use_kernel), all static.
def _static(cfg):
    scale, causal, threshold, keep_scale, has_bias, has_seg, q_total, kv_total, _ = cfg
    return dict(scale=scale, causal=causal, threshold=threshold, keep_scale=keep_scale, has_bias=has_bias,
                has_seg=has_seg, q_total=q_total, kv_total=kv_total)


def _forward(q, k, v, bias, q_seg, kv_seg, seed, cfg):
    if cfg[-1]:
        return _FWD(q, k, v, bias, q_seg, kv_seg, seed, **_static(cfg))
    return _fwd_reference(q, k, v, bias, q_seg, kv_seg, seed, **_static(cfg))


@functools.partial(fused_vjp, nondiff_argnums=(7,), op="flash_attention",
                   plain="jax.nn.dot_product_attention(q, k, v, implementation='xla')")
def _flash(q, k, v, bias, q_seg, kv_seg, seed, cfg):
    return _forward(q, k, v, bias, q_seg, kv_seg, seed, cfg)


def _flash_fwd(q, k, v, bias, q_seg, kv_seg, seed, cfg):
    out, lse = _forward(q, k, v, bias, q_seg, kv_seg, seed, cfg)
    return (out, lse), (q, k, v, bias, q_seg, kv_seg, seed, out, lse)


def _backward(dout, dlse, q, k, v, out, lse, bias, q_seg, kv_seg, seed, cfg):
    """(dq, dk, dv, dbias in the bias' dtype, zeros without a bias)."""
    args = (dout, dlse.astype(lse.dtype), q, k, v, out, lse, bias, q_seg, kv_seg, seed)
    if cfg[-1]:
        dq, dk, dv, dbias = _bwd_kernel(bias.shape[0] != 1 or q.shape[0] == 1)(*args, **_static(cfg))
    else:
        dq, dk, dv, dbias = _bwd_reference(*args, **_static(cfg))
    has_bias = cfg[4]
    dbias = dbias.astype(bias.dtype) if has_bias else jnp.zeros_like(bias)
    return dq, dk, dv, dbias


def _flash_bwd(cfg, res, cts):
    q, k, v, bias, q_seg, kv_seg, seed, out, lse = res
    dout, dlse = cts
    dq, dk, dv, dbias = _backward(dout, dlse, q, k, v, out, lse, bias, q_seg, kv_seg, seed, cfg)
    return dq, dk, dv, dbias, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public ops
_warned_reference: set = set()


def _use_kernel(op: str, dtype, head_dim: int) -> bool:
    """Whether the kernels take this dtype and head_dim; otherwise the reference runs:
    an error under JAX_LS2_IMPL=cuda, a warning (once per cause) on a CUDA backend."""
    if jnp.dtype(dtype) in KERNEL_DTYPES and head_dim in KERNEL_HEAD_DIMS:
        return True
    why = (f"the CUDA kernel takes dtype in ({', '.join(str(d) for d in KERNEL_DTYPES)}) and head_dim in "
           f"{KERNEL_HEAD_DIMS}, got {jnp.dtype(dtype)} and {head_dim}")
    mode = _dispatch._impl_mode()
    if mode == "cuda":
        raise ValueError(f"{op}: {why} (JAX_LS2_IMPL=cuda demands the kernel; leave it unset to run the "
                         f"pure-JAX reference)")
    if mode == "auto" and _ffi.cuda_backend() and why not in _warned_reference:
        _warned_reference.add(why)
        warnings.warn(f"{op}: running the pure-JAX reference, which holds the (batch, heads, q_len, kv_len) "
                      f"logits in memory: {why}", _dispatch.KernelsUnavailableWarning, stacklevel=3)
    return False


def _check_segments(op, segment_ids, b, lq, lk):
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"{op}: segment_ids must be one array or a pair (q_segment_ids, kv_segment_ids), "
                             f"got a sequence of {len(segment_ids)}")
        q_seg, kv_seg = segment_ids
    else:
        if lq != lk:
            raise ValueError(f"{op}: segment_ids must be a pair (q_segment_ids, kv_segment_ids) when q_len "
                             f"({lq}) != kv_len ({lk}), got one array")
        q_seg = kv_seg = segment_ids
    for name, s, n in (("q_segment_ids", q_seg, lq), ("kv_segment_ids", kv_seg, lk)):
        _checks.check_array(op, name, s, dtypes=None)
        if not jnp.issubdtype(s.dtype, jnp.integer):
            raise TypeError(f"{op}: {name} must have an integer dtype, got {s.dtype}")
        _checks.check_shape(op, name, s, (b, n))
    return _checks.clamp_to_int32(q_seg), _checks.clamp_to_int32(kv_seg)


def flash_attention(q, k, v, *, bias=None, padding_mask=None, segment_ids=None, causal: bool = False,
                    scale: float | None = None, rate: float = 0.0, key=None, deterministic: bool = False,
                    return_lse: bool = False, q_offset=0, kv_offset=0, q_total: int | None = None,
                    kv_total: int | None = None):
    """Attention ``softmax(scale * q k^T + bias, masked) v`` with dropout on the
    probabilities, without a ``(q_len, kv_len)`` array in memory on the GPU.

    Args:
      q: ``(batch, q_len, heads, head_dim)`` float16 or bfloat16 for the CUDA kernel
        (head_dim 64 or 128); the reference takes any float dtype and head_dim.
      k, v: ``(batch, kv_len, kv_heads, head_dim)``, q's dtype; ``kv_heads`` divides
        ``heads`` (grouped-query attention: query head ``h`` reads kv head
        ``h // (heads // kv_heads)``). Any ``q_len, kv_len >= 1``.
      bias: optional additive bias of any float dtype, shape broadcastable to
        ``(batch, heads, q_len, kv_len)`` (rank 4, each dim 1 or equal); used in
        float32. Its gradient (summed over its broadcast dims) comes back in its dtype.
      padding_mask: optional bool ``(batch, kv_len)``, True = a real key.
      segment_ids: optional integer ``(batch, len)`` (when q_len == kv_len) or a pair
        ``(q_segment_ids (batch, q_len), kv_segment_ids (batch, kv_len))``: a query
        attends only keys of its own segment. Not together with ``padding_mask``.
      causal: query ``i`` attends keys ``j <= i + kv_len - q_len`` (aligned at the end,
        as ``jax.nn.dot_product_attention``).
      scale: static float, default ``1 / sqrt(head_dim)``.
      rate, key, deterministic: dropout on the probabilities (see the module
        docstring for the mask's numbering); ``key`` is required when ``rate > 0`` and
        not ``deterministic``.
      return_lse: also return the log-sum-exp of each row's logits, float32 (float64
        for float64 inputs).
      q_offset, kv_offset, q_total, kv_total: the dropout mask's numbering only (masks,
        causality and bias are those of this call alone): this call is the block
        ``[q_offset, q_offset + q_len) x [kv_offset, kv_offset + kv_len)`` of a
        ``q_total x kv_total`` attention, and element ``(b, h, i, j)`` gets the mask
        bit of element ``(b, h, q_offset + i, kv_offset + j)`` of that attention for the
        same key. Offsets: non-negative ints or integer scalars (traced ones too, e.g.
        from ``axis_index``; the caller keeps them in range); totals: static ints,
        default ``q_len`` and ``kv_len``, below 2**31.

    Returns:
      ``out`` ``(batch, q_len, heads, head_dim)`` in q's dtype, and with
      ``return_lse`` also ``lse`` ``(batch, heads, q_len)`` float32. A query with no
      attended key (fully masked) gets zeros and ``lse = -inf``, and zero gradients; a
      NaN logit (from a NaN in q, k or the bias) makes the out and lse of its row NaN, as
      ``jax.nn.logsumexp`` does, never the ``-inf`` of an empty row.

    Logits, softmax statistics and accumulation are float32. Kept for the backward:
    q, k, v, out and lse (and the bias, masks and seed); the backward recomputes the
    probabilities and regenerates the dropout mask. It accepts a cotangent for lse
    (``d lse_i / d s_ij = p_ij``), so partial attentions can be merged
    (`merge_attention`) and differentiated.
    """
    op = "flash_attention"
    for name, flag in (("return_lse", return_lse),):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{op}: {name} must be a Python bool, got {type(flag).__name__}")
    arrays, cfg = _prepare(op, q, k, v, bias=bias, padding_mask=padding_mask, segment_ids=segment_ids,
                           causal=causal, scale=scale, rate=rate, key=key, deterministic=deterministic,
                           q_offset=q_offset, kv_offset=kv_offset, q_total=q_total, kv_total=kv_total)
    q, k, v, bias_in, q_seg, kv_seg, seed = arrays
    out, lse = _flash(q, k, v, bias_in, q_seg, kv_seg, seed, cfg)
    return (out, lse) if return_lse else out


def flash_attention_bwd(dout, q, k, v, out, lse, *, dlse=None, bias=None, padding_mask=None, segment_ids=None,
                        causal: bool = False, scale: float | None = None, rate: float = 0.0, key=None,
                        deterministic: bool = False, q_offset=0, kv_offset=0, q_total: int | None = None,
                        kv_total: int | None = None):
    """The backward of `flash_attention` as one call, from a given ``out`` and ``lse``.

    With the ``out`` and ``lse`` of the attention over all keys (for instance merged
    from several blocks with `merge_attention`), the gradients this returns for a call
    over a subset of the keys (``k, v`` a block of them) are that block's share of the
    whole attention's gradients: ``dq`` sums over the blocks, and ``dk, dv`` (and
    ``dbias``) are the block's own. So a ring of blocks needs one backward call per
    block and no forward recomputation.

    Args:
      dout: ``(batch, q_len, heads, head_dim)``, q's dtype: the cotangent of ``out``.
      q, k, v: as for `flash_attention`.
      out: ``(batch, q_len, heads, head_dim)``, q's dtype: the attention's output (over
        all keys when this call is a block of it).
      lse: ``(batch, heads, q_len)`` float: its log-sum-exp (-inf for rows that attend
        nothing).
      dlse: optional cotangent of ``lse``, ``lse``'s shape (default zeros).
      bias, padding_mask, segment_ids, causal, scale, rate, key, deterministic, q_offset,
        kv_offset, q_total, kv_total: as for `flash_attention` (the same values as the
        forward of this block, so the dropout mask is regenerated).

    Returns:
      ``(dq, dk, dv)`` in the dtypes of q, k, v, and ``dbias`` (the bias' shape and
      dtype) after them when a bias is given. Not differentiable again.
    """
    op = "flash_attention_bwd"
    arrays, cfg = _prepare(op, q, k, v, bias=bias, padding_mask=padding_mask, segment_ids=segment_ids,
                           causal=causal, scale=scale, rate=rate, key=key, deterministic=deterministic,
                           q_offset=q_offset, kv_offset=kv_offset, q_total=q_total, kv_total=kv_total)
    q, k, v, bias_in, q_seg, kv_seg, seed = arrays
    b, lq, h, _ = q.shape
    for name, x in (("dout", dout), ("out", out)):
        _checks.check_array(op, name, x, dtypes=None, ndim=4)
        _checks.check_same_dtype(op, name, x, q.dtype)
        _checks.check_shape(op, name, x, q.shape)
    for name, x in (("lse", lse), ("dlse", dlse)):
        if x is None:
            continue
        _checks.check_array(op, name, x, dtypes=None)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must have a floating dtype, got {x.dtype}")
        _checks.check_shape(op, name, x, (b, h, lq))
    lse = lse.astype(jnp.promote_types(lse.dtype, F32))
    dlse = jnp.zeros(lse.shape, lse.dtype) if dlse is None else dlse.astype(lse.dtype)
    q, k, v, bias_in, dout, out, lse, dlse = match_varying(q, k, v, bias_in, dout, out, lse, dlse)
    dq, dk, dv, dbias = _backward(dout, dlse, q, k, v, out, lse, bias_in, q_seg, kv_seg, seed, cfg)
    if bias is None:
        return dq, dk, dv
    return dq, dk, dv, dbias.reshape(bias.shape).astype(bias.dtype)


def _check_offset(op, name, value, length, total):
    """A dropout offset as a uint32 scalar; a concrete one must fit in ``[0, total - length]``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be an int or an integer scalar array, got {value!r}")
    if isinstance(value, (int, np.integer)):
        if not 0 <= int(value) <= total - length:
            raise ValueError(f"{op}: {name} must be in [0, {total - length}] (the block must fit in the total "
                             f"length {total}), got {value}")
        return jnp.asarray(int(value), jnp.uint32)
    if not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.integer) or jnp.ndim(value) != 0:
        raise TypeError(f"{op}: {name} must be an int or an integer scalar array, got "
                        f"{getattr(value, 'dtype', type(value).__name__)} of shape {jnp.shape(value)}")
    return jnp.asarray(value).astype(jnp.uint32)


def _check_total(op, name, value, length):
    if value is None:
        return int(length)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be a static int or None, got {type(value).__name__}")
    if not length <= int(value) < 2**31:
        raise ValueError(f"{op}: {name} must be in [{length}, 2**31) (at least this call's length), got {value}")
    return int(value)


def _first_rows_word(op, q_shape):
    """uint32[1]: the seed's shard offset word for q's rows inside `_random.batch_rows_from`
    (a pipeline's micro-batch): the query elements before its first row; 0 outside."""
    first_row = _random.batch_row_offset()
    if first_row is None:
        return jnp.zeros((1,), jnp.uint32)
    b, lq, h, d = q_shape
    per_row = lq * h * d
    if per_row >= 2**32:
        raise ValueError(f"{op}: inside batch_rows_from a batch row of q must have fewer than 2**32 elements "
                         f"(q_len x heads x head_dim), got q of shape {tuple(q_shape)}")
    return (jnp.asarray(first_row, jnp.uint32) * np.uint32(per_row))[None]


def _prepare(op, q, k, v, *, bias, padding_mask, segment_ids, causal, scale, rate, key, deterministic, q_offset,
             kv_offset, q_total, kv_total):
    """Checks the arguments shared by the forward and the backward; returns
    ``((q, k, v, bias_in, q_seg, kv_seg, seed), cfg)`` for `_flash` / `_backward`."""
    _checks.check_array(op, "q", q, dtypes=None, ndim=4)
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"{op}: q must have a floating dtype, got {q.dtype}")
    _checks.check_array(op, "k", k, dtypes=None, ndim=4)
    _checks.check_array(op, "v", v, dtypes=None, ndim=4)
    _checks.check_same_dtype(op, "k", k, q.dtype)
    _checks.check_same_dtype(op, "v", v, q.dtype)
    b, lq, h, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    if lq < 1 or d < 1:
        raise ValueError(f"{op}: q must have q_len >= 1 and head_dim >= 1, got shape {tuple(q.shape)}")
    if lk < 1:
        raise ValueError(f"{op}: k must have kv_len >= 1, got shape {tuple(k.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{op}: k must have shape ({b}, kv_len, kv_heads, {d}) (q's batch and head_dim), "
                         f"got {tuple(k.shape)}")
    _checks.check_shape(op, "v", v, k.shape)
    if hk < 1 or h % hk:
        raise ValueError(f"{op}: kv_heads ({hk}, k.shape[2]) must divide heads ({h}, q.shape[2])")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, (jax.Array, np.ndarray)) and not isinstance(scale, jax.core.Tracer):
        scale = float(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not np.isfinite(scale):
        raise TypeError(f"{op}: scale must be a finite Python float (static) or None, got {scale!r}")
    for name, flag in (("causal", causal),):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{op}: {name} must be a Python bool, got {type(flag).__name__}")
    deterministic = _checks.check_deterministic(op, deterministic)
    has_bias = bias is not None
    if has_bias:
        _checks.check_array(op, "bias", bias, dtypes=None)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"{op}: bias must have a floating dtype, got {bias.dtype}")
        _checks.check_broadcastable(op, "bias", bias, (b, h, lq, lk))
        bias_in = bias.astype(_compute_dtype(q.dtype))
    else:
        bias_in = jnp.zeros((1, 1, 1, 1), _compute_dtype(q.dtype))
    if padding_mask is not None and segment_ids is not None:
        raise ValueError(f"{op}: pass padding_mask or segment_ids, not both")
    has_seg = padding_mask is not None or segment_ids is not None
    if padding_mask is not None:
        _checks.check_array(op, "padding_mask", padding_mask, dtypes=(jnp.dtype(bool),))
        _checks.check_shape(op, "padding_mask", padding_mask, (b, lk))
        # A padded key gets segment -1, which no query has.
        q_seg = jnp.zeros((1, 1), jnp.int32)
        kv_seg = jnp.where(padding_mask, 0, -1).astype(jnp.int32)
    elif segment_ids is not None:
        q_seg, kv_seg = _check_segments(op, segment_ids, b, lq, lk)
    else:
        q_seg = kv_seg = jnp.zeros((1, 1), jnp.int32)
    rate = _checks.check_rate(op, rate, key, deterministic)
    threshold = 0 if deterministic else _random.dropout_threshold(rate)
    q_total = _check_total(op, "q_total", q_total, lq)
    kv_total = _check_total(op, "kv_total", kv_total, lk)
    offsets = jnp.stack([_check_offset(op, "q_offset", q_offset, lq, q_total),
                         _check_offset(op, "kv_offset", kv_offset, lk, kv_total)])
    if threshold:
        # (k0, k1, shard offset, q_offset, kv_offset)
        seed = jnp.concatenate([_random.seed_words(key)[:2], _first_rows_word(op, q.shape), offsets])
        keep_scale = _random.keep_scale(rate)
    else:
        seed = jnp.zeros((5,), jnp.uint32)
        keep_scale = 1.0
    use_kernel = _use_kernel(op, q.dtype, d)
    cfg = (float(scale), bool(causal), int(threshold), float(keep_scale), has_bias, has_seg, q_total, kv_total,
           use_kernel)
    q, k, v, bias_in = match_varying(q, k, v, bias_in)
    return (q, k, v, bias_in, q_seg, kv_seg, seed), cfg




def merge_attention(out1, lse1, out2, lse2):
    """Combines two attentions of the same queries over disjoint key sets.

    Args:
      out1, out2: ``(batch, q_len, heads, head_dim)``, each normalised over its keys.
      lse1, lse2: ``(batch, heads, q_len)`` float32, their log-sum-exps (-inf where a
        row attended no key).

    Returns:
      ``(out, lse)``: the attention over the union of the key sets, out in out1's dtype
      (computed in float32), ``lse = log(exp(lse1) + exp(lse2))``. The weights are
      ``sigmoid(lse1 - lse2)`` and ``sigmoid(lse2 - lse1)`` and the new lse
      ``max + softplus(-|lse1 - lse2|)``, so nothing overflows; rows with both lse
      ``-inf`` give zeros and ``-inf``. Differentiable by autodiff, with finite
      gradients there too.
    """
    op = "merge_attention"
    for name, o in (("out1", out1), ("out2", out2)):
        _checks.check_array(op, name, o, dtypes=None, ndim=4)
        if not jnp.issubdtype(o.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must have a floating dtype, got {o.dtype}")
    _checks.check_shape(op, "out2", out2, out1.shape)
    b, lq, h, _ = out1.shape
    for name, s in (("lse1", lse1), ("lse2", lse2)):
        _checks.check_array(op, name, s, dtypes=None)
        if not jnp.issubdtype(s.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must have a floating dtype, got {s.dtype}")
        _checks.check_shape(op, name, s, (b, h, lq))
    ct = jnp.promote_types(_compute_dtype(out1.dtype), _compute_dtype(lse1.dtype))
    l1, l2 = lse1.astype(ct), lse2.astype(ct)
    both = jnp.isneginf(l1) & jnp.isneginf(l2)
    l1 = jnp.where(both, 0, l1)
    l2 = jnp.where(both, 0, l2)
    diff = l1 - l2
    w1 = jax.nn.sigmoid(diff)
    w2 = jax.nn.sigmoid(-diff)
    lse = jnp.maximum(l1, l2) + jax.nn.softplus(-jnp.abs(diff))
    lse = jnp.where(both, -jnp.inf, lse)
    w1 = jnp.swapaxes(w1, 1, 2)[..., None]
    w2 = jnp.swapaxes(w2, 1, 2)[..., None]
    out = w1 * out1.astype(ct) + w2 * out2.astype(ct)
    return out.astype(out1.dtype), lse.astype(lse1.dtype)
