"""Train-step benchmark of the zoo: jax_ls2 models against their plain-Flax twins.

    python -m bench.bench_models --out bench/results            # standard shapes (GPU)
    python -m bench.bench_models --out /tmp/b --quick           # smaller shapes
    python -m bench.bench_models --out /tmp/b --smoke           # tiny presets, any backend
    python -m bench.bench_models --out /tmp/b --impls ls2 ls2-fp8   # FP8 against bf16 jax_ls2
    python -m bench.bench_models --out /tmp/b --models llama-1b --batch 24   # another batch

Both forms run with their best settings: bf16 compute with fp32 params, cuDNN attention
where it applies (no attention dropout, sequence lengths multiples of 64), jax_ls2 fused
optimizer for jax_ls2 and optax.adamw for the plain twin. Each (model, impl) runs in a
fresh subprocess so peak-memory figures do not mix. Timing: warm-up steps, then groups
of 5 steps enqueued back to back and timed to ``block_until_ready`` of the last; median,
p20, p80 over the groups of ``--steps`` (>= 20) steps, per step. ``ls2-fp8`` runs the
jax_ls2 model with its Transformer layers' weight GEMMs in FP8 (``DelayedScaling()``);
its rows also carry ``speedup_vs_ls2``, over the bf16 jax_ls2 run.
MFU is against 790 TFLOP/s (H200 dense bf16) with analytic FLOPs (6 x matmul params x
tokens, plus attention: 12 x layers x hidden x keys per query token, half under causal
masks; for LLaMA, "hidden" in the attention term is heads x head_dim, and the matmul params
are the q/k/v/output projections with grouped-query k/v, the three SwiGLU matrices and
the output head). A run that does not fit in device memory is reported as such.
Writes ``models_<date>.csv`` (and a PNG when matplotlib is present) to --out.
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

PEAK_FLOPS = 790e12
GROUP = 5  # steps per timed group (--group)
IMPLS = ("plain", "ls2", "ls2-fp8")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (family, preset, batch, seq, dropout[, config overrides]); seq 0 = images;
# `dropout` sets every dropout rate the overrides do not.
MODELS = {
    "gpt2-small": ("gpt", "small", 16, 1024, 0.0),
    "gpt2-medium": ("gpt", "medium", 8, 1024, 0.0),
    "bert-base-512": ("bert", "base", 32, 512, 0.1),
    # Hidden dropout only: both forms then run cuDNN attention.
    "bert-base-512-attn0": ("bert", "base", 32, 512, 0.1, {"attn_dropout": 0.0}),
    # The MLM head on at most 80 masked tokens per sequence (BERT pre-training's setting).
    "bert-base-512-mlm80": ("bert", "base", 32, 512, 0.1, {"mlm_max_predictions": 80}),
    "bert-base-128": ("bert", "base", 256, 128, 0.1),
    "transformer-base": ("transformer", "base", 64, 128, 0.1),
    "vit-b16": ("vit", "b16", 128, 0, 0.0),
    "llama-1b": ("llama", "1b", 16, 2048, 0.0),
    "llama-small": ("llama", "tiny", 8, 1024, 0.0),
}
# Architectures that are no preset: the named preset with these fields replaced (not
# under --smoke, which runs the tiny preset). llama-small is a LLaMA at GPT-2 small's
# size (125M parameters).
SIZES = {"llama-small": {"vocab_size": 32000, "hidden_size": 768, "num_layers": 12, "num_heads": 12,
                         "num_kv_heads": 4, "ffn_size": 2048, "max_len": 1024}}
DEFAULT = ["gpt2-small", "bert-base-512", "bert-base-128", "transformer-base", "vit-b16", "bert-base-512-attn0",
           "bert-base-512-mlm80"]
QUICK = {"gpt2-small": (4, 512), "gpt2-medium": (2, 512), "bert-base-512": (8, 512), "bert-base-512-attn0": (8, 512),
         "bert-base-512-mlm80": (8, 512),
         "bert-base-128": (64, 128), "transformer-base": (16, 128), "vit-b16": (32, 0),
         "llama-1b": (4, 1024), "llama-small": (4, 512)}
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory")  # in a failed run's stderr


def train_flops(cfg, batch, seq):
    """Analytic FLOPs of one train step (forward + backward = 3 x forward)."""
    h, f, n_layers, v = cfg.hidden_size, cfg.ffn_size, cfg.num_layers, cfg.vocab_size
    layer = 4 * h * h + 2 * h * f
    if cfg.family == "vit":
        tokens = (cfg.image_size // cfg.patch_size) ** 2 + 1
        per_seq = (n_layers * layer + cfg.patch_size ** 2 * cfg.channels * h) * tokens
        attn = n_layers * 4 * h * tokens * tokens
        return 3 * 2 * batch * (per_seq + attn / 2)
    if cfg.family == "transformer":
        enc = n_layers * layer * seq + n_layers * 2 * h * seq * seq
        dec = n_layers * (layer + 4 * h * h) * seq + h * v * seq
        dec_attn = n_layers * (h * seq * seq + 2 * h * seq * seq)
        return 3 * 2 * batch * (enc + dec + dec_attn)
    causal = cfg.family in ("gpt", "llama")
    width = h  # of the attention's queries (heads x head_dim)
    if cfg.family == "llama":
        head_dim = cfg.head_dim or h // cfg.num_heads
        width, kv = cfg.num_heads * head_dim, (cfg.num_kv_heads or cfg.num_heads) * head_dim
        layer = h * (width + 2 * kv) + width * h + 3 * h * f
    attn = n_layers * 2 * width * seq * seq * (0.5 if causal else 1.0)
    head_tokens = min(cfg.mlm_max_predictions, seq) if cfg.mlm_max_predictions else seq  # bert's MLM head
    return 3 * 2 * batch * (n_layers * layer * seq + h * v * head_tokens + attn)


def batch_shape(name, quick, smoke, batch=None):
    """(batch, seq) of a model's run: its entry's, --quick's or --smoke's; `batch` (--batch)
    replaces the batch. seq 0: images."""
    family, _, size, seq, *_ = MODELS[name]
    if quick:
        size, seq = QUICK[name]
    if smoke:
        size, seq = 4, (0 if family == "vit" else 64)
    return batch or size, seq


def model_config(name, smoke):
    """The flax_models config of a MODELS entry: its preset (tiny under `smoke`) with the
    entry's dropout rates and overrides (and SIZES' fields, not under `smoke`)."""
    import flax_models as fm
    family, preset, _, _, dropout, *extra = MODELS[name]
    overrides = extra[0] if extra else {}
    if smoke:
        preset = "tiny"
    else:
        overrides = {**SIZES.get(name, {}), **overrides}
    return fm.get_config(family, preset, **{
        "hidden_dropout": dropout, "attn_dropout": dropout,
        "activation_dropout": 0.0 if family in ("bert", "gpt", "vit") else dropout, **overrides})


def time_steps(step, state, batches, steps, warmup, group=GROUP):
    """(state, loss, times, host_ms) of `step` run over `batches` in turn: `warmup`
    steps, then groups of `group` for `steps` steps; `times`: seconds per step, one per
    group."""
    import jax
    for i in range(warmup):
        state, loss, _ = step(state, batches[i % len(batches)])
    jax.block_until_ready(loss)
    # Steps are enqueued in groups of `group` and waited for at the group's end, as a
    # training loop runs them (the host prepares step i+1 while the device runs step i);
    # a step's time is its group's time / group. The device waits for the group's first
    # launch, which the wait at the end of the group before it makes a fixed cost per group.
    # host_ms: time inside the step calls (the host's dispatch); near the step time, the
    # host rather than the device sets the pace.
    times, host = [], 0.0
    for g in range(max(1, steps // group)):
        t0 = time.perf_counter()
        for i in range(group):
            t1 = time.perf_counter()
            state, loss, _ = step(state, batches[(g * group + i) % len(batches)])
            host += time.perf_counter() - t1
        jax.block_until_ready((state, loss))
        times.append((time.perf_counter() - t0) / group)
    return state, loss, times, 1e3 * host / (len(times) * group)


def run_one(name, impl, steps, warmup, quick, smoke, group=GROUP, batch=None):
    measure, _ = prepare(name, impl, quick, smoke, batch)
    return measure(steps, warmup, group)


def prepare(name, impl, quick, smoke, batch=None):
    """(measure, compile_s): builds one (model, impl)'s train state and compiles its step
    in this process; ``measure(steps, warmup, group)`` then runs and times it (nothing
    compiles there) and returns the result row."""
    import time as _time

    import jax
    import jax.numpy as jnp

    from flax_models import data, training
    family, _, _, _, dropout, *extra = MODELS[name]
    overrides = {**({} if smoke else SIZES.get(name, {})), **(extra[0] if extra else {})}
    batch, seq = batch_shape(name, quick, smoke, batch)
    cfg = model_config(name, smoke)
    seq = seq or cfg.max_len
    if impl == "ls2-fp8":
        from jax_ls2.fp8 import DelayedScaling
        cfg = cfg.replace(fp8=DelayedScaling())
    tx, opt = training.make_optimizer(1e-4, 1000, 10, fused=impl != "plain")
    graphdef, state = training.create(cfg, impl="plain" if impl == "plain" else "ls2", dtype=jnp.bfloat16, seed=0,
                                      tx=tx)
    jitted = training.make_step(graphdef)
    batches = [jax.device_put(data.make_batch(cfg, 0, i, batch, seq)) for i in range(4)]
    t0 = _time.perf_counter()
    step = jitted.lower(state, batches[0]).compile()
    compile_s = _time.perf_counter() - t0
    return (lambda steps, warmup, group=GROUP: _measure(
        step, state, batches, steps, warmup, group, name=name, impl=impl, cfg=cfg, batch=batch, seq=seq,
        family=family, dropout=dropout, overrides=overrides, opt=opt, compile_s=compile_s)), compile_s


def _measure(step, state, batches, steps, warmup, group, *, name, impl, cfg, batch, seq, family, dropout,
             overrides, opt, compile_s):
    import jax
    import numpy as np

    from flax_models import data
    state, loss, times, host_ms = time_steps(step, state, batches, steps, warmup, group)
    if os.environ.get("JAX_LS2_PROFILE_TOP"):
        print_top_kernels(lambda s: step(s, batches[0]), state, int(os.environ["JAX_LS2_PROFILE_TOP"]))
    if os.environ.get("JAX_LS2_PROFILE_HLO"):
        print_fusions(step.as_text(),
                      os.environ["JAX_LS2_PROFILE_HLO"].split(","))
    ms = 1e3 * np.asarray(times)
    med = float(np.median(ms))
    units = data.tokens_in(cfg, batches[0])
    stats = jax.devices()[0].memory_stats() or {}
    shape = f"{batch}x{seq}" if family != "vit" else f"{batch}x{cfg.image_size}^2"
    drop = " ".join([f"dropout={dropout}"] + [f"{k}={v}" for k, v in overrides.items()])
    return {"model": name, "shape": f"{shape} {drop}", "dtype": "bf16", "impl": impl,
            "ms_median": med, "ms_p20": float(np.percentile(ms, 20)),
            "ms_p80": float(np.percentile(ms, 80)), "tokens_per_s": units / med * 1e3,
            "unit": "images" if family == "vit" else "tokens",
            "mfu": train_flops(cfg, batch, seq) / (med * 1e-3) / PEAK_FLOPS,
            "peak_mem_gb": stats.get("peak_bytes_in_use", float("nan")) / 1e9,
            "optimizer": opt, "loss": float(loss), "group": group, "host_ms": host_ms, "compile_s": compile_s,
            "gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__}


def print_top_kernels(run, state, top, steps=3):
    """Prints the `top` kernels by device time per step (CUPTI through torch.profiler)."""
    import jax
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            state, loss, _ = run(state)
        jax.block_until_ready(loss)
    events = [e for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]
    total = sum(e.device_time_total for e in events)
    print(f"device time per step: {total / steps / 1e3:.2f} ms", file=sys.stderr)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / steps / 1e3:8.3f} ms {100 * e.device_time_total / total:5.1f}% "
              f"x{e.count // steps:<4} {e.key[:110]}", file=sys.stderr)
    try:
        print_kinds(events, steps)
        print_idle(prof, steps)
    except Exception as err:  # the summaries are an aid; never fail the benchmark on them
        print(f"(no kind or idle summary: {err!r})", file=sys.stderr)


def print_fusions(hlo_text: str, names):
    """Prints the optimized HLO of the named kernels (fusion names from the kernel
    profile): the calling instruction and the fused computation it runs."""
    import re
    for name in names:
        # Kernel names spell the HLO name's dots as underscores (fusion.704 -> fusion_704).
        pattern = re.escape(name).replace("_", "[_.]")
        call = re.search(rf"^\s*(ROOT )?%?{pattern} = .*$", hlo_text, re.M)
        print(f"  ==== {name}: " + (call.group(0).strip()[:600] if call else "not found"), file=sys.stderr)
        comp = re.search(r"calls=%?([\w.\-]+)", call.group(0)) if call else None
        body = comp and re.search(rf"^%?{re.escape(comp.group(1))} .*?^}}", hlo_text, re.M | re.S)
        if body:
            print("\n".join("  | " + l for l in body.group(0)[:3000].splitlines()), file=sys.stderr)


def print_kinds(events, steps):
    """Device time per step by kind of kernel: jax_ls2's, cuDNN attention, GEMMs, the rest."""
    groups = {}
    for e in events:
        k = e.key
        g = ("jax_ls2 kernels" if "jax_ls2::" in k else
             "attention (cuDNN)" if ("cudnn" in k or "sdpa" in k or "flash" in k) else
             "GEMM" if any(t in k for t in ("nvjet", "gemm", "cutlass", "xmma", "sm90_")) else
             "other XLA kernels and copies")
        groups[g] = groups.get(g, 0.0) + e.device_time_total
    print("by kind: " + "; ".join(f"{g} {t / steps / 1e3:.2f} ms" for g, t in sorted(groups.items(), key=lambda x: -x[1])),
          file=sys.stderr)


def print_idle(prof, steps):
    """Where the device waits between kernels: kernels per step, the idle time inside the
    profiled span, and how much of it sits in gaps of 1-10 us (launch to launch) or longer
    (the host or a synchronisation)."""
    import numpy as np
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not spans:
        return
    gaps, end = [], spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            gaps.append(a - end)
        end = max(end, b)
    gaps = np.asarray(gaps or [0.0])  # microseconds
    idle = gaps.sum()
    print(f"kernels per step: {len(spans) / steps:.0f}; idle {idle / steps / 1e3:.2f} ms per step of "
          f"{(end - spans[0][0]) / steps / 1e3:.2f} ms: gaps <1 us {gaps[gaps < 1].sum() / steps / 1e3:.2f} ms, "
          f"1-10 us {gaps[(gaps >= 1) & (gaps < 10)].sum() / steps / 1e3:.2f} ms, "
          f">=10 us {gaps[gaps >= 10].sum() / steps / 1e3:.2f} ms ({int((gaps >= 10).sum()) / steps:.1f} per step)",
          file=sys.stderr)


def git_commit():
    if os.environ.get("JAX_LS2_COMMIT"):
        return os.environ["JAX_LS2_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def chart(rows, path):
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 4))
    for k, impl in enumerate(("plain", "ls2")):
        vals = [next((r["ms_median"] for r in rows if r["model"] == n and r["impl"] == impl),
                     0.0) for n in names]
        ax.bar([i + 0.4 * k for i in range(len(names))], vals, 0.4,
               label="plain Flax" if impl == "plain" else "jax_ls2")
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=15)
    ax.set_ylabel("train step, ms (median, lower is better)")
    ax.set_title(f"{rows[0]['gpu']}, bf16, jax {rows[0]['jax_version']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the CSV and PNG")
    p.add_argument("--models", nargs="+", default=DEFAULT, choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--group", type=int, default=GROUP, help="steps enqueued between waits")
    p.add_argument("--quick", action="store_true", help="smaller batches")
    p.add_argument("--smoke", action="store_true", help="tiny presets (checks the script)")
    p.add_argument("--batch", type=int, help="every model's batch size (default: its entry's)")
    p.add_argument("--impls", nargs="+", default=["plain", "ls2"], choices=IMPLS,
                   help="ls2-fp8: jax_ls2 with the layers' weight GEMMs in FP8 (DelayedScaling()); "
                        "not for the llama models")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 20 and not args.smoke:
        p.error("--steps must be >= 20")
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    names, impls = ([args.one[0]], [args.one[1]]) if args.one else (args.models, args.impls)
    if args.one:
        from bench.common import backend
        result = run_one(*args.one, args.steps, args.warmup, args.quick, args.smoke, args.group, args.batch)
        result["backend"] = backend()  # what jax_ls2's ops ran in this process
        print("RESULT " + json.dumps(result), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    rows, commit = [], git_commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name in args.models:
        for impl in args.impls:
            cmd = [sys.executable, "-m", "bench.bench_models", "--out", args.out, "--one", name,
                   impl, "--steps", str(args.steps), "--warmup", str(args.warmup), "--group", str(args.group)]
            cmd += ["--quick"] * args.quick + ["--smoke"] * args.smoke
            cmd += ["--batch", str(args.batch)] if args.batch else []
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            got = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if os.environ.get("JAX_LS2_PROFILE_TOP") or os.environ.get("JAX_LS2_PROFILE_HLO"):
                print(f"---- {name}/{impl}\n" + "\n".join(
                    l for l in proc.stderr.splitlines()
                    if l.startswith(("device time", "  ", "by kind", "kernels per step", "(no kind"))))
            if proc.returncode or not got:
                batch, seq = batch_shape(name, args.quick, args.smoke, args.batch)
                oom = any(m in proc.stderr for m in OOM_MARKERS)
                why = f" (out of device memory at batch {batch} x {seq or 'images'})" if oom else ""
                print(f"{name}/{impl} FAILED{why}:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            r = json.loads(got[-1][7:])
            r.update(git_commit=commit, date=date)
            rows.append(r)
            print(f"{name}/{impl}: {r['ms_median']:.2f} ms, {r['tokens_per_s']:,.0f} {r['unit']}/s, "
                  f"peak {r['peak_mem_gb']:.2f} GB, host dispatch {r['host_ms']:.2f} ms a step", flush=True)
        path = write_csv(rows, args.out, date, args.quick, args.smoke)
    png = chart(rows, path[:-4] + ".png") if rows else None
    print(f"{'model':<21}{'shape':<44}{'impl':<8}{'ms':>9}{'units/s':>12}{'MFU':>7}"
          f"{'peak GB':>9}{'mem x':>7}{'speedup':>9}")
    for r in rows:
        print(f"{r['model']:<21}{r['shape']:<44}{r['impl']:<8}{r['ms_median']:>9.2f}"
              f"{r['tokens_per_s']:>12,.0f}{r['mfu']:>7.1%}{r['peak_mem_gb']:>9.2f}{r['peak_mem_vs_plain']:>7.2f}"
              f"{r['speedup']:>8.2f}x" + (f" ({r['speedup_vs_ls2']:.2f}x ls2)" if "speedup_vs_ls2" in r else ""))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    if len(rows) < len(args.impls) * len(args.models):
        sys.exit(1)


def write_csv(rows, out, date, quick, smoke):
    """Writes every row so far (with speedups and peak-memory ratios over the plain twin);
    returns the path."""
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["impl"] == "plain"), None)
        r["speedup"] = base["ms_median"] / r["ms_median"] if base else float("nan")
        r["peak_mem_vs_plain"] = r["peak_mem_gb"] / base["peak_mem_gb"] if base and base["peak_mem_gb"] else float("nan")
        bf16 = next((b for b in rows if b["model"] == r["model"] and b["impl"] == "ls2"), None)
        if r["impl"] == "ls2-fp8" and bf16:
            r["speedup_vs_ls2"] = bf16["ms_median"] / r["ms_median"]
    fields = ["model", "shape", "dtype", "impl", "backend", "ms_median", "ms_p20", "ms_p80", "tokens_per_s",
              "unit", "mfu", "peak_mem_gb", "peak_mem_vs_plain", "speedup", "speedup_vs_ls2", "optimizer", "loss",
              "group", "host_ms", "compile_s", "gpu", "jax_version", "git_commit", "date"]
    path = os.path.join(out, f"models_{date[:10]}{'_quick' if quick else ''}"
                             f"{'_smoke' if smoke else ''}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


if __name__ == "__main__":
    main()
