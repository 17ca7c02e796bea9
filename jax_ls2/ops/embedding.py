"""Fused token + position embedding with dropout.

The dropout mask numbers an output element by its global coordinates (its flat
row-major index in the whole ``(..., hidden)`` output, 64-bit;
`jax_ls2._random.keep_mask_at`), so under ``jit`` the ids may stay sharded along any dim
(batch, sequence) and each shard draws its block of the unsharded mask; inside
``shard_map`` pass ``shard_spec``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random
from jax_ls2._dispatch import OFFSETS, PARAM, ROWS, SEED, SUM, FusedKernel, Role, match_varying, result_type
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks

F32 = jnp.float32
_POS_NONE, _POS_LEARNED, _POS_SINUSOIDAL = 0, 1, 2
_GRAD_MODES = ("atomic", "sorted")


def sinusoid_inv_freq(hidden: int) -> jax.Array:
    """``(hidden // 2,)`` float32 frequencies of the sinusoidal positions:
    ``exp(-i * log(10000) / (hidden // 2 - 1))``. Position ``p`` is embedded as
    ``[sin(p * f), cos(p * f)]`` (fairseq / LightSeq layout), plus a zero column when
    ``hidden`` is odd."""
    half = hidden // 2
    return jnp.exp(jnp.arange(max(half, 1), dtype=F32) * -(math.log(10000.0) / max(half - 1, 1)))


def _keep(seed, offsets, out_shape, threshold, strides):
    """The keep mask of the output block ``out_shape`` whose ids start at ``offsets``."""
    offsets = jnp.concatenate([offsets, jnp.zeros((1,), jnp.uint32)])
    return _random.keep_mask_at(seed, offsets, out_shape, strides, threshold)


# ---------------------------------------------------------------- reference math
def _fwd_reference(ids, positions, table, pos_table, inv_freq, seed, offsets, *, scale, pos_mode, padding_idx,
                   has_padding, threshold, keep_scale, out_dtype, strides):
    vocab, hidden = table.shape
    idc = jnp.clip(ids, 0, vocab - 1)
    x = jnp.take(table, idc, axis=0).astype(F32) * np.float32(scale)
    if pos_mode == _POS_LEARNED:
        pc = jnp.clip(positions, 0, pos_table.shape[0] - 1)
        x = x + jnp.take(pos_table, pc, axis=0).astype(F32)
    elif pos_mode == _POS_SINUSOIDAL:
        half = hidden // 2
        ang = positions.astype(F32)[..., None] * inv_freq[:half]
        sin = jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)
        if hidden % 2:
            sin = jnp.pad(sin, [(0, 0)] * (sin.ndim - 1) + [(0, 1)])
        x = x + sin
    if has_padding:
        x = jnp.where((idc == padding_idx)[..., None], 0.0, x)
    if threshold > 0:
        keep = _keep(seed, offsets, x.shape, threshold, strides)
        x = jnp.where(keep, x * np.float32(keep_scale), 0.0)
    return (x.astype(out_dtype),)


def _row_grads(dout, ids, seed, offsets, vocab, padding_idx, has_padding, threshold, keep_scale, strides):
    hidden = dout.shape[-1]
    g = dout.astype(F32)
    if threshold > 0:
        keep = _keep(seed, offsets, g.shape, threshold, strides)
        g = jnp.where(keep, g * np.float32(keep_scale), 0.0)
    idc = jnp.clip(ids, 0, vocab - 1)
    if has_padding:
        g = jnp.where((idc == padding_idx)[..., None], 0.0, g)
    return g.reshape(-1, hidden), idc.reshape(-1)


def _bwd_reference(ids, positions, dout, seed, offsets, *, scale, pos_mode, padding_idx, has_padding, threshold,
                   keep_scale, vocab, max_pos, grad_mode, strides):
    hidden = dout.shape[-1]
    g, idc = _row_grads(dout, ids, seed, offsets, vocab, padding_idx, has_padding, threshold, keep_scale, strides)
    dtable = jnp.zeros((vocab, hidden), F32).at[idc].add(g * np.float32(scale))
    dpos = jnp.zeros((max_pos, hidden), F32)
    if pos_mode == _POS_LEARNED:
        dpos = dpos.at[jnp.clip(positions, 0, max_pos - 1).reshape(-1)].add(g)
    return dtable, dpos


# ---------------------------------------------------------------- CUDA calls
def _attrs(ids, positions, table_or_dout, *arrays, scale, pos_mode, padding_idx, has_padding, threshold,
           keep_scale, strides, grad_mode=None, **shapes):
    # The output's (or dout's) local shape: the ids' plus hidden, the last dim of the table or of dout.
    out_shape = ids.shape + table_or_dout.shape[-1:]
    attrs = dict(scale=np.float32(scale), pos_mode=np.int64(pos_mode), padding_idx=np.int64(padding_idx),
                 has_padding=bool(has_padding), threshold=np.int64(threshold), keep_scale=np.float32(keep_scale),
                 **_random.kernel_row_attrs(out_shape, threshold, strides))
    if grad_mode is not None:
        attrs["deterministic"] = grad_mode == "sorted"
    return attrs


def _fwd_types(ids, positions, table, *arrays, out_dtype, **static):
    return (result_type(ids, ids.shape + (table.shape[1],), out_dtype),)


def _bwd_types(ids, positions, dout, seed, offsets, *, vocab, max_pos, **static):
    hidden = dout.shape[-1]
    return result_type(dout, (vocab, hidden), F32), result_type(dout, (max_pos, hidden), F32)


def _order(keys, n):
    flat = jnp.clip(keys, 0, n - 1).reshape(-1)
    return jnp.argsort(flat, stable=True).astype(jnp.int32).reshape(keys.shape)


def _kernel_seed(seed, offsets, strides):
    # The ids' offsets against the output's strides but the last (hidden, never split).
    return _random.kernel_seed(seed, offsets, strides[:-1])


def _fwd_operands(ids, positions, table, pos_table, inv_freq, seed, offsets, *, strides, **static):
    return ids, positions, table, pos_table, inv_freq, _kernel_seed(seed, offsets, strides)


def _bwd_operands(ids, positions, dout, seed, offsets, *, pos_mode, vocab, max_pos, grad_mode, strides, **static):
    # The kernel also takes the order in which to visit the rows: sorted by id (and by
    # position) for the reproducible mode; unused (ids passed as a placeholder) otherwise.
    det = grad_mode == "sorted"
    tok_order = _order(ids, vocab) if det else ids
    pos_order = _order(positions, max_pos) if det and pos_mode == _POS_LEARNED else ids
    return dout, ids, positions, _kernel_seed(seed, offsets, strides), tok_order, pos_order


# ids come first in both kernels: the offsets are the ids' (every dim shardable); with
# dropout active, vmap runs the examples one by one, each drawing its own mask.
_I, _X, _P, _S, _O = Role(ROWS, 0), Role(ROWS, 1), Role(PARAM), Role(SEED), Role(OFFSETS)
_FWD = FusedKernel("jax_ls2_embedding_fwd", _fwd_reference, operands=(_I, _I, _P, _P, _P, _S, _O), results=(_X,),
                   result_types=_fwd_types, attrs=_attrs, ffi_operands=_fwd_operands, vmap_method="broadcast_all",
                   per_example=_random.dropping)
_BWD = FusedKernel("jax_ls2_embedding_bwd", _bwd_reference, operands=(_I, _I, _X, _S, _O),
                   results=(Role(SUM), Role(SUM)), result_types=_bwd_types, attrs=_attrs,
                   ffi_operands=_bwd_operands, vmap_method="sequential", per_example=_random.dropping)


# ---------------------------------------------------------------- custom_vjp
# cfg: (scale, pos_mode, padding_idx, has_padding, threshold, keep_scale, out_dtype, strides, grad_mode,
#       vocab, max_pos, table dtype, pos_table dtype), all static
def _fwd_static(cfg):
    scale, pos_mode, padding_idx, has_padding, threshold, keep_scale, out_dtype, strides = cfg[:8]
    return dict(scale=scale, pos_mode=pos_mode, padding_idx=padding_idx, has_padding=has_padding,
                threshold=threshold, keep_scale=keep_scale, out_dtype=out_dtype, strides=strides)


@functools.partial(fused_vjp, nondiff_argnums=(7,), op="embedding",
                   plain="jnp.take(table, ids, axis=0) * scale (+ the positions' rows)")
def _embedding(ids, positions, table, pos_table, inv_freq, seed, offsets, cfg):
    return _FWD(ids, positions, table, pos_table, inv_freq, seed, offsets, **_fwd_static(cfg))[0]


def _embedding_fwd(ids, positions, table, pos_table, inv_freq, seed, offsets, cfg):
    out = _FWD(ids, positions, table, pos_table, inv_freq, seed, offsets, **_fwd_static(cfg))[0]
    return out, (ids, positions, seed, offsets)


def _embedding_bwd(cfg, res, dout):
    ids, positions, seed, offsets = res
    grad_mode, vocab, max_pos, tdt, pdt = cfg[8:]
    st = _fwd_static(cfg)
    st.pop("out_dtype")
    dtable, dpos = _BWD(ids, positions, dout, seed, offsets, vocab=vocab, max_pos=max_pos, grad_mode=grad_mode,
                        **st)
    # Under shard_map the gradients vary as dout does, like the tables they are for (an
    # unused position table's zero gradient included).
    dtable, dpos = match_varying(dout, dtable, dpos)[1:]
    return None, None, dtable.astype(tdt), dpos.astype(pdt), None, None, None


_embedding.defvjp(_embedding_fwd, _embedding_bwd, optimize_remat=True)


def _out_spec(shard_spec, ndim):
    """The output's spec from the ids': hidden never split."""
    if shard_spec is None:
        return None
    spec = tuple(shard_spec)
    return spec + (None,) * (ndim - len(spec)) + (None,) if len(spec) <= ndim else spec


def _check_index_range(op, name, x, n, what):
    if not isinstance(x, jax.core.Tracer) and x.size:
        v = np.asarray(x)
        bad = (v < 0) | (v >= n)
        if bad.any():
            raise ValueError(f"{op}: {name} must be in [0, {n}) ({what}), got {v[bad].reshape(-1)[0]}")


def embedding(ids, table, *, scale: float = 1.0, positions=None, pos_table=None, sinusoidal: bool = False,
              padding_idx: int | None = None, rate: float = 0.0, key=None, deterministic: bool = False,
              dtype=None, grad_mode: str = "atomic", shard_spec=None):
    """``dropout(scale * table[ids] + P[positions])`` in one kernel.

    Args:
      ids: ``(...)`` integer token ids in ``[0, vocab)``.
      table: ``(vocab, hidden)`` float32, float16 or bfloat16 (any vocab size < 2**31).
      scale: multiplies the token embedding (e.g. ``sqrt(hidden)``), not the positions.
      positions: ``(...)`` integer, broadcastable to ``ids.shape``; default
        ``0 .. ids.shape[-1] - 1`` along the last axis (a ``pos_table`` must have that
        many rows, else ``ValueError``). Used with ``pos_table`` or ``sinusoidal``.
      pos_table: ``(max_positions, hidden)`` learned positions, ``table.dtype``.
      sinusoidal: add ``[sin(p * f), cos(p * f)]`` (see `sinusoid_inv_freq`), computed
        in the kernel.
      padding_idx: ids equal to it give a zero output row and no gradient (to either
        table).
      rate, key, deterministic: dropout on the sum with the shared counter-based mask
        (``jax_ls2._random``) over the flat output, numbered in the whole output;
        ``key`` a JAX PRNG key.
      dtype: output dtype (default ``table.dtype``); e.g. an fp32 table with bf16
        activations, read and cast in the kernel.
      grad_mode: ``"atomic"`` (fp32 atomics: fast, summation order varies between
        runs) or ``"sorted"`` (rows sorted by id, each id's rows summed in a fixed
        order: bitwise reproducible).
      shard_spec: inside ``shard_map`` only: how ``ids`` is split over the manual mesh
        axes, its ``in_specs`` entry, so this device draws its block of the whole
        output's mask (and default positions count from the block's first position).
        Default: ``ids`` are the whole array.

    Returns:
      ``(..., hidden)`` in ``dtype``.

    Out-of-range ids (and learned positions) raise ``ValueError`` when they are
    concrete; traced ones are clamped into the table (the output and the gradient use
    the clamped row). The forward keeps only ids, positions and the 3-word seed; the
    backward regenerates the mask and accumulates the table gradients in float32,
    returned in the tables' dtypes.
    """
    op = "embedding"
    _checks.check_array(op, "ids", ids, dtypes=None, min_ndim=1)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{op}: ids must have an integer dtype, got {ids.dtype}")
    _checks.check_array(op, "table", table, ndim=2)
    vocab, hidden = table.shape
    if not 1 <= vocab < 2**31 or hidden < 1:
        raise ValueError(f"{op}: table must be (vocab, hidden) with 1 <= vocab < 2**31 and hidden >= 1, "
                         f"got {tuple(table.shape)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"{op}: scale must be a Python float, got {type(scale).__name__}")
    if pos_table is not None and sinusoidal:
        raise ValueError(f"{op}: pass pos_table (learned) or sinusoidal=True, not both")
    if positions is not None and pos_table is None and not sinusoidal:
        raise ValueError(f"{op}: positions given without pos_table or sinusoidal=True")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)):
            raise TypeError(f"{op}: padding_idx must be a Python int or None, got {type(padding_idx).__name__}")
        if not 0 <= int(padding_idx) < vocab:
            raise ValueError(f"{op}: padding_idx must be in [0, {vocab}), got {padding_idx}")
    if grad_mode not in _GRAD_MODES:
        raise ValueError(f"{op}: grad_mode must be 'atomic' or 'sorted', got {grad_mode!r}")
    try:
        out_dtype = jnp.dtype(table.dtype if dtype is None else dtype)
    except TypeError:
        out_dtype = None
    if out_dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be one of float32, float16, bfloat16, got "
                        f"{dtype if out_dtype is None else out_dtype!r}")
    deterministic = _checks.check_deterministic(op, deterministic)
    rate = _checks.check_rate(op, rate, key, deterministic)
    _check_index_range(op, "ids", ids, vocab, "the table's rows")

    pos_mode = _POS_LEARNED if pos_table is not None else (_POS_SINUSOIDAL if sinusoidal else _POS_NONE)
    if pos_mode == _POS_LEARNED:
        _checks.check_array(op, "pos_table", pos_table, ndim=2)
        _checks.check_shape(op, "pos_table", pos_table, (pos_table.shape[0], hidden))
        _checks.check_same_dtype(op, "pos_table", pos_table, table.dtype)
        if pos_table.shape[0] < 1:
            raise ValueError(f"{op}: pos_table must have at least one row, got {tuple(pos_table.shape)}")
    else:
        pos_table = jnp.zeros((1, hidden), table.dtype)
    if pos_mode == _POS_NONE:
        positions = jnp.zeros(ids.shape, jnp.int32)
    elif positions is None:
        # This block's positions in the whole sequence (inside shard_map, its offset).
        ids_offsets, ids_global = _random.shard_box(op, ids.shape, shard_spec)
        length = ids_global[-1]
        if pos_mode == _POS_LEARNED and length > pos_table.shape[0]:
            raise ValueError(f"{op}: the default positions 0 .. {length - 1} need a pos_table of at least "
                             f"{length} rows, got {pos_table.shape[0]}")
        first = ids_offsets[-1].astype(jnp.int32)
        positions = jnp.broadcast_to(first + jnp.arange(ids.shape[-1], dtype=jnp.int32), ids.shape)
    else:
        _checks.check_array(op, "positions", positions, dtypes=None)
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"{op}: positions must have an integer dtype, got {positions.dtype}")
        try:
            np.broadcast_shapes(positions.shape, ids.shape)
        except ValueError:
            raise ValueError(f"{op}: positions must be broadcastable to {tuple(ids.shape)}, "
                             f"got {tuple(positions.shape)}") from None
        if pos_mode == _POS_LEARNED:
            _check_index_range(op, "positions", positions, pos_table.shape[0], "the pos_table's rows")
        positions = jnp.broadcast_to(_checks.clamp_to_int32(positions), ids.shape)
    inv_freq = sinusoid_inv_freq(hidden)

    dropping = rate > 0.0 and not deterministic
    threshold = _random.dropout_threshold(rate) if dropping else 0
    keep = _random.keep_scale(rate) if dropping else 1.0
    seed = _random.seed_words(key) if dropping else _random.no_seed()
    offsets, strides = _random.numbering(op, ids.shape + (hidden,), _out_spec(shard_spec, ids.ndim), threshold)
    offsets = offsets[:-1]  # the ids' dims; hidden is never split
    cfg = (float(scale), pos_mode, int(padding_idx or 0), padding_idx is not None, int(threshold), float(keep),
           out_dtype.name, strides, grad_mode, vocab, pos_table.shape[0], jnp.dtype(table.dtype).name,
           jnp.dtype(pos_table.dtype).name)
    # Under shard_map, replicated tables meeting per-device ids become per-device too, and
    # their gradients are summed over the devices (see match_varying).
    ids, positions, table, pos_table = match_varying(_checks.clamp_to_int32(ids), positions, table, pos_table)
    return _embedding(ids, positions, table, pos_table, inv_freq, seed, offsets, cfg)
