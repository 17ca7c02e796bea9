"""The training command's metrics file: one JSON object per line (JSONL).

Records, each with ``"kind"`` and the run's ``"label"`` (the implementation: "ls2" or
"plain"):

* ``run``: written when a run starts or resumes: model, preset, implementation (what
  ran the jax_ls2 ops: "cuda" or "reference"; "plain" for the twin), batch, seq, dtype,
  steps, start_step, device, unit ("tokens" or "images").
* ``step``: after each step: step (steps done so far), loss, step_ms, rate (units/s of
  that step; null for a run's first step, which includes compilation), elapsed_s.
* ``eval``: step, eval_loss (mean loss over the held-out batches, eval mode).
* ``summary``: at the end of a run: final_loss, median_ms (median step time after the
  run's first step), rate (units/s from that median), peak_bytes (null where the device
  reports no memory statistics).
"""
from __future__ import annotations

import json
import os

KINDS = ("run", "step", "eval", "summary")


class MetricsWriter:
    """Appends records to ``path`` (``append=False`` starts the file afresh)."""

    def __init__(self, path: str, label: str, *, append: bool):
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self.path, self.label = path, label
        self._file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def write(self, kind: str, **fields) -> None:
        if kind not in KINDS:
            raise ValueError(f"MetricsWriter.write: kind must be one of {KINDS}, got {kind!r}")
        self._file.write(json.dumps({"kind": kind, "label": self.label, **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(path: str) -> list[dict]:
    """The records of a metrics file, in order. Raises ValueError naming the file and line
    for a line that is not a JSON object with a known ``kind``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"metrics.read: {path} line {i} is not JSON ({e})") from e
            if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
                raise ValueError(f"metrics.read: {path} line {i} is not a metrics record "
                                 f"(a JSON object with kind in {KINDS})")
            out.append(rec)
    return out


def series(records: list[dict]) -> dict:
    """Plot-ready lists from one file's records: ``label``, ``unit``, ``step``/``loss`` (every
    step), ``rate_step``/``rate`` (steps with a rate), ``eval_step``/``eval_loss``. A
    resumed run's records continue the same lists."""
    out = {"label": None, "unit": "tokens", "step": [], "loss": [], "rate_step": [], "rate": [],
           "eval_step": [], "eval_loss": []}
    for rec in records:
        out["label"] = out["label"] or rec.get("label")
        if rec["kind"] == "run":
            out["unit"] = rec.get("unit", out["unit"])
        elif rec["kind"] == "step":
            out["step"].append(rec["step"])
            out["loss"].append(rec["loss"])
            if rec.get("rate") is not None:
                out["rate_step"].append(rec["step"])
                out["rate"].append(rec["rate"])
        elif rec["kind"] == "eval":
            out["eval_step"].append(rec["step"])
            out["eval_loss"].append(rec["eval_loss"])
    return out
