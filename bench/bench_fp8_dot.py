"""One FP8 GEMM, forward and forward + backward: jax_ls2's `fp8_dot` against Flax's
`fp8_scaled_dot_general` (the math of `Fp8DirectDotGeneralOp`) and a bf16 `jnp.dot`.

With ``--hlo`` it also prints, per implementation, the GEMM custom calls of the compiled
program (their target and operand types) and the count of other fusions, which tells
whether the scaling and the casts landed inside the cuBLASLt calls.

    python -m bench.bench_fp8_dot --out DIR [--shapes 8192x4096x4096] [--hlo]
"""
from __future__ import annotations

import argparse
import os
import re

import jax
import jax.numpy as jnp

from bench.common import MATMUL_TFLOPS, Rows, time_fn
from jax_ls2 import fp8

SHAPES = ["8192x4096x4096", "8192x4096x16384", "8192x16384x4096"]  # M x K x N
IMPLS = ("bf16", "flax-fp8", "ls2-fp8")


def _flax_meta(history: int):
    one, zeros = jnp.ones((1,), jnp.float32), jnp.zeros((history,), jnp.float32)
    return dict(lhs_scale=one, rhs_scale=one, grad_scale=one, lhs_amax_history=zeros, rhs_amax_history=zeros,
                grad_amax_history=zeros)


def make(impl: str, history: int):
    """(fn(x, w, meta, dy) -> forward value or vjp, meta)."""
    recipe = fp8.DelayedScaling(amax_history_len=history)
    if impl == "bf16":
        return (lambda x, w, meta: jnp.dot(x, w)), None
    if impl == "flax-fp8":
        from flax.linen.fp8_ops import fp8_scaled_dot_general

        def f(x, w, meta):
            return fp8_scaled_dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=x.dtype,
                                          quantize_compute_type=x.dtype, **meta)
        return f, _flax_meta(history)
    return (lambda x, w, meta: fp8.fp8_dot(x, w, meta, recipe)), fp8.DotMeta.create(recipe)


def fwd_bwd(f):
    def g(x, w, meta, dy):
        y, vjp = jax.vjp(f, x, w, meta)
        return vjp(dy)
    return g


def gemm_summary(fn, *args) -> str:
    text = jax.jit(fn).lower(*args).compile().as_text()
    gemms = []
    for line in text.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if not target or not re.search("gemm|cublas|matmul", target.group(1), flags=re.I):
            continue
        out, operands = line.split(" custom-call(", 1)
        types = lambda s: " ".join(re.findall(r"(f8e\w+|bf16|f16|f32)\[", s))  # noqa: E731
        gemms.append(f"{target.group(1)}({types(operands.split('), custom_call_target')[0])}) -> {types(out)}")
    fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, flags=re.M))
    return f"{len(gemms)} GEMM calls [{'; '.join(gemms)}], {fusions} other fusions"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--history", type=int, default=1024)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--hlo", action="store_true")
    args = p.parse_args(argv)
    rows = Rows()
    for shape in args.shapes:
        m, k, n = (int(d) for d in shape.split("x"))
        kx, kw, kd = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
        base = {}
        for impl in args.impls:
            f, meta = make(impl, args.history)
            for pass_, fn, flops in (("fwd", lambda x, w, meta, dy, f=f: f(x, w, meta), 2.0 * m * k * n),
                                     ("fwd+bwd", fwd_bwd(f), 6.0 * m * k * n)):
                med, p20, p80 = time_fn(fn, [(x, w, meta, dy)], reps=args.reps)
                base.setdefault(pass_, med)
                tflops = flops / (med * 1e-3) / 1e12
                rows.add(op="fp8_dot", shape=shape, dtype="bfloat16", **{"pass": pass_}, impl=impl, ms_median=med,
                         ms_p20=p20, ms_p80=p80, speedup_vs_xla=round(base[pass_] / med, 3))
                print(f"{shape:<18}{impl:<10}{pass_:<9}{med:9.4f} ms {tflops:7.1f} TFLOP/s "
                      f"({100 * tflops / MATMUL_TFLOPS:5.1f}% of bf16 peak) x{base[pass_] / med:.3f} vs bf16")
                if args.hlo:
                    print("    " + gemm_summary(fn, x, w, meta, dy))
    os.makedirs(args.out, exist_ok=True)
    rows.write(os.path.join(args.out, "bench_fp8_dot.csv"))


if __name__ == "__main__":
    main()
