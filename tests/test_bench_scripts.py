"""The benchmark scripts start and write their CSVs: each runs here on its smallest
shapes, as `bench/gpu_check.sh` starts it on the GPU machine (``python -m`` from the
repository root), so an import or argument error shows before a GPU run."""
import csv
import os
import subprocess
import sys

import pytest

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
