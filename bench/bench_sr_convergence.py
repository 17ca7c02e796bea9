"""Convergence of bf16 params without an fp32 master copy: GPT trained with
``jax_ls2.optim.adamw`` in three precision modes from the same init and the same data.

    python -m bench.bench_sr_convergence --out DIR [--steps 300] [--preset small]
        [--batch 16 --seq 1024] [--small] [--check]

Model: the zoo's GPT (``flax_models``, GPT-2 small by default) on the fused layers
(``--impl ls2``; without the CUDA kernels they run as their pure-JAX references), bf16
compute, params stored in bfloat16 (``param_dtype=bfloat16``), dropout off, init seed
``--seed``. Data: ``flax_models.data.make_batch`` (Python standard library source bytes),
batch ``step`` of seed ``--seed`` at step ``step``: every mode sees the same batches in
the same order.

Optimizer: ``jax_ls2.optim.adamw`` (lr ``--lr``, weight decay 0.01, float32 moments)
with linear warm-up then cosine decay to lr / 10 (the schedule of
``flax_models.training.lr_schedule``), applied with ``jax_ls2.optim.apply_updates``
(the fused step that writes the new params; stochastic rounding only happens there).
Modes:
  fp32_master:  ``master_weights=True``: a float32 master copy lives in the optimizer
                state; the bf16 params are the master rounded to nearest.
  bf16_sr:      ``master_weights=False, stochastic_rounding=True``: bf16 params only,
                written with stochastic rounding.
  bf16_nearest: ``master_weights=False, stochastic_rounding=False``: bf16 params only,
                rounded to nearest (updates below half an ulp are lost).

The loss is recorded at every step. A mode's final loss is the mean of the losses of
its last 20 steps (all steps when fewer). Reported per mode: final loss, its relative
difference to fp32_master's ((mode - fp32_master) / fp32_master) and whether
|difference| <= 1% (the claim checked for bf16_sr), plus the median step time (the
model's loss and gradient, compiled once and shared by the modes, then the mode's
optimizer update, compiled per mode).
``--check`` makes the exit status 1 when bf16_sr is off by more than 1%.

CSVs under --out: ``bench_sr_convergence.csv`` (one row per mode, with gpu, jax
version, commit and date) and ``sr_convergence_curves.csv`` (step, mode, loss).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_models as fm
from bench.common import git_commit, gpu_name
from flax_models import data, training
from jax_ls2 import optim

MODES = {  # name: adamw precision options
    "fp32_master": dict(master_weights=True, stochastic_rounding=False),
    "bf16_sr": dict(master_weights=False, stochastic_rounding=True),
    "bf16_nearest": dict(master_weights=False, stochastic_rounding=False),
}
REFERENCE, CLAIMED = "fp32_master", "bf16_sr"
TOLERANCE = 0.01   # relative, on the final loss
FINAL_WINDOW = 20  # the final loss is the mean of this many last steps
WEIGHT_DECAY = 0.01

FIELDS = ["op", "shape", "dtype", "impl", "optimizer", "steps", "params", "first_loss", "final_loss",
          "rel_diff_vs_fp32_master", "within_1pct", "ms_per_step", "gpu", "jax_version", "commit", "date"]
CURVE_FIELDS = ["step", "mode", "loss"]


def final_loss(losses) -> float:
    """Mean of the last FINAL_WINDOW losses."""
    return float(np.mean(np.asarray(losses, np.float64)[-FINAL_WINDOW:]))


def build_model(cfg, args):
    """The model every mode starts from: (initial params, the loss-and-gradient function
    jitted once for all modes, the number of params). The modes differ only in the
    optimizer, so the model's forward and backward compile once per run."""
    model = fm.build(cfg, impl=args.impl, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, seed=args.seed,
                     train=True)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, batch):
        loss, _ = nnx.merge(graphdef, p, rest).loss(batch)
        return loss.astype(jnp.float32)

    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    return params, jax.jit(jax.value_and_grad(loss_fn)), n_params


def train_mode(cfg, mode: str, args, model, log=print) -> dict:
    """Trains one mode for args.steps steps from `model` (see `build_model`); returns its
    losses and median step time (gradient and update)."""
    params0, loss_and_grad, n_params = model
    params = jax.tree.map(jnp.copy, params0)  # the update donates its params
    tx = optim.adamw(training.lr_schedule(args.lr, args.steps, args.warmup), weight_decay=WEIGHT_DECAY, seed=args.seed,
                     **MODES[mode])
    opt_state = tx.init(params)
    update = jax.jit(lambda p, s, g: optim.apply_updates(tx, g, s, p), donate_argnums=(0, 1))
    losses, times = [], []
    for i in range(args.steps):
        batch = {k: jnp.asarray(v) for k, v in data.make_batch(cfg, args.seed, i, args.batch, args.seq).items()}
        t0 = time.perf_counter()
        loss, grads = loss_and_grad(params, batch)
        params, opt_state = update(params, opt_state, grads)
        loss = float(loss)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"bench_sr_convergence: {mode} loss is {loss} at step {i}")
        if args.log_every and ((i + 1) % args.log_every == 0 or i + 1 == args.steps):
            log(f"  {mode:<13} step {i + 1:>5}/{args.steps}  loss {loss:.4f}", flush=True)
    steady = times[1:] or times  # the first step compiles
    return {"losses": losses, "ms_per_step": 1e3 * float(np.median(steady)), "params": n_params}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.bench_sr_convergence", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="training steps per mode (default 300; 30 with --small)")
    ap.add_argument("--batch", type=int, help="sequences per batch (default 16; 8 with --small)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 1024; 64 with --small)")
    ap.add_argument("--preset", help="GPT preset (default small, GPT-2 small; tiny with --small)")
    ap.add_argument("--impl", default="ls2", choices=fm.IMPLS)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, help="warm-up steps (default steps // 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--log-every", type=int, default=50, help="print the loss every N steps (0: never)")
    ap.add_argument("--small", action="store_true", help="tiny preset, 30 steps (a CPU smoke test)")
    ap.add_argument("--check", action="store_true",
                    help="exit status 1 when bf16_sr's final loss is not within 1%% of fp32_master's")
    args = ap.parse_args(argv)
    small = args.small
    args.preset = args.preset or ("tiny" if small else "small")
    args.steps = args.steps or (30 if small else 300)
    args.batch = args.batch or (8 if small else 16)
    args.seq = args.seq or (64 if small else 1024)
    args.warmup = args.steps // 10 if args.warmup is None else args.warmup
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    return args


def write_csv(path, fields, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def summarize(results: dict, args, shape: str, meta: dict) -> list:
    """One CSV row per trained mode, with the relative difference to fp32_master."""
    ref = final_loss(results[REFERENCE]["losses"]) if REFERENCE in results else None
    rows = []
    for mode, r in results.items():
        fin = final_loss(r["losses"])
        rel = (fin - ref) / ref if ref is not None else None
        rows.append(dict(op="sr_convergence", shape=shape, dtype=mode, impl=args.impl,
                         optimizer="jax_ls2.optim.adamw", steps=len(r["losses"]), params=r["params"],
                         first_loss=round(r["losses"][0], 6), final_loss=round(fin, 6),
                         rel_diff_vs_fp32_master="" if rel is None else round(rel, 6),
                         within_1pct="" if rel is None else bool(abs(rel) <= TOLERANCE),
                         ms_per_step=round(r["ms_per_step"], 3), **meta))
    return rows


def main(argv=None):
    args = parse_args(argv)
    cfg = fm.get_config("gpt", args.preset, hidden_dropout=0.0, attn_dropout=0.0, activation_dropout=0.0)
    shape = f"gpt_{args.preset}_b{args.batch}x{args.seq}_{args.steps}steps"
    meta = dict(gpu=gpu_name(), jax_version=jax.__version__, commit=git_commit(),
                date=datetime.date.today().isoformat())
    summary_path = os.path.join(args.out, "bench_sr_convergence.csv")
    curves_path = os.path.join(args.out, "sr_convergence_curves.csv")
    print(f"gpt/{args.preset} ({args.impl}), batch {args.batch} x {args.seq}, {args.steps} steps, lr {args.lr} "
          f"(warm-up {args.warmup}, cosine), bf16 params, on {meta['gpu']}", flush=True)
    results = {}
    model = build_model(cfg, args)
    for mode in args.modes:
        results[mode] = train_mode(cfg, mode, args, model)
        # written after every mode: a run stopped by a time limit keeps what was measured
        write_csv(summary_path, FIELDS, summarize(results, args, shape, meta))
        write_csv(curves_path, CURVE_FIELDS,
                  [dict(step=i, mode=m, loss=round(l, 6)) for m, r in results.items()
                   for i, l in enumerate(r["losses"])])
    rows = summarize(results, args, shape, meta)
    print(f"{'mode':<14}{'first loss':>11}{'final loss':>11}{'vs fp32_master':>16}{'<= 1%':>7}{'ms/step':>10}")
    for r in rows:
        rel = r["rel_diff_vs_fp32_master"]
        print(f"{r['dtype']:<14}{r['first_loss']:>11.4f}{r['final_loss']:>11.4f}"
              f"{'' if rel == '' else f'{100 * rel:+.3f}%':>16}{str(r['within_1pct']):>7}"
              f"{r['ms_per_step']:>10.1f}")
    by_mode = {r["dtype"]: r for r in rows}
    ok = None
    if REFERENCE in by_mode and CLAIMED in by_mode:
        r = by_mode[CLAIMED]
        ok = bool(r["within_1pct"])
        print(f"{CLAIMED} final loss (mean of the last {min(FINAL_WINDOW, r['steps'])} steps) is "
              f"{100 * r['rel_diff_vs_fp32_master']:+.3f}% from {REFERENCE}'s: "
              f"{'within' if ok else 'NOT within'} 1%")
    print(f"wrote {summary_path} and {curves_path}")
    if args.check and ok is False:
        sys.exit(1)
    return {"results": results, "rows": rows, "within_1pct": ok}


if __name__ == "__main__":
    main()
