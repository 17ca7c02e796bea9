"""The counter-based dropout generator, bit for bit the same as ``csrc/kernels/common.cuh``.

Element ``g`` (global flat index, offset included) of a dropout mask is kept iff
its 16-bit draw ``u16(g) >= threshold`` with ``threshold = round(rate * 65536)``:
so the dropout rate is quantised to 1/65536 and the kept fraction is exactly
``1 - threshold / 65536``. ``u16(g)`` is the low (even g) or high (odd g) half of
``mix32(((g & ~1) * 0x9E3779B1 + k0) ^ k1)`` (uint32 arithmetic), ``k0, k1`` the two
32-bit words of the JAX key.

`keep_mask_wide` numbers elements by a 64-bit index ``g = hi * 2**32 + lo`` (flash
attention's masks reach 2**39 elements): with ``c = mix32(hi * 0x9E3779B1 + k1) ^
mix32(k1)`` (zero for ``hi = 0``), the draw is the half of ``mix32(((lo & ~1) *
0x9E3779B1 + k0) ^ k1 ^ c) ^ c``. Below 2**32 it is the 32-bit generator bit for bit;
above, each 2**32 block gets its own input and output whitening, so no block repeats
another.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np


def dropout_threshold(rate: float) -> int:
    """The 16-bit drop threshold for `rate` in [0, 1)."""
    return int(min(65535, round(float(rate) * 65536.0)))


def keep_scale(rate: float) -> float:
    """The scale applied to kept elements: 1 / kept fraction."""
    t = dropout_threshold(rate)
    return 65536.0 / (65536.0 - t)


def seed_words(key: jax.Array) -> jax.Array:
    """uint32[3] = (k0, k1, offset=0) from a JAX PRNG key (new-style or raw uint32[2])."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
    else:
        data = key
    data = jnp.asarray(data).reshape(-1).astype(jnp.uint32)
    if data.shape[0] < 2:
        data = jnp.concatenate([data, jnp.zeros((2 - data.shape[0],), jnp.uint32)])
    return jnp.concatenate([data[:2], jnp.zeros((1,), jnp.uint32)])


def no_seed() -> jax.Array:
    """The uint32[3] seed of an op that drops nothing (never read by the generator)."""
    return jnp.zeros((3,), jnp.uint32)


def mix32(x):
    """The 32-bit integer finaliser shared with the CUDA kernels (Mix32 in common.cuh)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return x


def keep_mask(seed: jax.Array, shape, threshold: int) -> jax.Array:
    """Boolean keep mask of `shape` for seed uint32[3], element order row-major."""
    n = int(np.prod(shape, dtype=np.int64))
    g = jnp.arange(n, dtype=jnp.uint32) + seed[2]
    h = mix32(((g & np.uint32(0xFFFFFFFE)) * np.uint32(0x9E3779B1) + seed[0]) ^ seed[1])
    u = jnp.where((g & 1) == 1, h >> 16, h & np.uint32(0xFFFF))
    return (u >= np.uint32(threshold)).reshape(shape)


def _wide_word(hi, k1):
    """The per-2**32-block word c(hi) of the 64-bit index (0 for hi = 0)."""
    hi = jnp.asarray(hi, jnp.uint32)
    k1 = jnp.asarray(k1, jnp.uint32)
    return mix32(hi * np.uint32(0x9E3779B1) + k1) ^ mix32(k1)


def keep_bits_wide(k0, k1, hi, lo, threshold: int) -> jax.Array:
    """Keep flags of the elements with 64-bit indices ``hi * 2**32 + lo`` (uint32 arrays
    of one shape, broadcast); ``k0, k1`` the key words."""
    hi, lo = jnp.broadcast_arrays(jnp.asarray(hi, jnp.uint32), jnp.asarray(lo, jnp.uint32))
    c = _wide_word(hi, k1)
    w = ((lo & np.uint32(0xFFFFFFFE)) * np.uint32(0x9E3779B1) + jnp.asarray(k0, jnp.uint32)) ^ \
        jnp.asarray(k1, jnp.uint32) ^ c
    h = mix32(w) ^ c
    u = jnp.where((lo & 1) == 1, h >> 16, h & np.uint32(0xFFFF))
    return u >= np.uint32(threshold)


def mul_wide(a, b):
    """(hi, lo) uint32 words of the 64-bit product of uint32 arrays a and b."""
    a = jnp.asarray(a, jnp.uint32)
    b = jnp.asarray(b, jnp.uint32)
    m16 = np.uint32(0xFFFF)
    a0, a1, b0, b1 = a & m16, a >> 16, b & m16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & m16) + (p10 & m16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, a * b


def add_wide(hi, lo, x):
    """(hi, lo) + x for a uint32 x, the carry into hi."""
    x = jnp.asarray(x, jnp.uint32)
    s = lo + x
    return hi + (s < lo).astype(jnp.uint32), s


# ---------------------------------------------------------------- global numbering
# The one numbering of every dropout mask: an array (or a shard of it) is a box of a global
# array, and its element at local coordinates ``i`` is numbered
#
#     g = sum_k (offsets[k] + i[k]) * strides[k]        (mod 2**64)
#
# ``offsets`` the box's first global coordinate per dim (the shard's position, zeros for a
# whole array; traced uint32), ``strides`` the global element stride per dim (static ints:
# the row-major strides of the global shape, or of a transpose of it, such as the
# batch-first numbering of sequence-first activations). Element g is kept iff
# ``keep_bits_wide(k0, k1, g >> 32, g & 0xFFFFFFFF, threshold)``. Below 2**32 elements
# this is the 32-bit generator on the flat row-major index; flash attention's index over
# ``(batch, heads, q_total, kv_total)`` with offsets ``(b0, 0, q_offset, kv_offset)`` is
# the same numbering. The kernels receive it as a 64-bit base (`kernel_seed`) and a row
# map (`row_map`): row r of the local array starts at ``base + sum digit_k(r) *
# stride_k`` over merged leading dims, and its element c is that plus c.
MAX_ROW_DIMS = 6  # merged leading dims a kernel's row map holds (kMaskMaxRowDims in common.cuh)


def row_major_strides(shape, order=None) -> tuple:
    """Global element strides of each dim of ``shape`` (Python ints) when the elements are
    numbered row-major in the dim order ``order`` (outermost first; default the dims'
    own order). ``order=(1, 0, 2)`` numbers a ``(len, batch, hidden)`` array as its
    ``(batch, len, hidden)`` transpose."""
    shape = tuple(int(d) for d in shape)
    order = tuple(range(len(shape))) if order is None else tuple(order)
    strides = [0] * len(shape)
    s = 1
    for d in reversed(order):
        strides[d] = s
        s *= shape[d]
    return tuple(strides)


def _split64(v: int):
    v = int(v) % 2**64
    return np.uint32(v >> 32), np.uint32(v & 0xFFFFFFFF)


def _add64(a, b):
    """(hi, lo) + (hi, lo), mod 2**64."""
    lo = a[1] + b[1]
    return a[0] + b[0] + (lo < a[1]).astype(jnp.uint32), lo


def _mul64(x, stride: int):
    """(hi, lo) of uint32 array ``x`` times the static 64-bit ``stride``, mod 2**64."""
    s_hi, s_lo = _split64(stride)
    hi, lo = mul_wide(x, s_lo)
    return hi + jnp.asarray(x, jnp.uint32) * s_hi, lo


def flat_index(coords, strides):
    """(hi, lo) uint32 words of ``g = sum_k coords[k] * strides[k]`` (mod 2**64):
    ``coords`` uint32 arrays (broadcast together) of global coordinates, ``strides``
    static ints. Any global shape: no array of the global shape is ever made."""
    coords = [jnp.asarray(c, jnp.uint32) for c in coords]
    shape = jnp.broadcast_shapes(*(c.shape for c in coords)) if coords else ()
    acc = (jnp.zeros(shape, jnp.uint32), jnp.zeros(shape, jnp.uint32))
    for c, s in zip(coords, strides):
        if int(s):
            acc = _add64(acc, _mul64(c, s))
    return acc


def element_index(offsets, local_shape, strides):
    """(hi, lo) uint32 arrays of ``local_shape``: the global number of every element of
    the box starting at ``offsets`` (uint32[ndim])."""
    n = len(local_shape)
    offsets = jnp.asarray(offsets, jnp.uint32)
    coords = [(offsets[k] + jnp.arange(d, dtype=jnp.uint32)).reshape((1,) * k + (d,) + (1,) * (n - k - 1))
              for k, d in enumerate(local_shape)]
    hi, lo = flat_index(coords, strides)
    return jnp.broadcast_to(hi, tuple(local_shape)), jnp.broadcast_to(lo, tuple(local_shape))


def keep_mask_at(seed, offsets, local_shape, strides, threshold: int) -> jax.Array:
    """Boolean keep mask of the box ``local_shape`` at ``offsets`` of the global array
    numbered by ``strides``; ``seed`` the uint32[3] of `seed_words` (its third word is
    not used: the offsets say where the box is)."""
    hi, lo = element_index(offsets, local_shape, strides)
    return keep_bits_wide(seed[0], seed[1], hi, lo, threshold)


def kernel_seed(seed, offsets, strides) -> jax.Array:
    """uint32[4] ``(k0, k1, base_lo, base_hi)`` the kernels take: the key words and the
    64-bit number of the box's first element."""
    offsets = jnp.asarray(offsets, jnp.uint32)
    hi, lo = flat_index([offsets[k] for k in range(len(strides))], strides)
    return jnp.stack([jnp.asarray(seed[0], jnp.uint32), jnp.asarray(seed[1], jnp.uint32), lo, hi])


def row_map(local_shape, strides):
    """The kernels' row map: ``(extents, strides)`` tuples of the merged leading dims
    (all but the last, whose stride must be 1) of a box ``local_shape``; size-1 dims
    dropped, and a dim merged into the one before it where that one's stride is its
    extent times its stride. At least one entry (``((1,), (0,))`` without leading dims)."""
    if local_shape and int(strides[-1]) != 1 and int(local_shape[-1]) > 1:
        raise ValueError(f"row_map: the last dim must have global stride 1, got strides {tuple(strides)}")
    merged = []
    for e, s in zip(local_shape[:-1], strides[:-1]):
        e, s = int(e), int(s)
        if e == 1:
            continue
        if merged and merged[-1][1] == e * s:
            merged[-1] = (merged[-1][0] * e, s)
        else:
            merged.append((e, s))
    if not merged:
        merged = [(1, 0)]
    if len(merged) > MAX_ROW_DIMS:
        raise ValueError(f"row_map: a box {tuple(local_shape)} with global strides {tuple(strides)} needs "
                         f"{len(merged)} row dims, more than the kernels' {MAX_ROW_DIMS}")
    return tuple(e for e, _ in merged), tuple(s for _, s in merged)


def shard_box(op: str, local_shape, shard_spec):
    """Inside ``shard_map``: ``(offsets, global_shape)`` of this device's block of an
    array split as ``shard_spec`` says (its ``in_specs`` entry: per dim, None, a mesh
    axis name or a tuple of names, the first one outermost). ``None``: the local array
    is the whole array (offsets zero)."""
    n = len(local_shape)
    if shard_spec is None:
        return jnp.zeros((n,), jnp.uint32), tuple(int(d) for d in local_shape)
    spec = tuple(shard_spec)
    if len(spec) > n:
        raise ValueError(f"{op}: shard_spec must have at most {n} entries (one per dim), got {shard_spec!r}")
    spec = spec + (None,) * (n - len(spec))
    offsets, global_shape = [], []
    for d, entry in zip(local_shape, spec):
        names = () if entry is None else (tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))
        index, size = jnp.zeros((), jnp.uint32), 1
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"{op}: shard_spec entries must be None, a mesh axis name or a tuple of names, "
                                f"got {entry!r}")
            try:
                axis_size = jax.lax.axis_size(name)
            except NameError:
                raise ValueError(f"{op}: shard_spec names the axis {name!r}, which is not a manual axis of the "
                                 f"enclosing shard_map") from None
            index = index * np.uint32(axis_size) + jax.lax.axis_index(name).astype(jnp.uint32)
            size *= int(axis_size)
        offsets.append(index * np.uint32(d))
        global_shape.append(int(d) * size)
    return jnp.stack(offsets) if offsets else jnp.zeros((0,), jnp.uint32), tuple(global_shape)


_BATCH_ROW_OFFSETS: list = []


@contextlib.contextmanager
def batch_rows_from(first_row):
    """Within the block, every dropout mask numbered (`numbering`) is of a block of
    rows of a larger batch, the first of them global row ``first_row`` (a uint32
    scalar, may be traced): it is added to the offset of the batch dim, the outermost
    dim of the numbering order. A pipeline runs its layers on micro-batches this way,
    so each draws its rows of the whole batch's masks. Blocks nest by adding."""
    _BATCH_ROW_OFFSETS.append(jnp.asarray(first_row, jnp.uint32))
    try:
        yield
    finally:
        _BATCH_ROW_OFFSETS.pop()


@contextlib.contextmanager
def batch_rows_exactly(first_row):
    """Within the block, the enclosing `batch_rows_from` blocks are replaced by one
    starting at ``first_row`` (None: none), e.g. for a backward traced after the
    forward's block has closed, with the forward's `batch_row_offset`."""
    saved = list(_BATCH_ROW_OFFSETS)
    _BATCH_ROW_OFFSETS[:] = [] if first_row is None else [jnp.asarray(first_row, jnp.uint32)]
    try:
        yield
    finally:
        _BATCH_ROW_OFFSETS[:] = saved


def batch_row_offset():
    """The first global batch row (a uint32 scalar, may be traced) of the enclosing
    `batch_rows_from` blocks, summed; None outside any."""
    if not _BATCH_ROW_OFFSETS:
        return None
    return sum(_BATCH_ROW_OFFSETS[1:], _BATCH_ROW_OFFSETS[0])


def numbering(op: str, local_shape, shard_spec, threshold: int, order=None):
    """``(offsets, strides)`` numbering the mask of an array of ``local_shape`` by its
    global coordinates: inside ``shard_map`` with ``shard_spec``, those of this
    device's block (`shard_box`), its batch rows moved by an enclosing
    `batch_rows_from`; ``order`` the numbering's dim order (see `row_major_strides`).
    Without dropout (threshold 0): zeros and no strides."""
    offsets, global_shape = shard_box(op, local_shape, shard_spec)
    if not threshold:
        return jnp.zeros_like(offsets), ()
    first_row = batch_row_offset()
    if first_row is not None and len(local_shape):
        batch_dim = 0 if order is None else tuple(order)[0]
        offsets = offsets.at[batch_dim].add(first_row)
    if int(np.prod(global_shape, dtype=object)) >= 2**63:
        raise ValueError(f"{op}: the whole array must have fewer than 2**63 elements to number its dropout mask, "
                         f"got shape {global_shape}")
    return offsets, row_major_strides(global_shape, order)


def kernel_row_attrs(local_shape, threshold: int, strides) -> dict:
    """The FFI attributes ``row_extents``, ``row_strides`` (int64 arrays) of a kernel's
    row map (`row_map`), whose extents multiply to the rows (the leading dims' product)
    the kernel sees; a single row dim when nothing is dropped or there are no rows."""
    rows = int(np.prod(local_shape[:-1], dtype=np.int64))
    if threshold and rows:
        extents, row_strides = row_map(local_shape, strides)
    else:
        extents, row_strides = (rows,), (0,)
    return dict(row_extents=np.asarray(extents, np.int64), row_strides=np.asarray(row_strides, np.int64))


def kernel_operands(*arrays, strides, **static):
    """A kernel's FFI operands from its arrays ``(..., seed, offsets)``: the pair replaced
    by the uint32[4] `kernel_seed` (a `jax_ls2._dispatch.FusedKernel` ``ffi_operands``)."""
    *rest, seed, offsets = arrays
    return (*rest, kernel_seed(seed, offsets, strides))


def apply_mask(v, seed, offsets, threshold: int, scale: float, strides):
    """float32 ``v`` (the box at ``offsets`` of the array numbered by ``strides``) with its
    keep mask applied and kept elements times ``scale``; threshold 0 returns ``v`` untouched."""
    if threshold == 0:
        return v
    keep = keep_mask_at(seed, offsets, v.shape, strides, threshold)
    return jnp.where(keep, v * np.float32(scale), np.float32(0))


def dropping(static) -> bool:
    """Whether a dropout kernel's static options drop anything (its ``threshold``)."""
    return static["threshold"] != 0


def kernel_options(attrs) -> dict:
    """The `jax_ls2._dispatch.FusedKernel` options of a kernel whose last two arrays are
    the seed and the offsets: ``attrs`` its attribute builder, the pair passed as
    `kernel_operands`, and with dropout active the examples of a vmap run one by one,
    so each draws the mask it would draw on its own."""
    return dict(attrs=attrs, ffi_operands=kernel_operands, per_example=dropping)
