"""Timing and CSV helpers shared by the benchmarks.

Every figure comes from `time_fn`: the op is applied to k distinct input copies
inside one jitted program (so launch overhead is amortised, XLA cannot merge the
calls, and data larger than the 60 MB L2 is not served from cache), several runs
of the program are enqueued back to back per sample, warm-up and compilation are
excluded, the device is synchronised, and the median/p20/p80 are taken over >= 50
samples.
"""
from __future__ import annotations

import csv
import datetime
import os
import subprocess
import time
from typing import Callable, Sequence

import jax
import numpy as np

COPY_GBPS = 4137.0  # measured HBM copy bandwidth (read + write) of the H200 test machine
MATMUL_TFLOPS = 790.0

# One run's CSV (what `Rows.write` writes): one row per (op, shape, dtype, pass, impl).
# `impl` is what was timed (xla, jax_ls2, jax_ls2[<launch option>]); `backend` is what
# jax_ls2's ops ran in that process (cuda or reference), so a row timed without the
# kernels says so.
FIELDS = ["op", "shape", "dtype", "pass", "impl", "backend", "ms_median", "ms_p20", "ms_p80", "gbytes", "gbps",
          "pct_copy_bw", "speedup_vs_xla", "device_ms", "device_pct_copy_bw", "device_speedup_vs_xla",
          "peak_mem_bytes", "gpu", "jax_version", "commit", "date"]

# The results history (bench/results/results.csv): every run's rows appended in long
# form, one figure per row, whatever CSV the benchmark wrote (op benchmarks, bench_models,
# bench_sr_convergence). `run` names the run and file the row came from; `metric`/`value`
# are the original column and its cell (`bench.report append` does the conversion).
RESULTS_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "results.csv")
LONG_FIELDS = ["run", "bench", "op", "shape", "dtype", "pass", "impl", "backend", "metric", "value",
               "gpu", "jax_version", "commit", "date"]
# Columns of a run's CSV that identify a row rather than measure it, with the long name
# they take (bench_models writes `model` and `git_commit`; bench_sr_convergence's curves
# `mode` and `step`; bench_scaling `mesh`, the mesh spec or "none"; bench_sequence_memory
# `search`, what a probe searched or "max <it>" for a search's maximum).
ID_COLUMNS = {"op": "op", "model": "op", "shape": "shape", "dtype": "dtype", "pass": "pass", "impl": "impl",
              "mode": "impl", "mesh": "impl", "step": "pass", "search": "pass", "backend": "backend", "gpu": "gpu",
              "jax_version": "jax_version", "commit": "commit", "git_commit": "commit", "date": "date"}


def git_commit() -> str:
    if os.environ.get("JAX_LS2_COMMIT"):
        return os.environ["JAX_LS2_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(__file__),
                                       stderr=subprocess.DEVNULL).decode().strip()
    except Exception:
        return "unknown"


def gpu_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


def backend() -> str:
    """What jax_ls2's ops run here: ``jax_ls2.implementation()`` where the package has
    it, else "cuda" when the kernels are built and the default backend is a GPU (and
    ``JAX_LS2_IMPL`` does not force the references), else "reference"."""
    import jax_ls2

    implementation = getattr(jax_ls2, "implementation", None)
    if implementation is not None:
        return str(implementation())
    if os.environ.get("JAX_LS2_IMPL") == "reference":
        return "reference"
    return "cuda" if jax_ls2.cuda_available() and jax.default_backend() == "gpu" else "reference"


def long_rows(rows: Sequence[dict], run: str, bench: str, meta: dict | None = None) -> list:
    """A run's CSV rows (any benchmark's columns) in LONG_FIELDS form: the identifying
    columns (ID_COLUMNS) kept, every other non-empty cell one row (metric, value).
    `meta` fills identifying columns a row lacks (gpu, commit, ...); `op` defaults to
    `bench`. Rows come out in file order, metrics in column order."""
    out = []
    for r in rows:
        base = {k: "" for k in LONG_FIELDS}
        base.update(meta or {})
        base.update(run=run, bench=bench)
        for col, value in r.items():
            if col in ID_COLUMNS and value not in (None, ""):
                base[ID_COLUMNS[col]] = f"step={value}" if col == "step" else value
        base["op"] = base["op"] or bench
        for col, value in r.items():
            if col in ID_COLUMNS or col is None or value in (None, ""):
                continue
            out.append(dict(base, metric=col, value=value))
    return out


def append_long(rows: Sequence[dict], path: str = RESULTS_CSV) -> int:
    """Appends LONG_FIELDS rows to the results history at `path` (header written when
    the file is new). Refuses (ValueError) rows of a run already in the file, so a run
    is never counted twice. Returns the number of rows written."""
    runs = {r["run"] for r in rows}
    if os.path.exists(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != LONG_FIELDS:
                raise ValueError(f"append_long: {path} has columns {reader.fieldnames}, expected {LONG_FIELDS}")
            present = runs & {r["run"] for r in reader}
        if present:
            raise ValueError(f"append_long: runs already in {path}: {sorted(present)}")
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LONG_FIELDS)
        if new:
            w.writeheader()
        w.writerows(rows)
    return len(rows)


def device_time(prog, arg_sets, runs: int = 5):
    """Device time in ms of one application: the sum of the durations of every
    kernel, copy and memset the program launched (recorded with CUPTI through
    torch.profiler), divided by the applications. None where torch or CUPTI is
    unavailable. Unlike the host-timed figure it excludes gaps between launches."""
    if os.environ.get("JAX_LS2_DEVICE_TIME", "1") != "1":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None
    jax.block_until_ready(prog(arg_sets))
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                jax.block_until_ready(prog(arg_sets))
        total_us = sum(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
                       for e in prof.key_averages())
    except Exception:
        return None
    if not total_us:
        return None
    return total_us / 1e3 / (runs * len(arg_sets))


LAST_DEVICE_MS = {}
ONLY: set = set()  # "op:pass" pairs to time; empty: all
# Kernel-option variants timed beside the default (--variants): (label, {option: value}).
VARIANTS: list = []


def parse_variants(text: str) -> list:
    """"a=1,a=2+b=1" -> [("a=1", {"a": 1}), ("a=2+b=1", {"a": 2, "b": 1})]."""
    out = []
    for label in filter(None, text.split(",")):
        opts = dict(kv.split("=") for kv in label.split("+"))
        out.append((label, {k: int(v) for k, v in opts.items()}))
    return out


def set_kernel_options(opts: dict):
    if not opts:
        return
    from jax_ls2 import _C  # only with the CUDA extension built
    for name, value in opts.items():
        _C.set_kernel_option(name, value)


def time_fn(fn: Callable, arg_sets: Sequence[tuple], reps: int = 50, warmup: int = 3, pipeline: int = 4):
    """Median, p20, p80 in ms of one fn(*args) (and, in LAST_DEVICE_MS["ms"], the
    CUPTI device time of one application, when available).

    One program applies fn to every input set in arg_sets. Each sample enqueues
    `pipeline` runs of it back to back and waits for the last, so the host's
    argument handling overlaps device work; sample time / (pipeline * len(arg_sets))
    is the time of one application."""
    arg_sets = list(arg_sets)
    return time_program(compile_sets(fn, arg_sets), arg_sets, reps, warmup, pipeline)


def compile_sets(fn: Callable, arg_sets: Sequence[tuple]):
    """The compiled program that `time_fn` times: fn applied to every input set."""
    return jax.jit(lambda sets: [fn(*s) for s in sets]).lower(list(arg_sets)).compile()


def time_program(prog, arg_sets: Sequence[tuple], reps: int = 50, warmup: int = 3, pipeline: int = 4):
    """`time_fn`'s timing of a program from `compile_sets` (nothing compiles here)."""
    arg_sets = list(arg_sets)
    for _ in range(warmup):
        jax.block_until_ready(prog(arg_sets))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [prog(arg_sets) for _ in range(pipeline)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) * 1e3 / (pipeline * len(arg_sets)))
        del outs
    t = np.asarray(times)
    LAST_DEVICE_MS["ms"] = device_time(prog, arg_sets)
    return float(np.median(t)), float(np.percentile(t, 20)), float(np.percentile(t, 80))


def int_list(text: str) -> list:
    """"1,2,4" -> [1, 2, 4] (an argparse type)."""
    return [int(x) for x in text.split(",") if x]


def copies_for(nbytes: int, target_bytes: int = 1 << 30) -> int:
    """How many distinct input copies one timed program should process: enough
    that the program moves about a gigabyte (launch overhead amortised, L2 missed)."""
    return int(max(4, min(8, np.ceil(target_bytes / max(nbytes, 1)))))


class Rows:
    """Collects CSV rows with the run's metadata."""

    def __init__(self):
        self.rows = []
        self.meta = dict(backend=backend(), gpu=gpu_name(), jax_version=jax.__version__, commit=git_commit(),
                         date=datetime.date.today().isoformat())

    def add(self, **kw):
        row = {k: "" for k in FIELDS}
        row.update(self.meta)
        row.update(kw)
        if "ms_median" in kw and "gbytes" in kw and kw["gbytes"]:
            row["gbps"] = round(kw["gbytes"] / (kw["ms_median"] * 1e-3), 1)
            row["pct_copy_bw"] = round(100 * row["gbps"] / COPY_GBPS, 1)
        if kw.get("device_ms") and kw.get("gbytes"):
            row["device_pct_copy_bw"] = round(100 * kw["gbytes"] / (kw["device_ms"] * 1e-3) / COPY_GBPS, 1)
        if isinstance(kw.get("device_ms"), float):
            row["device_ms"] = round(kw["device_ms"], 4)
        for k in ("ms_median", "ms_p20", "ms_p80"):
            if isinstance(row[k], float):
                row[k] = round(row[k], 4)
        self.rows.append(row)
        return row

    def write(self, path: str, extra_fields: Sequence[str] = ()):
        """The rows as CSV: the common FIELDS, then a benchmark's own `extra_fields`."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*FIELDS, *extra_fields], extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)

    def print_table(self):
        print(f"{'op':<24}{'shape':<20}{'dtype':<9}{'pass':<9}{'impl':<9}{'ms':>9}{'GB/s':>9}{'%bw':>7}{'x xla':>8}"
              f"{'dev ms':>9}{'dev %bw':>8}{'dev x':>7}")
        for r in self.rows:
            print(f"{r['op']:<24}{r['shape']:<20}{r['dtype']:<9}{r['pass']:<9}{r['impl']:<9}"
                  f"{r['ms_median']:>9}{r['gbps']:>9}{r['pct_copy_bw']:>7}{str(r['speedup_vs_xla']):>8}"
                  f"{str(r['device_ms']):>9}{str(r['device_pct_copy_bw']):>8}{str(r['device_speedup_vs_xla']):>7}")


def compare(rows: Rows, op: str, shape, dtype, pass_: str, gbytes: float, ours: Callable, xla: Callable,
            arg_sets, reps: int = 60, xla_sets=None):
    """Times ours and xla on the same inputs (or on `xla_sets` when the XLA side needs
    its own, e.g. its own saved residuals) and records both rows with the speedup.
    Skipped (returns None) when --only names other "op:pass" pairs."""
    if ONLY and f"{op}:{pass_}" not in ONLY:
        return None
    mx = time_fn(xla, arg_sets if xla_sets is None else xla_sets, reps)
    dx = LAST_DEVICE_MS.get("ms")
    shape_s = "x".join(str(s) for s in shape)
    dt = np.dtype(dtype).name
    rows.add(op=op, shape=shape_s, dtype=dt, **{"pass": pass_}, impl="xla", ms_median=mx[0], ms_p20=mx[1],
             ms_p80=mx[2], gbytes=gbytes, speedup_vs_xla=1.0, device_ms=dx or "",
             device_speedup_vs_xla=1.0 if dx else "")
    first = None
    for label, opts in [("", {})] + VARIANTS:
        # A fresh program per setting, first run with the setting in place: XLA may
        # capture the custom calls into a CUDA graph on a program's first run and replay
        # it, so a program keeps the launch choices it was first run with.
        set_kernel_options(opts)
        try:
            mo = time_fn(ours, arg_sets, reps)
        finally:
            set_kernel_options({k: 0 for k in opts})
        do = LAST_DEVICE_MS.get("ms")
        row = rows.add(op=op, shape=shape_s, dtype=dt, **{"pass": pass_},
                       impl=f"jax_ls2[{label}]" if label else "jax_ls2", ms_median=mo[0], ms_p20=mo[1],
                       ms_p80=mo[2], gbytes=gbytes, speedup_vs_xla=round(mx[0] / mo[0], 3), device_ms=do or "",
                       device_speedup_vs_xla=round(dx / do, 3) if dx and do else "")
        first = first or row
    return first


def op_bench_main(csv_name: str, run: Callable, default_dtypes: str = "bfloat16,float16"):
    """Command line of an op benchmark: --out, --reps, --dtypes; runs
    ``run(rows, dtypes, reps)``, writes ``<out>/<csv_name>`` and prints the table."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--dtypes", default=default_dtypes)
    p.add_argument("--only", default="", help='comma-separated "op:pass" pairs, e.g. layer_norm:fwd')
    p.add_argument("--variants", default="",
                   help='kernel options to time beside the default, e.g. "dropout_rows_in_flight=2,'
                        'dropout_rows_in_flight=4+dropout_full_grid=1" (rows "jax_ls2[<variant>]")')
    a = p.parse_args()
    ONLY.update(x for x in a.only.split(",") if x)
    VARIANTS.extend(parse_variants(a.variants))
    rows = Rows()
    run(rows, [jax.numpy.dtype(d) for d in a.dtypes.split(",")], a.reps)
    rows.write(os.path.join(a.out, csv_name))
    rows.print_table()
