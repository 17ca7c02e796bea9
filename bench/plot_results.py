"""Plots drawn from the results history (bench/results/results.csv) into bench/results/plots/:

    python -m bench.plot_results [--csv PATH] [--out DIR]

- ``models_speedup_history.png``: each model's speedup over its plain-Flax twin, run by run;
- ``models_latest.png``: step time of each model and its twin in the latest model run.

Without matplotlib nothing is drawn: the command says so and leaves the existing PNGs.
"""
from __future__ import annotations

import argparse
import os
import sys

from bench.common import RESULTS_CSV
from bench.report import is_model_row, read, select

PLOTS_DIR = os.path.join(os.path.dirname(RESULTS_CSV), "plots")


def speedup_history(rows: list) -> dict:
    """{model: [(run, speedup)]} of the jax_ls2 rows, in file order."""
    out = {}
    for r in rows:
        if is_model_row(r) and r["impl"] == "ls2" and r["metric"] == "speedup":
            out.setdefault(r["op"], []).append((r["run"], float(r["value"])))
    return out


def step_times(rows: list) -> dict:
    """{model: {impl: step ms}} of one run's model rows."""
    out = {}
    for r in rows:
        if r["metric"] == "ms_median":
            out.setdefault(r["op"], {})[r["impl"]] = float(r["value"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plot_results", description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=RESULTS_CSV)
    p.add_argument("--out", default=PLOTS_DIR)
    args = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results: matplotlib is not installed, so no plots were drawn; the PNGs already in "
              f"{args.out} are kept. Install matplotlib to draw them.")
        return 0
    rows = read(args.csv)
    os.makedirs(args.out, exist_ok=True)

    history = speedup_history(rows)
    runs = list(dict.fromkeys(r["run"] for r in rows if is_model_row(r)))  # file order
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for model, series in history.items():
        ax.plot([runs.index(run) for run, _ in series], [s for _, s in series], marker="o", label=model)
    ax.set_xticks(range(len(runs)), runs, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("speedup over the plain-Flax twin")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(args.out, "models_speedup_history.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")

    latest = select(rows, "latest", is_model_row)
    times = step_times(latest)
    fig, ax = plt.subplots(figsize=(7, 4))
    models = list(times)
    for i, impl in enumerate(("plain", "ls2")):
        ax.bar([m + 0.4 * i for m in range(len(models))], [times[m].get(impl, 0.0) for m in models], 0.4,
               label={"plain": "plain Flax", "ls2": "jax_ls2"}[impl])
    ax.set_xticks([m + 0.2 for m in range(len(models))], models)
    ax.set_ylabel("train step, ms")
    ax.set_title(f"{latest[0]['run']} ({latest[0]['gpu']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(args.out, "models_latest.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
