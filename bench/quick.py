"""The standard benchmarks in one run, each figure beside its same-run baseline.

    python -m bench.quick --out DIR [--after FILE] [--jobs N] [--smoke]

What runs (bf16 unless named; every pair from this one process tree on one GPU):

* train steps of GPT-2 small 16x1024, BERT-base 256x128 (dropout 0.1) and LLaMA-small
  8x1024: the plain-Flax twin, jax_ls2, and jax_ls2 FP8 where the family has FP8 layers
  (bench_models' measurement);
* Transformer Engine's seed layer (hidden 4096, FFN 16384, 32 heads, 2048 x 4) fwd+bwd:
  plain Flax (cuDNN attention), Flax's own FP8, jax_ls2 bf16 and jax_ls2 FP8, at dropout
  0 and 0.1 (bench_te_layer's measurement);
* attention fwd+bwd, jax_ls2's flash attention against cuDNN, at 8x2048x16x128 and
  2x8192x16x128, causal and not (bench_attention).

Compiles are what take the time, so every (model or layer, impl) runs in a process of its
own that builds its state and compiles its program side by side with the others
(``--jobs`` at once), while ``--after FILE`` lets other GPU work (the GPU tests) go on.
No timing starts before every compile has ended and FILE exists: then the processes are
timed one at a time, the GPU otherwise idle, and each exits after its timing (so peak
memory figures stay per process). The attention cases, whose compiles are short, run last
in their own process.

Writes into DIR the CSVs the benchmarks write themselves (``models_<date>.csv``,
``bench_te_layer.csv``, ``attention.csv``), ready for ``python -m bench.report append``,
one log per process under DIR/quick_logs, and prints the short table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = (("gpt2-small", ("plain", "ls2", "ls2-fp8")), ("bert-base-128", ("plain", "ls2", "ls2-fp8")),
          ("llama-small", ("plain", "ls2", "ls2-fp8")))
TE_IMPLS = ("flax-bf16", "flax-fp8", "ls2-bf16", "ls2-fp8")
TE_RATES = (0.0, 0.1)
ATTENTION_ARGS = ["--head-dims", "128", "--lengths", "2048,8192", "--causal", "0,1", "--rates", "0",
                  "--passes", "fwd+bwd", "--impls", "cudnn,jax_ls2", "--probe-lengths", ""]
MODEL_STEPS, MODEL_WARMUP, TE_REPS, ATTENTION_REPS = 20, 3, 30, 20


def jobs(smoke: bool) -> list:
    """(kind, args) of every compiling process, the longest compiles first (Flax's FP8
    layer compiled for 92 s on an H200)."""
    te = [("te_layer", (impl, rate)) for impl in ("flax-fp8", "ls2-fp8", "flax-bf16", "ls2-bf16")
          for rate in TE_RATES]
    models = [("models", (name, impl)) for name, impls in MODELS for impl in impls]
    if smoke:  # tiny shapes; one of each kind keeps the check short
        return [("te_layer", ("ls2-fp8", 0.1)), ("te_layer", ("flax-bf16", 0.1)), ("models", ("gpt2-small", "plain")),
                ("models", ("gpt2-small", "ls2"))]
    return te[:2] + models[:3] + te[2:4] + models[3:6] + te[4:] + models[6:]


# ---------------------------------------------------------------- one process

def child(kind: str, args: list, smoke: bool):
    """Prepares (builds, compiles), says READY, waits for GO on stdin, measures, says
    RESULT <json>. The protocol owns stdout; anything else printed goes to stderr."""
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    if kind == "models":
        from bench import bench_models
        name, impl = args
        measure, compile_s = bench_models.prepare(name, impl, quick=False, smoke=smoke)
        run = lambda: measure(5 if smoke else MODEL_STEPS, 1 if smoke else MODEL_WARMUP)
    else:
        from bench import bench_te_layer
        impl, rate = args[0], float(args[1])
        measure, compile_s = bench_te_layer.prepare(impl, bench_te_layer.SMOKE if smoke else bench_te_layer.SEED, rate)
        run = lambda: measure(3 if smoke else TE_REPS)
    proto.write(f"READY {compile_s:.2f}\n")
    if sys.stdin.readline().strip() != "GO":
        return
    from bench.common import backend
    result = run()
    result["backend"] = backend()
    proto.write("RESULT " + json.dumps(result) + "\n")


# ---------------------------------------------------------------- the run

class Proc:
    def __init__(self, kind, args, smoke, log_dir, env):
        self.kind, self.args = kind, args
        self.label = f"{kind}:{'/'.join(str(a) for a in args)}"
        self.log = open(os.path.join(log_dir, self.label.replace(":", "_").replace("/", "_") + ".log"), "w")
        cmd = [sys.executable, "-m", "bench.quick", "--child", kind, *map(str, args)] + ["--smoke"] * smoke
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.compile_s = self.ready_s = None
        self.result = None

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)  # end of output

    def wait_line(self, timeout):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def run_all(out, smoke, n_jobs, after, timeout):
    """Every job of `jobs`, then the attention cases; returns (procs, attention_ok)."""
    log_dir = os.path.join(out, "quick_logs")
    os.makedirs(log_dir, exist_ok=True)
    # JAX_LS2_DEVICE_TIME=0: no CUPTI re-runs after each timing (the rows here carry none).
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", JAX_LS2_DEVICE_TIME="0")
    deadline = time.time() + timeout
    pending, compiling, ready, done = list(jobs(smoke)), [], [], []
    while pending or compiling:
        while pending and len(compiling) < n_jobs:
            compiling.append(Proc(*pending.pop(0), smoke, log_dir, env))
        for p in list(compiling):
            line = p.wait_line(0.2)
            if line is None or (line and not line.startswith("READY")) or time.time() > deadline:
                p.stop()
                print(f"{p.label}: FAILED while compiling (see {p.log.name})", flush=True)
                compiling.remove(p)
                done.append(p)
            elif line.startswith("READY"):
                p.compile_s, p.ready_s = float(line.split()[1]), time.time() - p.t0
                print(f"{p.label}: compiled in {p.compile_s:.0f} s (ready after {p.ready_s:.0f} s)", flush=True)
                compiling.remove(p)
                ready.append(p)
    t_wait = time.time()
    while after and not os.path.exists(after) and time.time() < deadline:
        time.sleep(1)
    if after:
        print(f"waited {time.time() - t_wait:.0f} s for {after}", flush=True)
    for p in ready:  # one at a time, the GPU otherwise idle
        p.proc.stdin.write("GO\n")
        p.proc.stdin.flush()
        line = ""
        while line is not None and not line.startswith("RESULT") and time.time() < deadline:
            line = p.wait_line(1.0)
        if line and line.startswith("RESULT"):
            p.result = json.loads(line[len("RESULT "):])
            print(f"{p.label}: {p.result['ms_median']:.2f} ms", flush=True)
        else:
            print(f"{p.label}: FAILED while timing (see {p.log.name})", flush=True)
        p.stop()
        done.append(p)
    attention_ok = True
    if not smoke:
        with open(os.path.join(log_dir, "attention.log"), "w") as log:
            try:
                attention_ok = subprocess.run(
                    [sys.executable, "-m", "bench.bench_attention", "--out", out, "--reps", str(ATTENTION_REPS),
                     *ATTENTION_ARGS], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                    timeout=max(1.0, deadline - time.time())).returncode == 0
            except subprocess.TimeoutExpired:
                attention_ok = False
    return done, attention_ok


def write_csvs(out, procs, smoke):
    from bench import bench_models, bench_te_layer
    from bench.common import git_commit
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    model_rows = []
    for p in procs:
        if p.kind == "models" and p.result:
            model_rows.append(dict(p.result, git_commit=git_commit(), date=date))
    order = [(n, i) for n, impls in MODELS for i in impls]
    model_rows.sort(key=lambda r: order.index((r["model"], r["impl"])) if (r["model"], r["impl"]) in order else 99)
    te_rows = []
    shape = bench_te_layer.SMOKE if smoke else bench_te_layer.SEED
    for rate in TE_RATES:
        results = {p.args[0]: p.result for p in procs
                   if p.kind == "te_layer" and p.result and float(p.args[1]) == rate}
        ordered = {impl: results[impl] for impl in TE_IMPLS if impl in results}
        te_rows += bench_te_layer.result_rows(ordered, shape, rate)
    if model_rows:
        bench_models.write_csv(model_rows, out, date, quick=False, smoke=smoke)
    if te_rows:
        bench_te_layer.write_rows(te_rows, os.path.join(out, "bench_te_layer.csv"))
    return model_rows, te_rows


def attention_rows(out):
    import csv
    path = os.path.join(out, "attention.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r["op"] == "attention"]


def table(model_rows, te_rows, att_rows):
    """(what, ours ms, baseline, baseline ms, ratio) lines: each figure over its same-run
    baseline (ratio > 1: ours is faster)."""
    lines = []

    def add(what, ours, base_name, base):
        if ours and base:
            lines.append((what, ours, base_name, base, base / ours))

    for name, _ in MODELS:
        got = {r["impl"]: r["ms_median"] for r in model_rows if r["model"] == name}
        add(f"{name} train step, jax_ls2", got.get("ls2"), "plain Flax", got.get("plain"))
        add(f"{name} train step, jax_ls2 FP8", got.get("ls2-fp8"), "jax_ls2 bf16", got.get("ls2"))
    for rate in TE_RATES:
        got = {r["impl"]: r["ms_median"] for r in te_rows
               if ("dropout=" in r["shape"]) == bool(rate)}
        tag = f"seed layer, dropout {rate:g}"
        add(f"{tag}, jax_ls2 bf16", got.get("ls2-bf16"), "Flax bf16" + (" (cuDNN)" if not rate else ""),
            got.get("flax-bf16"))
        add(f"{tag}, jax_ls2 FP8", got.get("ls2-fp8"), "Flax FP8", got.get("flax-fp8"))
        add(f"{tag}, jax_ls2 FP8", got.get("ls2-fp8"), "jax_ls2 bf16", got.get("ls2-bf16"))
    for shape in dict.fromkeys((r["shape"], r["causal"]) for r in att_rows):
        got = {r["impl"]: float(r["ms_median"]) for r in att_rows if (r["shape"], r["causal"]) == shape}
        causal = " causal" if shape[1] == "True" else ""
        add(f"attention {shape[0]}{causal} fwd+bwd, jax_ls2 flash", got.get("jax_ls2"), "cuDNN", got.get("cudnn"))
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="")
    p.add_argument("--jobs", type=int, default=max(2, (os.cpu_count() or 4) // 2),
                   help="processes compiling at once")
    p.add_argument("--after", default="", help="start no timing before this file exists")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds for everything")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script, any backend)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1:], args.smoke)
    if not args.out:
        p.error("--out is required")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    procs, attention_ok = run_all(args.out, args.smoke, args.jobs, args.after, args.timeout)
    model_rows, te_rows = write_csvs(args.out, procs, args.smoke)
    lines = table(model_rows, te_rows, attention_rows(args.out))
    failed = [p.label for p in procs if not p.result] + ([] if attention_ok else ["attention"])
    import jax

    from bench.common import git_commit, gpu_name
    print(f"==== standard benchmarks: {gpu_name()}, jax {jax.__version__}, commit {git_commit()}, "
          f"{time.time() - t0:.0f} s")
    print(f"{'figure':<50}{'ms':>9}  {'baseline (same run)':<22}{'ms':>9}{'ratio':>8}")
    for what, ours, base_name, base, ratio in lines:
        print(f"{what:<50}{ours:>9.2f}  {base_name:<22}{base:>9.2f}{ratio:>7.2f}x")
    if failed:
        print("FAILED: " + ", ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
