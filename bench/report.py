"""The results history (bench/results/results.csv): append a run, list runs, print tables.

    python -m bench.report append DIR --run NAME   # a run's CSVs (any benchmark) into the history
    python -m bench.report runs                    # every run, oldest first; the last is the latest
    python -m bench.report models [--run RUN]      # the zoo against its plain-Flax twins (Markdown)
    python -m bench.report ops [--run RUN] [--default-only]  # the fused ops against XLA (Markdown)
    python -m bench.report scaling [--run RUN]     # train steps on device meshes (Markdown)
    python -m bench.report sequence-memory [--run RUN]  # seq against tensor meshes' limits (Markdown)

RUN is a run name as `runs` lists it, or a prefix of several (a folder of a run), or
"latest" (the default): the last run in the file that has rows of the table's kind.
The history is append-only: `append` refuses a run name already present.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import sys

from bench.common import RESULTS_CSV, append_long, long_rows

_DATE = re.compile(r"_\d{4}-\d{2}-\d{2}")
_HASH = re.compile(r"_(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?=_|$)")  # a commit in a file name


def read(path: str = RESULTS_CSV) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _bench_name(rel: str, commit: str) -> str:
    """"models_2026-11-29_13e10ab.csv" -> "models"; "sweep_dropout/dropout.csv" ->
    "sweep_dropout_dropout": the file's path without dates and commits (the row's own,
    or one the file was named after)."""
    stem = os.path.splitext(rel)[0].replace(os.sep, "_")
    if commit:
        stem = stem.replace(f"_{commit}", "")
    return _HASH.sub("", _DATE.sub("", stem))


def run_rows(folder: str, run: str) -> list:
    """Long rows of every CSV under `folder` (recursively), run names `<run>/<file stem>`.
    A file without gpu/commit/date columns (bench_sr_convergence's curves) takes them from
    the folder's other files: those of the commit its name carries, else the only one."""
    files = sorted(glob.glob(os.path.join(folder, "**", "*.csv"), recursive=True))
    tables = {}
    for path in files:
        with open(path, newline="") as f:
            tables[path] = list(csv.DictReader(f))
    metas = {}
    for rows in tables.values():
        for r in rows:
            commit = r.get("commit") or r.get("git_commit")
            if commit:
                metas.setdefault(commit, dict(gpu=r.get("gpu", ""), jax_version=r.get("jax_version", ""),
                                              commit=commit, date=r.get("date", "")))
    out = []
    for path, rows in tables.items():
        rel = os.path.relpath(path, folder)
        first = rows[0] if rows else {}
        commit = first.get("commit") or first.get("git_commit") or ""
        meta = None
        if not commit:
            named = [c for c in metas if c in os.path.basename(path)]
            if named or len(metas) == 1:
                meta = metas[(named or list(metas))[0]]
                commit = meta["commit"]
        name = f"{run}/{os.path.splitext(rel)[0]}" if run else os.path.splitext(rel)[0]
        out += long_rows(rows, name, _bench_name(rel, commit), meta)
    return out


def runs(rows: list) -> list:
    """(run, benches, commit, date, gpu, rows) in file order."""
    seen = {}
    for r in rows:
        s = seen.setdefault(r["run"], dict(run=r["run"], benches=set(), commit=r["commit"], date=r["date"],
                                           gpu=r["gpu"], rows=0))
        s["benches"].add(r["bench"])
        s["rows"] += 1
    return list(seen.values())


def select(rows: list, run: str, kind) -> list:
    """The rows of `run` (a name or a prefix) that `kind(row)` accepts; "latest": the last
    run in the file with such rows."""
    rows = [r for r in rows if kind(r)]
    if run == "latest":
        if not rows:
            raise SystemExit("report: no run in the history has rows for this table")
        run = rows[-1]["run"]
    chosen = [r for r in rows if r["run"] == run or r["run"].startswith(run.rstrip("/") + "/")]
    if not chosen:
        raise SystemExit(f"report: no rows for run {run!r} (see `python -m bench.report runs`)")
    return chosen


def _pivot(rows: list, keys: tuple) -> dict:
    """{key tuple: {metric: value}}, in first-seen order."""
    out = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), {})[r["metric"]] = r["value"]
    return out


def _num(text: str, fmt: str) -> str:
    try:
        return format(float(text), fmt)
    except (TypeError, ValueError):
        return ""


def _source(rows: list) -> str:
    names = sorted({r["run"] for r in rows})
    commits = sorted({r["commit"] for r in rows})
    dates = sorted({r["date"][:10] for r in rows})
    gpus = sorted({r["gpu"] for r in rows})
    return (f"run {', '.join(names)} (commit {', '.join(commits)}, {', '.join(dates)}, {', '.join(gpus)})")


def models_table(rows: list) -> str:
    table = _pivot(rows, ("op", "shape", "impl", "backend"))
    lines = [_source(rows), "",
             "| model | batch | impl | step ms | tokens (images)/s | MFU | peak GB | speedup |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (model, shape, impl, backend), m in table.items():
        name = {"plain": "plain Flax", "ls2": "jax_ls2", "ls2-fp8": "jax_ls2 FP8"}.get(impl, impl)
        if backend and impl != "plain":
            name += f" ({backend})"
        lines.append(f"| {model} | {shape} | {name} | {_num(m.get('ms_median'), '.2f')} | "
                     f"{_num(m.get('tokens_per_s'), ',.0f')} | {_num(m.get('mfu'), '.1%')} | "
                     f"{_num(m.get('peak_mem_gb'), '.2f')} | {_num(m.get('speedup'), '.2f')}x |")
    return "\n".join(lines)


def scaling_table(rows: list) -> str:
    """bench_scaling's rows: a model's step without a mesh and on each mesh (its spec in
    the `impl` column); a skipped mesh with its reason."""
    table = _pivot(rows, ("op", "impl", "shape", "backend"))
    lines = [_source(rows), "",
             "| model | mesh | batch | devices | step ms | tokens/s | tokens/s per device | efficiency | "
             "x no mesh | peak GB per device |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (model, mesh, shape, backend), m in table.items():
        if m.get("skipped"):
            lines.append(f"| {model} | {mesh} | skipped: {m['skipped']} | | | | | | | |")
            continue
        name = f"{mesh} ({backend})" if backend else mesh
        lines.append(f"| {model} | {name} | {shape} | {m.get('devices', '')} | {_num(m.get('ms_median'), '.2f')} | "
                     f"{_num(m.get('tokens_per_s'), ',.0f')} | {_num(m.get('tokens_per_s_per_device'), ',.0f')} | "
                     f"{_num(m.get('scaling_efficiency'), '.2f')} | {_num(m.get('ms_vs_no_mesh'), '.3f')} | "
                     f"{_num(m.get('peak_mem_gb_per_device'), '.2f')} |")
    return "\n".join(lines)


def sequence_memory_table(rows: list) -> str:
    """bench_sequence_memory's maxima: per mesh and search, the largest size that fits the
    capacity, the smallest probed that does not, and the seq mesh's ratio to tensor's."""
    table = _pivot([r for r in rows if r["pass"].startswith("max ")], ("op", "impl", "pass", "backend", "dtype"))
    lines = [_source(rows), "",
             "| model | mesh | search | max | first failing | probes | GB per device at max | seq / tensor | "
             "capacity GB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (model, mesh, search, backend, dtype), m in table.items():
        if m.get("skipped"):
            lines.append(f"| {model} | {mesh} | {search} | skipped: {m['skipped']} | | | | | |")
            continue
        lines.append(f"| {model} | {mesh} ({backend}, {dtype}) | {search[len('max '):]} | {m.get('max_fitting', '')} "
                     f"| {m.get('min_failing', '')} | {m.get('probes', '')} | {_num(m.get('per_device_gb'), '.2f')} | "
                     f"{_num(m.get('ratio_seq_over_tensor'), '.2f')} | {_num(m.get('capacity_gb'), '.2f')} |")
    return "\n".join(lines)


def ops_table(rows: list, default_only: bool = False) -> str:
    """jax_ls2's rows against XLA; `default_only`: without launch-option variants."""
    ours = [r for r in rows if r["impl"] == "jax_ls2" or (r["impl"].startswith("jax_ls2") and not default_only)]
    table = _pivot(ours, ("op", "shape", "dtype", "pass", "impl"))
    lines = [_source(rows), "",
             "| op | shape | dtype | pass | ms | % copy BW | x XLA | device ms | device % copy BW | device x XLA |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (op, shape, dtype, pass_, impl), m in table.items():
        variant = "" if impl == "jax_ls2" else f" ({impl[len('jax_ls2'):].strip('[]')})"
        lines.append(f"| {op}{variant} | {shape} | {dtype} | {pass_} | {m.get('ms_median', '')} | "
                     f"{m.get('pct_copy_bw', '')} | {m.get('speedup_vs_xla', '')} | {m.get('device_ms', '')} | "
                     f"{m.get('device_pct_copy_bw', '')} | {m.get('device_speedup_vs_xla', '')} |")
    return "\n".join(lines)


def is_model_row(r: dict) -> bool:
    return r["bench"].startswith("models")


def is_scaling_row(r: dict) -> bool:
    return r["bench"].startswith("scaling")


def is_sequence_memory_row(r: dict) -> bool:
    return r["bench"].startswith("sequence_memory")


def is_op_row(r: dict) -> bool:
    return r["bench"] != "models" and not is_scaling_row(r) and (r["impl"] == "xla" or r["impl"].startswith("jax_ls2"))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=RESULTS_CSV, help="the results history (default: %(default)s)")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("append", help="append every CSV under DIR to the history as one run")
    a.add_argument("folder", metavar="DIR")
    a.add_argument("--run", required=True, help="the run's name, e.g. h200-2026-12-03_abc1234")
    sub.add_parser("runs", help="list the runs, oldest first")
    for name in ("models", "ops", "scaling", "sequence-memory"):
        t = sub.add_parser(name, help=f"Markdown table of the {name} rows of one run")
        t.add_argument("--run", default="latest")
        if name == "ops":
            t.add_argument("--default-only", action="store_true", help="leave out launch-option variants")
    args = p.parse_args(argv)
    if args.cmd == "append":
        if not os.path.isdir(args.folder):
            p.error(f"append: DIR must be a folder of CSVs, got {args.folder!r}")
        rows = run_rows(args.folder, args.run)
        if not rows:
            p.error(f"append: no CSV rows under {args.folder!r}")
        n = append_long(rows, args.csv)
        print(f"appended {n} rows of {len({r['run'] for r in rows})} files to {args.csv}")
    elif args.cmd == "runs":
        for s in runs(read(args.csv)):
            print(f"{s['run']:<58}{s['commit']:<9}{s['date'][:10]:<12}{s['gpu']:<13}{s['rows']:>6}  "
                  f"{','.join(sorted(s['benches']))}")
    elif args.cmd == "models":
        print(models_table(select(read(args.csv), args.run, is_model_row)))
    elif args.cmd == "scaling":
        print(scaling_table(select(read(args.csv), args.run, is_scaling_row)))
    elif args.cmd == "sequence-memory":
        print(sequence_memory_table(select(read(args.csv), args.run, is_sequence_memory_row)))
    else:
        print(ops_table(select(read(args.csv), args.run, is_op_row), args.default_only))


if __name__ == "__main__":
    sys.exit(main())
