"""The results history (bench/common.py long form, bench/report.py): a run's CSVs become one
row per figure, appending is refused for a run already present, files without metadata
take it from their folder, and the committed history holds only well-formed rows."""
import csv
import os

import pytest

from bench import bench_models, report
from bench.common import LONG_FIELDS, RESULTS_CSV, append_long, long_rows


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_long_rows_one_row_per_figure():
    rows = [{"model": "gpt2-small", "shape": "16x1024", "impl": "ls2", "ms_median": "30.3", "mfu": "",
             "git_commit": "abc1234", "gpu": "H200", "date": "2026-12-02"}]
    out = long_rows(rows, "r/models", "models")
    assert [(r["metric"], r["value"]) for r in out] == [("ms_median", "30.3")]  # the empty cell dropped
    assert out[0]["op"] == "gpt2-small" and out[0]["commit"] == "abc1234" and out[0]["run"] == "r/models"
    assert set(out[0]) == set(LONG_FIELDS)


def test_append_refuses_a_run_twice(tmp_path):
    path = str(tmp_path / "history.csv")
    rows = long_rows([{"op": "layer_norm", "impl": "jax_ls2", "ms_median": "0.05"}], "run1/ln", "layer_norm")
    assert append_long(rows, path) == 1
    with pytest.raises(ValueError, match="already in"):
        append_long(rows, path)
    assert append_long([dict(r, run="run2/ln") for r in rows], path) == 1
    assert [r["run"] for r in report.read(path)] == ["run1/ln", "run2/ln"]


def test_run_rows_fill_metadata_and_bench_names(tmp_path):
    folder = tmp_path / "h200-x"
    folder.mkdir()
    _write(folder / "summary_ea16308.csv", [{"op": "sr", "dtype": "bf16_sr", "final_loss": "2.33",
                                            "gpu": "H200", "jax_version": "0.11.2", "commit": "ea16308",
                                            "date": "2026-11-29"}])
    _write(folder / "curves_ea16308.csv", [{"step": "0", "mode": "bf16_sr", "loss": "10.8"}])
    _write(folder / "models_39293bf.csv", [{"model": "gpt2-small", "impl": "ls2", "speedup": "1.3",
                                           "git_commit": "48f7ef0", "date": "2026-12-01"}])
    rows = {r["run"]: r for r in report.run_rows(str(folder), "h200-x")}
    curve = rows["h200-x/curves_ea16308"]
    assert (curve["commit"], curve["gpu"], curve["pass"], curve["impl"]) == ("ea16308", "H200", "step=0", "bf16_sr")
    assert curve["bench"] == "curves"
    assert rows["h200-x/models_39293bf"]["bench"] == "models"  # a file named after another commit


def test_committed_history_is_well_formed():
    rows = report.read(RESULTS_CSV)
    with open(RESULTS_CSV, newline="") as f:
        assert next(csv.reader(f)) == LONG_FIELDS
    assert all(r["run"] and r["metric"] and r["value"] != "" for r in rows)
    latest = report.select(rows, "latest", report.is_model_row)
    impls = {r["impl"] for r in latest}
    assert {"plain", "ls2"} <= impls <= set(bench_models.IMPLS), impls
    assert os.path.isdir(os.path.join(os.path.dirname(RESULTS_CSV), "plots"))
