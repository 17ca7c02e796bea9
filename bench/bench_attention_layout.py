"""Self-attention block (q/k/v projections, fused softmax+dropout, output projection),
forward + backward, with the activations batch-first (batch, len, hidden) against
sequence-first (len, batch, hidden).

Batch-first q, k, v reach the attention GEMMs, batched over (batch, heads), only
through transposes to (batch, heads, len, head_dim) and back. Sequence-first, the
(batch, heads) index has one stride (head_dim) in every operand, so cuBLAS can read
them in place. This benchmark measures what that is worth under XLA, and counts the
transpose kernels in each compiled program.

It also times the q, k, v projections with their biases, fwd + bwd, written on the
(batch, len, hidden) activations or on their (batch * len, hidden) view, and counts the
XLA add fusions left in each program (a bias add XLA moves into the GEMM epilogue
leaves none).

    python -m bench.bench_attention_layout --out bench/results
"""
from __future__ import annotations

import argparse
import math
import os
import re

import jax
import jax.numpy as jnp

from bench.common import LAST_DEVICE_MS, Rows, time_fn
from jax_ls2 import ops

SHAPES = [(256, 128, 768, 12), (32, 512, 768, 12), (16, 1024, 768, 12)]  # batch, len, hidden, heads
RATE = 0.1


def block(x, w, mask, key, seq_first: bool, n: int):
    """x: (b, t, c) or (t, b, c) bf16; w: (4, c, c) bf16 q, k, v, out kernels; mask (b, t)
    bool; n heads. Returns the block's output in x's layout."""
    c = x.shape[-1]
    h = c // n
    q, k, v = (jnp.dot(x, w[i]).reshape(*x.shape[:-1], n, h) for i in range(3))
    if seq_first:
        scores = jnp.einsum("tbnh,sbnh->bnts", q, k)
    else:
        scores = jnp.einsum("btnh,bsnh->bnts", q, k)
    probs = ops.softmax_dropout(scores, scale=1.0 / math.sqrt(h), mask=mask[:, None, None, :],
                                rate=RATE, key=key)
    if seq_first:
        ctx = jnp.einsum("bnts,sbnh->tbnh", probs, v)
    else:
        ctx = jnp.einsum("bnts,bsnh->btnh", probs, v)
    return jnp.dot(ctx.reshape(*x.shape[:-1], c), w[3])


def train_fn(seq_first, n):
    def f(x, w, mask, key, dy):
        y, vjp = jax.vjp(lambda x, w: block(x, w, mask, key, seq_first, n), x, w)
        return vjp(dy)
    return f


def qkv_projection(x, w, bias, flat: bool):
    """q, k, v = x_i @ w[i] + bias[i] for three distinct copies x_i of x (as the layers'
    LayerNorm hands them out). x: (b, t, c) bf16; w: (3, c, c); bias: (3, c)."""
    xs = jax.lax.optimization_barrier((x,) * 3)
    if flat:
        return tuple((jnp.dot(xi.reshape(-1, x.shape[-1]), w[i]) + bias[i]).reshape(x.shape)
                     for i, xi in enumerate(xs))
    return tuple(jnp.dot(xi, w[i]) + bias[i] for i, xi in enumerate(xs))


def qkv_train_fn(flat):
    def f(x, w, bias, dys):
        _, vjp = jax.vjp(lambda x, w, bias: qkv_projection(x, w, bias, flat), x, w, bias)
        return vjp(dys)
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows = Rows()
    for b, t, c, n in SHAPES:
        ks = jax.random.split(jax.random.key(0), 4)
        w = (jax.random.normal(ks[0], (4, c, c)) / math.sqrt(c)).astype(jnp.bfloat16)
        mask = jnp.arange(t)[None, :] < (t - jnp.arange(b)[:, None] % 16)
        key = ks[3]
        for seq_first in (False, True):
            shape = (t, b, c) if seq_first else (b, t, c)
            x = jax.random.normal(ks[1], shape).astype(jnp.bfloat16)
            dy = jax.random.normal(ks[2], shape).astype(jnp.bfloat16)
            f = train_fn(seq_first, n)
            text = jax.jit(f).lower(x, w, mask, key, dy).compile().as_text()
            transposes = len(re.findall(r"^\s*(?:ROOT )?%?\w*transpose\w*[\w.]* = ", text, re.M))
            med, p20, p80 = time_fn(f, [(x, w, mask, key, dy)], reps=30)
            layout = "seq_first" if seq_first else "batch_first"
            # pass: the number of transpose kernels in the compiled program
            rows.add(op="attention_block", shape=f"{b}x{t}x{c}", dtype="bfloat16",
                     impl=layout, ms_median=med, ms_p20=p20, ms_p80=p80,
                     device_ms=LAST_DEVICE_MS.get("ms"), **{"pass": f"fwd+bwd/{transposes}T"})
            print(f"{b}x{t}x{c} {layout:12s} {med:.3f} ms (device {LAST_DEVICE_MS.get('ms')}) "
                  f"transpose kernels: {transposes}", flush=True)
        x = jax.random.normal(ks[1], (b, t, c)).astype(jnp.bfloat16)
        bias = jax.random.normal(ks[2], (3, c)).astype(jnp.bfloat16)
        dys = tuple(jax.random.normal(k, (b, t, c)).astype(jnp.bfloat16) for k in jax.random.split(ks[3], 3))
        for flat in (False, True):
            f = qkv_train_fn(flat)
            text = jax.jit(f).lower(x, w[:3], bias, dys).compile().as_text()
            adds = len(re.findall(r"^\s*(?:ROOT )?%?\w*add\w*fusion[\w.]* = ", text, re.M))
            med, p20, p80 = time_fn(f, [(x, w[:3], bias, dys)], reps=30)
            form = "bias_2d" if flat else "bias_3d"
            # pass: the number of XLA add fusions in the compiled program
            rows.add(op="qkv_projection", shape=f"{b}x{t}x{c}", dtype="bfloat16", impl=form,
                     ms_median=med, ms_p20=p20, ms_p80=p80, device_ms=LAST_DEVICE_MS.get("ms"),
                     **{"pass": f"fwd+bwd/{adds}A"})
            print(f"{b}x{t}x{c} qkv {form:8s} {med:.3f} ms (device {LAST_DEVICE_MS.get('ms')}) "
                  f"add fusions: {adds}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    rows.write(os.path.join(args.out, "attention_layout.csv"))


if __name__ == "__main__":
    main()
