"""embedding: an independent numpy formula, gradients for repeated tokens and
padding, both gradient modes, large vocabularies, id checks and clamping,
validation, dropout masks, sharding, CUDA lowering, and (on a GPU) the 2x rule."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ls2
from jax_ls2 import _random
from jax_ls2.ops import embedding
from jax_ls2.ops.embedding import sinusoid_inv_freq

F32 = jnp.float32


def _sinusoid(pos, hidden):
    half = hidden // 2
    freq = np.exp(np.arange(half) * -(math.log(10000.0) / max(half - 1, 1)))
    ang = np.asarray(pos, np.float64)[..., None] * freq
    out = np.concatenate([np.sin(ang), np.cos(ang)], -1)
    if hidden % 2:
        out = np.concatenate([out, np.zeros(out.shape[:-1] + (1,))], -1)
    return out


def _truth(ids, table, *, scale=1.0, positions=None, pos_table=None, sinusoidal=False, padding_idx=None,
           keep=None, rate=0.0):
    """float64 numpy forward, and a function giving (dtable, dpos) for a cotangent."""
    ids = np.asarray(ids)
    t = np.asarray(table, np.float64)
    h = t.shape[1]
    if positions is None:
        positions = np.broadcast_to(np.arange(ids.shape[-1]), ids.shape)
    positions = np.asarray(positions)
    x = scale * t[ids]
    if pos_table is not None:
        x = x + np.asarray(pos_table, np.float64)[positions]
    elif sinusoidal:
        x = x + _sinusoid(positions, h)
    live = np.ones(ids.shape, bool) if padding_idx is None else ids != padding_idx
    m = np.ones(x.shape) if keep is None else np.asarray(keep) / (1.0 - rate)
    out = np.where(live[..., None], x, 0.0) * m

    def grads(ct):
        g = np.asarray(ct, np.float64) * m * live[..., None]
        dt = np.zeros_like(t)
        np.add.at(dt, ids.reshape(-1), scale * g.reshape(-1, h))
        dp = None
        if pos_table is not None:
            dp = np.zeros(np.shape(pos_table))
            np.add.at(dp, positions.reshape(-1), g.reshape(-1, h))
        return dt, dp

    return out, grads


def _setup(seed, lead, vocab, hidden, max_pos=None, dtype=F32):
    k = jax.random.split(jax.random.key(seed), 4)
    ids = jax.random.randint(k[0], lead, 0, vocab, jnp.int32)
    ids = ids.reshape(-1).at[1].set(ids.reshape(-1)[0]).reshape(lead)  # a repeated token
    table = jax.random.normal(k[1], (vocab, hidden), F32).astype(dtype)
    pt = None if max_pos is None else jax.random.normal(k[2], (max_pos, hidden), F32).astype(dtype)
    ct = jax.random.normal(k[3], lead + (hidden,), F32)
    return ids, table, pt, ct


@pytest.mark.parametrize("grad_mode", ["atomic", "sorted"])
@pytest.mark.parametrize("case", ["plain", "learned", "sinusoidal", "padding_dropout", "odd_hidden"])
def test_matches_float64_formula(case, grad_mode):
    hidden = 123 if case == "odd_hidden" else 16
    ids, table, pt, ct = _setup(1, (3, 7), 50, hidden, max_pos=9)
    kw, tkw = {}, {}
    if case == "learned":
        kw = tkw = dict(pos_table=pt, scale=2.0)
    if case in ("sinusoidal", "odd_hidden"):
        kw = tkw = dict(sinusoidal=True, scale=4.0)
    if case == "padding_dropout":
        ids = ids.at[0, 3].set(5).at[1, 2].set(5)
        key = jax.random.key(7)
        kw = dict(pos_table=pt, padding_idx=5, rate=0.25, key=key)
        keep = _random.keep_mask(_random.seed_words(key), ids.shape + (hidden,), _random.dropout_threshold(0.25))
        tkw = dict(pos_table=pt, padding_idx=5, keep=keep, rate=_random.dropout_threshold(0.25) / 65536)
        assert 0 < float(jnp.mean(keep)) < 1
    out = embedding(ids, table, grad_mode=grad_mode, **kw)
    ref, grads = _truth(ids, table, **tkw)
    assert out.shape == ids.shape + (hidden,) and out.dtype == table.dtype
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)

    def f(table, pt):
        return jnp.sum(embedding(ids, table, grad_mode=grad_mode, **{**kw, **({"pos_table": pt} if "pos_table" in kw else {})}) * ct)

    dt, dp = jax.jit(jax.grad(f, (0, 1)))(table, pt)
    tdt, tdp = grads(ct)
    np.testing.assert_allclose(dt, tdt, rtol=1e-5, atol=1e-5)
    if "pos_table" in kw:
        np.testing.assert_allclose(dp, tdp, rtol=1e-5, atol=1e-5)
    if case == "padding_dropout":
        assert np.all(np.asarray(dt)[5] == 0.0)
        assert np.all(np.asarray(out)[np.asarray(ids) == 5] == 0.0)


@pytest.mark.parametrize("vocab", [50257, 128256, 262144])
def test_large_vocab_repeated_tokens(vocab):
    ids = jnp.array([[vocab - 1, 0, vocab - 1, 17], [17, vocab - 1, 3, vocab // 2]], jnp.int32)
    table = jax.random.normal(jax.random.key(2), (vocab, 8), F32)
    ct = jax.random.normal(jax.random.key(3), (2, 4, 8), F32)
    for mode in ("atomic", "sorted"):
        dt = jax.jit(jax.grad(lambda t: jnp.sum(embedding(ids, t, grad_mode=mode) * ct)))(table)
        _, grads = _truth(ids, table)
        tdt, _ = grads(ct)
        rows = np.unique(np.asarray(ids))
        np.testing.assert_allclose(np.asarray(dt)[rows], tdt[rows], rtol=1e-6, atol=1e-6)
        assert float(jnp.abs(dt).sum()) == pytest.approx(float(np.abs(tdt).sum()), rel=1e-5)


def test_fp32_table_bf16_output():
    ids, table, pt, ct = _setup(4, (2, 5), 30, 16, max_pos=5)
    out = embedding(ids, table, pos_table=pt, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    ref, grads = _truth(ids, table, pos_table=pt)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-2, atol=1e-2)
    dt, dp = jax.grad(lambda t, p: jnp.sum(embedding(ids, t, pos_table=p, dtype=jnp.bfloat16).astype(F32) * ct),
                      (0, 1))(table, pt)
    assert dt.dtype == F32 and dp.dtype == F32


def test_ids_out_of_range():
    table = jnp.ones((10, 4), F32)
    with pytest.raises(ValueError, match=r"embedding: ids must be in \[0, 10\).*got 10"):
        embedding(jnp.array([[1, 10]]), table)
    with pytest.raises(ValueError, match=r"embedding: ids must be in \[0, 10\).*got -1"):
        embedding(jnp.array([[-1, 2]]), table)
    with pytest.raises(ValueError, match=r"embedding: positions must be in \[0, 3\)"):
        embedding(jnp.array([[1, 2]]), table, positions=jnp.array([[0, 3]]), pos_table=jnp.ones((3, 4), F32))
    # Traced: clamped into the table (documented).
    t = jax.random.normal(jax.random.key(0), (10, 4), F32)
    out = jax.jit(lambda i: embedding(i, t))(jnp.array([[-3, 12, 4]]))
    np.testing.assert_array_equal(out[0], t[jnp.array([0, 9, 4])])
    dt = jax.jit(jax.grad(lambda t, i: embedding(i, t).sum()))(t, jnp.array([[-3, 12, 12]]))
    np.testing.assert_array_equal(dt[:, 0], np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 2], np.float32))


def test_validation_errors():
    table = jnp.ones((10, 4), F32)
    ids = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(TypeError, match="embedding: ids must have an integer dtype"):
        embedding(ids.astype(F32), table)
    with pytest.raises(ValueError, match="embedding: table must have rank 2"):
        embedding(ids, jnp.ones((10,), F32))
    with pytest.raises(ValueError, match="embedding: pass pos_table .* not both"):
        embedding(ids, table, pos_table=table, sinusoidal=True)
    with pytest.raises(ValueError, match=r"embedding: padding_idx must be in \[0, 10\), got 10"):
        embedding(ids, table, padding_idx=10)
    with pytest.raises(ValueError, match=r"embedding: pos_table must have shape \(10, 4\), got \(10, 5\)"):
        embedding(ids, table, pos_table=jnp.ones((10, 5), F32))
    with pytest.raises(ValueError, match="embedding: key is required"):
        embedding(ids, table, rate=0.1)
    with pytest.raises(ValueError, match="embedding: grad_mode must be"):
        embedding(ids, table, grad_mode="fast")
    with pytest.raises(TypeError, match="embedding: pos_table must have dtype float32"):
        embedding(ids, table, pos_table=jnp.ones((3, 4), jnp.bfloat16))


def test_dropout_mask_follows_key():
    ids, table, pt, _ = _setup(5, (4, 8), 40, 32, max_pos=8)
    a = embedding(ids, table, pos_table=pt, rate=0.5, key=jax.random.key(1))
    b = embedding(ids, table, pos_table=pt, rate=0.5, key=jax.random.key(1))
    c = embedding(ids, table, pos_table=pt, rate=0.5, key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(np.asarray(a) == 0, np.asarray(c) == 0)
    d = embedding(ids, table, pos_table=pt, rate=0.5, key=jax.random.key(2), deterministic=True)
    np.testing.assert_allclose(d, embedding(ids, table, pos_table=pt), rtol=0)


def test_vmap_and_checkpoint():
    ids, table, pt, ct = _setup(6, (3, 5), 20, 8, max_pos=5)
    v = jax.vmap(lambda i: embedding(i, table, pos_table=pt))(ids)
    np.testing.assert_allclose(v, embedding(ids, table, pos_table=pt), rtol=0)
    f = lambda t: jnp.sum(embedding(ids, t, pos_table=pt, rate=0.1, key=jax.random.key(0)) * ct)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(f))(table), jax.grad(f)(table), rtol=1e-6)


def test_batch_sharded_jit_no_all_gather_and_same_mask():
    devs = jax.devices()
    if len(devs) < 8:
        pytest.skip("needs 8 (simulated) devices")
    mesh = jax.sharding.Mesh(np.array(devs[:8]), ("data",))
    ids, table, pt, ct = _setup(7, (16, 12), 64, 16, max_pos=12)
    key = jax.random.key(3)

    def step(ids, table, pt, ct):
        def f(table, pt):
            return jnp.sum(embedding(ids, table, pos_table=pt, padding_idx=1, rate=0.2, key=key) * ct)
        out = embedding(ids, table, pos_table=pt, padding_idx=1, rate=0.2, key=key)
        return out, jax.grad(f, (0, 1))(table, pt)

    sh = NamedSharding(mesh, P("data"))
    args = (jax.device_put(ids, sh), table, pt, jax.device_put(ct, sh))
    hlo = jax.jit(step).lower(*args).compile().as_text()
    assert "all-gather" not in hlo
    out, (dt, dp) = jax.jit(step)(*args)
    out0, (dt0, dp0) = step(ids, table, pt, ct)
    np.testing.assert_array_equal(out, out0)  # the same mask on every shard as unsharded
    np.testing.assert_allclose(dt, dt0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dp, dp0, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not jax_ls2.kernels_built(), reason="CUDA kernels not built")
def test_lowering_for_cuda_shows_custom_calls():
    ids, table, pt, _ = _setup(8, (2, 4), 20, 8, max_pos=4)
    f = lambda t: jax.value_and_grad(lambda t: embedding(ids, t, pos_table=pt, rate=0.1,
                                                         key=jax.random.key(0)).sum())(t)
    text = jax.jit(f).trace(table).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_ls2_embedding_fwd" in text and "jax_ls2_embedding_bwd" in text


# ---------------------------------------------------------------- GPU
def xla_embedding(ids, table, *, scale=1.0, pos_table=None, sinusoidal=False, padding_idx=None, rate=0.0,
                  key=None):
    """What one writes in plain jnp, computed in the table's dtype (the XLA side of the
    2x rule), with the same dropout mask as the op."""
    dt = table.dtype
    hidden = table.shape[1]
    x = jnp.take(table, ids, axis=0) * jnp.asarray(scale, dt)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
    if pos_table is not None:
        x = x + jnp.take(pos_table, pos, axis=0)
    elif sinusoidal:
        half = hidden // 2
        ang = pos.astype(F32)[..., None] * sinusoid_inv_freq(hidden)[:half]
        sin = jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)
        if hidden % 2:
            sin = jnp.pad(sin, [(0, 0)] * (sin.ndim - 1) + [(0, 1)])
        x = x + sin.astype(dt)
    if padding_idx is not None:
        x = jnp.where((ids == padding_idx)[..., None], jnp.zeros((), dt), x)
    if rate > 0:
        threshold = _random.dropout_threshold(rate)
        keep = _random.keep_mask(_random.seed_words(key), x.shape, threshold)
        x = jnp.where(keep, x * jnp.asarray(_random.keep_scale(rate), dt), jnp.zeros((), dt))
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("hidden", [768, 123, 4097])
@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_gpu_two_x_rule(dtype, hidden, pos):
    ids, table, pt, ct = _setup(9, (4, 257), 50257, hidden, max_pos=300, dtype=dtype)
    key = jax.random.key(5)
    kw = dict(pos_table=pt) if pos == "learned" else dict(sinusoidal=True)
    kw.update(padding_idx=int(ids[0, 5]), rate=0.1, key=key, scale=2.0)
    ctd = ct.astype(dtype)
    ours = jax.jit(lambda t, p: jax.vjp(lambda t, p: embedding(ids, t, **{**kw, **({"pos_table": p} if pos == "learned" else {})}), t, p))
    ref = jax.jit(lambda t, p: jax.vjp(lambda t, p: xla_embedding(ids, t, **{**kw, **({"pos_table": p} if pos == "learned" else {})}), t, p))
    out, vo = ours(table, pt)
    rout, vr = ref(table, pt)
    keep = _random.keep_mask(_random.seed_words(key), ids.shape + (hidden,), _random.dropout_threshold(0.1))
    tkw = dict(kw)
    tkw.pop("key"), tkw.pop("rate")
    truth, grads = _truth(ids, table.astype(F32), keep=keep, rate=_random.dropout_threshold(0.1) / 65536,
                          **{k: (v.astype(F32) if k == "pos_table" else v) for k, v in tkw.items()})
    err = lambda a, t: np.max(np.abs(np.asarray(a, np.float64) - t))
    assert err(out, truth) <= 2 * err(rout, truth) + (0 if dtype == jnp.float32 else 0)
    (dt, dp), (rdt, rdp) = vo(ctd), vr(ctd)
    tdt, tdp = grads(np.asarray(ctd.astype(F32)))
    assert err(dt, tdt) <= 2 * err(rdt, tdt)
    if pos == "learned":
        assert err(dp, tdp) <= 2 * err(rdp, tdp)


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_sorted_mode_is_bitwise_reproducible():
    ids = jax.random.randint(jax.random.key(0), (16, 1024), 0, 50, jnp.int32)  # heavy repetition
    table = jax.random.normal(jax.random.key(1), (50257, 768), F32)
    ct = jax.random.normal(jax.random.key(2), (16, 1024, 768), F32)
    g = jax.jit(jax.grad(lambda t: jnp.sum(embedding(ids, t, grad_mode="sorted") * ct)))
    a, b = g(table), g(table)
    np.testing.assert_array_equal(a, b)
    ga = jax.jit(jax.grad(lambda t: jnp.sum(embedding(ids, t) * ct)))(table)
    np.testing.assert_allclose(a, ga, rtol=1e-4, atol=1e-3)
