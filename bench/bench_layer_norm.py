"""LayerNorm (plain and residual-fused) against its XLA reference: forward,
backward and both, at Transformer shapes. Writes layer_norm.csv under --out."""
from __future__ import annotations


import jax
import jax.numpy as jnp

from bench.common import Rows, compare, copies_for, op_bench_main
from jax_ls2.ops import layer_norm

SHAPES = [(16384, 768), (8192, 1024), (8192, 4096)]


def xla_layer_norm(x, g, b, eps=1e-5):
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mu).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * g.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def xla_add_layer_norm(x, r, g, b):
    s = x + r
    return xla_layer_norm(s, g, b), s


def run(rows: Rows, dtypes, reps: int):
    for dtype in dtypes:
        for shape in SHAPES:
            n, h = shape
            e = jnp.dtype(dtype).itemsize
            act = n * h * e
            k = copies_for(3 * act)
            keys = jax.random.split(jax.random.key(0), k)
            sets = []
            for kk in keys:
                k1, k2, k3 = jax.random.split(kk, 3)
                x = jax.random.normal(k1, shape, dtype)
                r = jax.random.normal(k2, shape, dtype)
                g = (1 + 0.1 * jax.random.normal(k3, (h,))).astype(dtype)
                sets.append((x, r, g, jnp.zeros((h,), dtype), x))
            # Bytes that must move: forward reads x, writes y (+ 8 B/row of stats);
            # backward reads dy, x and the stats, writes dx.
            fwd_gb = (2 * act + 8 * n) / 1e9
            bwd_gb = (3 * act + 8 * n) / 1e9
            ours_f = lambda x, r, g, b, dy: layer_norm(x, g, b)
            xla_f = lambda x, r, g, b, dy: xla_layer_norm(x, g, b)
            compare(rows, "layer_norm", shape, dtype, "fwd", fwd_gb, ours_f, xla_f, sets, reps)

            def vjp_of(f):
                def run_both(x, r, g, b, dy):
                    # y is returned too: an unused forward output may be removed by XLA.
                    y, pull = jax.vjp(lambda x, g, b: f(x, g, b), x, g, b)
                    return y, pull(dy)
                return run_both

            # Backward alone: the pullbacks (holding the forward's residuals) are made
            # beforehand and passed in, so only the backward runs in the timed program.
            pulls = lambda f: [(jax.vjp(f, x, g, b)[1], dy) for x, r, g, b, dy in sets]
            bwd_ours, bwd_xla = pulls(layer_norm), pulls(xla_layer_norm)
            apply = lambda pull, dy: pull(dy)
            compare(rows, "layer_norm", shape, dtype, "bwd", bwd_gb, apply, apply, bwd_ours, reps,
                    xla_sets=bwd_xla)
            del bwd_ours, bwd_xla
            compare(rows, "layer_norm", shape, dtype, "fwd+bwd", fwd_gb + bwd_gb,
                    vjp_of(layer_norm), vjp_of(xla_layer_norm), sets, reps)
            # Pre-LN form (layer_norm(..., return_input=True)): the backward also adds the
            # residual branch's gradient: reads dy, x, dres and the stats, writes dx.
            ours_ri = lambda x, g, b: layer_norm(x, g, b, return_input=True)
            xla_ri = lambda x, g, b: (xla_layer_norm(x, g, b), x)
            pulls2 = lambda f: [(jax.vjp(f, x, g, b)[1], (dy, r)) for x, r, g, b, dy in sets]
            bwd_ours, bwd_xla = pulls2(ours_ri), pulls2(xla_ri)
            compare(rows, "layer_norm_return_input", shape, dtype, "bwd", (4 * act + 8 * n) / 1e9, apply, apply,
                    bwd_ours, reps, xla_sets=bwd_xla)
            del bwd_ours, bwd_xla
            # Residual-fused forward: reads x and r, writes y and s.
            compare(rows, "add_layer_norm", shape, dtype, "fwd", (4 * act + 8 * n) / 1e9,
                    lambda x, r, g, b, dy: layer_norm(x, g, b, residual=r),
                    lambda x, r, g, b, dy: xla_add_layer_norm(x, r, g, b), sets, reps)


def main():
    op_bench_main("layer_norm.csv", run)


if __name__ == "__main__":
    main()
