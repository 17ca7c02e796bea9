"""Scaling benchmark: the jax_ls2 train step of the zoo without a mesh and on device meshes.

    python -m bench.bench_scaling --out bench/results                 # every device found (GPU)
    python -m bench.bench_scaling --out /tmp/b --models gpt2-small     # one model
    python -m bench.bench_scaling --out /tmp/b --smoke                 # tiny presets, any backend

For each model (bench_models' entries: preset, batch, sequence length, dropout; bf16
compute (fp32 on the CPU), fp32 params, the fused optimizer) the step runs once without a mesh and then on
every mesh of the list below, each in a fresh subprocess (so peak memory does not mix).
With n = jax.device_count():

    data=1                      the 1-device mesh; ``ms_vs_no_mesh`` is its step time over
                                the run without a mesh (the cost of the mesh itself)
    data=n                      (n > 1 from here on)
    tensor=n                    Megatron tensor parallelism (heads, FFN, vocabulary split)
    data=n/2,tensor=2
    pipe=2,data=n/2             GPipe stages, 2 micro-batches per data part
    seq=n                       gpt only: the sequence split, attention through the ring

A mesh the model or the device count does not take is written as a row with the reason in
``skipped`` (the checks are those of ``python -m flax_models.train --mesh``). Weak scaling:
the batch per data replica is fixed (the entry's batch, or --batch), so the global batch
is that x data. Per row: step time (median, p20, p80 over groups of steps, as
bench_models times them), tokens/s, tokens/s per device, ``scaling_efficiency``
(tokens/s over the no-mesh run's tokens/s x devices) and the peak memory of the busiest
device. Writes ``scaling_<date>.csv`` (and a PNG when matplotlib is present) to --out.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import subprocess
import sys

from bench.bench_models import GROUP, MODELS, OOM_MARKERS, REPO, batch_shape, git_commit, model_config, time_steps

DEFAULT = ["gpt2-small", "bert-base-128"]
NO_MESH = "none"
FIELDS = ["model", "mesh", "shape", "dtype", "backend", "devices", "global_batch", "ms_median", "ms_p20",
          "ms_p80", "tokens_per_s", "tokens_per_s_per_device", "scaling_efficiency", "ms_vs_no_mesh",
          "peak_mem_gb_per_device", "loss", "host_ms", "skipped", "gpu", "jax_version", "git_commit", "date"]


class MeshRefused(Exception):
    """A mesh the model, the batch or the devices do not take; the message says why."""


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message):
        raise MeshRefused(message)


def mesh_specs(devices: int, family: str) -> list:
    """(spec, reason) of the meshes to run on `devices` devices; reason is None for a
    mesh to run, else why it is not (a split the device count does not allow)."""
    specs = [("data=1", None)]
    if devices == 1:
        return specs
    half = (f"data={devices // 2}", None) if devices % 2 == 0 else \
        (f"data={devices}/2", f"{devices} devices do not split in halves")
    specs += [(f"data={devices}", None), (f"tensor={devices}", None),
              (f"{half[0]},tensor=2", half[1]), (f"pipe=2,{half[0]}", half[1])]
    if family == "gpt":
        specs.append((f"seq={devices}", None))
    seen, out = set(), []
    for spec, reason in specs:  # on 2 devices tensor=2 and data=1,tensor=2 are one mesh
        key = spec if reason else tuple(sorted(parse_sizes(spec).items()))
        if key not in seen:
            seen.add(key)
            out.append((spec, reason))
    return out


def parse_sizes(spec: str) -> dict:
    from jax_ls2 import parallel
    return parallel.parse_mesh_spec(spec)


def build_mesh(spec: str, cfg, preset: str, batch: int, seq: int):
    """(mesh, cfg, microbatches) of `spec` for a model of `cfg` at batch x seq (None,
    cfg, 1 for the no-mesh run), checked as ``flax_models.train --mesh`` checks it
    (MeshRefused with its message otherwise). ``data=1`` on a machine of several
    devices is the 1-device mesh over the first device."""
    import jax

    from flax_models import train
    from jax_ls2 import parallel
    if spec == NO_MESH:
        return None, cfg, 1
    sizes = parallel.parse_mesh_spec(spec)
    if math.prod(sizes.values()) == 1:
        return parallel.make_mesh(sizes, devices=jax.devices()[:1]), cfg, 1
    args = train.build_parser().parse_args(["--model", cfg.family, "--preset", preset, "--mesh", spec, "--batch",
                                            str(batch), "--seq", str(seq), "--attention-backend",
                                            cfg.attention_backend])
    mesh, cfg = train.mesh_from(_RefusingParser(), args, cfg, batch, seq)
    return mesh, cfg, train.microbatches(args)


def run_one(name, spec, steps, warmup, smoke, group=GROUP, batch=None):
    """The RESULT dict of `name` on mesh `spec` (NO_MESH: without a mesh)."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    from flax_models import data, train, training
    from jax_ls2 import parallel
    per_replica, seq = batch_shape(name, False, smoke, batch)
    cfg = model_config(name, smoke)
    seq = seq or cfg.max_len
    replicas = 1 if spec == NO_MESH else parallel.parse_mesh_spec(spec)[parallel.DATA]
    global_batch = per_replica * replicas
    # XLA's CPU compiler aborts (AllReducePromotion) on the bf16 tensor-parallel step, so
    # the CPU runs compute in fp32
    cpu = jax.default_backend() == "cpu"
    row = {"model": name, "mesh": spec, "shape": f"{global_batch}x{seq}", "dtype": "fp32" if cpu else "bf16",
           "global_batch": global_batch, "gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__,
           "device_count": jax.device_count()}
    try:
        mesh, cfg, microbatches = build_mesh(spec, cfg, "tiny" if smoke else MODELS[name][1], global_batch, seq)
    except (MeshRefused, ValueError) as e:
        return dict(row, skipped=str(e))
    tx, _ = training.make_optimizer(1e-4, 1000, 10, fused=True)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        graphdef, state = training.create(cfg, impl="ls2", dtype=None if cpu else jnp.bfloat16, seed=0, tx=tx,
                                          mesh=mesh, microbatches=microbatches)
        host_batches = [data.make_batch(cfg, 0, i, global_batch, seq) for i in range(4)]
        if mesh is None:
            step = training.make_step(graphdef)
            batches = [jax.device_put(b) for b in host_batches]
        else:
            step = training.make_mesh_step(graphdef, state)
            batches = [training.shard_batch(b, mesh) for b in host_batches]
            if cfg.sequence_axis is not None:
                batches = [train.split_sequences(b, mesh, seq) for b in batches]
        state, loss, times, host_ms = time_steps(step, state, batches, steps, warmup, group)
    devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", float("nan")) for d in devices]
    ms = 1e3 * np.asarray(times)
    med = float(np.median(ms))
    tokens_per_s = data.tokens_in(cfg, host_batches[0]) / med * 1e3
    return dict(row, devices=len(devices), ms_median=med, ms_p20=float(np.percentile(ms, 20)),
                ms_p80=float(np.percentile(ms, 80)), tokens_per_s=tokens_per_s,
                tokens_per_s_per_device=tokens_per_s / len(devices),
                peak_mem_gb_per_device=max(peaks) / 1e9, loss=float(training.to_host(loss)), host_ms=host_ms)


def run_subprocess(name, spec, args) -> dict:
    """`run_one` in a fresh process; a failed run is a row with the failure in ``skipped``."""
    cmd = [sys.executable, "-m", "bench.bench_scaling", "--out", args.out, "--one", name, spec,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--group", str(args.group)]
    cmd += ["--smoke"] * args.smoke + (["--batch", str(args.batch)] if args.batch else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    got = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not got:
        oom = any(m in proc.stderr for m in OOM_MARKERS)
        print(f"{name} on {spec} FAILED:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"model": name, "mesh": spec, "failed": True,
                "skipped": "out of device memory" if oom else f"failed (exit {proc.returncode})"}
    return json.loads(got[-1][7:])


def add_ratios(rows) -> None:
    """Fills scaling_efficiency (every mesh row) and ms_vs_no_mesh (the data=1 row) from
    the model's no-mesh row."""
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["mesh"] == NO_MESH and "ms_median" in b), None)
        if base is None or "ms_median" not in r:
            continue
        r["scaling_efficiency"] = r["tokens_per_s"] / (base["tokens_per_s"] * r["devices"])
        if r["mesh"] == "data=1":
            r["ms_vs_no_mesh"] = r["ms_median"] / base["ms_median"]


def write_csv(rows, out, date, smoke) -> str:
    path = os.path.join(out, f"scaling_{date[:10]}{'_smoke' if smoke else ''}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def chart(rows, path):
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    timed = [r for r in rows if "tokens_per_s" in r]
    names = list(dict.fromkeys(r["model"] for r in timed))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in timed if r["model"] == name]
        ax.bar(range(len(mine)), [r["tokens_per_s_per_device"] for r in mine])
        ax.set_xticks(range(len(mine)), [r["mesh"] for r in mine], rotation=30, ha="right")
        ax.set_title(name)
        ax.set_ylabel("tokens/s per device (higher is better)")
    fig.suptitle(f"{timed[0]['gpu']}, bf16, jax {timed[0]['jax_version']}, weak scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _num(r, key, fmt):
    return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else "-"


def print_table(rows) -> None:
    print(f"{'model':<15}{'mesh':<18}{'dev':>4}{'batch':>7}{'ms':>10}{'p20':>9}{'p80':>9}{'tokens/s':>12}"
          f"{'/device':>11}{'eff':>7}{'vs none':>9}{'peak GB':>9}  skipped")
    for r in rows:
        print(f"{r['model']:<15}{r['mesh']:<18}{_num(r, 'devices', 'd'):>4}{_num(r, 'global_batch', 'd'):>7}"
              f"{_num(r, 'ms_median', '.2f'):>10}{_num(r, 'ms_p20', '.2f'):>9}{_num(r, 'ms_p80', '.2f'):>9}"
              f"{_num(r, 'tokens_per_s', ',.0f'):>12}{_num(r, 'tokens_per_s_per_device', ',.0f'):>11}"
              f"{_num(r, 'scaling_efficiency', '.2f'):>7}{_num(r, 'ms_vs_no_mesh', '.3f'):>9}"
              f"{_num(r, 'peak_mem_gb_per_device', '.2f'):>9}  {r.get('skipped', '')}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the CSV and PNG")
    p.add_argument("--models", nargs="+", default=DEFAULT, choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--group", type=int, default=GROUP, help="steps enqueued between waits")
    p.add_argument("--smoke", action="store_true", help="tiny presets (checks the script)")
    p.add_argument("--batch", type=int, help="sequences per data replica (default: the model's entry's batch)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "MESH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 20 and not args.smoke:
        p.error("--steps must be >= 20")
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    families = {MODELS[n][0] for n in args.models}
    if families - {"gpt", "bert"}:
        p.error(f"--models: the meshes run GPT and BERT models only, not {', '.join(sorted(families - {'gpt', 'bert'}))}")
    if args.one:
        from bench.common import backend
        result = run_one(*args.one, args.steps, args.warmup, args.smoke, args.group, args.batch)
        result["backend"] = backend()
        print("RESULT " + json.dumps(result), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    rows, commit = [], git_commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name in args.models:
        base = run_subprocess(name, NO_MESH, args)  # also tells how many devices there are
        rows.append(base)
        count = base.get("device_count", 1)
        for spec, reason in mesh_specs(count, MODELS[name][0]):
            r = {"model": name, "mesh": spec, "skipped": reason} if reason else run_subprocess(name, spec, args)
            rows.append(r)
            print(f"{name} on {spec}: " + (f"skipped: {r['skipped']}" if r.get("skipped") else
                                           f"{r['ms_median']:.2f} ms, {r['tokens_per_s']:,.0f} tokens/s"), flush=True)
    for r in rows:
        r.update(git_commit=commit, date=date)
        if r.get("skipped"):
            r["skipped"] = " ".join(str(r["skipped"]).split())  # one CSV line
    add_ratios(rows)
    path = write_csv(rows, args.out, date, args.smoke)
    png = chart(rows, path[:-4] + ".png") if any("tokens_per_s" in r for r in rows) else None
    print_table(rows)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    if any(r.get("failed") for r in rows) or "ms_median" not in rows[0]:
        sys.exit(1)


if __name__ == "__main__":
    main()
