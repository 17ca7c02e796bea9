"""Dropout masks numbered by global coordinates: the 64-bit numbering on virtual shapes far
beyond 2**32 elements, the kernels' row map against it, and sharded ops (under ``jit`` and
inside ``shard_map``, along batch, sequence and hidden/heads) drawing exactly the unsharded
mask with nothing gathered; on a GPU, the kernels' masks at large global offsets."""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ls2 import _random
from jax_ls2.ops import bias_act_dropout, bias_dropout_residual, dropout, embedding, softmax_dropout
from numerics import mesh8

# The modules (jax_ls2.ops re-exports functions of the same names).
dropout_ops = importlib.import_module("jax_ls2.ops.dropout")
embedding_ops = importlib.import_module("jax_ls2.ops.embedding")
softmax_ops = importlib.import_module("jax_ls2.ops.softmax")
from jax_ls2.ops.flash_attention import attention_keep_mask

RATE = 0.3
THRESHOLD = _random.dropout_threshold(RATE)
KEY = jax.random.key(7)
SEED = _random.seed_words(KEY)


# ---------------------------------------------------------------- the numbering itself
def _numbers(coords, strides):
    """Python-int truth of the global numbers of the elements at ``coords``."""
    return [sum(int(c[i]) * s for c, s in zip(coords, strides)) % 2**64 for i in range(len(coords[0]))]


def _as_ints(hi, lo):
    return [(int(h) << 32) | int(lo_) for h, lo_ in zip(np.asarray(hi).ravel(), np.asarray(lo).ravel())]


@pytest.mark.parametrize("shape,order", [((2**20, 2**14, 4099), None),       # 2**45 elements
                                         ((65537, 3, 2**31 - 1), None),     # a row longer than 2**31
                                         ((131072, 64, 12288), (1, 0, 2))])  # sequence-first, 2**36.6
def test_flat_index_on_huge_virtual_shapes(shape, order):
    strides = _random.row_major_strides(shape, order)
    rng = np.random.default_rng(len(shape) + shape[0])
    coords = [rng.integers(0, d, size=257) for d in shape]
    coords[0][0], coords[1][0], coords[2][0] = shape[0] - 1, shape[1] - 1, shape[2] - 1  # the last element
    got = _as_ints(*_random.flat_index([c.astype(np.uint32) for c in coords], strides))
    want = _numbers(coords, strides)
    assert got == want
    assert max(want) >= 2**32


def test_keep_bits_at_huge_offsets_follow_the_numbers():
    """A box at offsets past 2**32 elements (crossing a 2**32 boundary inside a row) draws
    keep_bits_wide of the true 64-bit numbers, and below 2**32 the 32-bit generator."""
    shape = (1024, 4096, 1536)
    strides = _random.row_major_strides(shape)
    # The row (b, t) = (700, 1777) starts 2**32 * 1670 + 1073741824 + ...: pick a column
    # window that straddles the next multiple of 2**32.
    b, t = 700, 1777
    start = b * strides[0] + t * strides[1]
    cross = (start // 2**32 + 1) * 2**32 - start
    c0 = int(cross) - 5 if 0 < cross < shape[2] - 16 else 0
    offsets = jnp.asarray([b, t, c0], jnp.uint32)
    box = (1, 2, 16)
    got = np.asarray(jax.jit(_random.keep_mask_at, static_argnums=(2, 3, 4))(SEED, offsets, box, strides,
                                                                          THRESHOLD)).ravel()
    g = [start + dt * strides[1] + c0 + c for dt in range(2) for c in range(16)]
    hi = np.asarray([x >> 32 for x in g], np.uint32)
    lo = np.asarray([x & 0xFFFFFFFF for x in g], np.uint32)
    want = np.asarray(jax.jit(_random.keep_bits_wide, static_argnums=4)(SEED[0], SEED[1], hi, lo, THRESHOLD))
    np.testing.assert_array_equal(got, want)
    small = (3, 5, 7)
    np.testing.assert_array_equal(
        _random.keep_mask_at(SEED, jnp.zeros(3, jnp.uint32), small, _random.row_major_strides(small), THRESHOLD),
        _random.keep_mask(SEED, small, THRESHOLD))


def _kernel_numbers(local_shape, offsets, strides):
    """The kernels' formula (common.cuh, MaskRowStart): row map digits plus the base."""
    extents, row_strides = _random.row_map(local_shape, strides)
    base = sum(int(o) * s for o, s in zip(offsets, strides))
    rows = int(np.prod(local_shape[:-1], dtype=np.int64))
    out = []
    for r in range(rows):
        g, rem = base, r
        for e, s in zip(reversed(extents), reversed(row_strides)):
            g += (rem % e) * s
            rem //= e
        out += [(g + c) % 2**64 for c in range(local_shape[-1])]
    return out


@pytest.mark.parametrize("global_shape,local_shape,offsets,order", [
    ((8, 12, 10), (8, 12, 10), (0, 0, 0), None),         # whole: one row dim
    ((8, 12, 10), (4, 12, 10), (4, 0, 0), None),         # batch shard: one row dim
    ((8, 12, 10), (8, 3, 10), (0, 6, 0), None),          # sequence shard: two row dims
    ((8, 12, 10), (2, 3, 5), (2, 9, 5), None),           # every dim split
    ((12, 8, 10), (3, 4, 10), (3, 4, 0), (1, 0, 2)),     # sequence-first, both split
    ((2, 4, 6, 6), (2, 1, 3, 6), (0, 3, 3, 0), None),    # scores: heads and queries split
    ((2**22, 2**12, 2048), (2, 3, 4), (2**22 - 2, 77, 2044), None),  # past 2**32
])
def test_row_map_reproduces_the_numbering(global_shape, local_shape, offsets, order):
    strides = _random.row_major_strides(global_shape, order)
    hi, lo = _random.element_index(jnp.asarray(offsets, jnp.uint32), local_shape, strides)
    assert _as_ints(hi, lo) == _kernel_numbers(local_shape, offsets, strides)
    seed4 = np.asarray(_random.kernel_seed(SEED, jnp.asarray(offsets, jnp.uint32), strides))
    assert (int(seed4[3]) << 32 | int(seed4[2])) == sum(o * s for o, s in zip(offsets, strides)) % 2**64
    assert tuple(seed4[:2]) == tuple(np.asarray(SEED[:2]))


@pytest.mark.parametrize("threshold", [0, THRESHOLD])
@pytest.mark.parametrize("local_shape,global_shape", [((4, 8, 16), (4, 8, 16)), ((2, 3, 16), (4, 12, 16)),
                                                      ((1, 1, 7), (1, 1, 7)), ((0, 5, 3), (0, 5, 3)),
                                                      ((5,), (5,)), ((2, 1, 3, 4), (2, 4, 6, 4))])
def test_kernel_row_attrs_describe_every_row(local_shape, global_shape, threshold):
    """The row map the kernels get covers exactly the rows they see (the handlers refuse
    anything else), with and without dropout, empty arrays included."""
    attrs = _random.kernel_row_attrs(local_shape, threshold, _random.row_major_strides(global_shape))
    ext, st = attrs["row_extents"], attrs["row_strides"]
    assert ext.dtype == st.dtype == np.int64 and 1 <= ext.size == st.size <= _random.MAX_ROW_DIMS
    assert int(np.prod(ext)) == int(np.prod(local_shape[:-1], dtype=np.int64))


def test_attention_numbering_is_the_same_vocabulary():
    """flash attention's block numbering is keep_mask_at over (batch, heads, q_total, kv_total)."""
    b, lq, h, lk, q_total, kv_total, q_off, kv_off = 2, 5, 3, 7, 40, 33, 17, 9
    seed5 = jnp.concatenate([SEED, jnp.asarray([q_off, kv_off], jnp.uint32)])
    got = jax.jit(lambda s: attention_keep_mask(s, (b, lq, h, 8), lk, THRESHOLD, q_total, kv_total))(seed5)
    want = jax.jit(lambda s, o: _random.keep_mask_at(s, o, (b, h, lq, lk),
                                                     _random.row_major_strides((b, h, q_total, kv_total)),
                                                     THRESHOLD))(SEED, jnp.asarray([0, 0, q_off, kv_off], jnp.uint32))
    np.testing.assert_array_equal(got, want)


def test_row_map_limits_and_bad_shard_spec():
    with pytest.raises(ValueError, match="global stride 1"):
        _random.row_map((4, 5), (1, 4))
    many = (2,) * 9
    strides = _random.row_major_strides((4,) * 9)
    with pytest.raises(ValueError, match="more than the kernels'"):
        _random.row_map(many, strides)
    mesh = mesh8("data", "model", shape=(2, 4))
    x = jnp.ones((4, 8, 16))
    bad = jax.shard_map(lambda x: dropout(x, rate=RATE, key=KEY, shard_spec=("nope",)), mesh=mesh,
                        in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match="dropout: shard_spec names the axis 'nope'"):
        jax.jit(bad)(x)
    s = jnp.ones((2, 4, 8, 8))
    with pytest.raises(ValueError, match="softmax_dropout: shard_spec must not split the key dim or, with causal"):
        softmax_dropout(s, causal=True, rate=RATE, key=KEY, shard_spec=(None, None, "model"))


# ---------------------------------------------------------------- sharded ops
def _inputs():
    k = jax.random.split(jax.random.key(3), 10)
    x = jax.random.normal(k[0], (4, 8, 16))
    b = jax.random.normal(k[1], (16,))
    r = jax.random.normal(k[2], (4, 8, 16))
    s = jax.random.normal(k[3], (2, 4, 8, 8))
    ids = jax.random.randint(k[4], (4, 8), 0, 11)
    table = jax.random.normal(k[5], (11, 16))
    pos = jax.random.normal(k[6], (8, 16))
    dy = jax.random.normal(k[7], (4, 8, 16))
    ds = jax.random.normal(k[8], (2, 4, 8, 8))
    de = jax.random.normal(k[9], (4, 8, 16))
    return x, b, r, s, ids, table, pos, dy, ds, de


# name: (spec of the (batch, seq, hidden) activations, of the (batch, heads, q, k) scores,
# of the (batch, seq) ids, causal softmax); the softmax shards its query dim only without
# causal masking.
SHARDINGS = {  # batch alone: tests/test_dropout.py, test_softmax.py, test_embedding.py
    "sequence": (P(None, "model"), P(None, None, "model"), P(None, "model"), False),
    "hidden_heads": (P(None, None, "model"), P(None, "model"), P(), True),
    "batch_and_sequence": (P("data", "model"), P("data", "model"), P("data", "model"), True),
}


def _all_ops(x, b, r, s, ids, table, pos, *, causal, specs=None):
    """Every dropout op of the library on the same key; ``specs`` (x's, the scores', the
    ids') inside shard_map."""
    xs, ss, ids_spec = specs or (None, None, None)
    k = jax.random.split(KEY, 5)
    return (bias_dropout_residual(x, b, r, rate=RATE, key=k[0], shard_spec=xs),
            bias_act_dropout(x, b, activation="gelu", rate=RATE, key=k[1], shard_spec=xs),
            dropout(x, rate=RATE, key=k[2], shard_spec=xs),
            softmax_dropout(s, scale=0.5, causal=causal, rate=RATE, key=k[3], shard_spec=ss),
            embedding(ids, table, pos_table=pos, rate=RATE, key=k[4], shard_spec=ids_spec))


def _loss(x, b, r, s, ids, table, pos, dy, ds, de, *, causal):
    # de: the embedding's cotangent, laid out as the ids (its hidden dim is never split)
    y1, y2, y3, p, e = _all_ops(x, b, r, s, ids, table, pos, causal=causal)
    return jnp.sum((y1 + y2 + y3) * dy) + jnp.sum(p * ds) + jnp.sum(e * de)


@functools.lru_cache(maxsize=None)
def _unsharded(causal):
    args = _inputs()
    outs = jax.jit(functools.partial(_all_ops, causal=causal))(*args[:7])
    grads = jax.jit(jax.grad(functools.partial(_loss, causal=causal), argnums=(0, 1, 3, 5, 6)))(*args)
    return outs, grads


def _check(outs, grads, causal):
    want_outs, want_grads = _unsharded(causal)
    for name, got, want in zip(("bias_dropout_residual", "bias_act_dropout", "dropout", "softmax_dropout",
                                "embedding"), outs, want_outs):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    for name, got, want in zip(("dx", "dbias", "dscores", "dtable", "dpos"), grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("name", list(SHARDINGS))
def test_sharded_jit_draws_the_unsharded_masks_without_all_gather(name):
    x_spec, s_spec, ids_spec, causal = SHARDINGS[name]
    mesh = mesh8("data", "model", shape=(2, 4))
    args = _inputs()
    specs = (x_spec, P(), x_spec, s_spec, ids_spec, P(), P(), x_spec, s_spec, P(*ids_spec, None))
    placed = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(args, specs)]

    def step(*a):
        return (_all_ops(*a[:7], causal=causal),
                jax.grad(functools.partial(_loss, causal=causal), argnums=(0, 1, 3, 5, 6))(*a))

    compiled = jax.jit(step).lower(*placed).compile()
    hlo = compiled.as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo, f"{name}: the compiled step gathers"
    outs, grads = compiled(*placed)
    _check(outs, grads, causal)
    assert outs[0].sharding.is_equivalent_to(NamedSharding(mesh, x_spec), 3)


def test_shard_map_draws_the_unsharded_masks():
    """Inside shard_map, each device told its block (shard_spec) draws that block of the
    whole mask: along batch and sequence at once, and along heads; gradients too."""
    mesh = mesh8("data", "model", shape=(2, 4))
    x_spec, s_spec, ids_spec = P("data", "model"), P("data", "model"), P("data", "model")
    args = _inputs()
    specs = (x_spec, P(), x_spec, s_spec, ids_spec, P(), P(), x_spec, s_spec, x_spec)
    ops = functools.partial(_all_ops, causal=True, specs=(x_spec, s_spec, ids_spec))
    out_specs = (x_spec, x_spec, x_spec, s_spec, P("data", "model", None))
    fwd = jax.shard_map(ops, mesh=mesh, in_specs=specs[:7], out_specs=out_specs)

    def loss(x, b, r, s, ids, table, pos, dy, ds, de):
        y1, y2, y3, p, e = fwd(x, b, r, s, ids, table, pos)
        return jnp.sum((y1 + y2 + y3) * dy) + jnp.sum(p * ds) + jnp.sum(e * de)

    placed = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(args, specs)]
    outs = jax.jit(fwd)(*placed[:7])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 3, 5, 6)))(*placed)
    _check(outs, grads, True)


# ---------------------------------------------------------------- GPU: kernels at large offsets
def _crossing_case():
    """A box of (3, 2**21, 1036) split along every dim whose middle row crosses 2**32
    inside a vector (the hidden offset 2 puts vectors off the boundary's alignment)."""
    global_shape = (3, 2**21, 1036)
    s0, s1 = global_shape[1] * global_shape[2], global_shape[2]
    t = (2**32 - s0) // s1  # row t of batch 1 starts below 2**32 and ends above it
    return global_shape, (2, 5, 1024), (1, t - 2, 2)


_GPU_CASES = [
    # (global (batch, seq, hidden), local box, its offsets): past 2**32 elements, a row
    # crossing a 2**32 boundary, and a small box split along every dim.
    ((2**21, 2**12, 1024), (2, 8, 1024), (2**21 - 2, 4000, 0)),
    _crossing_case(),
    ((64, 512, 768), (4, 16, 96), (12, 32, 384)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("global_shape,box,offsets", _GPU_CASES)
def test_gpu_kernel_masks_at_global_offsets(dtype, global_shape, box, offsets, monkeypatch):
    """The CUDA kernels (dropout family, softmax, embedding) given a block at ``offsets``
    of a virtual array draw the reference mask of that block, bit for bit."""
    monkeypatch.setenv("JAX_LS2_IMPL", "cuda")
    from jax_ls2 import _dispatch
    _dispatch.forget_choices()
    try:
        strides = _random.row_major_strides(global_shape)
        off = jnp.asarray(offsets, jnp.uint32)
        k = jax.random.split(jax.random.key(11), 3)
        x = (jax.random.normal(k[0], box) + 2.0).astype(dtype)  # positive: a kept element is never 0
        bias = jnp.zeros((1, 1, box[-1]), dtype)
        st = dict(threshold=THRESHOLD, scale=_random.keep_scale(RATE), strides=strides)
        want = dropout_ops._bdr_fwd_ref(x, bias, jnp.zeros_like(x), SEED, off, **st)[0]
        got = jax.jit(lambda x: dropout_ops._BDR_FWD(x, bias, jnp.zeros_like(x), SEED, off, **st)[0])(x)
        np.testing.assert_array_equal(np.asarray(got) == 0, np.asarray(want) == 0)
        dx, _ = jax.jit(lambda y: dropout_ops._BAD_BWD(y, x, bias, SEED, off, activation="relu", **st))(x)
        ref_dx, _ = dropout_ops._bad_bwd_ref(x, x, bias, SEED, off, activation="relu", **st)
        np.testing.assert_array_equal(np.asarray(dx) == 0, np.asarray(ref_dx) == 0)

        # softmax over (batch, seq, heads=1, keys=hidden) as scores (..., q, k)
        s = x.reshape(box[0], 1, box[1], box[2])
        s_strides = _random.row_major_strides((global_shape[0], 1) + global_shape[1:])
        s_off = jnp.asarray([offsets[0], 0, offsets[1], 0], jnp.uint32)
        ones_b, ones_m = jnp.zeros((1, 1, 1, 1), dtype), jnp.ones((1, 1, 1, 1), bool)
        sst = dict(scale=1.0, causal=False, threshold=THRESHOLD, keep_scale=_random.keep_scale(RATE),
                   has_bias=False, has_mask=False, strides=s_strides)
        fwd = softmax_ops._kernels(False)[0]
        got = jax.jit(lambda s: fwd(s, ones_b, ones_m, SEED, s_off, **sst)[0])(s)
        want = softmax_ops._fwd_reference(s, ones_b, ones_m, SEED, s_off, **sst)[0]
        np.testing.assert_array_equal(np.asarray(got) == 0, np.asarray(want) == 0)

        # embedding: ids (batch, seq) at the block's offsets, one-row table of positive values
        if offsets[2] == 0:
            ids = jnp.zeros(box[:2], jnp.int32)
            table = (jnp.abs(jax.random.normal(k[1], (1, box[2]))) + 1.0).astype(dtype)
            zeros = jnp.zeros(box[:2], jnp.int32)
            est = dict(scale=1.0, pos_mode=0, padding_idx=0, has_padding=False, threshold=THRESHOLD,
                       keep_scale=_random.keep_scale(RATE), out_dtype=jnp.dtype(dtype).name, strides=strides)
            args = (ids, zeros, table, jnp.zeros((1, box[2]), dtype), embedding_ops.sinusoid_inv_freq(box[2]), SEED,
                    off[:2])
            got = jax.jit(lambda *a: embedding_ops._FWD(*a, **est)[0])(*args)
            want = embedding_ops._fwd_reference(*args, **est)[0]
            np.testing.assert_array_equal(np.asarray(got) == 0, np.asarray(want) == 0)
    finally:
        _dispatch.forget_choices()


def test_gpu_cases_reach_past_two_to_the_32():
    """The GPU cases above really number past 2**32, and one row of the second crosses a
    multiple of 2**32 off a vector boundary."""
    def row_starts(case):
        global_shape, box, offsets = case
        strides = _random.row_major_strides(global_shape)
        return [(offsets[0] + i) * strides[0] + (offsets[1] + j) * strides[1] + offsets[2]
                for i in range(box[0]) for j in range(box[1])], box[2]

    starts, width = row_starts(_GPU_CASES[0])
    assert min(starts) >= 2**32
    starts, width = row_starts(_GPU_CASES[1])
    crossing = [g for g in starts if g // 2**32 != (g + width - 1) // 2**32]
    assert len(crossing) == 1 and (2**32 - crossing[0]) % 8 != 0
