"""Fused optimizer benchmark: the AdamW update over BERT-base's parameter pytree
(199 leaves, 109.5M params), and its share of a full jitted BERT-base train step.

    python -m bench.bench_optim --out DIR [--parts update,train] [--batch 32 --seq 512] [--small]

update: the update alone, K steps inside one jitted ``fori_loop`` with params and state
  donated (in place), per-step median/p20/p80 over >= 50 repetitions, and the CUPTI
  device time per step (all kernels, and the fused update kernel alone). The host-timed
  figure includes the loop's per-iteration round trip to the host; the device time does
  not. (Unrolling the K steps instead lets XLA fuse the optax and xla_flat updates
  across steps, which no train step can do.) GB/s counts the bytes each implementation
  must move per step (its own bytes/param, in the op name).
  impls: optax (optax.adamw per leaf + apply_updates), jax_ls2 (optim.apply_updates,
  one fused pass), jax_ls2_std (optim.adamw update + optax.apply_updates), xla_flat (the
  same AdamW as one XLA fusion over flat fp32 buffers: a ceiling, not a usable optimizer).
train: BERT-base (flax_models, plain layers, bf16 compute) train steps: a step returning
  the grads without updating, an optax.adamw step and a jax_ls2 step, same run. Step
  times are host-timed in interleaved rounds; the update's share = device time of the
  step - that of the grads-only step (CUPTI; the median over 5 interleaved rounds of
  2 steps per variant; pass "share_device"), in ms and as a
  multiple of the bytes-over-copy-bandwidth floor of the jax_ls2 mode ("x_floor" in the
  impl column). With bf16 params the plain model's embedding-gradient scatter (bf16
  atomics) takes 12-17 ms and its time moves by several ms between compilations of the
  same gradient, so the share is also given without the kernels named "scatter" (pass
  "share_device_ex_scatter"); their time per variant is in the log.
Modes (--modes): fp32 (fp32 params and moments), bf16 (bf16 params, fp32 moments, no master,
stochastic rounding), bf16_master (bf16 params, fp32 master copy and moments).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.common import COPY_GBPS, Rows
from jax_ls2 import optim

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 0.01, 1e-4
PROFILE_ROUNDS = 5


def bert_base_shapes(vocab=30522, hidden=768, layers=12, ffn=3072, max_pos=512):
    """BERT-base's leaf shapes: embeddings, 12 x (q, k, v, out, ffn1, ffn2 kernels and biases,
    2 LayerNorms), pooler: 199 leaves."""
    h = hidden
    shapes = [(vocab, h), (max_pos, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4 + [(h, ffn), (ffn,), (ffn, h), (h,), (h,), (h,), (h,), (h,)]
    shapes += [(h, h), (h,)]
    return shapes


def make_tree(shapes, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {f"p{i:03d}": (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dtype)
            for i, (k, s) in enumerate(zip(keys, shapes))}


def timed(fn, args, reps, k):
    """Per-step ms (median, p20, p80) of fn(args) -> args run k times per call."""
    args = fn(*args)  # compile + warm up
    args = fn(*args)
    jax.block_until_ready(args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        args = fn(*args)
        jax.block_until_ready(args)
        times.append((time.perf_counter() - t0) * 1e3 / k)
    t = np.asarray(times)
    return float(np.median(t)), float(np.percentile(t, 20)), float(np.percentile(t, 80))


def device_profile(fn, args, k, label, top=6, calls=3):
    """CUPTI device time per step of fn(*args) -> args (k steps a call): (total ms, ms of
    the kernels whose name holds "UpdateKernel", ms of those whose name holds "scatter",
    the last args: fn donates its inputs); prints the `top` kernels to stderr. The times
    are None where torch/CUPTI is unavailable."""
    args = jax.block_until_ready(fn(*args))
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None, None, None, args
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                args = fn(*args)
            jax.block_until_ready(args)
        events = [e for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]
    except Exception as err:  # the device time is an aid; the host-timed figures still come
        print(f"{label}: no device profile ({err!r})", file=sys.stderr)
        return None, None, None, args
    if not events:
        return None, None, None, args
    steps = calls * k
    total = sum(e.device_time_total for e in events) / steps / 1e3
    update = sum(e.device_time_total for e in events if "UpdateKernel" in e.key) / steps / 1e3
    scatter = sum(e.device_time_total for e in events if "scatter" in e.key) / steps / 1e3
    print(f"{label}: device {total:.4f} ms per step, {scatter:.4f} ms of it in scatter kernels", file=sys.stderr)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / steps / 1e3:8.4f} ms x{e.count / steps:<5.2f} {e.key[:100]}", file=sys.stderr)
    return total, update, scatter, args


def timed_interleaved(variants, reps, rounds=10):
    """Per-step ms (median, p20, p80) of each name -> (fn, args) in `variants`, timed in
    `rounds` rounds that each run every variant reps // rounds times, in an order that
    rotates, so clock and memory drift over the run reach every variant alike."""
    state = {}
    for name, (fn, args) in variants.items():
        args = fn(*args)  # compile + warm up
        state[name] = jax.block_until_ready(fn(*args))
    times = {name: [] for name in variants}
    names = list(variants)
    per = max(1, reps // rounds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, args = variants[name][0], state[name]
            for _ in range(per):
                t0 = time.perf_counter()
                args = jax.block_until_ready(fn(*args))
                times[name].append((time.perf_counter() - t0) * 1e3)
            state[name] = args
    out = {}
    for name, t in times.items():
        t = np.asarray(t)
        out[name] = (float(np.median(t)), float(np.percentile(t, 20)), float(np.percentile(t, 80)))
    return out


def loop(step, k):
    def run(params, state, grads):
        p, s = jax.lax.fori_loop(0, k, lambda i, c: step(grads, c[1], c[0]), (params, state))
        return p, s, grads
    return jax.jit(run, donate_argnums=(0, 1))


def optax_step(tx):
    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


def fused_step(tx):
    return lambda g, s, p: optim.apply_updates(tx, g, s, p)


def xla_flat_step(g, s, p):
    m, v, t = s
    t = t + 1
    m = (1 - B1) * g + B1 * m
    v = (1 - B2) * g * g + B2 * v
    u = (m / (1 - B1 ** t)) / (jnp.sqrt(v / (1 - B2 ** t)) + EPS) + WD * p
    return p - LR * u, (m, v, t)


MODES = {  # name: (param dtype, fused kwargs, bytes/param of the fused update)
    "fp32": (jnp.float32, dict(), 28),
    "bf16": (jnp.bfloat16, dict(stochastic_rounding=True), 22),
    # bf16 params, fp32 master in the state: reads g (2), master, m, v (12); writes
    # master, m, v (12) and the bf16 params (2).
    "bf16_master": (jnp.bfloat16, dict(master_weights=True), 28),
}


def bench_update(rows, shapes, reps, k, flush, modes):
    n = sum(int(np.prod(s)) for s in shapes)
    shape_s = f"bert_base_{len(shapes)}leaves_{n}"
    for mode, (dt, kw, bpp) in ((m, MODES[m]) for m in modes):
        params = make_tree(shapes, dt)
        grads = make_tree(shapes, dt, seed=1)
        esize = jnp.dtype(dt).itemsize
        results = {}
        tx_optax = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)
        optax_bpp = 7 * esize  # g, p, m, v read; p, m, v written, all in the param dtype
        dev = {}

        def run(name, fn, args):
            """Host-timed per-step figures, and the device time per step (CUPTI)."""
            total, update, _, args = device_profile(fn, args, k, f"{mode} {name}")
            dev[name] = (total, update)
            return timed(fn, args, reps, k)

        results["optax"] = (run("optax", loop(optax_step(tx_optax), k), (params, tx_optax.init(params), grads)),
                            optax_bpp)
        del params
        tx = optim.adamw(LR, B1, B2, EPS, weight_decay=WD, **kw)
        p = make_tree(shapes, dt)
        results["jax_ls2"] = (run("jax_ls2", loop(fused_step(tx), k), (p, tx.init(p), grads)), bpp)
        del p
        p = make_tree(shapes, dt)
        std_bpp = 4 * esize + 8 + 8 + 2 * esize + 2 * esize  # update pass + apply_updates pass
        if kw.get("master_weights"):
            std_bpp += 8  # the update pass also reads and writes the fp32 master
        results["jax_ls2_std"] = (run("jax_ls2_std", loop(optax_step(tx), k), (p, tx.init(p), grads)), std_bpp)
        del p
        if mode == "fp32":
            fp = jnp.zeros((n,), jnp.float32)
            fs = (jnp.zeros((n,)), jnp.zeros((n,)), jnp.zeros((), jnp.float32))
            results["xla_flat"] = (run("xla_flat", loop(xla_flat_step, k), (fp, fs, jnp.ones((n,)) * 1e-3)), 28)
        base = results["optax"][0][0]
        for impl, ((med, p20, p80), b) in results.items():
            total, update = dev.get(impl, (None, None))
            rows.add(op=f"adamw_update[{b}B/param]", shape=shape_s, dtype=mode, **{"pass": "update"}, impl=impl,
                     ms_median=med, ms_p20=p20, ms_p80=p80, gbytes=b * n / 1e9,
                     speedup_vs_xla=round(base / med, 3), device_ms=total)
            # The fused update kernel alone, without the step's small XLA kernels. Only where
            # it is the whole step: jax_ls2_std's bytes include its separate apply pass.
            if update and impl == "jax_ls2":
                rows.add(op=f"adamw_update[{b}B/param]", shape=shape_s, dtype=mode, **{"pass": "update_kernel"},
                         impl=impl, device_ms=update, gbytes=b * n / 1e9)
        flush()


def bench_train(rows, batch, seq, reps, flush, modes, preset="base"):
    from flax import nnx
    import flax_models as fm
    from flax_models.data import make_batch
    # Dropout off: the step's cost is the same, and the timed step needs no RNG state.
    cfg = fm.get_config("bert", preset, hidden_dropout=0.0, attn_dropout=0.0)
    data = {k: jnp.asarray(v) for k, v in make_batch(cfg, 0, 0, batch, seq).items()}
    for mode, (dt, kw, bpp) in ((m, MODES[m]) for m in modes):
        model = fm.build(cfg, impl="plain", dtype=jnp.bfloat16, param_dtype=dt, seed=0)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        n = sum(x.size for x in jax.tree.leaves(params))

        def loss_fn(p):
            return nnx.merge(graphdef, p, rest).loss(data)[0]

        # Every variant takes (params, state, grad buffers) donated and returns them, so
        # none allocates or copies: grads_only writes the gradients into the donated
        # buffers (what a step that keeps them must at least do), the others update.
        def grads_only(p, s, sink):
            return p, s, jax.grad(loss_fn)(p)

        def with_tx(update):
            def step(p, s, sink):
                p, s = update(jax.grad(loss_fn)(p), s, p)
                return p, s, sink
            return step

        tx_optax = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)
        tx = optim.adamw(LR, B1, B2, EPS, weight_decay=WD, **kw)
        variants = {"grads_only": (grads_only, tx_optax),
                    "optax": (with_tx(optax_step(tx_optax)), tx_optax),
                    "jax_ls2": (with_tx(fused_step(tx)), tx)}
        runs = {}
        for name, (fn, t) in variants.items():
            p = jax.tree.map(jnp.copy, params)
            runs[name] = (jax.jit(fn, donate_argnums=(0, 1, 2)), (p, t.init(p), jax.tree.map(jnp.zeros_like, p)))
        del p
        # Device time per step of each variant (CUPTI), in PROFILE_ROUNDS interleaved
        # rounds: the share of each round is variant - grads_only of that round, and the
        # median over rounds is reported (one round's difference moves by ~0.1 ms).
        dev = {name: [] for name in runs}
        for r in range(PROFILE_ROUNDS):
            for name, (fn, args) in runs.items():
                total, _, scatter, args = device_profile(fn, args, 1, f"{mode} train step {name} (round {r})",
                                                         top=4 if r == 0 else 0, calls=2)
                dev[name].append((total, scatter))
                runs[name] = (fn, args)
        res = timed_interleaved(runs, reps)
        del runs
        floor = bpp * n / (COPY_GBPS * 1e9) * 1e3
        shape_s = f"bert_{preset}_b{batch}x{seq}_{n}"
        valid = all(t is not None for v in dev.values() for t, _ in v)
        for name, (med, p20, p80) in res.items():
            rows.add(op="bert_train_step", shape=shape_s, dtype=mode, **{"pass": "step"}, impl=name,
                     ms_median=med, ms_p20=p20, ms_p80=p80,
                     device_ms=float(np.median([t for t, _ in dev[name]])) if valid else None,
                     speedup_vs_xla=round(res["optax"][0] / med, 3))
        if not valid:
            flush()
            continue
        for name in ("optax", "jax_ls2"):
            rounds = list(zip(dev[name], dev["grads_only"]))
            for pass_, shares in (
                    ("share_device", [t - bt for (t, _), (bt, _) in rounds]),
                    ("share_device_ex_scatter", [(t - sc) - (bt - bsc) for (t, sc), (bt, bsc) in rounds])):
                share = float(np.median(shares))
                print(f"{mode} {name} {pass_}: median {share:.4f} ms = {share / floor:.3f}x floor; rounds "
                      + " ".join(f"{x:.3f}" for x in shares), file=sys.stderr)
                rows.add(op=f"bert_update_share[{bpp}B/param]", shape=shape_s, dtype=mode, **{"pass": pass_},
                         impl=f"{name}:x_floor={share / floor:.3f}", device_ms=share, gbytes=bpp * n / 1e9)
        flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--parts", default="update,train")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--k", type=int, default=10, help="update steps per timed call")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--modes", default="fp32,bf16", help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--small", action="store_true", help="a tiny pytree (smoke test on the CPU)")
    args = ap.parse_args(argv)
    rows = Rows()
    printed = []

    def flush():
        """Writes the CSV so far and prints the rows not printed yet (a time limit that
        stops the run keeps what was measured)."""
        rows.write(os.path.join(args.out, "bench_optim.csv"))
        if not printed:
            print(f"{'op':<30}{'dtype':<6}{'impl':<34}{'ms':>9}{'GB/s':>9}{'%bw':>7}{'x optax':>9}")
        for r in rows.rows[len(printed):]:
            print(f"{r['op']:<30}{r['dtype']:<6}{r['impl']:<34}{r['ms_median']:>9}{r['gbps']:>9}"
                  f"{r['pct_copy_bw']:>7}{str(r['speedup_vs_xla']):>9}", flush=True)
            printed.append(r)

    parts = args.parts.split(",")
    if "update" in parts:
        shapes = bert_base_shapes(vocab=300, hidden=16, layers=2, ffn=64, max_pos=32) if args.small \
            else bert_base_shapes()
        bench_update(rows, shapes, args.reps, args.k, flush, args.modes.split(","))
    if "train" in parts:
        batch, seq = (2, 32) if args.small else (args.batch, args.seq)
        bench_train(rows, batch, seq, args.reps, flush, args.modes.split(","), preset="tiny" if args.small else "base")

if __name__ == "__main__":
    main()
