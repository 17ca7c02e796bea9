"""The LLaMA-family ops (rms_norm, rotary, gated_act_dropout) against their XLA
references at hidden 4096: forward, backward and both. Writes llama_ops.csv under --out.

    python -m bench.bench_llama_ops --out bench/results/latest          # GPU
    python -m bench.bench_llama_ops --out /tmp/b --smoke --reps 3       # tiny shapes, any backend

Besides --smoke, the options of every op benchmark (`bench.common.op_bench_main`).
"""
from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from bench.common import Rows, compare, copies_for, op_bench_main
from jax_ls2.ops import gated_act_dropout, rms_norm, rotary, rotary_frequencies

NORM_SHAPES = [(8192, 4096), (16384, 4096)]
# (batch, seq, heads, kv_heads, head_dim): LLaMA-3 8B's attention at hidden 4096, and
# the same with as many kv heads as heads (LLaMA-2 7B).
ROTARY_SHAPES = [(4, 2048, 32, 8, 128), (2, 4096, 32, 32, 128)]
# (tokens, ffn): LLaMA-3 8B's and LLaMA-2 7B's MLPs at hidden 4096; gated_act_dropout with
# SwiGLU, rows "swiglu" without dropout and "swiglu_dropout" at rate 0.1.
GATED_SHAPES = [(8192, 14336), (8192, 11008)]
# --smoke: one small shape of each kind (norm, rotary, gated), grouped-query rotary, and
# one input copy a timed program (the full run sizes its copies with `copies_for`).
SMOKE = dict(shapes=([(64, 128)], [(2, 16, 4, 2, 32)], [(64, 96)]), copies=1)
KEY = jax.random.key(0)


# ---------------------------------------------------------------- XLA references
def xla_rms_norm(x, g, eps=1e-6):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * g.astype(jnp.float32)).astype(x.dtype)


def xla_rotary(q, k, pos, inv_freq):
    ang = pos.astype(jnp.float32)[..., None, None] * inv_freq
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def rot(x):
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, -1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
    return rot(q), rot(k)


def xla_gated(x, rate):
    gate, up = jnp.split(x.astype(jnp.float32), 2, -1)
    y = jax.nn.silu(gate) * up
    if rate:
        y = jnp.where(jax.random.bernoulli(KEY, 1 - rate, y.shape), y / (1 - rate), 0)
    return y.astype(x.dtype)


def _timed_passes(rows, op, shape, dtype, reps, sets, ours, xla, fwd_gb, bwd_gb, n_diff):
    """Forward, backward alone (pullbacks made beforehand, so only the backward runs in
    the timed program) and both, of `ours` and `xla` over the first n_diff arguments of
    each set; each set's last entry is the cotangent."""
    compare(rows, op, shape, dtype, "fwd", fwd_gb, lambda *a: ours(*a[:-1]), lambda *a: xla(*a[:-1]), sets, reps)

    def pulls(f):
        # One compiled forward a shape; its pullbacks (pytrees of residuals) are the inputs.
        make = jax.jit(lambda d, rest: jax.vjp(lambda *x: f(*x, *rest), *d)[1])
        return [(make(s[:n_diff], s[n_diff:-1]), s[-1]) for s in sets]

    apply = lambda pull, ct: pull(ct)
    compare(rows, op, shape, dtype, "bwd", bwd_gb, apply, apply, pulls(ours), reps, xla_sets=pulls(xla))

    # In training the cotangent comes from the layers after the op, so it exists only once
    # the forward output does: the barrier keeps that order, where XLA would otherwise fuse
    # the backward into the forward's pass over x. y is returned too, since an unused
    # forward output may be removed.
    def both(f):
        def run(*a):
            y, pull = jax.vjp(lambda *d: f(*d, *a[n_diff:-1]), *a[:n_diff])
            y, ct = jax.lax.optimization_barrier((y, a[-1]))
            return y, pull(ct)
        return run

    compare(rows, op, shape, dtype, "fwd+bwd", fwd_gb + bwd_gb, both(ours), both(xla), sets, reps)


def run(rows: Rows, dtypes, reps: int, shapes=(NORM_SHAPES, ROTARY_SHAPES, GATED_SHAPES), copies=None):
    norm_shapes, rotary_shapes, gated_shapes = shapes
    for dtype in dtypes:
        e = jnp.dtype(dtype).itemsize
        for shape in norm_shapes:
            n, h = shape
            act = n * h * e
            sets = []
            for kk in jax.random.split(KEY, copies or copies_for(3 * act)):
                k1, k2, k3 = jax.random.split(kk, 3)
                sets.append((jax.random.normal(k1, shape, dtype), (1 + 0.1 * jax.random.normal(k2, (h,))).astype(dtype),
                             jax.random.normal(k3, shape, dtype)))
            # Forward reads x, writes y and 4 B/row of rstd; backward reads dy, x and rstd,
            # writes dx.
            _timed_passes(rows, "rms_norm", shape, dtype, reps, sets, lambda x, g: rms_norm(x, g), xla_rms_norm,
                          (2 * act + 4 * n) / 1e9, (3 * act + 4 * n) / 1e9, 2)
            # Residual-fused forward: reads x and r, writes y and the sum.
            compare(rows, "add_rms_norm", shape, dtype, "fwd", (4 * act + 4 * n) / 1e9,
                    lambda x, g, r: rms_norm(x, g, residual=r), lambda x, g, r: (xla_rms_norm(x + r, g), x + r),
                    sets, reps)
        for shape in rotary_shapes:
            b, s, h, kvh, d = shape
            inv = jnp.asarray(rotary_frequencies(d, theta=500000.0))
            qk = b * s * (h + kvh) * d * e
            sets = []
            for kk in jax.random.split(KEY, copies or copies_for(4 * qk)):
                k1, k2, k3, k4 = jax.random.split(kk, 4)
                q, k = jax.random.normal(k1, (b, s, h, d), dtype), jax.random.normal(k2, (b, s, kvh, d), dtype)
                pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
                sets.append((q, k, pos, (jax.random.normal(k3, q.shape, dtype), jax.random.normal(k4, k.shape, dtype))))
            # Each pass reads q and k (or their cotangents) and the positions, writes them.
            gb = (2 * qk + 4 * b * s) / 1e9
            _timed_passes(rows, "rotary", shape, dtype, reps, sets,
                          lambda q, k, pos: rotary(q, k, pos, theta=500000.0),
                          lambda q, k, pos: xla_rotary(q, k, pos, inv), gb, gb, 2)
        for rate in (0.0, 0.1):
            for shape in gated_shapes:
                n, f = shape
                out = n * f * e
                sets = []
                for kk in jax.random.split(KEY, copies or copies_for(8 * out)):
                    k1, k2 = jax.random.split(kk)
                    sets.append((jax.random.normal(k1, (n, 2 * f), dtype), jax.random.normal(k2, (n, f), dtype)))
                # Forward reads x (2 ffn a row), writes y (ffn); backward reads x and dy,
                # writes dx (2 ffn).
                _timed_passes(rows, "swiglu_dropout" if rate else "swiglu", shape, dtype, reps, sets,
                              lambda x: gated_act_dropout(x, activation="swiglu", rate=rate, key=KEY),
                              lambda x: xla_gated(x, rate), 3 * out / 1e9, 5 * out / 1e9, 1)


def main():
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--smoke", action="store_true")
    args, rest = p.parse_known_args()
    sys.argv[1:] = rest  # the other options are op_bench_main's
    op_bench_main("llama_ops.csv", functools.partial(run, **SMOKE) if args.smoke else run,
                  default_dtypes="bfloat16")


if __name__ == "__main__":
    main()
