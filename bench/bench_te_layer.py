"""Transformer Engine's seed layer, forward + backward, in bf16 and FP8.

The layer of Transformer Engine's performance guide: pre-LN, hidden 4096, FFN 16384,
32 heads, sequence 2048, batch 4, GELU, no dropout, bf16 activations and weights. Each
implementation runs in its own process (clean compile cache and memory peak):

  flax-bf16   plain Flax Linen, cuDNN attention (`jax.nn.dot_product_attention`)
  flax-fp8    the same layer with Flax's own FP8 on every Dense
              (`flax.linen.Fp8DirectDotGeneralOp`: delayed scaling, history 1024)
  ls2-bf16    `jax_ls2.nn.TransformerLayer`, cuDNN attention
  ls2-fp8     the same with ``fp8=jax_ls2.fp8.DelayedScaling()`` (history 1024)

With ``--dropout R`` every variant drops attention probabilities and the two hidden
outputs (after the attention's output projection and after the FFN) at rate R, a fresh
mask per element: plain Flax through ``flax.linen.dot_product_attention`` (its written-out
softmax with ``broadcast_dropout=False``) and ``nn.Dropout``; jax_ls2 with
``attention_backend="auto"`` (which picks its fused path under dropout).

One timed application is the vjp of the layer with respect to its parameters, its FP8
state and its input, for a random output cotangent, plus (jax_ls2 FP8) the meta update
that rolls the amax histories; Flax's FP8 computes its new scales inside the same pass.
Attention stays bf16 in every variant.

With ``--accumulate N`` it times instead one micro-step of gradient accumulation of the
jax_ls2 FP8 layer (bf16 weights), one jitted call per micro-batch as under
``optax.MultiSteps``: the gradients of ``sum(layer(x) * dy)`` with respect to the
parameters and metas added into float32 sums, with

  flat    the gradients in the weights' dtype, added by ``fp8.accumulate_flat`` (one kernel
          over a flat float32 buffer: a second pass over every accumulator)
  fused   ``fp8.accumulate_grads`` (``fuse_wgrad_accumulation``: each FP8 weight-gradient
          GEMM writes float32 and adds into its accumulator in its own epilogue)

each without weight caching (``nocache``: every micro-step casts every weight), and with
``fp8.cache_weights``: the first micro-batch's step (``fill``) and a later one's
(``reuse``, no weight cast). ``ms_optimizer_step`` is N micro-steps: N x nocache, or
fill + (N - 1) x reuse.

    python -m bench.bench_te_layer --out DIR [--impls ls2-bf16 ls2-fp8] [--dropout 0.1] [--smoke]
    python -m bench.bench_te_layer --out DIR --accumulate 4 [--smoke]
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import MATMUL_TFLOPS, backend, compile_sets, git_commit, gpu_name, time_program

IMPLS = ("flax-bf16", "flax-fp8", "ls2-bf16", "ls2-fp8")
ACCUMULATIONS = ("flat", "fused")
CACHE_MODES = {"nocache": None, "fill": True, "reuse": False}  # -> fp8.cache_weights' is_first_microbatch
ACC_IMPLS = tuple(f"acc-{a}-{c}" for a in ACCUMULATIONS for c in CACHE_MODES)
SEED = dict(batch=4, seq=2048, hidden=4096, ffn=16384, heads=32)
SMOKE = dict(batch=2, seq=64, hidden=128, ffn=512, heads=4)
AMAX_HISTORY = 1024
FIELDS = ["op", "shape", "dtype", "pass", "impl", "backend", "ms_median", "ms_p20", "ms_p80", "tflops",
          "pct_matmul_peak", "speedup_vs_ls2_bf16", "speedup_vs_flax_fp8", "speedup_vs_flax_bf16", "micro_batches", "ms_optimizer_step",
          "speedup_vs_flat_nocache", "peak_mem_bytes", "compile_s",
          "gpu", "jax_version", "commit", "date"]


def layer_flops(batch, seq, hidden, ffn, heads) -> float:
    """Analytic FLOPs of one forward + backward (3x the forward's GEMM FLOPs)."""
    del heads
    tokens = batch * seq
    gemms = 2 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
    attention = 4 * tokens * seq * hidden
    return 3.0 * (gemms + attention)


def attention(q, k, v, rate=0.0, rng=None):
    """(batch, seq, heads, head_dim) bf16 -> same. Without dropout cuDNN on the GPU (XLA
    elsewhere); with dropout Flax's written-out attention, a mask drawn per element."""
    from flax import linen as nn

    if rate:
        return nn.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=rate, broadcast_dropout=False,
                                        deterministic=False, dtype=q.dtype)
    implementation = "cudnn" if jax.default_backend() == "gpu" else None
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)


def flax_layer(shape, fp8: bool, rate: float = 0.0):
    """(apply(variables, x, rng), variables): the plain Linen layer, FP8 Dense layers if
    asked, dropout at `rate` (attention probabilities and both hidden outputs)."""
    from flax import linen as nn

    hidden, ffn, heads = shape["hidden"], shape["ffn"], shape["heads"]
    extra = {"dot_general_cls": nn.Fp8DirectDotGeneralOp} if fp8 else {}

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            def dense(features, name):
                return nn.Dense(features, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, name=name, **extra)

            def drop(y):
                return nn.Dropout(rate, deterministic=False)(y) if rate else y

            b, t, _ = x.shape
            h = nn.LayerNorm(epsilon=1e-5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)
            q, k, v = jnp.split(dense(3 * hidden, "qkv")(h).reshape(b, t, 3 * heads, hidden // heads), 3, axis=2)
            a = attention(q, k, v, rate, self.make_rng("dropout") if rate else None)
            x = x + drop(dense(hidden, "out")(a.reshape(b, t, hidden)))
            h = nn.LayerNorm(epsilon=1e-5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)
            h = jax.nn.gelu(dense(ffn, "fc1")(h), approximate=False)
            return x + drop(dense(hidden, "fc2")(h))

    layer = Layer()
    x = jnp.zeros((shape["batch"], shape["seq"], hidden), jnp.bfloat16)
    variables = layer.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    return (lambda v, x, rng: layer.apply(v, x, rngs={"dropout": rng})), variables


def flax_step(shape, fp8: bool, rate: float = 0.0):
    apply, variables = flax_layer(shape, fp8, rate)

    def step(variables, x, dy):
        y, vjp = jax.vjp(lambda v, x: apply(v, x, jax.random.key(2)), variables, x)
        return vjp(dy)

    return step, variables


def ls2_layer(shape, rate: float, **kw):
    """The jax_ls2 TransformerLayer of the seed shape: cuDNN attention without dropout,
    "auto" (its fused path) with it."""
    from flax import nnx

    from jax_ls2.nn import TransformerLayer

    backend = "auto" if rate else ("cudnn" if jax.default_backend() == "gpu" else "xla")
    return TransformerLayer(shape["hidden"], shape["ffn"], shape["heads"], hidden_dropout=rate, attn_dropout=rate,
                            activation_dropout=0.0, activation="gelu", attention_backend=backend,
                            dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **kw)


def ls2_step(shape, fp8: bool, rate: float = 0.0):
    from flax import nnx

    from jax_ls2 import fp8 as ls2_fp8

    recipe = ls2_fp8.DelayedScaling(amax_history_len=AMAX_HISTORY) if fp8 else None
    layer = ls2_layer(shape, rate, **({"fp8": recipe} if fp8 else {}))
    # A key given at call time: the module's own stream would be mutated inside the vjp.
    call = dict(deterministic=False, rngs=jax.random.key(2)) if rate else dict(deterministic=True)
    if not fp8:
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def step(params, x, dy):
            y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p, rest)(x, **call), params, x)
            return vjp(dy)

        return step, params

    graphdef, params, metas, rest = nnx.split(layer, nnx.Param, ls2_fp8.FP8Meta, ...)

    def fp8_step(state, x, dy):
        params, metas = state
        y, vjp = jax.vjp(lambda p, m, x: nnx.merge(graphdef, p, m, rest)(x, **call),
                         params, metas, x)
        param_grads, meta_grads, dx = vjp(dy)
        _, new_metas = ls2_fp8.apply_meta_updates(metas, meta_grads, recipe)
        return param_grads, new_metas, dx

    return fp8_step, (params, metas)


def ls2_accumulate_step(shape, accumulation: str, cache):
    """(step, state) of one accumulation micro-step of the jax_ls2 FP8 layer (bf16
    weights): ``step((acc, variables, caches), x, dy)`` -> the new sums (and, filling,
    the new weight caches). ``accumulation`` in ACCUMULATIONS; ``cache``:
    `fp8.cache_weights`' is_first_microbatch."""
    from flax import nnx

    from jax_ls2 import fp8 as ls2_fp8

    recipe = ls2_fp8.DelayedScaling(amax_history_len=AMAX_HISTORY)
    layer = ls2_layer(shape, 0.0, fp8=recipe)
    if cache is not None:
        # Filled once, so that the fill and the reuse step take caches of one structure.
        ls2_fp8.cache_weights(layer, True)
        x = jnp.zeros((shape["batch"], shape["seq"], shape["hidden"]), jnp.bfloat16)
        nnx.jit(lambda m, x: m(x, deterministic=True))(layer, x)
    graphdef, variables, caches, rest = nnx.split(layer, nnx.Any(nnx.Param, ls2_fp8.FP8Meta),
                                                  ls2_fp8.FP8WeightCache, ...)

    def loss(variables, caches, x, dy):
        model = nnx.merge(graphdef, variables, caches, rest)
        if cache is not None:
            ls2_fp8.cache_weights(model, cache)
        y = model(x, deterministic=True)
        return jnp.sum((y * dy).astype(jnp.float32)), nnx.state(model, ls2_fp8.FP8WeightCache)

    if accumulation == "fused":
        micro = ls2_fp8.accumulate_grads(loss, has_aux=True)

        def step(state, x, dy):
            acc, variables, caches = state
            (_, new_caches), acc = micro(acc, variables, caches, x, dy)
            return acc, new_caches if cache else None

        return step, (ls2_fp8.init_grad_accumulator(variables), variables, caches)

    def flat_step(state, x, dy):
        acc, variables, caches = state
        grads, new_caches = jax.grad(loss, has_aux=True)(variables, caches, x, dy)
        return ls2_fp8.accumulate_flat(acc, grads), new_caches if cache else None

    return flat_step, (ls2_fp8.init_flat_accumulator(variables), variables, caches)


def prepare(impl: str, shape: dict, rate: float = 0.0):
    """(measure, compile_s): builds and compiles one implementation's timed program in
    this process; ``measure(reps)`` then times it (nothing compiles there) and returns
    its figures."""
    import time

    if impl.startswith("acc-"):
        _, accumulation, mode = impl.split("-")
        step, state = ls2_accumulate_step(shape, accumulation, CACHE_MODES[mode])
    else:
        kind, precision = impl.split("-")
        builder = flax_step if kind == "flax" else ls2_step
        step, state = builder(shape, precision == "fp8", rate)
    kx, kd = jax.random.split(jax.random.key(1))
    dims = (shape["batch"], shape["seq"], shape["hidden"])
    x = jax.random.normal(kx, dims, jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, dims, jnp.float32).astype(jnp.bfloat16)
    sets = [(state, x, dy)]
    t0 = time.perf_counter()
    prog = compile_sets(step, sets)
    compile_s = time.perf_counter() - t0

    def measure(reps: int) -> dict:
        med, p20, p80 = time_program(prog, sets, reps=reps, warmup=3, pipeline=4)
        stats = jax.devices()[0].memory_stats() or {}
        return dict(ms_median=med, ms_p20=p20, ms_p80=p80, compile_s=compile_s,
                    peak_mem_bytes=stats.get("peak_bytes_in_use", ""))

    return measure, compile_s


def run_one(impl: str, shape: dict, reps: int, rate: float = 0.0) -> dict:
    """Times one implementation in this process; returns its figures."""
    measure, _ = prepare(impl, shape, rate)
    return measure(reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the CSV")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="a tiny layer (checks the script, any backend)")
    p.add_argument("--accumulate", type=int, default=0, metavar="N",
                   help="time FP8 accumulation micro-steps (flat vs fused, weight caching) for N micro-batches")
    p.add_argument("--dropout", type=float, default=0.0, help="attention and hidden dropout rate")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.accumulate and args.dropout:
        p.error("--accumulate times the layer without dropout; leave --dropout out")
    shape = SMOKE if args.smoke else SEED
    if args.one:
        print(json.dumps(run_one(args.one, shape, args.reps, args.dropout)))
        return
    impls = ACC_IMPLS if args.accumulate else args.impls
    results = {}
    for impl in impls:
        cmd = [sys.executable, "-m", "bench.bench_te_layer", "--out", args.out, "--one", impl,
               "--reps", str(args.reps), "--dropout", str(args.dropout)] + (["--smoke"] if args.smoke else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{impl}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = result_rows(results, shape, args.dropout, args.accumulate)
    path = write_rows(rows, os.path.join(args.out, "bench_te_layer.csv"))
    print_rows(rows)
    print(f"wrote {path}")
    if len(results) < len(impls):
        sys.exit(1)
    return rows


def result_rows(results: dict, shape: dict, rate: float = 0.0, accumulate: int = 0) -> list:
    """CSV rows of {impl: figures} measured at one dropout rate, with TFLOP/s and the
    speedups over the jax_ls2 bf16 and Flax FP8 rows of the same rate."""
    flops = layer_flops(**shape)
    meta = dict(backend=backend(), gpu=gpu_name(), jax_version=jax.__version__, commit=git_commit(),
                date=datetime.date.today().isoformat())
    shape_text = "x".join(str(shape[k]) for k in ("batch", "seq", "hidden", "ffn", "heads"))
    shape_text += f" dropout={rate}" if rate else ""
    rows = []
    op = "te_layer_accumulate" if accumulate else "te_layer"
    for impl, r in results.items():
        row = dict(meta, op=op, shape=shape_text, dtype="bfloat16", **{"pass": "fwd+bwd"}, impl=impl, **r)
        row["tflops"] = round(flops / (r["ms_median"] * 1e-3) / 1e12, 1)
        row["pct_matmul_peak"] = round(100 * row["tflops"] / MATMUL_TFLOPS, 1)
        for ref, col in (("ls2-bf16", "speedup_vs_ls2_bf16"), ("flax-fp8", "speedup_vs_flax_fp8"),
                         ("flax-bf16", "speedup_vs_flax_bf16")):
            if ref in results:
                row[col] = round(results[ref]["ms_median"] / r["ms_median"], 3)
        for k in ("ms_median", "ms_p20", "ms_p80", "compile_s"):
            row[k] = round(row[k], 4)
        rows.append(row)
    if accumulate:
        _optimizer_step_times(rows, results, accumulate)
    return rows


def write_rows(rows: list, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def print_rows(rows: list):
    print(f"{'impl':<19}{'ms':>9}{'p20':>9}{'p80':>9}{'TFLOP/s':>9}{'x ls2 bf16':>11}{'x flax fp8':>11}"
          f"{'step ms':>9}{'x flat':>8}{'peak GB':>9}{'compile s':>10}")
    for r in rows:
        peak = f"{r['peak_mem_bytes'] / 1e9:.2f}" if r["peak_mem_bytes"] != "" else ""
        print(f"{r['impl']:<19}{r['ms_median']:>9}{r['ms_p20']:>9}{r['ms_p80']:>9}{r['tflops']:>9}"
              f"{str(r.get('speedup_vs_ls2_bf16', '')):>11}{str(r.get('speedup_vs_flax_fp8', '')):>11}"
              f"{str(r.get('ms_optimizer_step', '')):>9}{str(r.get('speedup_vs_flat_nocache', '')):>8}"
              f"{peak:>9}{r['compile_s']:>10}")


def _optimizer_step_times(rows, results, n: int):
    """Adds, to the nocache and reuse rows, the time of an optimizer step of ``n``
    micro-batches (n x nocache; fill + (n - 1) x reuse) and its speedup over flat
    accumulation without caching."""
    def step_ms(accumulation, mode):
        if mode == "nocache":
            r = results.get(f"acc-{accumulation}-nocache")
            return None if r is None else n * r["ms_median"]
        fill, reuse = results.get(f"acc-{accumulation}-fill"), results.get(f"acc-{accumulation}-reuse")
        return None if fill is None or reuse is None else fill["ms_median"] + (n - 1) * reuse["ms_median"]

    baseline = step_ms("flat", "nocache")
    for row in rows:
        _, accumulation, mode = row["impl"].split("-")
        row["micro_batches"] = n
        ms = step_ms(accumulation, mode) if mode != "fill" else None
        if ms is not None:
            row["ms_optimizer_step"] = round(ms, 4)
            if baseline is not None:
                row["speedup_vs_flat_nocache"] = round(baseline / ms, 3)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
