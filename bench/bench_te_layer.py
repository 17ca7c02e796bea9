"""Transformer Engine's seed layer, forward + backward, in bf16 and FP8.

The layer of Transformer Engine's performance guide: pre-LN, hidden 4096, FFN 16384,
32 heads, sequence 2048, batch 4, GELU, no dropout, bf16 activations and weights. Each
implementation runs in its own process (clean compile cache and memory peak):

  flax-bf16   plain Flax Linen, cuDNN attention (`jax.nn.dot_product_attention`)
  flax-fp8    the same layer with Flax's own FP8 on every Dense
              (`flax.linen.Fp8DirectDotGeneralOp`: delayed scaling, history 1024)
  ls2-bf16    `jax_ls2.nn.TransformerLayer`, cuDNN attention
  ls2-fp8     the same with ``fp8=jax_ls2.fp8.DelayedScaling()`` (history 1024)

One timed application is the vjp of the layer with respect to its parameters, its FP8
state and its input, for a random output cotangent, plus (jax_ls2 FP8) the meta update
that rolls the amax histories; Flax's FP8 computes its new scales inside the same pass.
Attention stays bf16 in every variant.

With ``--accumulate N`` it times instead one micro-step of gradient accumulation of the
jax_ls2 FP8 layer (bf16 weights), one jitted call per micro-batch as under
``optax.MultiSteps``: the gradients of ``sum(layer(x) * dy)`` with respect to the
parameters and metas added into float32 sums, with

  flat    the gradients in the weights' dtype, added by ``optim.accumulate`` (one kernel
          over a flat float32 buffer: a second pass over every accumulator)
  fused   ``fp8.accumulate_grads`` (``fuse_wgrad_accumulation``: each FP8 weight-gradient
          GEMM writes float32 and adds into its accumulator in its own epilogue)

each without weight caching (``nocache``: every micro-step casts every weight), and with
``fp8.cache_weights``: the first micro-batch's step (``fill``) and a later one's
(``reuse``, no weight cast). ``ms_optimizer_step`` is N micro-steps: N x nocache, or
fill + (N - 1) x reuse.

    python -m bench.bench_te_layer --out DIR [--impls ls2-bf16 ls2-fp8] [--smoke]
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

from bench.common import MATMUL_TFLOPS, backend, git_commit, gpu_name, time_fn

IMPLS = ("flax-bf16", "flax-fp8", "ls2-bf16", "ls2-fp8")
ACCUMULATIONS = ("flat", "fused")
CACHE_MODES = {"nocache": None, "fill": True, "reuse": False}  # -> fp8.cache_weights' is_first_microbatch
ACC_IMPLS = tuple(f"acc-{a}-{c}" for a in ACCUMULATIONS for c in CACHE_MODES)
SEED = dict(batch=4, seq=2048, hidden=4096, ffn=16384, heads=32)
SMOKE = dict(batch=2, seq=64, hidden=128, ffn=512, heads=4)
AMAX_HISTORY = 1024
FIELDS = ["op", "shape", "dtype", "pass", "impl", "backend", "ms_median", "ms_p20", "ms_p80", "tflops",
          "pct_matmul_peak", "speedup_vs_ls2_bf16", "speedup_vs_flax_fp8", "micro_batches", "ms_optimizer_step",
          "speedup_vs_flat_nocache", "peak_mem_bytes", "compile_s",
          "gpu", "jax_version", "commit", "date"]


def layer_flops(batch, seq, hidden, ffn, heads) -> float:
    """Analytic FLOPs of one forward + backward (3x the forward's GEMM FLOPs)."""
    del heads
    tokens = batch * seq
    gemms = 2 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
    attention = 4 * tokens * seq * hidden
    return 3.0 * (gemms + attention)


def attention(q, k, v):
    """(batch, seq, heads, head_dim) bf16 -> same; cuDNN on the GPU, XLA elsewhere."""
    implementation = "cudnn" if jax.default_backend() == "gpu" else None
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)


def flax_layer(shape, fp8: bool):
    """(apply(variables, x), variables): the plain Linen layer, FP8 Dense layers if asked."""
    from flax import linen as nn

    hidden, ffn, heads = shape["hidden"], shape["ffn"], shape["heads"]
    extra = {"dot_general_cls": nn.Fp8DirectDotGeneralOp} if fp8 else {}

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            def dense(features, name):
                return nn.Dense(features, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, name=name, **extra)

            b, t, _ = x.shape
            h = nn.LayerNorm(epsilon=1e-5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)
            q, k, v = jnp.split(dense(3 * hidden, "qkv")(h).reshape(b, t, 3 * heads, hidden // heads), 3, axis=2)
            x = x + dense(hidden, "out")(attention(q, k, v).reshape(b, t, hidden))
            h = nn.LayerNorm(epsilon=1e-5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)
            h = jax.nn.gelu(dense(ffn, "fc1")(h), approximate=False)
            return x + dense(hidden, "fc2")(h)

    layer = Layer()
    x = jnp.zeros((shape["batch"], shape["seq"], hidden), jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x)
    return layer.apply, variables


def flax_step(shape, fp8: bool):
    apply, variables = flax_layer(shape, fp8)

    def step(variables, x, dy):
        y, vjp = jax.vjp(lambda v, x: apply(v, x), variables, x)
        return vjp(dy)

    return step, variables


def ls2_step(shape, fp8: bool):
    from flax import nnx

    from jax_ls2 import fp8 as ls2_fp8
    from jax_ls2.nn import TransformerLayer

    recipe = ls2_fp8.DelayedScaling(amax_history_len=AMAX_HISTORY) if fp8 else None
    layer = TransformerLayer(shape["hidden"], shape["ffn"], shape["heads"], hidden_dropout=0.0, attn_dropout=0.0,
                             activation="gelu", attention_backend="cudnn" if jax.default_backend() == "gpu" else "xla",
                             dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                             **({"fp8": recipe} if fp8 else {}))
    if not fp8:
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def step(params, x, dy):
            y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p, rest)(x, deterministic=True), params, x)
            return vjp(dy)

        return step, params

    graphdef, params, metas, rest = nnx.split(layer, nnx.Param, ls2_fp8.FP8Meta, ...)

    def fp8_step(state, x, dy):
        params, metas = state
        y, vjp = jax.vjp(lambda p, m, x: nnx.merge(graphdef, p, m, rest)(x, deterministic=True), params, metas, x)
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
    from jax_ls2 import optim
    from jax_ls2.nn import TransformerLayer

    recipe = ls2_fp8.DelayedScaling(amax_history_len=AMAX_HISTORY)
    layer = TransformerLayer(shape["hidden"], shape["ffn"], shape["heads"], hidden_dropout=0.0, attn_dropout=0.0,
                             activation="gelu", attention_backend="cudnn" if jax.default_backend() == "gpu" else "xla",
                             dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8=recipe)
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
        return optim.accumulate(acc, grads), new_caches if cache else None

    return flat_step, (optim.init_accumulator(variables), variables, caches)


def run_one(impl: str, shape: dict, reps: int) -> dict:
    """Times one implementation in this process; returns its figures."""
    import time

    if impl.startswith("acc-"):
        _, accumulation, mode = impl.split("-")
        step, state = ls2_accumulate_step(shape, accumulation, CACHE_MODES[mode])
    else:
        kind, precision = impl.split("-")
        builder = flax_step if kind == "flax" else ls2_step
        step, state = builder(shape, precision == "fp8")
    kx, kd = jax.random.split(jax.random.key(1))
    dims = (shape["batch"], shape["seq"], shape["hidden"])
    x = jax.random.normal(kx, dims, jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, dims, jnp.float32).astype(jnp.bfloat16)
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(step).lower(state, x, dy).compile()(state, x, dy))
    compile_s = time.perf_counter() - t0
    med, p20, p80 = time_fn(step, [(state, x, dy)], reps=reps, warmup=3, pipeline=4)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(ms_median=med, ms_p20=p20, ms_p80=p80, compile_s=compile_s,
                peak_mem_bytes=stats.get("peak_bytes_in_use", ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the CSV")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="a tiny layer (checks the script, any backend)")
    p.add_argument("--accumulate", type=int, default=0, metavar="N",
                   help="time FP8 accumulation micro-steps (flat vs fused, weight caching) for N micro-batches")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = SMOKE if args.smoke else SEED
    if args.one:
        print(json.dumps(run_one(args.one, shape, args.reps)))
        return
    flops = layer_flops(**shape)
    impls = ACC_IMPLS if args.accumulate else args.impls
    results = {}
    for impl in impls:
        cmd = [sys.executable, "-m", "bench.bench_te_layer", "--out", args.out, "--one", impl,
               "--reps", str(args.reps)] + (["--smoke"] if args.smoke else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{impl}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    meta = dict(backend=backend(), gpu=gpu_name(), jax_version=jax.__version__, commit=git_commit(),
                date=datetime.date.today().isoformat())
    shape_text = "x".join(str(shape[k]) for k in ("batch", "seq", "hidden", "ffn", "heads"))
    rows = []
    op = "te_layer_accumulate" if args.accumulate else "te_layer"
    for impl, r in results.items():
        row = dict(meta, op=op, shape=shape_text, dtype="bfloat16", **{"pass": "fwd+bwd"}, impl=impl, **r)
        row["tflops"] = round(flops / (r["ms_median"] * 1e-3) / 1e12, 1)
        row["pct_matmul_peak"] = round(100 * row["tflops"] / MATMUL_TFLOPS, 1)
        for ref, col in (("ls2-bf16", "speedup_vs_ls2_bf16"), ("flax-fp8", "speedup_vs_flax_fp8")):
            if ref in results:
                row[col] = round(results[ref]["ms_median"] / r["ms_median"], 3)
        for k in ("ms_median", "ms_p20", "ms_p80", "compile_s"):
            row[k] = round(row[k], 4)
        rows.append(row)
    if args.accumulate:
        _optimizer_step_times(rows, results, args.accumulate)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_te_layer.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"{'impl':<19}{'ms':>9}{'p20':>9}{'p80':>9}{'TFLOP/s':>9}{'x ls2 bf16':>11}{'x flax fp8':>11}"
          f"{'step ms':>9}{'x flat':>8}{'peak GB':>9}{'compile s':>10}")
    for r in rows:
        peak = f"{r['peak_mem_bytes'] / 1e9:.2f}" if r["peak_mem_bytes"] != "" else ""
        print(f"{r['impl']:<19}{r['ms_median']:>9}{r['ms_p20']:>9}{r['ms_p80']:>9}{r['tflops']:>9}"
              f"{str(r.get('speedup_vs_ls2_bf16', '')):>11}{str(r.get('speedup_vs_flax_fp8', '')):>11}"
              f"{str(r.get('ms_optimizer_step', '')):>9}{str(r.get('speedup_vs_flat_nocache', '')):>8}"
              f"{peak:>9}{r['compile_s']:>10}")
    print(f"wrote {path}")
    if len(results) < len(impls):
        sys.exit(1)
    return rows


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
