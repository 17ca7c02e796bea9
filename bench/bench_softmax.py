"""Attention softmax + dropout (0.1) with a padding mask (batch, 1, 1, k_len) against
its XLA reference (jitted jax.nn.softmax + jax.random.bernoulli dropout, same dtype):
forward, backward and both. Writes softmax.csv under --out.

Bytes that must move (the op's design, see jax_ls2.ops.softmax_dropout): the forward
reads scores and writes the probabilities (+ the mask and 8 B/row of float32 stats);
the backward reads dy and scores (+ mask and stats) and writes d scores. The same
figure is used for the XLA rows, so GB/s compare like with like.
"""
from __future__ import annotations

import argparse
import math
import os

import jax
import jax.numpy as jnp

from bench.common import Rows, compare, copies_for, VARIANTS, parse_variants
from jax_ls2.ops import softmax_dropout

SHAPES = [(32, 12, 512, 512), (4, 32, 2048, 2048)]
RATE = 0.1


def xla_softmax_dropout(s, mask, key, *, scale, rate=RATE):
    x = jnp.where(mask, s * jnp.asarray(scale, s.dtype), jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(x, axis=-1)
    keep = jax.random.bernoulli(key, 1.0 - rate, s.shape)
    return jnp.where(keep, p / jnp.asarray(1.0 - rate, s.dtype), 0).astype(s.dtype)


def ours_softmax_dropout(s, mask, key, *, scale, rate=RATE):
    return softmax_dropout(s, scale=scale, mask=mask, rate=rate, key=key)


def run(rows: Rows, dtypes, reps: int, shapes=SHAPES):
    for dtype in dtypes:
        for shape in shapes:
            b, h, q, k = shape
            e = jnp.dtype(dtype).itemsize
            act = b * h * q * k * e
            nrows = b * h * q
            scale = 1.0 / math.sqrt(64)
            n_sets = copies_for(3 * act)
            sets = []
            for kk in jax.random.split(jax.random.key(0), n_sets):
                k1, k2, k3, k4 = jax.random.split(kk, 4)
                s = jax.random.normal(k1, shape, dtype)
                lens = jax.random.randint(k2, (b,), k // 2, k + 1)
                mask = (jnp.arange(k)[None, :] < lens[:, None])[:, None, None, :]
                dy = jax.random.normal(k3, shape, dtype)
                sets.append((s, mask, k4, dy))
            small = b * k + 8 * nrows  # mask bytes + float32 (max, 1/sum) per row
            fwd_gb = (2 * act + small) / 1e9
            bwd_gb = (3 * act + small) / 1e9
            ours = lambda s, m, key, dy: ours_softmax_dropout(s, m, key, scale=scale)
            xla = lambda s, m, key, dy: xla_softmax_dropout(s, m, key, scale=scale)
            compare(rows, "softmax_dropout", shape, dtype, "fwd", fwd_gb, ours, xla, sets, reps)

            # Backward alone: pullbacks (holding each forward's residuals) made beforehand.
            def pulls(f, sets=sets):
                return [(jax.vjp(lambda s: f(s, m, key, dy), s)[1], dy) for s, m, key, dy in sets]

            bwd_ours, bwd_xla = pulls(ours), pulls(xla)
            apply = lambda pull, dy: pull(dy)
            compare(rows, "softmax_dropout", shape, dtype, "bwd", bwd_gb, apply, apply, bwd_ours, reps,
                    xla_sets=bwd_xla)
            del bwd_ours, bwd_xla

            def vjp_of(f):
                def both(s, m, key, dy):
                    y, pull = jax.vjp(lambda s: f(s, m, key, dy), s)
                    return y, pull(dy)
                return both

            compare(rows, "softmax_dropout", shape, dtype, "fwd+bwd", fwd_gb + bwd_gb, vjp_of(ours), vjp_of(xla),
                    sets, reps)
            del sets


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--shapes", default="", help="e.g. '32x12x512x512,4x32x2048x2048' (default: both)")
    p.add_argument("--variants", default="", help='kernel options timed beside the default, e.g. "softmax_elems=16"')
    a = p.parse_args()
    VARIANTS.extend(parse_variants(a.variants))
    shapes = SHAPES if not a.shapes else [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows = Rows()
    run(rows, [jnp.dtype(d) for d in a.dtypes.split(",")], max(a.reps, 50), shapes)
    rows.write(os.path.join(a.out, "softmax.csv"))
    rows.print_table()


if __name__ == "__main__":
    main()
