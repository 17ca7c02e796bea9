"""Ring attention: self-attention over a sequence split into chunks across a mesh axis,
each device holding its chunk, keys and values passed around the ring with ``ppermute``.

Call `ring_attention` inside ``shard_map`` over the sequence axis (or inside
``jax.vmap(..., axis_name=...)``, which runs the same ring on one device with the mapped
axis as ``P`` virtual devices). Device ``r`` of the ring of size ``P`` holds the queries,
keys and values of its chunk of ``c = L / P`` positions. Two algorithms:

``impl="rsa"`` (Ring Self-Attention, Li et al. 2021, as the paper writes it)
  Forward: the key chunks travel once around the ring, so each device builds its full
  rows of scores ``(batch, heads, c, L)`` (its queries against every key), takes the
  softmax (and dropout) over them, then the value chunks travel around the ring and
  each device sums its probabilities times each value chunk. Backward, as the paper
  derives it: the value chunks travel again to form the probability gradients while the
  ``dV`` partial sums travel with them and arrive at their owner, then the softmax
  backward, then the key chunks travel again for ``dQ`` while the ``dK`` partial sums
  travel and arrive. (The paper's code all-reduces full-length ``dK``/``dV`` buffers and
  keeps its own slice: the same sums; passing each partial sum around the ring is the
  reduce-scatter half of that ring all-reduce, the only half whose result is used.)
  Memory: the ``(batch, heads, c, L)`` float32 probabilities are kept for the backward,
  the quantity the paper's memory comparison is about.

``impl="flash"``
  The key/value blocks travel around the ring; at each step every device runs
  ``ops.flash_attention(..., return_lse=True)`` on its queries against the block it
  holds and folds the result into a running ``(out, lse)`` with
  ``ops.merge_attention``. The next block's ``ppermute`` is started before the current
  block's attention (they are independent, so the scheduler may overlap them). Backward
  (custom VJP): the blocks travel again with float32 ``dK``/``dV`` accumulators that
  arrive at their owner after ``P`` steps; each block's gradient is one
  ``ops.flash_attention_bwd`` call given the merged ``out`` and ``lse`` (the
  probabilities ``exp(s - lse)`` of the whole row restricted to the block), so no block
  forward is recomputed. Kept for the backward: q, k, v, out, lse and the padding mask,
  all O(chunk); nothing of size chunk x L is ever held (the CPU reference of the flash op
  holds one (batch, heads, c, c) block at a time). Dropout: each call numbers its mask by
  the global positions of its queries and keys (``q_offset``/``kv_offset`` of the flash
  op), so under zigzag, with dropout on, calls cover one piece of queries and one of keys
  (quarter blocks) rather than whole chunks.

Layout (``balance``):

``"none"``
  device ``r`` holds positions ``[r c, (r + 1) c)``. Under a causal mask device ``r``
  attends ``r + 1`` of the ``P`` blocks, so the last device sets the pace.
``"zigzag"``
  the sequence is cut into ``2P`` pieces of ``c / 2`` and device ``r`` holds pieces ``r``
  and ``2P - 1 - r``, in that order. Under a causal mask every device then does the same
  work: besides its own (causal) block it attends, at each step, two of the four
  ``c/2 x c/2`` quarter blocks of the block it holds (the other two are fully masked and
  skipped by construction, no branch). Put a global sequence into this layout with
  `zigzag_permute` before sharding it over the axis (and positions for embeddings with
  `zigzag_order`), and back with `zigzag_unpermute`; or, inside ``shard_map``, exchange
  contiguous chunks for zigzag ones with `to_zigzag_chunks` (two half-chunk
  ``ppermute``s) and back with `from_zigzag_chunks`. The layout does not depend on
  ``causal``: non-causal attention runs on it too (every block is full).

Dropout (both impls): the mask is the single-device mask of ``ops.flash_attention``
for the same key: element ``(b, h, i, j)`` (global query and key positions) has the
64-bit counter ``((b * heads + h) * L + i) * L + j`` of the generator in
`jax_ls2._random`, whatever ``P`` and the layout. ``b`` is the index in this device's batch: where a data
axis also splits the batch, fold that axis' index into the key. The key must be the
same on every device of the ring.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random
from jax_ls2._dispatch import match_varying
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks
from jax_ls2.ops.flash_attention import attention_keep_mask, flash_attention, flash_attention_bwd, merge_attention
from jax_ls2.parallel.tensor import bound_axis_size

_OP = "ring_attention"
IMPLS = ("flash", "rsa")
BALANCES = ("zigzag", "none")
_HI = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------- layout functions
def zigzag_order(length: int, ring_size: int) -> np.ndarray:
    """int ``(length,)``: the global position held at each index of the zigzag layout
    (device ``r``'s chunk is indices ``[r c, (r + 1) c)``: pieces ``r`` and
    ``2 ring_size - 1 - r`` of ``2 ring_size`` pieces of ``c / 2``).

    Raises ValueError unless ``length`` is divisible by ``2 * ring_size``."""
    return _zigzag_order("zigzag_order", length, ring_size)


def _zigzag_order(op, length, ring_size):
    length, ring_size = _check_layout(op, length, ring_size)
    piece = length // (2 * ring_size)
    pieces = np.arange(length).reshape(2 * ring_size, piece)
    order = [pieces[i] for r in range(ring_size) for i in (r, 2 * ring_size - 1 - r)]
    return np.concatenate(order)


def zigzag_permute(x, ring_size: int, *, axis: int = 1):
    """``x`` with its sequence dim ``axis`` (length ``L``, default 1 as in ``(batch, L,
    ...)``) put in zigzag order for a ring of ``ring_size``; shard the result over the
    sequence axis. Raises ValueError unless ``L`` is divisible by ``2 * ring_size``."""
    return jnp.take(x, _zigzag_order("zigzag_permute", _seq_len("zigzag_permute", x, axis), ring_size), axis=axis)


def zigzag_unpermute(x, ring_size: int, *, axis: int = 1):
    """The inverse of `zigzag_permute`: ``x`` in zigzag order back to natural order."""
    order = _zigzag_order("zigzag_unpermute", _seq_len("zigzag_unpermute", x, axis), ring_size)
    return jnp.take(x, np.argsort(order), axis=axis)


def _piece_destinations(ring_size: int, parity: int) -> list:
    """(device, device) pairs: where each device's natural piece ``2 r + parity`` lives in
    the zigzag layout (piece ``j`` on device ``j`` if ``j < P``, else ``2P - 1 - j``)."""
    home = lambda j: j if j < ring_size else 2 * ring_size - 1 - j  # noqa: E731
    return [(r, home(2 * r + parity)) for r in range(ring_size)]


def to_zigzag_chunks(x, axis_name: str, *, axis: int = 1):
    """Inside ``shard_map`` over ``axis_name``: this device's contiguous chunk ``x``
    (device ``r`` holding positions ``[r c, (r + 1) c)`` along dim ``axis``) exchanged
    for its chunk of the zigzag layout (pieces ``r`` and ``2P - 1 - r`` of ``c / 2``),
    the layout `ring_attention` balances causal work with. Two ``ppermute``s of half a
    chunk each; nothing is gathered. Raises ValueError for an odd chunk."""
    ring = _ring_size("to_zigzag_chunks", x, axis_name, axis)
    first, second = jnp.split(x, 2, axis=axis)  # natural pieces 2r and 2r + 1
    even = jax.lax.ppermute(first, axis_name, _piece_destinations(ring, 0))
    odd = jax.lax.ppermute(second, axis_name, _piece_destinations(ring, 1))
    # device d's pieces d and 2P-1-d: the even one comes first on an even device
    even_device = jax.lax.axis_index(axis_name) % 2 == 0
    return jnp.concatenate([jnp.where(even_device, even, odd), jnp.where(even_device, odd, even)], axis=axis)


def from_zigzag_chunks(x, axis_name: str, *, axis: int = 1):
    """The inverse of `to_zigzag_chunks`: this device's zigzag chunk back to its
    contiguous chunk."""
    ring = _ring_size("from_zigzag_chunks", x, axis_name, axis)
    a, b = jnp.split(x, 2, axis=axis)
    even_device = jax.lax.axis_index(axis_name) % 2 == 0
    back = lambda pairs: [(dst, src) for src, dst in pairs]  # noqa: E731
    first = jax.lax.ppermute(jnp.where(even_device, a, b), axis_name, back(_piece_destinations(ring, 0)))
    second = jax.lax.ppermute(jnp.where(even_device, b, a), axis_name, back(_piece_destinations(ring, 1)))
    return jnp.concatenate([first, second], axis=axis)


def _ring_size(op, x, axis_name, axis):
    ring = bound_axis_size(axis_name)
    if ring is None:
        raise ValueError(f"{op}: axis_name {axis_name!r} must be a mapped axis (call inside shard_map over it)")
    if _seq_len(op, x, axis) % 2:
        raise ValueError(f"{op}: the chunk length ({x.shape[axis]}) must be even for the zigzag layout")
    return ring


def _seq_len(op, x, axis):
    if not hasattr(x, "shape") or not -len(x.shape) <= axis < len(x.shape):
        raise ValueError(f"{op}: axis {axis} must name a dim of x, got x of shape {getattr(x, 'shape', None)}")
    return int(x.shape[axis])


def _check_layout(op, length, ring_size):
    for name, value in (("length", length), ("ring_size", ring_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    if length % (2 * ring_size):
        raise ValueError(f"{op}: the sequence length ({length}) must be divisible by 2 x the ring size "
                         f"(2 x {ring_size} = {2 * ring_size}) for the zigzag layout")
    return int(length), int(ring_size)


# ---------------------------------------------------------------- the static configuration
class _Cfg(NamedTuple):
    axis_name: str
    ring: int        # P, devices on the ring
    chunk: int       # c, positions per device
    causal: bool
    zigzag: bool
    scale: float
    threshold: int   # dropout's 16-bit threshold, 0: no dropout
    keep_scale: float
    has_mask: bool
    rate: float      # the dropout rate (0.0 when off)


def _shift(cfg: _Cfg, tree):
    """Every device sends ``tree`` to the next device of the ring (and receives the previous one's)."""
    return jax.lax.ppermute(tree, cfg.axis_name, [(i, (i + 1) % cfg.ring) for i in range(cfg.ring)])


def _around_ring(cfg: _Cfg, rank, held):
    """Yields ``(step, src, block)`` for the P steps of a ring pass: at ``step`` this
    device holds ``block``, which started on device ``src``. The next block's transfer is
    issued before the step's work is traced, so the two can overlap."""
    for step in range(cfg.ring):
        received = _shift(cfg, held) if step + 1 < cfg.ring else None
        yield step, (rank - step) % cfg.ring, held
        held = received


def _pieces(cfg: _Cfg, device):
    """Device ``device``'s chunk as ``[(global_offset, local_offset, length)]`` runs."""
    c = cfg.chunk
    if not cfg.zigzag:
        return [(device * c, 0, c)]
    h = c // 2
    return [(device * h, 0, h), ((2 * cfg.ring - 1 - device) * h, h, h)]


def _positions(cfg: _Cfg, device):
    """int32 ``(c,)``: the global positions of device ``device``'s chunk."""
    return jnp.concatenate([off + jnp.arange(n) for off, _, n in _pieces(cfg, device)])


def _rows(x, offset, length, axis):
    if isinstance(offset, int) and offset == 0 and length == x.shape[axis]:
        return x
    return jax.lax.dynamic_slice_in_dim(x, offset, length, axis)


def _put(x, part, offset, axis):
    if isinstance(offset, int) and offset == 0 and part.shape[axis] == x.shape[axis]:
        return part
    return jax.lax.dynamic_update_slice_in_dim(x, part, offset, axis)


def _filled(like, shape, value, dtype):
    """An array of ``shape`` filled with ``value``, varying like ``like`` inside shard_map."""
    return match_varying(like, jnp.full(shape, value, dtype))[1]


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


# ---------------------------------------------------------------- impl="flash"
class _Block(NamedTuple):
    """Queries ``[q_off, q_off + n)`` of this device against keys ``[kv_off, kv_off + m)``
    of the block it holds; ``live``: None (always) or a traced bool (else skipped)."""
    q_off: object
    n: int
    kv_off: object
    m: int
    causal: bool
    live: object


def _global(cfg: _Cfg, device, local):
    """The global position of local index ``local`` of device ``device``'s chunk, for a
    ``local`` that starts a run of `_pieces` or lies inside one."""
    c = cfg.chunk
    if not cfg.zigzag:
        return device * c + local
    h = c // 2
    return jnp.where(local < h, device * h + local, (2 * cfg.ring - 1 - device) * h + local - h)


def _blocks(cfg: _Cfg, step: int, rank):
    """The attention calls of ``step`` on device ``rank`` (holding the block of device
    ``rank - step``): the unmasked parts of that (query chunk, key chunk) pair. Under
    zigzag with dropout every call covers one piece of queries and one of keys, whose
    global positions are contiguous (the dropout numbering needs that)."""
    c = cfg.chunk
    if cfg.zigzag and cfg.threshold and (step == 0 or not cfg.causal):
        h = c // 2
        if not cfg.causal:
            return [_Block(qo, h, ko, h, False, None) for qo in (0, h) for ko in (0, h)]
        # The own chunk: piece a before piece b, so b sees a whole and a never sees b.
        return [_Block(0, h, 0, h, True, None), _Block(h, h, 0, h, False, None), _Block(h, h, h, h, True, None)]
    if step == 0 or not cfg.causal:
        # Step 0 is the device's own chunk: causal within it, also under zigzag (its
        # first piece precedes its second).
        return [_Block(0, c, 0, c, cfg.causal, None)]
    src = (rank - step) % cfg.ring
    if not cfg.zigzag:
        # An earlier chunk is seen whole, a later one not at all.
        return [_Block(0, c, 0, c, False, src < rank)]
    # Pieces: queries (a, b) = (rank, 2P-1-rank), keys (a', b') = (src, 2P-1-src). b sees
    # a' always; a sees a' iff src < rank; b sees b' iff src > rank; a never sees b'.
    h = c // 2
    off = jnp.where(src < rank, 0, h)
    return [_Block(h, h, 0, h, False, None), _Block(off, h, off, h, False, None)]


def _block_call(cfg: _Cfg, blk: _Block, q, kv, key, rank, src):
    """(the flash op's keyword arguments for the block, (q, k, v) rows of the block)."""
    k, v = kv[0], kv[1]
    mask = _rows(kv[2], blk.kv_off, blk.m, 1) if cfg.has_mask else None
    qs = _rows(q, blk.q_off, blk.n, 1)
    ks, vs = _rows(k, blk.kv_off, blk.m, 1), _rows(v, blk.kv_off, blk.m, 1)
    kw = dict(padding_mask=mask, causal=blk.causal, scale=cfg.scale)
    if cfg.threshold:
        length = cfg.ring * cfg.chunk
        kw.update(rate=cfg.rate, key=key, q_offset=_global(cfg, rank, blk.q_off),
                  kv_offset=_global(cfg, src, blk.kv_off), q_total=length, kv_total=length)
    return kw, (qs, ks, vs)


def _when(live, fn, acc):
    return fn(acc) if live is None else jax.lax.cond(live, fn, lambda a: a, acc)


def _flash_forward(cfg: _Cfg, q, k, v, mask, key, first_row):
    """(out in q's dtype, lse (batch, heads, c) float32). ``first_row``: the batch row
    offset of the masks (`jax_ls2._random.batch_row_offset` at the call), or None."""
    with _random.batch_rows_exactly(first_row):
        return _flash_forward_rows(cfg, q, k, v, mask, key)


def _flash_forward_rows(cfg: _Cfg, q, k, v, mask, key):
    rank = jax.lax.axis_index(cfg.axis_name)
    ct = _compute_dtype(q.dtype)
    b, c, h, _ = q.shape
    acc = (jnp.zeros_like(q, ct), _filled(q, (b, h, c), -jnp.inf, ct))
    for step, src, kv in _around_ring(cfg, rank, (k, v, mask) if cfg.has_mask else (k, v)):
        for blk in _blocks(cfg, step, rank):
            def merge(acc, blk=blk, kv=kv, src=src):
                kw, args = _block_call(cfg, blk, q, kv, key, rank, src)
                o, lse = flash_attention(*args, return_lse=True, **kw)
                cur_o, cur_l = _rows(acc[0], blk.q_off, blk.n, 1), _rows(acc[1], blk.q_off, blk.n, 2)
                o, lse = merge_attention(cur_o, cur_l, o, lse)
                return _put(acc[0], o, blk.q_off, 1), _put(acc[1], lse, blk.q_off, 2)
            acc = _when(blk.live, merge, acc)
    return acc[0].astype(q.dtype), acc[1].astype(jnp.float32)


def _flash_backward(cfg: _Cfg, q, k, v, mask, key, first_row, out, lse, dout):
    with _random.batch_rows_exactly(first_row):
        return _flash_backward_rows(cfg, q, k, v, mask, key, out, lse, dout)


def _flash_backward_rows(cfg: _Cfg, q, k, v, mask, key, out, lse, dout):
    rank = jax.lax.axis_index(cfg.axis_name)
    ct = _compute_dtype(q.dtype)
    grads = (jnp.zeros_like(q, ct), jnp.zeros_like(k, ct), jnp.zeros_like(v, ct))
    for step, src, kv in _around_ring(cfg, rank, (k, v, mask) if cfg.has_mask else (k, v)):
        for blk in _blocks(cfg, step, rank):
            def add(grads, blk=blk, kv=kv, src=src):
                kw, args = _block_call(cfg, blk, q, kv, key, rank, src)
                rows = lambda x, axis=1: _rows(x, blk.q_off, blk.n, axis)
                # The block's share of the gradients, from the merged out and lse.
                parts = flash_attention_bwd(rows(dout), *args, rows(out), rows(lse, 2), **kw)
                new = []
                for acc, part, off, n in zip(grads, parts, (blk.q_off, blk.kv_off, blk.kv_off),
                                             (blk.n, blk.m, blk.m)):
                    new.append(_put(acc, _rows(acc, off, n, 1) + part.astype(ct), off, 1))
                return tuple(new)
            grads = _when(blk.live, add, grads)
        # dK, dV of the held block travel with it; after P shifts they are home.
        grads = (grads[0],) + _shift(cfg, grads[1:])
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


@functools.partial(fused_vjp, nondiff_argnums=(0,), op="ring_attention",
                   plain='jax.nn.dot_product_attention on the whole sequence (jax.lax.all_gather the chunks)')
def _flash_ring(cfg, q, k, v, mask, key, first_row):
    return _flash_forward(cfg, q, k, v, mask, key, first_row)[0]


def _flash_ring_fwd(cfg, q, k, v, mask, key, first_row):
    out, lse = _flash_forward(cfg, q, k, v, mask, key, first_row)
    return out, (q, k, v, mask, key, first_row, out, lse)


def _fresh(tree):
    """``tree`` behind an optimization barrier, so the backward's ring is not merged (CSE)
    with the forward's: merged, every block received in the forward would stay alive until
    the backward, O(L) memory per device."""
    return jax.lax.optimization_barrier(tree)


def _flash_ring_bwd(cfg, res, dout):
    return (*_flash_backward(cfg, *_fresh(res), dout), None, None, None)


_flash_ring.defvjp(_flash_ring_fwd, _flash_ring_bwd, optimize_remat=True)


# ---------------------------------------------------------------- impl="rsa"
def _cols(cfg: _Cfg, x, device):
    """The columns (last dim, global key order) of device ``device``'s chunk, in its local order."""
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, off, n, x.ndim - 1)
                            for off, _, n in _pieces(cfg, device)], axis=-1)


def _put_cols(cfg: _Cfg, x, part, device):
    for off, local, n in _pieces(cfg, device):
        x = jax.lax.dynamic_update_slice_in_dim(x, part[..., local:local + n], off, x.ndim - 1)
    return x


def _keep(cfg: _Cfg, seed, rank, batch: int, heads: int):
    """bool (batch, heads, c, L): the single-device dropout mask's rows of this device."""
    length = cfg.ring * cfg.chunk
    rows = []
    for off, _, n in _pieces(cfg, rank):
        # The rows [off, off + n) of the (L x L) attention's mask.
        block_seed = jnp.concatenate([seed, jnp.stack([jnp.asarray(off).astype(jnp.uint32), jnp.uint32(0)])])
        rows.append(attention_keep_mask(block_seed, (batch, n, heads, 1), length, cfg.threshold, length, length))
    return jnp.concatenate(rows, axis=2)


def _dropped(cfg: _Cfg, p, keep):
    if keep is None:
        return p
    return jnp.where(keep, p * jnp.asarray(cfg.keep_scale, p.dtype), jnp.zeros((), p.dtype))


def _group_sum(x, kv_heads):
    b, n, h, d = x.shape
    return x.reshape(b, n, kv_heads, h // kv_heads, d).sum(axis=3)


def _rsa_forward(cfg: _Cfg, q, k, v, mask, seed):
    """(out, probs (batch, heads, c, L) in the compute dtype, before dropout)."""
    rank = jax.lax.axis_index(cfg.axis_name)
    ct = _compute_dtype(q.dtype)
    b, c, h, _ = q.shape
    groups = h // k.shape[2]
    length = cfg.ring * c
    qc = q.astype(ct)
    # Step 1: the key chunks (and their padding) travel around the ring; this device's
    # rows of scores fill up in global key order.
    scores = _filled(q, (b, h, c, length), 0.0, ct)
    valid = _filled(q, (b, 1, 1, length), True, bool)
    for _, src, held in _around_ring(cfg, rank, (k, mask) if cfg.has_mask else (k,)):
        kx = jnp.repeat(held[0], groups, axis=2).astype(ct)
        part = jnp.einsum("bqhd,bkhd->bhqk", qc, kx, precision=_HI) * jnp.asarray(cfg.scale, ct)
        scores = _put_cols(cfg, scores, part, src)
        if cfg.has_mask:
            valid = _put_cols(cfg, valid, held[1][:, None, None, :], src)
    if cfg.causal:
        valid = valid & (jnp.arange(length)[None, :] <= _positions(cfg, rank)[:, None])[None, None]
    scores = jnp.where(valid, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - jnp.where(jnp.isneginf(top), 0.0, top))
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total > 0, total, 1.0)  # rows with no key: zeros
    keep = _keep(cfg, seed, rank, b, h) if cfg.threshold else None
    pz = _dropped(cfg, probs, keep)
    # Step 2: the value chunks travel around the ring.
    out = jnp.zeros_like(q, ct)
    for _, src, held in _around_ring(cfg, rank, v):
        vx = jnp.repeat(held, groups, axis=2).astype(ct)
        out = out + jnp.einsum("bhqk,bkhd->bqhd", _cols(cfg, pz, src), vx, precision=_HI)
    return out.astype(q.dtype), probs


def _rsa_backward(cfg: _Cfg, q, k, v, probs, seed, dout):
    rank = jax.lax.axis_index(cfg.axis_name)
    ct = probs.dtype
    b, _, h, _ = q.shape
    hk = k.shape[2]
    groups = h // hk
    keep = _keep(cfg, seed, rank, b, h) if cfg.threshold else None
    pz = _dropped(cfg, probs, keep)
    do = dout.astype(ct)
    # The value chunks travel again: dP's columns, and dV's partial sums travel with them.
    dpz = jnp.zeros_like(probs)
    dv = jnp.zeros_like(v, ct)
    for _, src, held in _around_ring(cfg, rank, v):
        vx = jnp.repeat(held, groups, axis=2).astype(ct)
        dpz = _put_cols(cfg, dpz, jnp.einsum("bqhd,bkhd->bhqk", do, vx, precision=_HI), src)
        dv = _shift(cfg, dv + _group_sum(jnp.einsum("bhqk,bqhd->bkhd", _cols(cfg, pz, src), do, precision=_HI), hk))
    dp = _dropped(cfg, dpz, keep)
    ds = probs * (dp - jnp.sum(probs * dp, axis=-1, keepdims=True)) * jnp.asarray(cfg.scale, ct)
    # The key chunks travel again: dQ, and dK's partial sums travel with them.
    qc = q.astype(ct)
    dq = jnp.zeros_like(q, ct)
    dk = jnp.zeros_like(k, ct)
    for _, src, held in _around_ring(cfg, rank, k):
        kx = jnp.repeat(held, groups, axis=2).astype(ct)
        dsb = _cols(cfg, ds, src)
        dq = dq + jnp.einsum("bhqk,bkhd->bqhd", dsb, kx, precision=_HI)
        dk = _shift(cfg, dk + _group_sum(jnp.einsum("bhqk,bqhd->bkhd", dsb, qc, precision=_HI), hk))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(fused_vjp, nondiff_argnums=(0,), op="ring_attention",
                   plain='jax.nn.dot_product_attention on the whole sequence (jax.lax.all_gather the chunks)')
def _rsa_ring(cfg, q, k, v, mask, seed):
    return _rsa_forward(cfg, q, k, v, mask, seed)[0]


def _rsa_ring_fwd(cfg, q, k, v, mask, seed):
    out, probs = _rsa_forward(cfg, q, k, v, mask, seed)
    return out, (q, k, v, probs, seed)


def _rsa_ring_bwd(cfg, res, dout):
    return (*_rsa_backward(cfg, *_fresh(res), dout), None, None)


_rsa_ring.defvjp(_rsa_ring_fwd, _rsa_ring_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public op
def _over_the_mesh(q, k, v, size, *, axis_name, padding_mask, key, balance, **kw):
    """`ring_attention` on whole (batch, L, ...) arrays under ``jit`` with a mesh set that
    has ``axis_name``: the length checked here, then the op inside ``shard_map`` over it."""
    op = _OP
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_array(op, name, x, dtypes=None, ndim=4)
    length = q.shape[1]
    need = 2 * size if balance == "zigzag" else size
    if length % need:
        what = (f"2 x the size ({size}) of mesh axis {axis_name!r} (balance='zigzag': an even chunk)"
                if balance == "zigzag" else f"the size ({size}) of mesh axis {axis_name!r}")
        raise ValueError(f"{op}: the sequence length ({length}, q.shape[1]) must be a multiple of {what}; pad the "
                         f"sequence or change the mesh")
    for name, x in (("k", k), ("v", v), ("padding_mask", padding_mask)):
        if x is not None and (getattr(x, "ndim", 0) < 2 or x.shape[1] != length):
            raise ValueError(f"{op}: {name} must have q's sequence length ({length}) in dim 1, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    split = jax.sharding.PartitionSpec(None, axis_name)
    args, specs = [q, k, v], [split] * 3
    if padding_mask is not None:
        args.append(padding_mask)
        specs.append(split)
    if key is not None:
        args.append(key)
        specs.append(jax.sharding.PartitionSpec())

    def body(q, k, v, *rest):
        return ring_attention(q, k, v, axis_name=axis_name, balance=balance,
                              padding_mask=rest[0] if padding_mask is not None else None,
                              key=rest[-1] if key is not None else None, **kw)

    return jax.shard_map(body, in_specs=tuple(specs), out_specs=split, axis_names={axis_name})(*args)


def ring_attention(q, k, v, *, axis_name: str, causal: bool = False, padding_mask=None, rate: float = 0.0,
                   key=None, deterministic: bool = False, impl: str = "flash", balance: str = "zigzag",
                   scale: float | None = None):
    """Self-attention over a sequence split across the mesh axis ``axis_name``; call
    inside ``shard_map`` over that axis (or ``jax.vmap(..., axis_name=axis_name)`` to
    run the ring on one device). See the module docstring for the algorithms.

    Under ``jit`` with a mesh set (``jax.set_mesh``) that has ``axis_name`` but outside
    ``shard_map`` over it, pass whole ``(batch, L, ...)`` arrays instead (in the zigzag
    layout for ``balance="zigzag"``): the op checks that the axis divides ``L`` and runs
    itself inside ``shard_map`` over the axis, returning the whole ``(batch, L, heads,
    head_dim)``. (Inside your own ``shard_map``, a length the axis does not divide is
    refused by ``shard_map`` before the op runs.)

    Args:
      q: ``(batch, c, heads, head_dim)``, this device's chunk of ``c`` queries
        (``L = P c`` in all, ``P`` the size of ``axis_name``); any float dtype (the flash
        op's CUDA kernel takes float16/bfloat16 with head_dim 64 or 128).
      k, v: ``(batch, c, kv_heads, head_dim)``, q's dtype, the same positions as q;
        ``kv_heads`` divides ``heads`` (grouped-query attention).
      axis_name: the sequence axis of the ring (e.g. ``"seq"``).
      causal: position ``i`` attends positions ``j <= i`` (global positions).
      padding_mask: optional bool ``(batch, c)``, True = a real key; this device's chunk
        of the ``(batch, L)`` mask, split like ``k``.
      rate, key, deterministic: dropout on the attention probabilities (see the module
        docstring for the mask, equal to single-device attention's).
      impl: ``"flash"`` or ``"rsa"``.
      balance: ``"zigzag"`` (inputs in the zigzag layout, see `zigzag_permute`; ``c``
        even) or ``"none"`` (contiguous chunks).
      scale: static float, default ``1 / sqrt(head_dim)``.

    Returns:
      ``(batch, c, heads, head_dim)`` in q's dtype: this device's rows of the attention
      over the whole sequence; a query with no attended key gets zeros. Logits, softmax
      and accumulation in float32 (or wider). Gradients flow to q, k and v.

    Raises:
      ValueError: an unknown ``impl`` or ``balance``; ``axis_name`` not a mapped axis
        here (outside ``shard_map``, or not one of the mesh's axes); under ``jit`` with
        a mesh, a sequence length the axis does not divide; an odd chunk under
        ``balance="zigzag"``; shapes that do not fit.
      TypeError: arrays of the wrong kind or dtype, non-bool flags.
    """
    op = _OP
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if balance not in BALANCES:
        raise ValueError(f"{op}: balance must be one of {BALANCES}, got {balance!r}")
    if not isinstance(axis_name, str):
        raise TypeError(f"{op}: axis_name must be a string (a mesh axis name), got {axis_name!r}")
    ring = bound_axis_size(axis_name)
    if ring is None:
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and axis_name in mesh.axis_names:
            return _over_the_mesh(q, k, v, int(mesh.shape[axis_name]), axis_name=axis_name, causal=causal,
                                  padding_mask=padding_mask, rate=rate, key=key, deterministic=deterministic,
                                  impl=impl, balance=balance, scale=scale)
        where = (f"the mesh here has axes {tuple(mesh.axis_names)}" if not mesh.empty else
                 "no mesh axis is bound here (not inside shard_map)")
        raise ValueError(f"{op}: axis_name {axis_name!r} must be a mapped axis: call inside shard_map over a mesh "
                         f"with that axis (or vmap with axis_name={axis_name!r}); {where}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_array(op, name, x, dtypes=None, ndim=4)
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"{op}: q must have a floating dtype, got {q.dtype}")
    _checks.check_same_dtype(op, "k", k, q.dtype)
    _checks.check_same_dtype(op, "v", v, q.dtype)
    b, c, h, d = q.shape
    if c < 1 or d < 1:
        raise ValueError(f"{op}: q must have a chunk length >= 1 and head_dim >= 1, got shape {tuple(q.shape)}")
    hk = k.shape[2]
    if k.shape[0] != b or k.shape[1] != c or k.shape[3] != d:
        raise ValueError(f"{op}: k must have shape ({b}, {c}, kv_heads, {d}) (q's batch, chunk and head_dim: "
                         f"self-attention over the same positions), got {tuple(k.shape)}")
    _checks.check_shape(op, "v", v, k.shape)
    if hk < 1 or h % hk:
        raise ValueError(f"{op}: kv_heads ({hk}, k.shape[2]) must divide heads ({h}, q.shape[2])")
    zigzag = balance == "zigzag"
    if zigzag and c % 2:
        raise ValueError(f"{op}: balance='zigzag' needs the sequence length ({ring} x {c} = {ring * c}) divisible "
                         f"by 2 x the ring size ({2 * ring}), i.e. an even chunk, got chunk {c}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{op}: causal must be a Python bool, got {type(causal).__name__}")
    if padding_mask is not None:
        _checks.check_array(op, "padding_mask", padding_mask, dtypes=(jnp.dtype(bool),))
        _checks.check_shape(op, "padding_mask", padding_mask, (b, c))
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not np.isfinite(scale):
        raise TypeError(f"{op}: scale must be a finite Python float (static) or None, got {scale!r}")
    deterministic = _checks.check_deterministic(op, deterministic)
    rate = _checks.check_rate(op, rate, key, deterministic)
    threshold = 0 if deterministic else _random.dropout_threshold(rate)
    cfg = _Cfg(axis_name, int(ring), int(c), bool(causal), zigzag, float(scale), int(threshold),
               _random.keep_scale(rate) if threshold else 1.0, padding_mask is not None,
               float(rate) if threshold else 0.0)
    q, k, v = match_varying(q, k, v)
    first_row = _random.batch_row_offset() if threshold else None
    if impl == "flash":
        return _flash_ring(cfg, q, k, v, padding_mask, key if threshold else None, first_row)
    if first_row is not None:
        raise ValueError(f"{op}: impl='rsa' with dropout cannot number its masks inside batch_rows_from (a "
                         f"pipeline's micro-batches); use impl='flash'")
    seed = _random.seed_words(key) if threshold else jnp.zeros((3,), jnp.uint32)
    return _rsa_ring(cfg, q, k, v, padding_mask, seed)
