"""The fused optimizer's pure-JAX reference against optax on the CPU: compile time of
one AdamW step for trees of many small leaves, and step time for a 26M-parameter tree.

    python -m bench.bench_optim_cpu [--leaves 300,1000] [--reps 20] [--impls optax,jax_ls2,jax_ls2_std]
                                    [--out bench/results/latest]

compile: seconds to trace, lower and compile (``jax.jit(step).lower(...).compile()``)
  one step over a transformer-like tree of N float32 leaves (hidden 64: 16 leaves a
  layer, matrices, biases and LayerNorm vectors); a fresh function per measurement, so
  no cache is hit.
step: ms per step (median, p20, p80 over --reps calls, after two warm-up calls, the
  impls interleaved in rounds) of a jitted step with params and state donated, on a transformer-like float32 tree of 26M
  params (hidden 512, 8 layers, 130 leaves).
impls: optax (optax.adamw + optax.apply_updates), jax_ls2 (optim.apply_updates, the
  fused step), jax_ls2_std (optim.adamw's update + optax.apply_updates).
Rows go to <out>/optim_cpu.csv (bench.common's columns; compile rows carry the
seconds in ms_median as milliseconds) and a table is printed.
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.common import Rows
from bench.bench_optim import fused_step, optax_step
from jax_ls2 import optim

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 0.01, 1e-4
LAYER_LEAVES = 16


def transformer_shapes(n_leaves: int, hidden: int, vocab: int | None = None) -> list:
    """Leaf shapes of a transformer-like tree with exactly `n_leaves` leaves: token and
    position embeddings, then layers of (q, k, v, out kernels and biases, two LayerNorms'
    scale and bias, ffn kernels and biases), cut at `n_leaves`."""
    h, f = hidden, 4 * hidden
    shapes = [(vocab or 8 * h, h), (h, h)]
    layer = [(h, h), (h,)] * 4 + [(h,), (h,), (h, f), (f,), (f, h), (h,), (h,), (h,)]
    while len(shapes) < n_leaves:
        shapes += layer
    return shapes[:n_leaves]


def make_tree(shapes, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {f"p{i:04d}": jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for i, s in enumerate(shapes)}


def make_impls():
    """name -> (transformation, step function); a fresh transformation each call."""
    tx_optax = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)
    tx = optim.adamw(LR, B1, B2, EPS, weight_decay=WD)
    return {"optax": (tx_optax, optax_step(tx_optax)),
            "jax_ls2": (tx, fused_step(tx)),
            "jax_ls2_std": (tx, optax_step(tx))}


def compile_seconds(name: str, shapes) -> tuple:
    """(trace + lower seconds, compile seconds) of one step of impl `name` on `shapes`."""
    tx, step = make_impls()[name]
    params = make_tree(shapes, 0)
    grads = make_tree(shapes, 1)
    state = tx.init(params)
    fn = jax.jit(lambda g, s, p: step(g, s, p), donate_argnums=(1, 2))
    t0 = time.perf_counter()
    lowered = fn.lower(grads, state, params)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def step_ms(names, shapes, reps: int, rounds: int = 5) -> dict:
    """name -> (median, p20, p80) ms of one jitted step of each impl in `names`, params
    and state donated. The impls are timed in `rounds` interleaved rounds of reps //
    rounds steps each, in a rotating order, so load from other processes on the machine
    reaches every impl alike."""
    runs = {}
    for name in names:
        tx, step = make_impls()[name]
        params = make_tree(shapes, 0)
        fn = jax.jit(lambda g, s, p, step=step: step(g, s, p), donate_argnums=(1, 2))
        args = (make_tree(shapes, 1), tx.init(params), params)
        for _ in range(2):  # compile, warm up
            params, state = jax.block_until_ready(fn(*args))
            args = (args[0], state, params)
        runs[name] = (fn, args)
    times = {name: [] for name in names}
    per = max(1, reps // rounds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, (g, s, p) = runs[name]
            for _ in range(per):
                t0 = time.perf_counter()
                p, s = jax.block_until_ready(fn(g, s, p))
                times[name].append((time.perf_counter() - t0) * 1e3)
            runs[name] = (fn, (g, s, p))
    out = {}
    for name, t in times.items():
        t = np.asarray(t)
        out[name] = (float(np.median(t)), float(np.percentile(t, 20)), float(np.percentile(t, 80)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", default="300,1000", help="comma-separated leaf counts of the compile rows")
    p.add_argument("--reps", type=int, default=20, help="timed steps of the 26M tree per impl")
    p.add_argument("--impls", default="optax,jax_ls2,jax_ls2_std", help="comma-separated impls to measure")
    p.add_argument("--parts", default="compile,step", help="compile, step or both")
    p.add_argument("--out", default="bench/results/latest", help="folder of optim_cpu.csv")
    a = p.parse_args()
    impls = [x for x in a.impls.split(",") if x]
    parts = set(a.parts.split(","))
    rows = Rows()
    table = []
    if "compile" in parts:
        for n in (int(x) for x in a.leaves.split(",") if x):
            shapes = transformer_shapes(n, 64)
            base = None
            for name in impls:
                lower_s, compile_s = compile_seconds(name, shapes)
                total = lower_s + compile_s
                base = base if base is not None else total
                table.append(("compile", f"{n} leaves", name, f"{total:.2f} s", f"lower {lower_s:.2f} s",
                              f"{total / base:.2f}x"))
                rows.add(op="adamw_step_compile", shape=f"{n}leaves_h64", dtype="float32", **{"pass": "compile"},
                         impl=name, ms_median=round(total * 1e3, 1))
                print(*table[-1], flush=True)
    if "step" in parts:
        shapes = transformer_shapes(2 + 8 * LAYER_LEAVES, 512, vocab=1024)
        n = sum(int(np.prod(s)) for s in shapes)
        base = None
        for name, (med, p20, p80) in step_ms(impls, shapes, a.reps).items():
            base = base if base is not None else med
            table.append(("step", f"{n / 1e6:.1f}M params {len(shapes)} leaves", name, f"{med:.1f} ms",
                          f"p20-p80 {p20:.1f}-{p80:.1f}", f"{med / base:.2f}x"))
            rows.add(op="adamw_step", shape=f"{len(shapes)}leaves_{n}", dtype="float32", **{"pass": "step"},
                     impl=name, ms_median=med, ms_p20=p20, ms_p80=p80)
            print(*table[-1], flush=True)
    rows.write(os.path.join(a.out, "optim_cpu.csv"))
    print(f"\n{'part':<9}{'tree':<28}{'impl':<13}{'figure':>10}  {'detail':<22}{'vs first impl':>14}")
    for part, tree, impl, fig, detail, ratio in table:
        print(f"{part:<9}{tree:<28}{impl:<13}{fig:>10}  {detail:<22}{ratio:>14}")


if __name__ == "__main__":
    main()
