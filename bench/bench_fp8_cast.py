"""The fused FP8 casts against XLA's unfused jnp of the same math (the ops' own
pure-JAX references, jit-compiled: compute, quantize, amax, transpose), at
Transformer shapes. Writes fp8_cast.csv under --out."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from bench.common import Rows, compare, copies_for, op_bench_main
from jax_ls2.fp8 import E4M3, E5M2
from jax_ls2.ops import bias_gelu_fp8, cast_transpose, dgelu_cast_transpose_dbias, layer_norm_fp8

fp8_ops = importlib.import_module("jax_ls2.ops.fp8_cast")

# (tokens, hidden): BERT-base, the Transformer Engine layer's hidden and its FFN width.
SHAPES = [(16384, 768), (8192, 4096), (8192, 16384)]
ACTIVATION = "gelu_tanh"


def run(rows: Rows, dtypes, reps: int):
    for dtype in dtypes:
        for shape in SHAPES:
            n, h = shape
            e = jnp.dtype(dtype).itemsize
            act = n * h * e  # one activation in dtype
            fp8 = n * h      # one FP8 copy
            k = copies_for(2 * act + 2 * fp8)
            sets = []
            for kk in jax.random.split(jax.random.key(0), k):
                k1, k2, k3 = jax.random.split(kk, 3)
                x = jax.random.normal(k1, shape, dtype)
                g = jax.random.normal(k2, shape, dtype)
                w = (1 + 0.1 * jax.random.normal(k3, (h,))).astype(dtype)
                sets.append((x, g, w, jnp.zeros((h,), dtype), jnp.float32(100.0)))

            # Bytes that must move. LayerNorm: reads x, writes q and 8 B/row of stats.
            compare(rows, "layer_norm_fp8", shape, dtype, "fwd", (act + fp8 + 8 * n) / 1e9,
                    lambda x, g, w, b, s: layer_norm_fp8(x, w, b, s),
                    lambda x, g, w, b, s: fp8_ops._ln_fp8_ref(x, w, b, s, eps=1e-5, fp8_dtype=E4M3), sets, reps)
            # bias + GELU: reads x, writes q.
            compare(rows, "bias_gelu_fp8", shape, dtype, "fwd", (act + fp8) / 1e9,
                    lambda x, g, w, b, s: bias_gelu_fp8(x, w, s, activation=ACTIVATION),
                    lambda x, g, w, b, s: fp8_ops._bias_act_fp8_ref(x, w, s, activation=ACTIVATION, fp8_dtype=E4M3),
                    sets, reps)
            # cast + transpose: reads x, writes q and q^T.
            compare(rows, "cast_transpose", shape, dtype, "fwd", (act + 2 * fp8) / 1e9,
                    lambda x, g, w, b, s: cast_transpose(x, s),
                    lambda x, g, w, b, s: fp8_ops._cast_transpose_ref(x, s, fp8_dtype=E4M3), sets, reps)
            # dGELU + cast + transpose + dbias: reads g and the pre-activation, writes q and q^T.
            compare(rows, "dgelu_cast_transpose_dbias", shape, dtype, "bwd", (2 * act + 2 * fp8 + h * e) / 1e9,
                    lambda x, g, w, b, s: dgelu_cast_transpose_dbias(g, x, s, activation=ACTIVATION),
                    lambda x, g, w, b, s: fp8_ops._dact_ref(g, x, s, activation=ACTIVATION, fp8_dtype=E5M2),
                    sets, reps)
            del sets


def main():
    op_bench_main("fp8_cast.csv", run, default_dtypes="bfloat16")


if __name__ == "__main__":
    main()
