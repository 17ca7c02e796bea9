"""The benchmark scripts start and write their CSVs: each runs here on its smallest
shapes, as `bench/gpu_check.sh` starts it on the GPU machine (``python -m`` from the
repository root), so an import or argument error shows before a GPU run."""
import csv
import os
import subprocess
import sys

import numpy as np
import pytest
from numerics import xla_flags_with_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args):
    proc = subprocess.run([sys.executable, "-m", *args, "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_bench_models_smoke_runs_each_impl_in_its_own_process(tmp_path):
    _run(tmp_path, "bench.bench_models", "--smoke", "--steps", "5", "--warmup", "1", "--models", "gpt2-small",
         "--impls", "ls2", "ls2-fp8")
    [path] = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    rows = _rows(tmp_path / path)
    assert [r["impl"] for r in rows] == ["ls2", "ls2-fp8"]
    assert all(float(r["ms_median"]) > 0 and r["backend"] for r in rows)
    assert float(rows[1]["speedup_vs_ls2"]) > 0


def test_bench_te_layer_smoke(tmp_path):
    out = _run(tmp_path, "bench.bench_te_layer", "--smoke", "--reps", "3", "--impls", "ls2-bf16", "ls2-fp8")
    rows = _rows(tmp_path / "bench_te_layer.csv")
    assert [r["impl"] for r in rows] == ["ls2-bf16", "ls2-fp8"], out
    assert float(rows[1]["speedup_vs_ls2_bf16"]) > 0 and float(rows[0]["tflops"]) >= 0


def test_bench_fp8_dot_smoke(tmp_path):
    _run(tmp_path, "bench.bench_fp8_dot", "--shapes", "64x32x48", "--reps", "3", "--history", "4")
    rows = _rows(tmp_path / "bench_fp8_dot.csv")
    assert {(r["impl"], r["pass"]) for r in rows} == {(i, p) for i in ("bf16", "flax-fp8", "ls2-fp8")
                                                       for p in ("fwd", "fwd+bwd")}


@pytest.mark.slow
def test_bench_models_llama_smoke_counts_llama_flops_in_bf16_and_fp8(tmp_path):
    import flax_models as fm
    from bench.bench_models import PEAK_FLOPS, train_flops
    _run(tmp_path, "bench.bench_models", "--smoke", "--steps", "2", "--group", "1", "--warmup", "1", "--models",
         "llama-1b", "--impls", "ls2", "ls2-fp8")
    [path] = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    rows = _rows(tmp_path / path)
    assert [(r["model"], r["impl"], r["shape"].split()[0]) for r in rows] == [
        ("llama-1b", "ls2", "4x64"), ("llama-1b", "ls2-fp8", "4x64")]
    for row in rows:
        flops = float(row["mfu"]) * PEAK_FLOPS * float(row["ms_median"]) * 1e-3
        assert flops == pytest.approx(train_flops(fm.get_config("llama", "tiny"), 4, 64), rel=1e-6)
        assert float(row["tokens_per_s"]) > 0 and 0 < float(row["loss"]) < 100
    assert float(rows[1]["speedup_vs_ls2"]) > 0


def _gemm_weights(cfg, head_is_token_table):
    """Weights of the GEMMs of cfg's model, from its parameter tree: every 2-D parameter
    but the embedding tables, and the token table where it is the output head."""
    import jax
    from flax import nnx

    import flax_models as fm
    model = nnx.eval_shape(lambda: fm.build(cfg, impl="plain"))
    total = 0
    for path, leaf in jax.tree.leaves_with_path(nnx.state(model, nnx.Param)):
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 2 and ("embed" not in name or (head_is_token_table and "tokens" in name)):
            total += leaf.size
    return total


def test_train_flops_llama_counts_gqa_swiglu_untied_head_and_causal_attention():
    import flax_models as fm
    from bench.bench_models import train_flops
    batch, seq = 3, 40
    # Queries 4 heads x 24 = 96 wide over a hidden size of 64, k/v of 2 heads: GPT at
    # hidden 96 has the same causal attention (GPT's head is its token table).
    llama = fm.get_config("llama", "tiny", head_dim=24, num_kv_heads=2)
    gpt = fm.get_config("gpt", "tiny", hidden_size=96)
    attention = [train_flops(cfg, batch, seq) - 6 * batch * seq * _gemm_weights(cfg, tied)
                 for cfg, tied in ((llama, False), (gpt, True))]
    assert attention[0] > 0 and attention[0] == pytest.approx(attention[1], rel=1e-12)


def test_bench_decode_smoke(tmp_path):
    _run(tmp_path, "bench.bench_decode", "--smoke", "--models", "llama-1b", "--batches", "2", "--impls", "ls2")
    [path] = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    [row] = _rows(tmp_path / path)
    assert (row["model"], row["impl"], row["batch"], row["shape"]) == ("llama-1b", "ls2", "2",
                                                                        "batch 2, prompt 8, new 4")
    assert float(row["tokens_per_s"]) == pytest.approx(2e3 / float(row["step_ms_median"]), rel=1e-6)
    assert float(row["prefill_ms"]) > 0 and float(row["generate_ms"]) > 0 and row["backend"]


def test_bench_llama_ops_smoke(tmp_path):
    _run(tmp_path, "bench.bench_llama_ops", "--smoke", "--reps", "3")
    rows = _rows(tmp_path / "llama_ops.csv")
    passes = ("fwd", "bwd", "fwd+bwd")
    expected = {(op, p) for op in ("rms_norm", "rotary", "swiglu", "swiglu_dropout") for p in passes}
    expected.add(("add_rms_norm", "fwd"))
    assert {(r["op"], r["pass"], r["impl"]) for r in rows} == {(*k, i) for k in expected for i in ("xla", "jax_ls2")}
    assert len(rows) == 2 * len(expected) and all(float(r["ms_median"]) > 0 and float(r["gbytes"]) > 0 for r in rows)


def test_bench_models_csv_has_speedup_and_peak_memory_over_the_twin(tmp_path):
    from bench.bench_models import write_csv
    rng = np.random.default_rng()
    ms, peak = rng.uniform(1, 50, 2), rng.uniform(1, 100, 2)
    rows = [{"model": "llama-small", "impl": impl, "ms_median": m, "peak_mem_gb": g}
            for impl, m, g in zip(("plain", "ls2"), ms, peak)]
    [plain, ls2] = _rows(write_csv(rows, str(tmp_path), "2026-12-02T00:00:00Z", False, True))
    assert float(plain["speedup"]) == float(plain["peak_mem_vs_plain"]) == 1.0
    assert float(ls2["speedup"]) == pytest.approx(ms[0] / ms[1], rel=1e-12)
    assert float(ls2["peak_mem_vs_plain"]) == pytest.approx(peak[1] / peak[0], rel=1e-12)


@pytest.mark.slow
def test_bench_scaling_smoke_runs_every_mesh_of_four_devices(tmp_path, capsys):
    """GPT only (BERT takes the same path but for the seq mesh; each mesh is a process)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(4))
    proc = subprocess.run([sys.executable, "-m", "bench.bench_scaling", "--smoke", "--steps", "2", "--warmup", "1",
                           "--group", "1", "--models", "gpt2-small", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [path] = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    assert path.startswith("scaling_") and path.endswith("_smoke.csv")
    rows = _rows(tmp_path / path)
    meshes = ["none", "data=1", "data=4", "tensor=4", "data=2,tensor=2", "pipe=2,data=2"]
    assert [(r["model"], r["mesh"]) for r in rows] == [("gpt2-small", m) for m in meshes + ["seq=4"]]
    for r in rows:
        assert not r["skipped"], r  # tiny presets (4 heads, 2 layers) take every mesh of 4 devices
        devices = 1 if r["mesh"] in ("none", "data=1") else 4
        assert int(r["devices"]) == devices
        data = int(r["mesh"].split("data=")[1].split(",")[0]) if "data=" in r["mesh"] else 1
        assert int(r["global_batch"]) == 4 * data and r["shape"] == f"{4 * data}x64"
        for col in ("ms_median", "ms_p20", "ms_p80", "tokens_per_s", "tokens_per_s_per_device", "scaling_efficiency"):
            assert float(r[col]) > 0, (r["mesh"], col)
        assert float(r["ms_p20"]) <= float(r["ms_median"]) <= float(r["ms_p80"])
        assert float(r["tokens_per_s_per_device"]) == pytest.approx(float(r["tokens_per_s"]) / devices, rel=1e-6)
        assert r["gpu"] and r["jax_version"] and r["git_commit"] and r["date"] and r["backend"]
        assert (r["ms_vs_no_mesh"] != "") == (r["mesh"] == "data=1")
    base, one = rows[:2]
    assert float(one["ms_vs_no_mesh"]) == pytest.approx(float(one["ms_median"]) / float(base["ms_median"]), rel=1e-6)
    assert float(base["scaling_efficiency"]) == pytest.approx(1.0)
    from bench import report
    history = str(tmp_path / "history" / "results.csv")
    report.main(["--csv", history, "append", str(tmp_path), "--run", "smoke"])
    capsys.readouterr()
    report.main(["--csv", history, "scaling"])
    table = capsys.readouterr().out
    assert table.count("| gpt2-small |") == 7
    assert "| gpt2-small | seq=4 (reference) | 4x64 | 4 |" in table
    with pytest.raises(SystemExit, match="no run"):  # scaling rows are no op rows
        report.main(["--csv", history, "ops"])


def test_bench_scaling_mesh_list_follows_the_device_count():
    from bench.bench_scaling import mesh_specs
    assert mesh_specs(1, "gpt") == [("data=1", None)]
    assert [s for s, _ in mesh_specs(2, "gpt")] == ["data=1", "data=2", "tensor=2", "pipe=2,data=1", "seq=2"]
    assert [s for s, _ in mesh_specs(8, "bert")] == ["data=1", "data=8", "tensor=8", "data=4,tensor=2",
                                                     "pipe=2,data=4"]
    odd = dict(mesh_specs(3, "gpt"))
    assert odd["data=3/2,tensor=2"] and odd["pipe=2,data=3/2"] and odd["tensor=3"] is None


def test_bench_sequence_memory_smoke_brackets_each_search(tmp_path, capsys):
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(4), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "bench.bench_sequence_memory", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [path] = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    assert path.startswith("sequence_memory_") and path.endswith("_smoke.csv")
    rows = _rows(tmp_path / path)
    from bench.bench_sequence_memory import FIELDS
    assert list(rows[0]) == FIELDS + ["skipped"]
    for r in rows:
        assert r["model"] == "bert-tiny" and r["devices"] == "4" and r["backend"] == "cpu" and r["dtype"] == "fp32"
        assert float(r["capacity_gb"]) == 0.03 and r["capacity_source"] == "--capacity-gb" and not r["skipped"]
    summaries = [r for r in rows if r["search"].startswith("max ")]
    assert [(r["mesh"], r["search"]) for r in summaries] == [
        ("seq=4", "max seq_len"), ("tensor=4", "max seq_len"), ("seq=4", "max batch"), ("tensor=4", "max batch")]
    for s in summaries:
        what = s["search"][len("max "):]
        probes = [r for r in rows if r["mesh"] == s["mesh"] and r["search"] == what]
        assert [int(r["probe"]) for r in probes] == list(range(1, int(s["probes"]) + 1))
        for r in probes:
            got = int(r["argument_bytes"]) + int(r["output_bytes"]) + int(r["temp_bytes"]) - int(r["alias_bytes"])
            assert int(r["per_device_bytes"]) == got > 0
            assert r["fits"] == str(int(got <= 0.03e9))
            assert r["shape"] == f"{r['batch']}x{r['seq_len']}"
            assert int(r["batch"] if what == "seq_len" else r["seq_len"]) == (8 if what == "seq_len" else 64)
        by_size = {int(r[what]): r for r in probes}
        best, fail = int(s["max_fitting"]), int(s["min_failing"])
        assert by_size[best]["fits"] == "1" and by_size[fail]["fits"] == "0" and best < fail, s
        assert all(r["fits"] == "1" for n, r in by_size.items() if n <= best)
        assert all(r["fits"] == "0" for n, r in by_size.items() if n >= fail)
        assert int(s["granularity"]) == (64 if what == "seq_len" else 1)  # lcm(2 x 4, 64); data size 1
        assert all(n % int(s["granularity"]) == 0 for n in by_size)
        ordered = [int(by_size[n]["per_device_bytes"]) for n in sorted(by_size)]
        assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered), (s["mesh"], what, ordered)
    for what in ("seq_len", "batch"):
        seq, tensor = [s for s in summaries if s["search"] == f"max {what}"]
        ratio = float(seq["ratio_seq_over_tensor"])
        assert ratio == pytest.approx(int(seq["max_fitting"]) / int(tensor["max_fitting"]), abs=1e-3)
        assert float(seq["ratio_low"]) <= ratio <= float(seq["ratio_high"])
        assert float(seq["ratio_low"]) == pytest.approx(
            int(seq["max_fitting"]) / (int(tensor["min_failing"]) - int(tensor["granularity"])), abs=1e-3)
        assert tensor["ratio_seq_over_tensor"] == tensor["ratio_low"] == ""
    assert "max seq_len" in proc.stdout and "seq/tensor" in proc.stdout
    from bench import report
    history = str(tmp_path / "history" / "results.csv")
    report.main(["--csv", history, "append", str(tmp_path), "--run", "smoke"])
    capsys.readouterr()
    report.main(["--csv", history, "sequence-memory"])
    table = capsys.readouterr().out
    assert table.count("| bert-tiny |") == 4 and "| bert-tiny | seq=4 (cpu, fp32) | seq_len |" in table


def test_bench_sequence_memory_abstract_state_is_the_state_create_places():
    import jax

    import flax_models as fm
    from bench.bench_sequence_memory import abstract_state, mesh_config
    from flax_models import training
    tx, _ = training.make_optimizer(1e-4, 1000, 10, fused=True)
    for kind in ("seq", "tensor"):
        mesh, cfg = mesh_config(kind, 4, fm.get_config("bert", "tiny"), "tiny", 8, 64)
        with jax.set_mesh(mesh):
            _, real = training.create(cfg, impl="ls2", dtype=None, seed=0, tx=tx, mesh=mesh)
            _, abstract = abstract_state(cfg, mesh, dtype=None, tx=tx)
        real = jax.tree_util.tree_flatten_with_path(real)[0]
        abstract = jax.tree_util.tree_flatten_with_path(abstract)[0]
        assert [p for p, _ in real] == [p for p, _ in abstract]
        for (path, x), (_, y) in zip(real, abstract):
            assert isinstance(y, jax.ShapeDtypeStruct), path
            assert (x.shape, x.dtype) == (y.shape, y.dtype), path
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (kind, path, x.sharding, y.sharding)
        split = [p for p, x in real if not x.sharding.is_fully_replicated]
        assert bool(split) == (kind == "tensor")  # the seq mesh replicates the whole state


def test_bench_sequence_memory_search_brackets_the_limit():
    from bench.bench_sequence_memory import default_devices, search
    import flax_models as fm
    convex = lambda n: 5e9 + 2e6 * n + 2e3 * n * n  # noqa: E731
    best, fail, probes = search(convex, 1152, 192, 30, 141e9)
    assert best % 192 == 0 and fail == best + 192 and convex(best) <= 141e9 < convex(fail)
    assert len(probes) == len({n for n, _ in probes}) and len(probes) < 12
    assert search(lambda n: n, 8, 1, 30, 300.5)[:2] == (300, 301)
    assert search(lambda n: n, 8, 1, 3, 300.5) == (32, None, [(8, 8), (16, 16), (32, 32)])
    assert search(lambda n: n, 512, 64, 30, 10) == (None, 64, [(512, 512), (256, 256), (128, 128), (64, 64)])
    assert search(lambda n: n, 512, 64, 30, 300)[:2] == (256, 320)
    assert default_devices(fm.get_config("bert", "base"), 8) == 6  # 30522 = 2 x 3 x 5087 words
    assert default_devices(fm.get_config("bert", "tiny"), 8) == 4


@pytest.mark.slow
def test_quick_smoke_times_only_after_every_compile_and_writes_the_csvs(tmp_path):
    out = _run(tmp_path, "bench.quick", "--smoke", "--jobs", "2")
    lines = out.splitlines()
    compiled = [i for i, l in enumerate(lines) if ": compiled in " in l]
    timed = [i for i, l in enumerate(lines) if l.endswith(" ms") and ": " in l]
    assert len(compiled) == len(timed) == 4 and max(compiled) < min(timed), out
    [models] = [p for p in os.listdir(tmp_path) if p.startswith("models_")]
    assert [(r["model"], r["impl"]) for r in _rows(tmp_path / models)] == [("gpt2-small", "plain"),
                                                                          ("gpt2-small", "ls2")]
    te = _rows(tmp_path / "bench_te_layer.csv")
    assert {r["impl"] for r in te} == {"flax-bf16", "ls2-fp8"} and all("dropout=0.1" in r["shape"] for r in te)
    assert float(te[0]["speedup_vs_flax_bf16"]) > 0
    table = out[out.index("==== standard benchmarks"):]
    assert "gpt2-small train step, jax_ls2" in table and "plain Flax" in table, table


def test_quick_table_puts_each_figure_over_its_same_run_baseline():
    from bench.quick import table
    models = [dict(model="gpt2-small", impl="plain", ms_median=40.0), dict(model="gpt2-small", impl="ls2", ms_median=30.0),
              dict(model="gpt2-small", impl="ls2-fp8", ms_median=25.0)]
    te = [dict(impl="flax-bf16", shape="4x2048", ms_median=16.0), dict(impl="ls2-bf16", shape="4x2048", ms_median=16.0),
          dict(impl="ls2-bf16", shape="4x2048 dropout=0.1", ms_median=19.0),
          dict(impl="flax-bf16", shape="4x2048 dropout=0.1", ms_median=22.8)]
    att = [dict(shape="8x2048x16x128", causal="True", impl="cudnn", ms_median="2.0"),
           dict(shape="8x2048x16x128", causal="True", impl="jax_ls2", ms_median="4.0")]
    got = {(what, base_name): ratio for what, _, base_name, _, ratio in table(models, te, att)}
    assert got[("gpt2-small train step, jax_ls2", "plain Flax")] == pytest.approx(40 / 30)
    assert got[("gpt2-small train step, jax_ls2 FP8", "jax_ls2 bf16")] == pytest.approx(30 / 25)
    assert got[("seed layer, dropout 0, jax_ls2 bf16", "Flax bf16 (cuDNN)")] == pytest.approx(1.0)
    assert got[("seed layer, dropout 0.1, jax_ls2 bf16", "Flax bf16")] == pytest.approx(22.8 / 19)
    assert got[("attention 8x2048x16x128 causal fwd+bwd, jax_ls2 flash", "cuDNN")] == pytest.approx(0.5)
    assert len(got) == 5  # no figure without its baseline


def test_gpu_test_shards_partition_the_gpu_tests():
    def collected(shard):
        env = dict(os.environ, **({"JAX_LS2_TEST_SHARD": shard} if shard else {}))
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                               "-p", "no:cacheprovider", "tests/test_rotary.py"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        return [l for l in proc.stdout.splitlines() if "::" in l]

    whole = collected(None)
    shards = [collected(f"{i}/3") for i in range(3)]
    assert len(whole) > 3 and sorted(sum(shards, [])) == sorted(whole)
    assert all(shards) and len(set(sum(shards, []))) == len(whole)


def test_gpu_tests_counts_outcomes_and_names_the_failures(tmp_path):
    from bench.gpu_tests import results, summary
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase file="tests/test_a.py" name="t1" time="2.5"/>'
        '<testcase file="tests/test_a.py" name="t2" time="1.0"><failure message="x"/></testcase>'
        '<testcase file="tests/test_b.py" name="t3" time="0.1"><skipped/></testcase></testsuite></testsuites>')
    counts, tests = results(str(tmp_path))
    assert counts == dict(passed=1, failed=1, errors=0, skipped=1)
    lines = summary(0, 10.0, counts, tests, [], 4)
    assert lines[0].startswith("gpu tests: 1 passed, 1 failed, 0 errors, 1 skipped")
    assert "  FAILED: tests/test_a.py::t2" in lines and "test_a.py 4" in " ".join(lines)
