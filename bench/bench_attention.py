"""Attention in TFLOP/s: jax_ls2's flash attention against cuDNN's fused attention
(``jax.nn.dot_product_attention(implementation="cudnn")``), XLA's attention and the
fused-softmax path (GEMMs around ``ops.softmax_dropout``), forward and forward+backward,
over head_dim, sequence length, causal or not and attention dropout; and a probe of
the longest sequence that trains (forward+backward) at batch 1, 32 heads, head_dim 128.

FLOPs are analytic: ``4 * batch * heads * q_len * kv_len * head_dim`` for the forward,
2.5 times that for the backward (so forward+backward is 3.5 times the forward, the
flash-attention convention), halved when causal. Shapes keep ``batch * len`` near
16384 tokens and ``heads * head_dim`` at 2048. cuDNN and XLA's
``dot_product_attention`` take no dropout: with dropout, "xla" is the formula written
out with ``jax.random.bernoulli`` (as plain Flax does) and cuDNN is not timed. A case an
implementation refuses or runs out of memory on is reported and skipped.

    python -m bench.bench_attention --out bench/results/latest            # everything
    python -m bench.bench_attention --lengths 2048,8192 --head-dims 128 \\
        --rates 0 --reps 10 --probe-lengths 131072                          # quick (~3 min)
    python -m bench.bench_attention --plot bench/results/latest/attention.csv
"""
from __future__ import annotations

import argparse
import csv
import math
import os

import jax
import jax.numpy as jnp

from bench.common import Rows, int_list, time_fn
from jax_ls2 import ops

TOKENS = 16384
WIDTH = 2048  # heads * head_dim
IMPLS = ("jax_ls2", "cudnn", "xla", "fused_softmax")
EXTRA_FIELDS = ["causal", "rate", "tflops", "x_cudnn"]
CSV_NAME = "attention.csv"


def attention_flops(b, h, lq, lk, d, causal, pass_):
    f = 4.0 * b * h * lq * lk * d * (3.5 if pass_ == "fwd+bwd" else 1.0)
    return f / 2 if causal else f


def _causal_mask(lq, lk):
    return jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None] + (lk - lq)


def xla_attention(q, k, v, causal, rate, key):
    """The formula written out (float32 softmax); dropout through jax.random.bernoulli."""
    d = q.shape[-1]
    if not rate:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    if causal:
        s = jnp.where(_causal_mask(q.shape[1], k.shape[1]), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    keep = jax.random.bernoulli(key, 1.0 - rate, p.shape)
    p = jnp.where(keep, p / (1.0 - rate), 0.0).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def fused_softmax_attention(q, k, v, causal, rate, key):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    p = ops.softmax_dropout(s, scale=1.0 / math.sqrt(q.shape[-1]), causal=causal, rate=rate, key=key)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def attention_fn(impl, causal, rate):
    """(q, k, v, key) -> out for one implementation, or None where it takes no dropout."""
    if impl == "jax_ls2":
        return lambda q, k, v, key: ops.flash_attention(q, k, v, causal=causal, rate=rate, key=key)
    if impl == "cudnn":
        if rate:
            return None
        return lambda q, k, v, key: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    if impl == "xla":
        return lambda q, k, v, key: xla_attention(q, k, v, causal, rate, key)
    if impl == "fused_softmax":
        return lambda q, k, v, key: fused_softmax_attention(q, k, v, causal, rate, key)
    raise ValueError(f"unknown impl {impl!r}")


def train_fn(f):
    def step(q, k, v, key, dout):
        _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, key), q, k, v)
        return vjp(dout)
    return step


def inputs(b, length, h, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v, dout = (jax.random.normal(ks[i], (b, length, h, d), jnp.float32).astype(dtype) for i in range(4))
    return q, k, v, ks[4], dout


def scores_bytes(b, h, length):
    return 4 * b * h * length * length  # one float32 (batch, heads, q, k) array


def run_grid(rows, args):
    dtype = jnp.dtype(args.dtype)
    for d in args.head_dims:
        h = WIDTH // d
        for length in args.lengths:
            b = max(1, TOKENS // length)
            data = inputs(b, length, h, d, dtype)
            for causal in args.causal:
                for rate in args.rates:
                    for pass_ in args.passes:
                        flops = attention_flops(b, h, length, length, d, causal, pass_)
                        base = None
                        # cuDNN first: the others are reported as a multiple of it.
                        for impl in sorted(args.impls, key=lambda i: i != "cudnn"):
                            f = attention_fn(impl, causal, rate)
                            if f is None:
                                continue
                            if impl in ("xla", "fused_softmax") and scores_bytes(b, h, length) > args.max_scores_gb * 2**30:
                                print(f"skip {impl} d={d} len={length}: the scores would take "
                                      f"{scores_bytes(b, h, length) / 2**30:.0f} GB", flush=True)
                                continue
                            fn = f if pass_ == "fwd" else train_fn(f)
                            call = (lambda fn: lambda q, k, v, key, dout: fn(q, k, v, key))(fn) \
                                if pass_ == "fwd" else fn
                            try:
                                med, p20, p80 = time_fn(call, [data], reps=args.reps, pipeline=2)
                            except Exception as e:  # refused shape, out of memory
                                print(f"skip {impl} d={d} len={length} causal={causal} rate={rate} {pass_}: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                                continue
                            tflops = flops / (med * 1e-3) / 1e12
                            if impl == "cudnn":
                                base = tflops
                            row = rows.add(op="attention", shape=f"{b}x{length}x{h}x{d}", dtype=dtype.name,
                                           impl=impl, ms_median=med, ms_p20=p20, ms_p80=p80,
                                           **{"pass": pass_})
                            row.update(causal=causal, rate=rate, tflops=round(tflops, 1),
                                       x_cudnn=round(tflops / base, 3) if base else "")
                            print(f"d={d:<4}len={length:<6}b={b:<3}causal={causal!s:<6}rate={rate:<4}{pass_:<8}"
                                  f"{impl:<14}{med:9.3f} ms {tflops:7.1f} TFLOP/s"
                                  f"{'' if not base or impl == 'cudnn' else f'  {tflops / base:.2f}x cudnn'}",
                                  flush=True)
            del data


def probe_longest(rows, args):
    """One forward+backward at batch 1, 32 heads, head_dim 128, causal, for each probe
    length (after a compiling run): the time and the peak device memory, or the
    failure that ends the probe."""
    import time

    dtype = jnp.dtype(args.dtype)
    h, d = 32, 128
    for length in args.probe_lengths:
        try:
            q, k, v, key, dout = inputs(1, length, h, d, dtype)
            step = jax.jit(train_fn(attention_fn("jax_ls2", True, 0.0)))
            jax.block_until_ready(step(q, k, v, key, dout))
            t0 = time.perf_counter()
            jax.block_until_ready(step(q, k, v, key, dout))
            ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # out of memory ends the probe
            print(f"probe: len={length} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            break
        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use", "")
        tflops = attention_flops(1, h, length, length, d, True, "fwd+bwd") / (ms * 1e-3) / 1e12
        row = rows.add(op="attention_longest", shape=f"1x{length}x{h}x{d}", dtype=dtype.name, impl="jax_ls2",
                       ms_median=ms, peak_mem_bytes=peak, **{"pass": "fwd+bwd"})
        row.update(causal=True, rate=0.0, tflops=round(tflops, 1))
        print(f"probe: len={length} trains: {ms:.1f} ms, {tflops:.1f} TFLOP/s, peak {peak} bytes", flush=True)
        del q, k, v, dout


def plot(csv_path):
    """TFLOP/s against length, one panel per (head_dim, causal, rate, pass)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        data = [r for r in csv.DictReader(f) if r["op"] == "attention"]
    panels = sorted({(r["shape"].split("x")[3], r["causal"], r["rate"], r["pass"]) for r in data})
    if not panels:
        return None
    cols = 4
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, (d, causal, rate, pass_) in zip(axes.ravel(), panels):
        sel = [r for r in data if (r["shape"].split("x")[3], r["causal"], r["rate"], r["pass"]) == (d, causal, rate, pass_)]
        for impl in IMPLS:
            pts = sorted((int(r["shape"].split("x")[1]), float(r["tflops"])) for r in sel if r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} causal={causal} rate={rate} {pass_}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    out = os.path.splitext(csv_path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


def _floats(text):
    return [float(x) for x in text.split(",") if x]


def _bools(text):
    return [x.strip().lower() in ("1", "true", "yes") for x in text.split(",") if x]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--head-dims", type=int_list, default=[64, 128])
    p.add_argument("--lengths", type=int_list, default=[197, 512, 2048, 8192, 32768])
    p.add_argument("--causal", type=_bools, default=[False, True], help="e.g. 0,1")
    p.add_argument("--rates", type=_floats, default=[0.0, 0.1])
    p.add_argument("--passes", type=lambda t: [x for x in t.split(",") if x], default=["fwd", "fwd+bwd"])
    p.add_argument("--impls", type=lambda t: [x for x in t.split(",") if x], default=list(IMPLS))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--max-scores-gb", type=float, default=16.0,
                   help="skip xla / fused_softmax where one float32 scores array exceeds this")
    p.add_argument("--probe-lengths", type=int_list, default=[32768, 65536, 131072],
                   help="lengths of the batch-1, 32-head, head_dim-128 training probe (empty: none)")
    p.add_argument("--plot", default="", help="only draw the plot of this CSV")
    a = p.parse_args(argv)
    if a.plot:
        print(plot(a.plot))
        return
    unknown = set(a.impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"bench_attention: unknown impls {sorted(unknown)}; choose from {IMPLS}")
    os.environ.setdefault("JAX_LS2_DEVICE_TIME", "0")  # host-timed TFLOP/s; no CUPTI reruns
    rows = Rows()
    run_grid(rows, a)
    if a.probe_lengths:
        probe_longest(rows, a)
    path = os.path.join(a.out, CSV_NAME)
    rows.write(path, EXTRA_FIELDS)
    print(f"wrote {path}")
    try:
        print(f"plot: {plot(path)}")
    except ImportError:
        print("plot skipped: matplotlib missing")


if __name__ == "__main__":
    main()
