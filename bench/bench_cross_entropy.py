"""Cross entropy (fused log-softmax + NLL) against optax on fp32-cast logits, and the
fused output projection + loss (linear_cross_entropy) against the unfused Flax head,
with peak device memory. Writes cross_entropy.csv under --out.

Bytes that must move: forward reads the logits once; forward+backward reads them once
and writes the gradient once (the kernel forms the gradient in the forward pass).
Peak memory: the compiled program's arguments + outputs + temporaries
(``memory_analysis``) for one application.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import optax

from bench.common import VARIANTS, Rows, compare, parse_variants, time_fn
from jax_ls2.ops import cross_entropy, linear_cross_entropy

F32 = jnp.float32


def peak_bytes(fn, *args) -> int:
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def optax_ce(x, y):  # as people write it: cast to fp32, then optax
    return optax.softmax_cross_entropy_with_integer_labels(x.astype(F32), y).mean()


def ours_ce(x, y):
    return cross_entropy(x, y, reduction="mean")[0]


def ours_ce_tokens(x, y):  # per-token output: forward keeps logits, backward re-reads them
    return jnp.mean(cross_entropy(x, y)[0])


def run_ce(rows: Rows, shapes, dtype, reps):
    for n, v in shapes:
        e = jnp.dtype(dtype).itemsize
        sets = []
        for kk in jax.random.split(jax.random.key(0), 4):
            k1, k2 = jax.random.split(kk)
            sets.append((jax.random.normal(k1, (n, v), dtype), jax.random.randint(k2, (n,), 0, v, jnp.int32)))
        gb = n * v * e / 1e9
        compare(rows, "cross_entropy", (n, v), dtype, "fwd", gb, ours_ce, optax_ce, sets, reps)
        vg = lambda f: (lambda x, y: jax.value_and_grad(f)(x, y))
        first = len(rows.rows)  # the optax row; ours (and any --variants) follow it
        r = compare(rows, "cross_entropy", (n, v), dtype, "fwd+bwd", 2 * gb, vg(ours_ce), vg(optax_ce), sets, reps)
        xla_row = rows.rows[first]
        r["peak_mem_bytes"] = peak_bytes(vg(ours_ce), *sets[0])
        xla_row["peak_mem_bytes"] = peak_bytes(vg(optax_ce), *sets[0])
        mt = time_fn(vg(ours_ce_tokens), sets, reps)
        xla_ms = xla_row["ms_median"]
        rows.add(op="cross_entropy", shape=f"{n}x{v}", dtype=jnp.dtype(dtype).name, **{"pass": "fwd+bwd"},
                 impl="jax_ls2_per_token", ms_median=mt[0], ms_p20=mt[1], ms_p80=mt[2], gbytes=2 * gb,
                 speedup_vs_xla=round(xla_ms / mt[0], 3))


def unfused_head(h, w, y):  # Flax: logits = h @ W.T (Dense / Embed.attend), optax on fp32 logits
    return optax_ce(h @ w.T, y)


def fused_head(h, w, y):
    return linear_cross_entropy(h, w, y)[0]


def run_lce(rows: Rows, n, hid, v, dtype, reps):
    sets = []
    for kk in jax.random.split(jax.random.key(1), 4):
        k1, k2, k3 = jax.random.split(kk, 3)
        sets.append((jax.random.normal(k1, (n, hid), dtype), (0.02 * jax.random.normal(k2, (v, hid), F32)).astype(dtype),
                     jax.random.randint(k3, (n,), 0, v, jnp.int32)))
    vg = lambda f: (lambda h, w, y: jax.value_and_grad(f, (0, 1))(h, w, y))
    first = len(rows.rows)
    r = compare(rows, "linear_cross_entropy", (n, hid, v), dtype, "fwd+bwd", "", vg(fused_head), vg(unfused_head),
                sets, reps)
    xla_row = rows.rows[first]
    r["peak_mem_bytes"] = peak_bytes(vg(fused_head), *sets[0])
    xla_row["peak_mem_bytes"] = peak_bytes(vg(unfused_head), *sets[0])
    print(f"linear_cross_entropy peak memory: fused {r['peak_mem_bytes'] / 1e9:.3f} GB, "
          f"unfused {xla_row['peak_mem_bytes'] / 1e9:.3f} GB "
          f"({100 * r['peak_mem_bytes'] / xla_row['peak_mem_bytes']:.1f}%)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--variants", default="", help='kernel options timed beside the default, e.g. "cross_entropy_threads=1024"')
    p.add_argument("--no-lce", action="store_true", help="skip linear_cross_entropy")
    a = p.parse_args()
    VARIANTS.extend(parse_variants(a.variants))
    rows = Rows()
    for dt in a.dtypes.split(","):
        dtype = jnp.dtype(dt)
        run_ce(rows, [(16384, 50257), (8192, 128256)], dtype, a.reps)
        if not a.no_lce:
            run_lce(rows, 16384, 768, 50257, dtype, a.reps)
    rows.print_table()
    path = os.path.join(a.out, "cross_entropy.csv")
    rows.write(path)
    print("wrote", path)


if __name__ == "__main__":
    main()
