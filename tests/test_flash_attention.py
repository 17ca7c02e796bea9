import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ls2 import _ffi, _random
from jax_ls2._dispatch import forget_choices
from jax_ls2.ops import flash_attention, flash_attention_bwd, merge_attention, softmax_dropout
from numerics import assert_within_2x, compiled_text, cuda_lowering_text, f64, mesh8, shard

# The module (jax_ls2.ops re-exports a function of the same name).
fa = importlib.import_module("jax_ls2.ops.flash_attention")
F32 = jnp.float32
TARGETS = {"jax_ls2_flash_attention_fwd", "jax_ls2_flash_attention_bwd"}


# ---------------------------------------------------------------- plain formula
def valid_pairs(b, lq, lk, *, causal=False, padding_mask=None, q_seg=None, kv_seg=None):
    """bool (batch, 1, q_len, kv_len)."""
    valid = jnp.ones((b, 1, lq, lk), bool)
    if causal:
        valid = valid & (jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None] + (lk - lq))
    if padding_mask is not None:
        valid = valid & padding_mask[:, None, None, :]
    if q_seg is not None:
        valid = valid & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    return valid


def plain(q, k, v, *, valid=None, bias=None, scale=None, keep=None, keep_scale=1.0, dtype=F32):
    """Attention written out with jax.nn.softmax in `dtype`: (out, lse); rows with no
    attended key give zeros and lse -inf."""
    b, lq, h, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kx, vx = (jnp.repeat(t, h // hk, axis=2).astype(dtype) for t in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(dtype), kx) * jnp.asarray(scale, dtype)
    if bias is not None:
        s = s + bias.astype(dtype)
    if valid is None:
        valid = jnp.ones((1, 1, lq, lk), bool)
    s = jnp.where(valid, s, jnp.finfo(dtype).min)
    any_valid = jnp.any(valid, axis=-1)
    p = jnp.where(any_valid[..., None], jax.nn.softmax(s, axis=-1), 0)
    lse = jnp.where(any_valid, jax.nn.logsumexp(s, axis=-1), -jnp.inf)
    if keep is not None:
        p = jnp.where(keep, p * jnp.asarray(keep_scale, dtype), 0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vx)
    return out.astype(q.dtype), lse


def qkv(b, lq, lk, h, hk, d, dtype=F32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, lq, h, d)).astype(dtype)
    k = jax.random.normal(ks[1], (b, lk, hk, d)).astype(dtype)
    v = jax.random.normal(ks[2], (b, lk, hk, d)).astype(dtype)
    return q, k, v


def with_x64(fn, *arrays):
    """fn on float64 copies of the arrays (None passes through), on the CPU."""
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [None if a is None else jax.device_put(
            jnp.asarray(f64(a)) if jnp.issubdtype(a.dtype, jnp.floating) else jnp.asarray(np.asarray(a)), cpu)
            for a in arrays]
        return jax.tree.map(np.asarray, fn(*args))


# case: (b, lq, lk, h, hk, d, causal, mask kind, bias shape or None, rate)
CASES = {
    "gqa causal unequal": (2, 4, 9, 4, 2, 16, True, None, None, 0.0),
    "q longer than kv causal": (1, 9, 4, 2, 1, 8, True, None, None, 0.0),
    "q_len 1 padding": (2, 1, 13, 2, 2, 8, False, "padding", None, 0.0),
    "kv_len 1 bias": (2, 6, 1, 2, 1, 8, False, None, (1, 2, 6, 1), 0.0),
    "padding full bias": (2, 7, 11, 2, 2, 8, False, "padding", (2, 2, 7, 11), 0.0),
    "segments causal key bias": (2, 10, 10, 3, 1, 8, True, "segments", (1, 3, 1, 10), 0.0),
    "dropout gqa padding bias": (2, 6, 9, 4, 2, 8, False, "padding", (2, 1, 6, 9), 0.2),
}


def case_inputs(name, dtype=F32):
    b, lq, lk, h, hk, d, causal, mask, bias_shape, rate = CASES[name]
    q, k, v = qkv(b, lq, lk, h, hk, d, dtype, seed=lq * 31 + lk)
    ks = jax.random.split(jax.random.key(lk), 4)
    kw = dict(causal=causal)
    vkw = dict(causal=causal)
    if mask == "padding":
        lens = jnp.arange(b) % lk + max(1, lk - 3)
        pm = jnp.arange(lk)[None, :] < lens[:, None]
        kw["padding_mask"] = vkw["padding_mask"] = pm
    elif mask == "segments":
        seg = jnp.sort(jax.random.randint(ks[0], (b, lq), 0, 3), axis=1)
        kw["segment_ids"] = seg
        vkw["q_seg"] = vkw["kv_seg"] = seg
    bias = None if bias_shape is None else jax.random.normal(ks[1], bias_shape).astype(dtype)
    if rate:
        kw.update(rate=rate, key=ks[2])
    return (q, k, v, bias), kw, vkw, rate


def keep_for(q, lk, kw):
    rate = kw.get("rate", 0.0)
    if not rate:
        return None, 1.0
    t = _random.dropout_threshold(rate)
    return fa.attention_keep_mask(_random.seed_words(kw["key"]), q.shape, lk, t), _random.keep_scale(rate)


# ---------------------------------------------------------------- reference against the truth
@pytest.mark.parametrize("name", sorted(CASES))
def test_values_lse_and_gradients_match_float64_truth(name):
    """out and lse, and dq, dk, dv, dbias of a loss that uses both (an lse cotangent)."""
    (q, k, v, bias), kw, vkw, _ = case_inputs(name)
    b, lq, h, d = q.shape
    lk = k.shape[1]
    w = jax.random.normal(jax.random.key(5), q.shape)
    u = jax.random.normal(jax.random.key(6), (b, h, lq))
    keep, ks = keep_for(q, lk, kw)
    valid = valid_pairs(b, lq, lk, **vkw)
    rows = np.asarray(jnp.any(jnp.broadcast_to(valid, (b, h, lq, lk)), -1))

    def loss_of(f):
        def loss(q, k, v, bias, w, u):
            out, lse = f(q, k, v, bias)
            return jnp.sum(out * w) + jnp.sum(jnp.where(rows, lse, 0) * u), (out, lse)
        return loss

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    ours = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, return_lse=True, **kw)
    truth = lambda q, k, v, bias: plain(q, k, v, valid=valid, bias=bias, keep=keep, keep_scale=ks,
                                        dtype=jnp.float64)
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss_of(ours), argnums, has_aux=True))(q, k, v, bias, w, u)
    (_, (t_out, t_lse)), t_grads = with_x64(jax.value_and_grad(loss_of(truth), argnums, has_aux=True),
                                            q, k, v, bias, w, u)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, lq) and lse.dtype == F32
    np.testing.assert_allclose(f64(out), t_out, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), rows)
    np.testing.assert_allclose(np.asarray(lse)[rows], t_lse[rows], rtol=2e-6, atol=2e-6)
    for gname, g, t in zip(("dq", "dk", "dv", "dbias"), grads, t_grads):
        assert g.dtype == q.dtype, gname
        np.testing.assert_allclose(f64(g), t, rtol=1e-4, atol=2e-5, err_msg=gname)


def test_matches_jax_nn_dot_product_attention():
    q, k, v = qkv(2, 6, 10, 4, 2, 16, seed=3)
    pm = jnp.arange(10)[None, :] < jnp.array([10, 7])[:, None]
    for causal in (False, True):
        ours = flash_attention(q, k, v, causal=causal, padding_mask=pm)
        mask = pm[:, None, None, :]
        if causal:
            mask = mask & (jnp.arange(10)[None, :] <= jnp.arange(6)[:, None] + 4)
        theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=f"causal={causal}")


def test_fully_masked_rows_give_zeros_lse_minus_inf_and_zero_grads():
    # q longer than kv with causal: the first 3 queries see no key; batch 1's keys all padded.
    q, k, v = qkv(2, 7, 4, 2, 2, 8, seed=9)
    pm = jnp.array([[True] * 4, [False] * 4])
    f = lambda q, k, v: flash_attention(q, k, v, causal=True, padding_mask=pm, return_lse=True,
                                        rate=0.1, key=jax.random.key(1))
    out, lse = f(q, k, v)
    assert np.all(np.asarray(out[0, :3]) == 0) and np.all(np.asarray(out[1]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[0, :, :3]))) and np.all(np.isneginf(np.asarray(lse[1])))
    assert np.all(np.isfinite(np.asarray(lse[0, :, 3:])))
    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0] * q), (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0][0, :3]) == 0) and np.all(np.asarray(grads[0][1]) == 0)
    assert np.all(np.asarray(grads[1][1]) == 0) and np.all(np.asarray(grads[2][1]) == 0)


def _check_nan_query_row_propagates(shape, dtype):
    """A NaN in one query row gives that row NaN in out and lse (as jax.nn.logsumexp), not
    lse = -inf, the "attended no key" marker; the other rows are untouched. Runs on the
    default device (so the kernel on the GPU)."""
    q, k, v = qkv(*shape, dtype=dtype, seed=4)
    bad = q.at[0, 2, 1, 0].set(jnp.nan)
    f = jax.jit(lambda q: flash_attention(q, k, v, return_lse=True))
    (out, lse), (out0, lse0) = f(bad), f(q)
    out, lse, out0, lse0 = (np.asarray(a, np.float32) for a in (out, lse, out0, lse0))
    assert np.isnan(lse[0, 1, 2]) and np.all(np.isnan(out[0, 2, 1]))
    rest = np.ones(lse.shape, bool)
    rest[0, 1, 2] = False
    np.testing.assert_array_equal(lse[rest], lse0[rest])
    np.testing.assert_array_equal(np.delete(out[0], 2, axis=0), np.delete(out0[0], 2, axis=0))
    dq = jax.jit(jax.grad(lambda q: jnp.sum(flash_attention(q, k, v).astype(F32))))(bad)
    assert np.all(np.isnan(np.asarray(dq[0, 2, 1], np.float32)))


def test_nan_in_a_query_row_propagates_to_its_out_and_lse():
    _check_nan_query_row_propagates((2, 5, 6, 2, 2, 8), F32)
    # as the plain formula says
    q, k, v = qkv(2, 5, 6, 2, 2, 8, seed=4)
    assert np.isnan(np.asarray(plain(q.at[0, 2, 1, 0].set(jnp.nan), k, v)[1][0, 1, 2]))


def test_dropout_mask_is_the_shared_generator_numbered_by_b_h_q_k():
    """With v the identity over keys, out is the dropped probabilities, which must equal
    softmax_dropout's on the (batch, heads, q, k) scores for the same key."""
    b, lq, lk, h = 2, 5, 16, 3
    q, k, _ = qkv(b, lq, lk, h, h, lk, seed=2)
    v = jnp.broadcast_to(jnp.eye(lk)[None, :, None, :], (b, lk, h, lk))
    key = jax.random.key(42)
    scale = 0.3
    out = flash_attention(q, k, v, scale=scale, rate=0.25, key=key, causal=True)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST)
    p = softmax_dropout(scores, scale=scale, rate=0.25, key=key, causal=True)
    np.testing.assert_allclose(jnp.swapaxes(out, 1, 2), p, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(out, 1, 2)) == 0, np.asarray(p) == 0)


def test_dropout_statistics_and_same_key_same_mask():
    b, lq, lk, h = 2, 64, 64, 4
    q, k, v = qkv(b, lq, lk, h, h, 8, seed=4)
    rate = 0.3
    keep = np.asarray(fa.attention_keep_mask(_random.seed_words(jax.random.key(7)), q.shape, lk,
                                             _random.dropout_threshold(rate)))
    assert abs(keep.mean() - (1 - rate)) < 0.01
    f = jax.jit(lambda key: flash_attention(q, k, v, rate=rate, key=key))
    a, a2, c = f(jax.random.key(7)), f(jax.random.key(7)), f(jax.random.key(8))
    np.testing.assert_array_equal(a, a2)
    assert not np.allclose(a, c)
    # The expectation over masks is the undropped output.
    outs = jnp.stack([f(kk) for kk in jax.random.split(jax.random.key(0), 64)])
    undropped = flash_attention(q, k, v)
    assert float(jnp.abs(outs.mean(0) - undropped).mean()) < 0.25 * float(jnp.abs(undropped).mean())
    np.testing.assert_array_equal(flash_attention(q, k, v, rate=rate, key=jax.random.key(7), deterministic=True),
                                  undropped)


def _mask_from_formula(key, b, h, lq, lk, q_offset, kv_offset, q_total, kv_total, threshold):
    """The keep mask (b, h, lq, lk) from the documented 64-bit numbering, in numpy uint64."""
    k0, k1 = (np.uint32(w) for w in np.asarray(_random.seed_words(key))[:2])
    c32 = np.uint32(0x9E3779B1)
    idx = ((np.arange(b, dtype=np.uint64)[:, None, None, None] * np.uint64(h) +
            np.arange(h, dtype=np.uint64)[None, :, None, None]) * np.uint64(q_total) + np.uint64(q_offset) +
           np.arange(lq, dtype=np.uint64)[None, None, :, None]) * np.uint64(kv_total) + np.uint64(kv_offset) + \
        np.arange(lk, dtype=np.uint64)
    hi, lo = (idx >> np.uint64(32)).astype(np.uint32), (idx & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    mix = lambda x: np.asarray(_random.mix32(x))
    with np.errstate(over="ignore"):
        c = mix(hi * c32 + k1) ^ mix(np.full_like(hi, k1))
        h32 = mix((((lo & np.uint32(0xFFFFFFFE)) * c32 + k0) ^ k1) ^ c) ^ c
    u = np.where(lo & 1, h32 >> 16, h32 & 0xFFFF)
    return u >= threshold


def test_dropout_block_of_a_larger_attention_draws_its_slice_of_the_mask():
    """A call on the block [4, 9) x [3, 9) of a 12 x 10 attention, numbered with
    q_offset/kv_offset/q_total/kv_total (offsets traced), drops exactly the whole
    attention's mask bits there: with v the identity over keys, out's zeros are them."""
    b, h, lq_all, lk_all, qo, n, ko, m = 2, 3, 12, 10, 4, 5, 3, 6
    key, rate = jax.random.key(9), 0.3
    t = _random.dropout_threshold(rate)
    whole = np.asarray(fa.attention_keep_mask(_random.seed_words(key), (b, lq_all, h, 8), lk_all, t))
    seed = jnp.concatenate([_random.seed_words(key), jnp.array([qo, ko], jnp.uint32)])
    block = np.asarray(fa.attention_keep_mask(seed, (b, n, h, 8), m, t, lq_all, lk_all))
    np.testing.assert_array_equal(block, whole[:, :, qo:qo + n, ko:ko + m])
    np.testing.assert_array_equal(whole, _mask_from_formula(key, b, h, lq_all, lk_all, 0, 0, lq_all, lk_all, t))
    q, k, _ = qkv(b, n, m, h, h, m, seed=3)
    v = jnp.broadcast_to(jnp.eye(m)[None, :, None, :], (b, m, h, m))
    f = jax.jit(lambda qo, ko: flash_attention(q, k, v, rate=rate, key=key, q_offset=qo, kv_offset=ko,
                                               q_total=lq_all, kv_total=lk_all))
    out = np.asarray(jnp.swapaxes(f(jnp.int32(qo), jnp.int32(ko)), 1, 2))
    np.testing.assert_array_equal(out != 0, whole[:, :, qo:qo + n, ko:ko + m])
    # Default numbering: the call is the whole attention.
    np.testing.assert_array_equal(
        np.asarray(fa.attention_keep_mask(_random.seed_words(key), (b, n, h, 8), m, t)),
        _mask_from_formula(key, b, h, n, m, 0, 0, n, m, t))


@pytest.mark.parametrize("kv_offset", [55900, 55901], ids=["odd row start", "even row start"])
def test_dropout_index_is_64_bit_past_2_to_the_32(kv_offset):
    """Rows of a 70001 x 70001 attention around index 2**32 (row 61355 of head 0 crosses
    it inside the block): the mask follows the 64-bit numbering, so the block past 2**32
    is not the block 2**32 earlier again."""
    b, h, n, m, qo, total = 1, 2, 33, 128, 61340, 70001
    key, t = jax.random.key(4), _random.dropout_threshold(0.5)
    seed = jnp.concatenate([_random.seed_words(key), jnp.array([qo, kv_offset], jnp.uint32)])
    got = np.asarray(fa.attention_keep_mask(seed, (b, n, h, 8), m, t, total, total))
    want = _mask_from_formula(key, b, h, n, m, qo, kv_offset, total, total, t)
    np.testing.assert_array_equal(got, want)
    # Head 1's rows lie wholly past 2**32, where a 32-bit index would wrap and repeat earlier draws.
    first = (1 * total + qo) * total + kv_offset
    assert first >= 2**32
    wrapped = np.asarray(_random.keep_mask(np.array([*np.asarray(seed[:2]), first % 2**32], np.uint32),
                                           (n, total), t))[:, :m]
    assert 0.3 < float(np.mean(got[0, 1] == wrapped)) < 0.7


def _bwd_inputs():
    q, k, v = qkv(2, 6, 10, 4, 2, 8, seed=21)
    bias = jax.random.normal(jax.random.key(1), (1, 4, 6, 10))
    pm = jnp.arange(10)[None, :] < jnp.array([10, 7])[:, None]
    dout = jax.random.normal(jax.random.key(2), q.shape)
    dlse = jax.random.normal(jax.random.key(3), (2, 4, 6))
    return q, k, v, bias, pm, dout, dlse


def test_flash_attention_bwd_equals_the_vjp():
    q, k, v, bias, pm, dout, dlse = _bwd_inputs()
    kw = dict(padding_mask=pm, causal=True, rate=0.2, key=jax.random.key(8))
    (out, lse), vjp = jax.vjp(lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, return_lse=True, **kw),
                              q, k, v, bias)
    want = vjp((dout, dlse))
    got = jax.jit(lambda *a: flash_attention_bwd(*a, dlse=dlse, bias=bias, **kw))(dout, q, k, v, out, lse)
    assert len(got) == 4
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
    without_bias = flash_attention_bwd(dout, q, k, v, out, lse, dlse=dlse, bias=None, **kw)
    assert len(without_bias) == 3


def test_flash_attention_bwd_per_key_block_with_the_merged_out_and_lse_sums_to_the_whole():
    """Keys split at 4: forward blocks merged, then one backward per block from the merged
    out and lse (dropout numbered by global key position) gives the whole's gradients."""
    q, k, v, _, pm, dout, _ = _bwd_inputs()
    key, rate, cut, lk = jax.random.key(8), 0.2, 4, k.shape[1]
    whole = lambda q, k, v: flash_attention(q, k, v, padding_mask=pm, rate=rate, key=key)
    want = jax.vjp(whole, q, k, v)[1](dout)
    parts = [(0, cut), (cut, lk)]
    blk = lambda lo, hi: dict(padding_mask=pm[:, lo:hi], rate=rate, key=key, kv_offset=lo, kv_total=lk)
    outs = [flash_attention(q, k[:, lo:hi], v[:, lo:hi], return_lse=True, **blk(lo, hi)) for lo, hi in parts]
    out, lse = merge_attention(*outs[0], *outs[1])
    np.testing.assert_allclose(out, whole(q, k, v), rtol=1e-5, atol=1e-6)
    grads = [flash_attention_bwd(dout, q, k[:, lo:hi], v[:, lo:hi], out, lse, **blk(lo, hi)) for lo, hi in parts]
    np.testing.assert_allclose(grads[0][0] + grads[1][0], want[0], rtol=1e-5, atol=1e-5)
    for i, name in ((1, "dk"), (2, "dv")):
        np.testing.assert_allclose(jnp.concatenate([g[i] for g in grads], axis=1), want[i], rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def test_bad_offsets_and_backward_inputs():
    q, k, v = qkv(2, 3, 4, 4, 2, 8)
    op = "flash_attention"
    with pytest.raises(ValueError, match=rf"{op}: q_offset must be in \[0, 7\]"):
        flash_attention(q, k, v, q_offset=8, q_total=10)
    with pytest.raises(ValueError, match=rf"{op}: kv_offset must be in \[0, 0\]"):
        flash_attention(q, k, v, kv_offset=1)
    with pytest.raises(ValueError, match=rf"{op}: kv_total must be in \[4, 2\*\*31\)"):
        flash_attention(q, k, v, kv_total=3)
    with pytest.raises(TypeError, match=f"{op}: q_total must be a static int"):
        flash_attention(q, k, v, q_total=jnp.int32(5))
    with pytest.raises(TypeError, match=f"{op}: q_offset must be an int or an integer scalar array"):
        flash_attention(q, k, v, q_offset=jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match=f"{op}: kv_offset must be an int or an integer scalar array"):
        flash_attention(q, k, v, kv_offset=1.0)
    out, lse = flash_attention(q, k, v, return_lse=True)
    b = "flash_attention_bwd"
    with pytest.raises(ValueError, match=rf"{b}: out must have shape \(2, 3, 4, 8\)"):
        flash_attention_bwd(out, q, k, v, out[:, :2], lse)
    with pytest.raises(ValueError, match=rf"{b}: lse must have shape \(2, 4, 3\)"):
        flash_attention_bwd(out, q, k, v, out, lse[..., :2])
    with pytest.raises(TypeError, match=rf"{b}: dout must have dtype float32"):
        flash_attention_bwd(out.astype(jnp.bfloat16), q, k, v, out, lse)
    with pytest.raises(ValueError, match=rf"{b}: dlse must have shape \(2, 4, 3\)"):
        flash_attention_bwd(out, q, k, v, out, lse, dlse=lse[0])


# ---------------------------------------------------------------- lse and merging
def test_merge_of_two_halves_equals_the_whole_values_and_gradients():
    q, k, v = qkv(2, 6, 11, 4, 2, 8, seed=11)
    bias = jax.random.normal(jax.random.key(3), (1, 4, 6, 11))
    w = jax.random.normal(jax.random.key(4), q.shape)

    def whole(q, k, v, bias):
        out, lse = flash_attention(q, k, v, bias=bias, return_lse=True)
        return jnp.sum(out * w) + jnp.sum(jnp.sin(lse)), (out, lse)

    def halves(q, k, v, bias):
        o1, l1 = flash_attention(q, k[:, :5], v[:, :5], bias=bias[..., :5], return_lse=True)
        o2, l2 = flash_attention(q, k[:, 5:], v[:, 5:], bias=bias[..., 5:], return_lse=True)
        out, lse = merge_attention(o1, l1, o2, l2)
        return jnp.sum(out * w) + jnp.sum(jnp.sin(lse)), (out, lse)

    (_, (o, lse)), g = jax.value_and_grad(whole, (0, 1, 2, 3), has_aux=True)(q, k, v, bias)
    (_, (om, lm)), gm = jax.value_and_grad(halves, (0, 1, 2, 3), has_aux=True)(q, k, v, bias)
    np.testing.assert_allclose(om, o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lm, lse, rtol=1e-6, atol=1e-6)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), gm, g):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_merge_is_stable_and_handles_minus_inf():
    o1 = jnp.ones((1, 3, 1, 2))
    o2 = 2 * jnp.ones((1, 3, 1, 2))
    l1 = jnp.array([[[1000.0, -jnp.inf, -jnp.inf]]])
    l2 = jnp.array([[[999.0, 5.0, -jnp.inf]]])
    out, lse = merge_attention(o1, l1, o2, l2)
    w1 = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(out[0, 0, 0], w1 * 1 + (1 - w1) * 2, rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], 1000 + np.log1p(np.exp(-1.0)), rtol=1e-7)
    np.testing.assert_allclose(out[0, 1, 0], 2.0)
    assert float(lse[0, 0, 1]) == 5.0 and np.isneginf(float(lse[0, 0, 2]))
    np.testing.assert_array_equal(out[0, 2, 0], 0.0 * out[0, 2, 0] + 0.5 * 1 + 0.5 * 2)
    grads = jax.grad(lambda *a: jnp.sum(merge_attention(*a)[0]) + jnp.sum(jnp.where(
        jnp.isfinite(merge_attention(*a)[1]), merge_attention(*a)[1], 0)), (0, 1, 2, 3))(o1, l1, o2, l2)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))


def test_merge_rows_both_empty_give_zeros_from_zero_partials():
    # Partial attentions of fully masked rows are zeros with lse -inf: their merge is zeros.
    q, k, v = qkv(1, 4, 6, 2, 2, 8, seed=1)
    pm = jnp.zeros((1, 6), bool)
    o1, l1 = flash_attention(q, k[:, :3], v[:, :3], padding_mask=pm[:, :3], return_lse=True)
    o2, l2 = flash_attention(q, k[:, 3:], v[:, 3:], padding_mask=pm[:, 3:], return_lse=True)
    out, lse = merge_attention(o1, l1, o2, l2)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


# ---------------------------------------------------------------- transformations
def test_jit_grad_vmap():
    q, k, v = qkv(2, 5, 7, 2, 1, 8, seed=6)
    f = lambda q, k, v: flash_attention(q, k, v, causal=True)
    batched = jax.jit(jax.vmap(f))(q[:, None], k[:, None], v[:, None])
    np.testing.assert_allclose(batched[:, 0], f(q, k, v), rtol=1e-6, atol=1e-7)
    g = jax.jit(jax.vmap(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2))))(
        q[:, None], k[:, None], v[:, None])
    g0 = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2))(q, k, v)
    for a, b in zip(g, g0):
        np.testing.assert_allclose(a[:, 0], b, rtol=1e-5, atol=1e-6)
    # vmap with dropout: each example draws the mask it would draw alone.
    key = jax.random.key(3)
    fd = lambda q: flash_attention(q, k[:1], v[:1], rate=0.3, key=key)
    np.testing.assert_allclose(jax.vmap(fd)(q[:, None])[1, 0], fd(q[1:2])[0], rtol=1e-6, atol=1e-7)


def test_checkpoint_and_scan():
    q, k, v = qkv(1, 6, 6, 2, 2, 8, seed=8)

    def body(x, _):
        return jax.checkpoint(lambda x: flash_attention(x, k, v, causal=True))(x), None

    loss = lambda q: jnp.sum(jax.lax.scan(body, q, None, length=2)[0])
    g = jax.jit(jax.grad(loss))(q)
    assert np.all(np.isfinite(np.asarray(g)))


def test_batch_sharded_jit_equals_unsharded_without_all_gather():
    """With dropout: shards draw the unsharded mask (the seed offset gives the batch)."""
    mesh = mesh8()
    q, k, v = qkv(8, 4, 6, 2, 1, 8, seed=12)
    pm = jnp.arange(6)[None, :] < (jnp.arange(8) % 6 + 1)[:, None]
    bias = jax.random.normal(jax.random.key(2), (1, 2, 4, 6))
    key = jax.random.key(9)

    def loss(q, k, v, pm, bias):
        out = flash_attention(q, k, v, padding_mask=pm, bias=bias, rate=0.2, key=key)
        return jnp.sum(out * q), out

    f = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 4), has_aux=True))
    (_, o0), g0 = f(q, k, v, pm, bias)
    args = [shard(a, mesh, "data") for a in (q, k, v, pm)] + [bias]
    (_, o1), g1 = f(*args)
    np.testing.assert_allclose(o1, o0, rtol=1e-6, atol=1e-7)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert o1.sharding.spec[0] == "data"
    text = compiled_text(lambda *a: jax.value_and_grad(loss, (0, 1, 2, 4), has_aux=True)(*a), *args)
    assert "all-gather" not in text


def test_shard_map():
    mesh = mesh8()
    q, k, v = qkv(8, 4, 4, 2, 2, 8, seed=13)
    f = jax.jit(jax.shard_map(lambda q, k, v: flash_attention(q, k, v, causal=True), mesh=mesh,
                              in_specs=(P("data"),) * 3, out_specs=P("data")))
    out = f(*(shard(a, mesh, "data") for a in (q, k, v)))
    np.testing.assert_allclose(out, flash_attention(q, k, v, causal=True), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- dispatch and lowering
@pytest.fixture
def declared_targets(monkeypatch):
    """The FFI targets declared registered (as when the extension is built): lowering for
    CUDA then writes the custom calls into the program, on any machine."""
    monkeypatch.setattr(_ffi, "_load", lambda: (frozenset(TARGETS), None))
    forget_choices()
    yield
    forget_choices()


LOWERING_CASES = {
    # name: (dtype, bias shape or None, mask kind, vmapped)
    "bf16 batched bias dropout": (jnp.bfloat16, (2, 4, 5, 7), None, False),
    "fp16 shared bias padding": (jnp.float16, (1, 4, 1, 7), "padding", False),
    "bf16 segments under vmap": (jnp.bfloat16, None, "segments", True),
}


@pytest.mark.parametrize("name", sorted(LOWERING_CASES))
def test_lowering_for_cuda_calls_the_kernels(declared_targets, name):
    dtype, bias_shape, mask, vmapped = LOWERING_CASES[name]
    q, k, v = qkv(2, 5, 7, 4, 2, 64, dtype)
    bias = None if bias_shape is None else jnp.zeros(bias_shape, dtype)
    kw = dict(causal=True, rate=0.1, key=jax.random.key(0), return_lse=True)
    if mask == "padding":
        kw["padding_mask"] = jnp.arange(7)[None, :] < jnp.array([7, 3])[:, None]
    elif mask == "segments":
        kw["segment_ids"] = (jnp.zeros((2, 5), jnp.int32), jnp.arange(14).reshape(2, 7) % 2)

    def loss(q, k, v, bias):
        out, lse = flash_attention(q, k, v, bias=bias, **kw)
        return jnp.sum(out.astype(F32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    f = jax.grad(loss, (0, 1, 2) if bias is None else (0, 1, 2, 3))
    if vmapped:
        f = jax.vmap(f, in_axes=(0, 0, 0, None))
        q, k, v = (t[None].repeat(2, 0) for t in (q, k, v))
    text = cuda_lowering_text(f, q, k, v, bias)
    for t in TARGETS:
        assert f"custom_call @{t}" in text, t


def test_lowering_flash_attention_bwd_calls_the_backward_kernel(declared_targets):
    q, k, v = qkv(2, 5, 7, 4, 2, 64, jnp.bfloat16)
    out, lse = flash_attention(q, k, v, return_lse=True)
    f = lambda qo: flash_attention_bwd(out, q, k, v, out, lse, rate=0.1, key=jax.random.key(0), q_offset=qo,
                                       q_total=9)
    text = cuda_lowering_text(f, jnp.int32(2))
    assert "custom_call @jax_ls2_flash_attention_bwd" in text
    assert "custom_call @jax_ls2_flash_attention_fwd" not in text


def test_unsupported_head_dim_or_dtype_runs_the_reference_or_raises(declared_targets, monkeypatch):
    q, k, v = qkv(1, 3, 3, 2, 2, 48, jnp.bfloat16)
    text = cuda_lowering_text(lambda q: flash_attention(q, k, v), q)
    assert "jax_ls2_flash_attention" not in text
    q32, k32, v32 = qkv(1, 3, 3, 2, 2, 64)
    assert "jax_ls2_flash_attention" not in cuda_lowering_text(lambda q: flash_attention(q, k32, v32), q32)
    monkeypatch.setenv("JAX_LS2_IMPL", "cuda")
    with pytest.raises(ValueError, match=r"flash_attention: the CUDA kernel takes dtype .* got bfloat16 and 48"):
        flash_attention(q, k, v)
    with pytest.raises(ValueError, match=r"flash_attention: the CUDA kernel takes dtype .* got float32 and 64"):
        flash_attention(q32, k32, v32)


# ---------------------------------------------------------------- bad inputs
def test_bad_inputs():
    q, k, v = qkv(2, 3, 4, 4, 2, 8)
    op = "flash_attention"
    with pytest.raises(ValueError, match=f"{op}: q must have rank 4"):
        flash_attention(q[0], k, v)
    with pytest.raises(TypeError, match=f"{op}: q must have a floating dtype"):
        flash_attention(q.astype(jnp.int32), k, v)
    with pytest.raises(TypeError, match=rf"{op}: k must have dtype float32 \(the input's\), got bfloat16"):
        flash_attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match=rf"{op}: k must have shape \(2, kv_len, kv_heads, 8\)"):
        flash_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match=rf"{op}: v must have shape \(2, 4, 2, 8\), got \(2, 5, 2, 8\)"):
        flash_attention(q, k, jnp.zeros((2, 5, 2, 8)))
    with pytest.raises(ValueError, match=rf"{op}: kv_heads \(3, k.shape\[2\]\) must divide heads \(4"):
        flash_attention(q, jnp.zeros((2, 4, 3, 8)), jnp.zeros((2, 4, 3, 8)))
    with pytest.raises(ValueError, match=f"{op}: k must have kv_len >= 1"):
        flash_attention(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match=rf"{op}: bias must be broadcastable to \(2, 4, 3, 4\)"):
        flash_attention(q, k, v, bias=jnp.zeros((1, 4, 3, 5)))
    with pytest.raises(TypeError, match=f"{op}: bias must have a floating dtype"):
        flash_attention(q, k, v, bias=jnp.zeros((1, 1, 3, 4), jnp.int32))
    with pytest.raises(ValueError, match=rf"{op}: padding_mask must have shape \(2, 4\), got \(2, 3\)"):
        flash_attention(q, k, v, padding_mask=jnp.ones((2, 3), bool))
    with pytest.raises(TypeError, match=f"{op}: padding_mask must have dtype in"):
        flash_attention(q, k, v, padding_mask=jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=f"{op}: pass padding_mask or segment_ids, not both"):
        flash_attention(q, k, v, padding_mask=jnp.ones((2, 4), bool), segment_ids=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=rf"{op}: segment_ids must be a pair .* when q_len \(3\) != kv_len \(4\)"):
        flash_attention(q, k, v, segment_ids=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=rf"{op}: kv_segment_ids must have shape \(2, 4\), got \(2, 3\)"):
        flash_attention(q, k, v, segment_ids=(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32)))
    with pytest.raises(TypeError, match=f"{op}: q_segment_ids must have an integer dtype"):
        flash_attention(q, k, v, segment_ids=(jnp.zeros((2, 3)), jnp.zeros((2, 4), jnp.int32)))
    with pytest.raises(TypeError, match=f"{op}: scale must be a finite Python float"):
        flash_attention(q, k, v, scale=float("inf"))
    with pytest.raises(TypeError, match=f"{op}: causal must be a Python bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match=f"{op}: return_lse must be a Python bool"):
        flash_attention(q, k, v, return_lse="yes")
    with pytest.raises(ValueError, match=f"{op}: key is required"):
        flash_attention(q, k, v, rate=0.1)
    with pytest.raises(ValueError, match=rf"{op}: rate must be in \[0, 1\)"):
        flash_attention(q, k, v, rate=1.0, key=jax.random.key(0))
    m = "merge_attention"
    o, lse = flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=rf"{m}: out2 must have shape \(2, 3, 4, 8\)"):
        merge_attention(o, lse, o[:1], lse)
    with pytest.raises(ValueError, match=rf"{m}: lse2 must have shape \(2, 4, 3\), got \(2, 3, 4\)"):
        merge_attention(o, lse, o, jnp.swapaxes(lse, 1, 2))
    with pytest.raises(ValueError, match=f"{m}: out1 must have rank 4"):
        merge_attention(o[0], lse, o, lse)


# ---------------------------------------------------------------- GPU
# (b, lq, lk, h, hk, d, causal, padding, bias shape or None)
GPU_CASES = {
    "d64 square": (2, 128, 128, 4, 4, 64, False, False, None),
    "d128 square causal": (2, 256, 256, 4, 4, 128, True, False, None),
    "d64 197 padded": (3, 197, 197, 4, 2, 64, False, True, None),
    "d128 odd unequal causal": (2, 77, 301, 4, 1, 128, True, False, None),
    "d64 q longer causal": (1, 300, 129, 2, 2, 64, True, True, None),
    "d128 q_len 1": (3, 1, 1000, 8, 2, 128, False, True, None),
    "d64 kv_len 1": (2, 65, 1, 2, 2, 64, False, False, None),
    "d128 full bias": (2, 100, 130, 4, 2, 128, False, False, (2, 4, 100, 130)),
    "d64 broadcast bias causal": (2, 150, 150, 4, 4, 64, True, True, (1, 4, 150, 150)),
    "d128 key bias": (2, 64, 333, 2, 2, 128, False, False, (2, 1, 1, 333)),
    "d128 long": (1, 1030, 2049, 2, 1, 128, True, False, None),
}


def _gpu_inputs(name, dtype):
    b, lq, lk, h, hk, d, causal, padded, bias_shape = GPU_CASES[name]
    q, k, v = qkv(b, lq, lk, h, hk, d, dtype, seed=lq + 7 * lk)
    pm = None
    if padded:
        lens = jax.random.randint(jax.random.key(lk), (b,), 1, lk + 1)
        pm = jnp.arange(lk)[None, :] < lens[:, None]
    bias = None if bias_shape is None else jax.random.normal(jax.random.key(3), bias_shape).astype(dtype)
    return q, k, v, pm, bias, causal


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_against_float64_truth(name, dtype):
    """out, lse, dq, dk, dv (and dbias) each within 2x the error of XLA's attention in
    the same dtype; the loss uses out and lse, so the lse cotangent path is covered."""
    q, k, v, pm, bias, causal = _gpu_inputs(name, dtype)
    b, lq, h, d = q.shape
    lk = k.shape[1]
    valid = valid_pairs(b, lq, lk, causal=causal, padding_mask=pm)
    rows = np.asarray(jnp.any(jnp.broadcast_to(valid, (b, h, lq, lk)), -1))
    w = jax.random.normal(jax.random.key(5), q.shape).astype(dtype)
    u = jax.random.normal(jax.random.key(6), (b, h, lq))

    def loss_of(f):
        def loss(q, k, v, bias):
            out, lse = f(q, k, v, bias)
            return jnp.sum(out.astype(F32) * w.astype(F32)) + jnp.sum(jnp.where(rows, lse, 0).astype(F32) * u)
        return loss

    ours = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, padding_mask=pm, causal=causal,
                                                 return_lse=True)
    xla = lambda q, k, v, bias: plain(q, k, v, valid=valid, bias=bias, dtype=dtype)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    out, lse = jax.jit(ours)(q, k, v, bias)
    out_x, lse_x = jax.jit(xla)(q, k, v, bias)
    g = jax.jit(jax.grad(loss_of(ours), argnums))(q, k, v, bias)
    g_x = jax.jit(jax.grad(loss_of(xla), argnums))(q, k, v, bias)
    t_out, t_lse = with_x64(lambda q, k, v, bias: plain(q, k, v, valid=valid, bias=bias, dtype=jnp.float64),
                            q, k, v, bias)
    t_g = with_x64(jax.grad(loss_of(lambda q, k, v, bias: plain(q, k, v, valid=valid, bias=bias,
                                                                dtype=jnp.float64)), argnums), q, k, v, bias)
    assert_within_2x(f"{name} out", out, out_x, t_out)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), ~rows, err_msg=f"{name} lse -inf rows")
    assert_within_2x(f"{name} lse", np.where(rows, lse, 0), np.where(rows, lse_x.astype(F32), 0),
                     np.where(rows, t_lse, 0))
    for gname, a, ax, t in zip(("dq", "dk", "dv", "dbias"), g, g_x, t_g):
        assert_within_2x(f"{name} {gname}", a, ax, t)


# (b, lq, lk, h, hk, d, causal, (q_offset, kv_offset, q_total, kv_total) or None)
GPU_DROPOUT_CASES = {
    "d64 causal": (2, 70, 64, 4, 2, 64, True, None),
    "d128 odd q": (1, 33, 128, 2, 2, 128, False, None),
    # A block of a 70001 x 70001 attention whose head-0 row 61355 crosses index 2**32 at
    # key 41 (odd row start) or 40 (even); head 1 lies past 2**32.
    "d128 block past 2**32 odd": (1, 33, 128, 2, 2, 128, False, (61340, 55900, 70001, 70001)),
    "d64 block past 2**32 even": (1, 33, 64, 2, 1, 64, True, (61340, 55901, 70001, 70001)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_DROPOUT_CASES))
def test_gpu_dropout_mask_and_values_equal_the_reference(name):
    """v = the identity over keys (kv_len == head_dim), so out holds the dropped
    probabilities: the kernel's zeros are exactly the reference's; values and
    gradients (dropout in the backward regenerated) match the reference on the CPU."""
    b, lq, lk, h, hk, d, causal, block = GPU_DROPOUT_CASES[name]
    q, k, _ = qkv(b, lq, lk, h, hk, d, jnp.bfloat16, seed=lq)
    v = jnp.broadcast_to(jnp.eye(lk, dtype=jnp.bfloat16)[None, :, None, :], (b, lk, hk, d))
    key = jax.random.key(17)
    numbering = {} if block is None else dict(zip(("q_offset", "kv_offset", "q_total", "kv_total"), block))
    f = lambda q, k, v: flash_attention(q, k, v, causal=causal, rate=0.2, key=key, **numbering)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(F32) * q.astype(F32))
    out = np.asarray(jax.jit(f)(q, k, v).astype(F32))
    g = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(a, cpu) for a in (q, k, v)]
    out_ref = np.asarray(jax.jit(f)(*args).astype(F32))
    g_ref = jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
    np.testing.assert_array_equal(out == 0, out_ref == 0, err_msg=f"{name}: dropout zeros")
    np.testing.assert_allclose(out, out_ref, rtol=2e-2, atol=2e-3, err_msg=f"{name}: out")
    for gname, a, r in zip(("dq", "dk", "dv"), g, g_ref):
        a, r = f64(a), f64(r)
        assert np.linalg.norm(a - r) <= 2e-2 * np.linalg.norm(r), f"{name} {gname}"


@pytest.mark.sanitize
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_nan_in_a_query_row_propagates_to_its_out_and_lse(d, dtype):
    _check_nan_query_row_propagates((2, 70, 130, 2, 2, d), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_small_every_output_written(d):
    """Odd lengths, GQA, causal, padding, bias and dropout on a small case: every output
    (NaN-filled before launch by the handlers) is written and finite."""
    q, k, v = qkv(2, 19, 37, 4, 2, d, jnp.bfloat16, seed=d)
    pm = jnp.arange(37)[None, :] < jnp.array([37, 5])[:, None]
    bias = jax.random.normal(jax.random.key(1), (1, 4, 19, 37)).astype(jnp.bfloat16)
    f = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, padding_mask=pm, causal=True, rate=0.1,
                                              key=jax.random.key(2), return_lse=True)
    out, lse = jax.jit(f)(q, k, v, bias)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0].astype(F32)), (0, 1, 2, 3)))(q, k, v, bias)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert bool(jnp.all(jnp.isfinite(lse[:, :, 18:])))  # the last queries see keys
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
        assert bool(jnp.all(jnp.isfinite(g.astype(F32)))), name


@pytest.mark.gpu
def test_gpu_program_calls_the_kernels():
    q, k, v = qkv(1, 8, 8, 2, 2, 64, jnp.bfloat16)
    text = compiled_text(jax.grad(lambda q: jnp.sum(flash_attention(q, k, v).astype(F32))), q)
    for t in TARGETS:
        assert t in text, t
