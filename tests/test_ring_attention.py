"""jax_ls2.parallel.ring_attention on a ring of the 8 simulated CPU devices (a ``seq=8``
mesh): outputs and gradients against single-device attention, for both algorithms and
layouts, causal or not, with padding and (rsa) dropout; the compiled program's
collectives; the ring emulated under vmap; errors; the benchmark's smoke run."""
import csv
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ls2 import parallel
from jax_ls2.ops import flash_attention

ra = importlib.import_module("jax_ls2.parallel.ring_attention")

# L = 64 is no other dim of the test, so an array holding the full length shows in the HLO.
RING, B, L, H, HK, D = 8, 2, 64, 4, 2, 8
CHUNK = L // RING
RATE = 0.1
SPEC = P(None, "seq")


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh(f"seq={RING}")


@pytest.fixture(scope="module")
def data():
    ks = jax.random.split(jax.random.key(23), 5)
    q = jax.random.normal(ks[0], (B, L, H, D))
    k = jax.random.normal(ks[1], (B, L, HK, D))
    v = jax.random.normal(ks[2], (B, L, HK, D))
    # Example 1 pads its last 37 keys: whole chunks of keys and part of one.
    pm = jnp.arange(L)[None, :] < jnp.array([L - 3, L - 37])[:, None]
    cot = jax.random.normal(ks[3], (B, L, H, D))
    return q, k, v, pm, cot, ks[4]


def _layout(balance, x, inverse=False):
    if balance == "none":
        return x
    return (ra.zigzag_unpermute if inverse else ra.zigzag_permute)(x, RING)


def _with_vjp(attend, q, k, v, pm, key, cot):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, pm, key), q, k, v)
    return out, vjp(cot)


@functools.lru_cache(maxsize=None)
def _ring_program(mesh, impl, balance, causal, rate):
    """jit: (q, k, v, pm, key, cot) in the layout -> (out, (dq, dk, dv)) in the layout."""
    def attend(q, k, v, pm, key):
        fn = functools.partial(ra.ring_attention, axis_name="seq", causal=causal, rate=rate, impl=impl,
                               balance=balance)
        body = lambda q, k, v, pm, key: fn(q, k, v, padding_mask=pm, key=key)
        return jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 4 + (P(),), out_specs=SPEC)(q, k, v, pm, key)
    return jax.jit(functools.partial(_with_vjp, attend))


@functools.lru_cache(maxsize=None)
def _single_program(causal, rate):
    attend = lambda q, k, v, pm, key: flash_attention(q, k, v, padding_mask=pm, causal=causal, rate=rate, key=key)
    return jax.jit(functools.partial(_with_vjp, attend))


def _ring_args(mesh, balance, data):
    q, k, v, pm, cot, key = data
    put = lambda x: jax.device_put(_layout(balance, x), NamedSharding(mesh, SPEC))
    return (put(q), put(k), put(v), put(pm), key, put(cot))


def _ring_result(mesh, impl, balance, causal, rate, data):
    out, grads = _ring_program(mesh, impl, balance, causal, rate)(*_ring_args(mesh, balance, data))
    return jax.tree.map(lambda x: _layout(balance, x, inverse=True), (out, grads))


def _close(got, want):
    for name, g, w in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)


CONFIGS = [(impl, balance, causal) for impl in ra.IMPLS for balance in ra.BALANCES for causal in (False, True)]


@pytest.mark.parametrize("impl,balance,causal", CONFIGS)
def test_outputs_and_gradients_equal_single_device(mesh, data, impl, balance, causal):
    """With padding and dropout (the single-device mask for the same key)."""
    want = _single_program(causal, RATE)(*data[:4], data[5], data[4])
    _close(_ring_result(mesh, impl, balance, causal, RATE, data), want)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_ring_equals_jax_nn_dot_product_attention(mesh, data, causal):
    q, k, v, pm, cot, key = data

    def plain(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=pm[:, None, None, :], is_causal=causal)

    want = jax.jit(functools.partial(_with_vjp, lambda q, k, v, pm, key: plain(q, k, v)))(q, k, v, pm, key, cot)
    _close(_ring_result(mesh, "flash", "zigzag", causal, 0.0, data), want)


@pytest.mark.parametrize("impl", ra.IMPLS)
def test_dropout_is_on_and_the_same_for_both_layouts(mesh, data, impl):
    """The dropout tests above would pass with dropout off if the single-device op ignored
    the rate too: the outputs must differ from rate 0's, and agree across layouts."""
    zig = _ring_result(mesh, impl, "zigzag", True, RATE, data)
    none = _ring_result(mesh, impl, "none", True, RATE, data)
    plain = _single_program(True, 0.0)(*data[:4], data[5], data[4])
    assert np.max(np.abs(np.asarray(zig[0]) - np.asarray(plain[0]))) > 0.1
    _close(zig, none)


def test_flash_dropout_deterministic_is_plain_attention(mesh, data):
    q, k, v, pm, _, key = data
    put = lambda x: jax.device_put(x, NamedSharding(mesh, SPEC))

    def run(**kw):
        body = lambda q, k, v, key: ra.ring_attention(q, k, v, axis_name="seq", impl="flash", balance="none",
                                                      rate=RATE, key=key, **kw)
        ring = jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 3 + (P(),), out_specs=SPEC)
        return jax.jit(ring)(put(q), put(k), put(v), key)

    want = flash_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(run(deterministic=True)), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- compiled program
def _compiled(mesh, impl, data):
    return _ring_program(mesh, impl, "zigzag", True, 0.0).lower(*_ring_args(mesh, "zigzag", data)).compile()


def _permutes(hlo):
    return [ln for ln in hlo.splitlines() if re.search(r" collective-permute(-start)?\(", ln)]


@pytest.mark.parametrize("impl", ra.IMPLS)
def test_compiled_ring_permutes_chunks_and_gathers_nothing(mesh, data, impl):
    hlo = _compiled(mesh, impl, data).as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter"):
        assert f" {op}(" not in hlo and f" {op}-start(" not in hlo, op
    permutes = _permutes(hlo)
    # forward + backward, P - 1 steps of each ring pass, P shifts of each accumulator:
    # flash: (k, v, mask) forward and again backward, then dK and dV;
    # rsa: (k, mask) and v forward; v, dV, then k, dK backward.
    steps = RING - 1
    want = 3 * steps + 3 * steps + 2 * RING if impl == "flash" else 3 * steps + 2 * steps + 2 * RING
    assert len(permutes) == want
    shapes = {re.search(r"= (\S+?)\{", ln).group(1) for ln in permutes}
    assert shapes == {f"f32[{B},{CHUNK},{HK},{D}]", f"pred[{B},{CHUNK}]"}
    for ln in permutes:
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", ln).group(1)
        assert pairs.count("{") == RING  # a shift around the whole ring
    full_length = re.findall(rf"\w+\[[\d,]*\b{L}\b[\d,]*\]", hlo)
    if impl == "flash":
        assert not full_length, f"an array of the full sequence length: {sorted(set(full_length))[:4]}"
    else:  # the paper's rows of probabilities, (batch, heads, chunk, L), kept for the backward
        assert f"f32[{B},{H},{CHUNK},{L}]" in full_length


def test_overlap_report_reads_async_pairs():
    bench = importlib.import_module("bench.bench_ring_attention")
    text = """HloModule m, is_scheduled=true
ENTRY %main {
  %p0 = f16[2,8,2,64]{3,2,1,0} parameter(0)
  %cp-start = (f16[2,8,2,64]{3,2,1,0}, f16[2,8,2,64]{3,2,1,0}) collective-permute-start(%p0), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %cc = (f16[2,8,4,64]{3,2,1,0}, f32[2,4,8]{2,1,0}) custom-call(%p0), custom_call_target="jax_ls2_flash_attention_fwd"
  %cp-done = f16[2,8,2,64]{3,2,1,0} collective-permute-done(%cp-start)
  %cp-start.2 = (f16[2,8,2,64]{3,2,1,0}, f16[2,8,2,64]{3,2,1,0}) collective-permute-start(%cp-done), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %cp-done.2 = f16[2,8,2,64]{3,2,1,0} collective-permute-done(%cp-start.2)
  %cc.2 = (f16[2,8,4,64]{3,2,1,0}, f32[2,4,8]{2,1,0}) custom-call(%cp-done.2), custom_call_target="jax_ls2_flash_attention_fwd"
}
"""
    report = bench.overlap_report(text)
    assert [(r["start"], r["overlapped"]) for r in report["async"]] == [("cp-start", ["cc"]), ("cp-start.2", [])]
    assert report["sync"] == 0 and report["attention_calls"] == 2


def test_overlap_report_on_cpu_counts_the_sync_permutes(mesh, data):
    bench = importlib.import_module("bench.bench_ring_attention")
    report = bench.overlap_report(_compiled(mesh, "flash", data).as_text())
    assert report["sync"] == len(_permutes(_compiled(mesh, "flash", data).as_text())) and not report["async"]


# ---------------------------------------------------------------- emulated ring (vmap)
@pytest.mark.parametrize("impl", ra.IMPLS)
@pytest.mark.optimized_cpu_code
def test_ring_under_vmap_emulates_the_devices(data, impl):
    """The ring over the vmapped axis (the benchmark's one-device emulation): with
    dropout, zigzag, causal, against single-device attention."""
    q, k, v, pm, cot, key = data
    split = lambda x: _layout("zigzag", x).reshape(x.shape[0], RING, CHUNK, *x.shape[2:]).swapaxes(0, 1)
    join = lambda x: _layout("zigzag", x.swapaxes(0, 1).reshape(x.shape[1], L, *x.shape[3:]), inverse=True)

    def attend(q, k, v, pm, key):
        fn = lambda q, k, v, pm: ra.ring_attention(q, k, v, axis_name="ring", causal=True, padding_mask=pm,
                                                   rate=RATE, key=key, impl=impl)
        return join(jax.vmap(fn, axis_name="ring")(split(q), split(k), split(v), split(pm)))

    got = jax.jit(functools.partial(_with_vjp, attend))(q, k, v, pm, key, cot)
    _close(got, _single_program(True, RATE)(q, k, v, pm, key, cot))


# ---------------------------------------------------------------- layout functions and errors
def test_zigzag_order_and_inverse():
    order = ra.zigzag_order(16, 4)
    np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                        [6, 7, 8, 9]])
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(ra.zigzag_permute(x, 4)[:, :, 0], x[:, order, 0])
    np.testing.assert_array_equal(ra.zigzag_unpermute(ra.zigzag_permute(x, 4), 4), x)
    with pytest.raises(ValueError, match=r"zigzag_permute: the sequence length \(12\) must be divisible by 2 x "
                                         r"the ring size \(2 x 4 = 8\)"):
        ra.zigzag_permute(jnp.zeros((1, 12)), 4)


def _call(mesh, length=L, axis_name="seq", **kw):
    q = jnp.ones((B, length, H, D))
    k = jnp.ones((B, length, HK, D))
    body = lambda q, k: ra.ring_attention(q, k, k, axis_name=axis_name, **kw)
    return jax.shard_map(body, mesh=mesh, in_specs=(SPEC, SPEC), out_specs=SPEC)(q, k)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(impl="ulysses"), ValueError, r"ring_attention: impl must be one of \('flash', 'rsa'\), got 'ulysses'"),
    (dict(balance="striped"), ValueError, r"ring_attention: balance must be one of \('zigzag', 'none'\), got "
                                          r"'striped'"),
    (dict(axis_name="sequence"), ValueError, r"ring_attention: axis_name 'sequence' must be a mapped axis.*mesh "
                                             r"here has axes \('pipe', 'data', 'seq', 'tensor'\)"),
    (dict(length=8 * 3), ValueError, r"ring_attention: balance='zigzag' needs the sequence length \(8 x 3 = 24\) "
                                     r"divisible by 2 x the ring size \(16\)"),
    (dict(causal=1), TypeError, "ring_attention: causal must be a Python bool"),
    (dict(rate=0.1, impl="rsa"), ValueError, "ring_attention: .*key"),
])
def test_bad_arguments_are_named(mesh, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(mesh, **kw)


def test_length_not_divisible_by_the_ring_is_refused_by_shard_map(mesh):
    with pytest.raises(ValueError, match="evenly divisible"):
        _call(mesh, length=RING * 2 + 1, balance="none")


@pytest.mark.parametrize("balance, length, match", [
    ("none", RING * 2 + 1, r"ring_attention: the sequence length \(17, q.shape\[1\]\) must be a multiple of the "
                           r"size \(8\) of mesh axis 'seq'"),
    ("zigzag", RING * 3, r"ring_attention: the sequence length \(24, q.shape\[1\]\) must be a multiple of 2 x the "
                         r"size \(8\) of mesh axis 'seq'"),
])
def test_length_not_divisible_under_jit_with_a_mesh_is_the_ops_error(mesh, balance, length, match):
    q = jnp.ones((B, length, H, D))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.jit(lambda q: ra.ring_attention(q, q, q, axis_name="seq", balance=balance))(q)


def test_whole_arrays_under_jit_with_a_mesh_equal_the_shard_map_call(mesh, data):
    q, k, v, pm, _, key = data
    kw = dict(axis_name="seq", causal=True, balance="none", padding_mask=pm)
    with jax.set_mesh(mesh):
        ours = jax.jit(lambda q, k, v: ra.ring_attention(q, k, v, **kw))(q, k, v)
    body = lambda q, k, v, pm: ra.ring_attention(q, k, v, **{**kw, "padding_mask": pm})
    want = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=SPEC))(q, k, v, pm)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"ring_attention: k must have q's sequence length \(64\) in dim 1"):
        with jax.set_mesh(mesh):
            ra.ring_attention(q, k[:, :8], v, axis_name="seq")


def test_outside_shard_map_and_bad_shapes():
    q = jnp.ones((B, CHUNK, H, D))
    with pytest.raises(ValueError, match=r"ring_attention: axis_name 'seq' must be a mapped axis.*not inside "
                                         r"shard_map"):
        ra.ring_attention(q, q, q, axis_name="seq")
    ring = functools.partial(jax.vmap, axis_name="seq")
    qs = jnp.ones((2, B, CHUNK, H, D))
    with pytest.raises(ValueError, match=r"ring_attention: k must have shape \(2, 8, kv_heads, 8\)"):
        ring(lambda q, k: ra.ring_attention(q, k, k, axis_name="seq"))(qs, jnp.ones((2, B, CHUNK + 1, H, D)))
    with pytest.raises(ValueError, match=r"ring_attention: kv_heads \(3, k.shape\[2\]\) must divide heads \(4"):
        ring(lambda q, k: ra.ring_attention(q, k, k, axis_name="seq"))(qs, jnp.ones((2, B, CHUNK, 3, D)))
    with pytest.raises(TypeError, match="ring_attention: padding_mask must have dtype"):
        ring(lambda q, m: ra.ring_attention(q, q, q, axis_name="seq", padding_mask=m))(qs, jnp.ones((2, B, CHUNK)))
    with pytest.raises(ValueError, match=r"ring_attention: padding_mask must have shape \(2, 8\)"):
        ring(lambda q, m: ra.ring_attention(q, q, q, axis_name="seq", padding_mask=m))(qs, jnp.ones((2, B, L), bool))


# ---------------------------------------------------------------- benchmark
def test_bench_smoke(tmp_path):
    """The benchmark's --smoke run, in this process (its ring checks its output against
    the whole call before timing)."""
    bench = importlib.import_module("bench.bench_ring_attention")
    bench.main(["--smoke", "--out", str(tmp_path)])
    with open(tmp_path / bench.CSV_NAME, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], r["ring"], r["pass"]) for r in rows] == [("flash_whole", "1", "fwd+bwd"),
                                                                  ("ring_flash", "2", "fwd+bwd")]
    assert all(float(r["ms_median"]) > 0 for r in rows)
    assert 0 < int(rows[1]["mem_per_device_bytes"]) < int(rows[0]["mem_per_device_bytes"])


# ---------------------------------------------------------------- GPU (run by hand on the GPU machine)
def _f64_attention(q, k, v, causal):
    """(out, (dq, dk, dv)) of the plain formula in float64 on the CPU, for the cotangent
    q (any fixed cotangent works; q's values are random)."""
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v)]
        f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        out, vjp = jax.vjp(f, *args)
        return jax.tree.map(np.asarray, (out, vjp(args[0])))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_emulated_ring_against_float64_truth(causal):
    """The ring of 4 virtual devices (vmap, the flash kernel per block, bfloat16, GQA)
    within 2x XLA's bfloat16 error of the float64 truth, output and gradients."""
    from numerics import assert_within_2x

    bench = importlib.import_module("bench.bench_ring_attention")
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (2, 1024, 4, 64), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 1024, 2, 64), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 1024, 2, 64), jnp.bfloat16)
    ring = bench.ring_fn(4, causal, "flash", "zigzag")
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    got = jax.jit(lambda q, k, v: _with_vjp(lambda q, k, v, *_: ring(q, k, v), q, k, v, None, None, q))(q, k, v)
    base = jax.jit(lambda q, k, v: _with_vjp(lambda q, k, v, *_: xla(q, k, v), q, k, v, None, None, q))(q, k, v)
    truth = _f64_attention(q, k, v, causal)
    for name, g, b, t in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(base),
                             jax.tree.leaves(truth)):
        assert_within_2x(name, g, b, t)


@pytest.mark.gpu
def test_gpu_ring_permutes_overlap_the_attention_calls():
    """Two or more GPUs: in the compiled forward, every asynchronous collective-permute of
    the ring has an attention kernel call scheduled between its start and its done."""
    if jax.device_count() < 2:
        pytest.skip("needs two or more GPUs")
    bench = importlib.import_module("bench.bench_ring_attention")
    n = jax.device_count()
    mesh = parallel.make_mesh(f"seq={n}")
    x = jax.device_put(jnp.ones((1, 1024 * n, 8, 128), jnp.bfloat16), NamedSharding(mesh, SPEC))
    for causal in (False, True):
        attend = functools.partial(ra.ring_attention, axis_name="seq", causal=causal, impl="flash")
        f = jax.shard_map(attend, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)
        report = bench.overlap_report(jax.jit(f).lower(x, x, x).compile().as_text())
        assert report["attention_calls"] >= n and report["async"], report
        assert all(r["overlapped"] for r in report["async"]), report["async"]
