"""Decode benchmark: KV-cache generation (flax_models.decode) of jax_ls2 models against
their plain-Flax twins, tokens/s at batch 1 and 32.

    python -m bench.bench_decode --out bench/results              # LLaMA 1b and GPT-2 small (GPU)
    python -m bench.bench_decode --out /tmp/b --smoke             # tiny presets, any backend
    python -m bench.bench_decode --out /tmp/b --models llama-1b --batches 1 --impls ls2   # a part

Both forms run in bf16 (params and compute), greedy, from the same random weights: a
``--prompt``-token prefill and ``--new`` generated tokens in one compiled program
(`flax_models.decode.generate`). A decode step's time is ``(T(new) - T(1)) / (new - 1)``,
with T(n) the median time of a whole generation of n tokens (prefill included), so the
prefill and the per-call overheads cancel; tokens/s is ``batch / step time``. Timing:
warm-up runs (compilation excluded), then ``--reps`` (>= 50) runs each synchronised;
median, p20, p80. Each (model, impl, batch) runs in a fresh subprocess so peak-memory
figures do not mix. Writes ``decode_<date>.csv`` to --out, one row per (model, impl,
batch), with the speedup over the plain twin's tokens/s.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time

IMPLS = ("plain", "ls2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (family, preset)
MODELS = {"llama-1b": ("llama", "1b"), "gpt2-small": ("gpt", "small")}
BATCHES = (1, 32)
# --prompt, --new, --reps when not given: (standard run, --smoke).
DEFAULTS = {"prompt": (128, 8), "new": (64, 4), "reps": (50, 3)}
FIELDS = ["model", "shape", "dtype", "impl", "backend", "batch", "step_ms_median", "step_ms_p20", "step_ms_p80",
          "tokens_per_s", "speedup", "prefill_ms", "generate_ms", "peak_mem_gb", "gpu", "jax_version", "git_commit",
          "date"]


def _median_times(fn, reps):
    import numpy as np
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return np.asarray(times)


def run_one(name, impl, batch, prompt, new, reps, warmup, smoke):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flax_models as fm
    from flax_models import decode
    family, preset = MODELS[name]
    if smoke:
        preset = "tiny"
    cfg = fm.get_config(family, preset)
    model = fm.build(cfg, impl=impl, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, seed=0, train=False)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    max_len = prompt + new

    def gen(steps):
        return lambda: jax.block_until_ready(decode.generate(model, ids, steps, max_len=max_len))
    for _ in range(warmup):
        gen(1)()
        gen(new)()
    t1, tn = _median_times(gen(1), reps), _median_times(gen(new), reps)
    # Per-step times from the pairs of runs; their median, p20 and p80.
    step = (tn - np.median(t1)) / (new - 1)
    med = float(np.median(step))
    stats = jax.devices()[0].memory_stats() or {}
    return {"model": name, "shape": f"batch {batch}, prompt {prompt}, new {new}", "dtype": "bf16", "impl": impl,
            "batch": batch, "step_ms_median": med, "step_ms_p20": float(np.percentile(step, 20)),
            "step_ms_p80": float(np.percentile(step, 80)), "tokens_per_s": batch / med * 1e3,
            "prefill_ms": float(np.median(t1)), "generate_ms": float(np.median(tn)),
            "peak_mem_gb": stats.get("peak_bytes_in_use", float("nan")) / 1e9,
            "gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__}


def write_csv(rows, out, date, smoke):
    """Writes every row so far (with the speedup over the plain twin); returns the path."""
    for r in rows:
        base = next((b for b in rows if (b["model"], b["batch"], b["impl"]) == (r["model"], r["batch"], "plain")),
                    None)
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    path = os.path.join(out, f"decode_{date[:10]}{'_smoke' if smoke else ''}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def main(argv=None):
    from bench.common import git_commit
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the CSV")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--prompt", type=int, help="prompt tokens (prefill); default 128 (--smoke: 8)")
    p.add_argument("--new", type=int, help="generated tokens, >= 2; default 64 (--smoke: 4)")
    p.add_argument("--reps", type=int, help=">= 50 unless --smoke; default 50 (--smoke: 3)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true",
                   help="tiny presets, a short prompt and generation, few reps (checks the script)")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--one", nargs=3, metavar=("MODEL", "IMPL", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, (standard, smoke) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else standard)
    if args.prompt < 1:
        p.error(f"--prompt must be >= 1, got {args.prompt}")
    if args.new < 2:
        p.error(f"--new must be >= 2, got {args.new}")
    if args.reps < 50 and not args.smoke:
        p.error(f"--reps must be >= 50, got {args.reps}")
    if args.one:
        from bench.common import backend
        name, impl, batch = args.one
        r = run_one(name, impl, int(batch), args.prompt, args.new, args.reps, args.warmup, args.smoke)
        r["backend"] = backend()  # what jax_ls2's ops ran in this process
        print("RESULT " + json.dumps(r), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    rows, commit = [], git_commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    path = None
    for name in args.models:
        for batch in args.batches:
            for impl in args.impls:
                cmd = [sys.executable, "-m", "bench.bench_decode", "--out", args.out, "--one", name, impl, str(batch),
                       "--prompt", str(args.prompt), "--new", str(args.new), "--reps", str(args.reps),
                       "--warmup", str(args.warmup)] + ["--smoke"] * args.smoke
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                got = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                if proc.returncode or not got:
                    print(f"{name}/{impl}/batch {batch} FAILED:\n{proc.stderr[-3000:]}", file=sys.stderr)
                    continue
                r = json.loads(got[-1][7:])
                r.update(git_commit=commit, date=date)
                rows.append(r)
                print(f"{name}/{impl}/batch {batch}: {r['step_ms_median']:.3f} ms a step, "
                      f"{r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_mem_gb']:.2f} GB", flush=True)
            path = write_csv(rows, args.out, date, args.smoke)
    print(f"{'model':<12}{'batch':>6}{'impl':>7}{'ms/step':>10}{'tokens/s':>12}{'speedup':>9}")
    for r in rows:
        print(f"{r['model']:<12}{r['batch']:>6}{r['impl']:>7}{r['step_ms_median']:>10.3f}"
              f"{r['tokens_per_s']:>12,.0f}{r['speedup']:>8.2f}x")
    print(f"wrote {path}")
    if len(rows) < len(args.models) * len(args.batches) * len(args.impls):
        sys.exit(1)


if __name__ == "__main__":
    main()
