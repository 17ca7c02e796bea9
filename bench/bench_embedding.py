"""Token + learned position embedding with dropout 0.1, forward+backward, against the
same computation as Flax runs it (nnx.Embed with dtype=bfloat16 casts the fp32 table
and gathers; positions likewise; nnx.Dropout draws jax.random.bernoulli). GPT-2 small
shapes. Writes embedding.csv under --out.

Bytes that must move (forward+backward): the gathered fp32 rows of both tables, the
bf16 output, the bf16 cotangent, and the fp32 gradients of both tables written once.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from bench.common import Rows, compare

F32, BF16 = jnp.float32, jnp.bfloat16
RATE = 0.1


def flax_embed(table, pos, ids, key):
    s = ids.shape[-1]
    x = jnp.take(table.astype(BF16), ids, axis=0) + jnp.take(pos.astype(BF16), jnp.arange(s), axis=0)[None]
    keep = jax.random.bernoulli(key, 1.0 - RATE, x.shape)
    return jax.lax.select(keep, x / (1.0 - RATE), jnp.zeros_like(x))


def ours_embed(table, pos, ids, key, grad_mode="atomic"):
    from jax_ls2.ops import embedding
    return embedding(ids, table, pos_table=pos, rate=RATE, key=key, dtype=BF16, grad_mode=grad_mode)


def fwd_bwd(f):
    def run(table, pos, ids, key, ct):
        out, vjp = jax.vjp(lambda t, p: f(t, p, ids, key), table, pos)
        return out, vjp(ct)
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=60)
    a = p.parse_args()
    rows = Rows()
    b, s, v, h = 16, 1024, 50257, 768
    sets = []
    for kk in jax.random.split(jax.random.key(0), 4):
        k = jax.random.split(kk, 5)
        sets.append((0.02 * jax.random.normal(k[0], (v, h), F32), 0.02 * jax.random.normal(k[1], (s, h), F32),
                     jax.random.randint(k[2], (b, s), 0, v, jnp.int32), k[3],
                     jax.random.normal(k[4], (b, s, h), BF16)))
    n = b * s
    gb = (2 * n * h * 4 + n * h * 2 + n * h * 2 + (v + s) * h * 4) / 1e9
    fwd = lambda f: (lambda t, p, i, k, c: f(t, p, i, k))
    gbf = (2 * n * h * 4 + n * h * 2) / 1e9
    compare(rows, "embedding", (b, s, v, h), BF16, "fwd", gbf, fwd(ours_embed), fwd(flax_embed), sets, a.reps)
    compare(rows, "embedding", (b, s, v, h), BF16, "fwd+bwd", gb, fwd_bwd(ours_embed), fwd_bwd(flax_embed), sets,
            a.reps)
    sorted_embed = lambda t, p, i, k: ours_embed(t, p, i, k, grad_mode="sorted")
    r = compare(rows, "embedding", (b, s, v, h), BF16, "fwd+bwd", gb, fwd_bwd(sorted_embed), fwd_bwd(flax_embed),
                sets, a.reps)
    r["impl"] = "jax_ls2_sorted"
    rows.print_table()
    path = os.path.join(a.out, "embedding.csv")
    rows.write(path)
    print("wrote", path)


if __name__ == "__main__":
    main()
