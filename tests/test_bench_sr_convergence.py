"""The bf16 stochastic-rounding convergence benchmark on the CPU (tiny GPT, 30 steps):
its CSVs, the three precision modes, and that fp32_master learns."""
import csv
import math

import pytest

from bench import bench_sr_convergence as B

MODES = {"fp32_master", "bf16_sr", "bf16_nearest"}


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_small_run_writes_both_csvs(tmp_path, capsys):
    out = B.main(["--small", "--out", str(tmp_path), "--log-every", "0"])
    printed = capsys.readouterr().out
    assert "within 1%" in printed

    rows = _read(tmp_path / "bench_sr_convergence.csv")
    assert {r["dtype"] for r in rows} == MODES and len(rows) == 3
    for r in rows:
        assert r["op"] == "sr_convergence" and r["impl"] == "ls2"
        assert r["shape"] == "gpt_tiny_b8x64_30steps" and int(r["steps"]) == 30
        assert math.isfinite(float(r["first_loss"])) and math.isfinite(float(r["final_loss"]))
        assert math.isfinite(float(r["rel_diff_vs_fp32_master"]))
        assert r["within_1pct"] in ("True", "False")
        assert r["commit"] and r["gpu"] and r["jax_version"] and r["date"]
    by_mode = {r["dtype"]: r for r in rows}
    ref = by_mode["fp32_master"]
    assert float(ref["rel_diff_vs_fp32_master"]) == 0.0
    # fp32_master learns: the final loss (mean of the last 20 steps) is below the first step's
    assert float(ref["final_loss"]) < float(ref["first_loss"]) - 0.1

    curves = _read(tmp_path / "sr_convergence_curves.csv")
    assert list(curves[0]) == ["step", "mode", "loss"]
    assert len(curves) == 3 * 30
    for mode in MODES:
        losses = [float(c["loss"]) for c in curves if c["mode"] == mode]
        assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    # the summary agrees with the curves and with the returned results
    ref_curve = [float(c["loss"]) for c in curves if c["mode"] == "fp32_master"]
    assert math.isclose(float(ref["final_loss"]), sum(ref_curve[-20:]) / 20, rel_tol=1e-5)
    assert math.isclose(float(ref["first_loss"]), ref_curve[0], rel_tol=1e-6)
    assert out["within_1pct"] == (by_mode["bf16_sr"]["within_1pct"] == "True")
    # every mode starts from the same weights and sees the same first batch
    assert len({r["first_loss"] for r in rows}) == 1
