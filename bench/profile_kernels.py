"""Runs the fused ops that are short of the bandwidth bar once each (bf16, after a
warm-up), and their XLA references, so that Nsight Compute can read their counters:

  ncu --clock-control none --kernel-name regex:'jax_ls2' --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats python3 -m bench.profile_kernels

`--only NAME,...` picks cases (names below); `--xla` adds the XLA references;
`--option NAME=VALUE` (repeatable) sets a launch option (bench/PERF_NOTES.md) first.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.bench_cross_entropy import optax_ce, ours_ce
from bench.bench_dropout import ours_bad, ours_bdr, xla_bad, xla_bdr
from bench.bench_layer_norm import xla_layer_norm
from bench.bench_softmax import ours_softmax_dropout, xla_softmax_dropout
import jax_ls2.ops as ops

BF16 = jnp.bfloat16


def _normal(key, shape, dtype=BF16):
    return jax.random.normal(key, shape, dtype)


def cases(with_xla: bool):
    """name -> (jitted fn, args)."""
    k = jax.random.split(jax.random.key(0), 8)
    out = {}
    # bias+dropout+residual and bias+GELU+dropout
    for n, h in ((16384, 768), (8192, 1024), (8192, 4096)):
        x, r, dy = _normal(k[2], (n, h)), _normal(k[3], (n, h)), _normal(k[4], (n, h))
        b = _normal(k[5], (h,))
        for name, ours, xla in (("bdr", ours_bdr, xla_bdr),):
            for tag, f in (("", ours),) + ((("_xla", xla),) if with_xla else ()):
                out[f"{name}_bwd_{n}x{h}{tag}"] = (
                    jax.jit(lambda x, b, r, dy, f=f: jax.vjp(lambda x, b, r: f(x, b, r, k[6]), x, b, r)[1](dy)),
                    (x, b, r, dy))
        for tag, f in (("", ours_bad),) + ((("_xla", xla_bad),) if with_xla else ()):
            out[f"gelu_fwd_{n}x{h}{tag}"] = (jax.jit(lambda x, b, f=f: f(x, b, k[6])), (x, b))
            out[f"gelu_bwd_{n}x{h}{tag}"] = (
                jax.jit(lambda x, b, dy, f=f: jax.vjp(lambda x, b: f(x, b, k[6]), x, b)[1](dy)), (x, b, dy))
        # GELU without dropout (BERT's FFN): the activation's arithmetic alone
        plain_gelu = lambda x, b: ops.bias_act_dropout(x, b, activation="gelu", rate=0.0, deterministic=True)
        out[f"gelu_nodrop_fwd_{n}x{h}"] = (jax.jit(plain_gelu), (x, b))
        out[f"gelu_nodrop_bwd_{n}x{h}"] = (
            jax.jit(lambda x, b, dy: jax.vjp(plain_gelu, x, b)[1](dy)), (x, b, dy))
        g = jnp.ones((h,), BF16)
        for tag, f in (("", ops.layer_norm),) + ((("_xla", xla_layer_norm),) if with_xla else ()):
            out[f"ln_bwd_{n}x{h}{tag}"] = (
                jax.jit(lambda x, g, dy, f=f: jax.vjp(lambda x, g: f(x, g, g), x, g)[1](dy)), (x, g, dy))
    # attention softmax + mask + dropout, 32 x 12 x 512 x 512, 4 x 32 x 2048 x 2048 and
    # BERT's 256 x 12 x 128 x 128
    for b, nh, t, sfx in ((32, 12, 512, ""), (4, 32, 2048, "_2048"), (256, 12, 128, "_128")):
        s, dy = _normal(k[0], (b, nh, t, t)), _normal(k[1], (b, nh, t, t))
        mask = jnp.ones((b, 1, 1, t), bool)
        for tag, f in (("", ours_softmax_dropout),) + ((("_xla", xla_softmax_dropout),) if with_xla else ()):
            out[f"softmax_fwd{sfx}{tag}"] = (jax.jit(lambda s, m, f=f: f(s, m, k[7], scale=0.125)), (s, mask))
            out[f"softmax_bwd{sfx}{tag}"] = (
                jax.jit(lambda s, m, dy, f=f: jax.vjp(lambda s: f(s, m, k[7], scale=0.125), s)[1](dy)),
                (s, mask, dy))
    # cross entropy 16384 x 50257, loss + gradient: last, its 3.3 GB of logits and
    # gradient make each kernel replay's memory save and restore slow
    x, y = _normal(k[0], (16384, 50257)), jax.random.randint(k[1], (16384,), 0, 50257)
    out["ce"] = (jax.jit(jax.value_and_grad(ours_ce)), (x, y))
    if with_xla:
        out["ce_xla"] = (jax.jit(jax.value_and_grad(optax_ce)), (x, y))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--xla", action="store_true", help="also run the XLA references")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a launch option to set before running (jax_ls2._C.set_kernel_option)")
    args = ap.parse_args()
    if args.option:
        from jax_ls2 import _C
        for opt in args.option:
            name, value = opt.split("=")
            _C.set_kernel_option(name, int(value))
    only = [s for s in args.only.split(",") if s]
    for name, (fn, a) in cases(args.xla).items():
        if only and not any(name.startswith(o) for o in only):
            continue
        jax.block_until_ready(fn(*a))  # one call: ncu profiles each kernel launch it makes
        print("ran", name, flush=True)


if __name__ == "__main__":
    main()
