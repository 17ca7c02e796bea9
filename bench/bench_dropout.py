"""bias_dropout_residual and bias_act_dropout (gelu) against their XLA references
(jnp + jax.random.bernoulli dropout, jitted, same dtype, rate 0.1): forward,
backward and both. Writes dropout.csv under --out."""
from __future__ import annotations


import jax
import jax.numpy as jnp

from bench.common import Rows, compare, copies_for, op_bench_main
from jax_ls2.ops import bias_act_dropout, bias_dropout_residual

SHAPES = [(16384, 768), (8192, 1024), (8192, 4096)]
RATE = 0.1


def xla_dropout(v, key, rate=RATE):
    keep = jax.random.bernoulli(key, 1.0 - rate, v.shape)
    return jnp.where(keep, v / (1.0 - rate), 0).astype(v.dtype)


def xla_bdr(x, b, r, key):
    return r + xla_dropout(x + b, key)


def xla_bad(x, b, key):
    return xla_dropout(jax.nn.gelu(x + b, approximate=False), key)


def ours_bdr(x, b, r, key):
    return bias_dropout_residual(x, b, r, rate=RATE, key=key)


def ours_bad(x, b, key):
    return bias_act_dropout(x, b, activation="gelu", rate=RATE, key=key)


def run(rows: Rows, dtypes, reps: int):
    for dtype in dtypes:
        for shape in SHAPES:
            n, h = shape
            act = n * h * jnp.dtype(dtype).itemsize
            k = copies_for(3 * act)
            sets = []
            for kk in jax.random.split(jax.random.key(0), k):
                k1, k2, k3, k4, k5 = jax.random.split(kk, 5)
                sets.append((jax.random.normal(k1, shape, dtype), (0.1 * jax.random.normal(k2, (h,))).astype(dtype),
                             jax.random.normal(k3, shape, dtype), k4, jax.random.normal(k5, shape, dtype)))
            # Bytes that must move. bias_dropout_residual: forward reads x, residual and
            # writes y; backward reads dy and writes dx (dresidual is dy itself).
            # bias_act_dropout: forward reads x, writes y; backward reads dy, x, writes dx.
            for name, ours, xla, nin, fwd_b, bwd_b in (
                    ("bias_dropout_residual", ours_bdr, xla_bdr, 3, 3 * act, 2 * act),
                    ("bias_act_dropout_gelu", ours_bad, xla_bad, 2, 2 * act, 3 * act)):
                def split(s, nin=nin):  # (arrays..., key), dy
                    arrays = s[:nin]
                    return arrays, s[3], s[4]

                fwd = lambda f, nin=nin: (lambda *s: f(*s[:nin], s[3]))
                compare(rows, name, shape, dtype, "fwd", fwd_b / 1e9, fwd(ours), fwd(xla), sets, reps)

                def pulls(f, nin=nin, sets=sets):
                    out = []
                    for s in sets:
                        arrays, key, dy = split(s)
                        out.append((jax.vjp(lambda *a: f(*a, key), *arrays)[1], dy))
                    return out

                # (dx, dbias) only: dresidual is dy itself, and returning it from a jitted
                # program would time a copy that a training step never makes.
                apply = lambda pull, dy: pull(dy)[:2]
                bo, bx = pulls(ours), pulls(xla)
                compare(rows, name, shape, dtype, "bwd", bwd_b / 1e9, apply, apply, bo, reps, xla_sets=bx)
                del bo, bx

                def both(f, nin=nin):
                    def g(*s):
                        arrays, key, dy = split(s)
                        y, pull = jax.vjp(lambda *a: f(*a, key), *arrays)
                        return y, pull(dy)[:2]
                    return g

                compare(rows, name, shape, dtype, "fwd+bwd", (fwd_b + bwd_b) / 1e9, both(ours), both(xla), sets,
                        reps)
            del sets


def main():
    op_bench_main("dropout.csv", run)


if __name__ == "__main__":
    main()
