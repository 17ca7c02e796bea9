"""Train a zoo model end to end: ``python -m flax_models.train --model gpt --preset tiny``.

Prints a progress bar with loss, tokens/s (images/s) and peak memory. ``--compare``
also trains the plain-Flax twin from the same weights, seed and data and prints the
speedup and the loss difference. ``--ckpt-dir`` saves the full state with orbax every
``--save-every`` steps; ``--resume`` continues from the latest checkpoint bit for bit.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flax_models as fm
from flax_models import data, training

DEFAULTS = {  # (batch, seq) per family and preset size
    "tiny": (8, 64), "bert": (32, 128), "gpt": (16, 1024), "transformer": (64, 128), "vit": (128, 0)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flax_models.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=fm.FAMILIES)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--impl", default="ls2", choices=fm.IMPLS)
    p.add_argument("--compare", action="store_true", help="also train the plain-Flax twin")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, help="override all dropout rates")
    p.add_argument("--mlm-max-predictions", type=int, default=0,
                   help="bert: mask at most this many tokens per sequence and run the MLM head on them only")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--remat", action="store_true")
    p.add_argument("--optimizer", default="fused", choices=["fused", "optax"])
    p.add_argument("--ckpt-dir")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def config_from(args):
    over = {"attention_backend": args.attention_backend, "remat": args.remat}
    if args.dropout is not None:
        over.update(hidden_dropout=args.dropout, attn_dropout=args.dropout,
                    activation_dropout=args.dropout)
    if args.mlm_max_predictions:
        if args.model != "bert":
            raise ValueError(f"train: --mlm-max-predictions applies to bert, not {args.model}")
        over["mlm_max_predictions"] = args.mlm_max_predictions
    cfg = fm.get_config(args.model, args.preset, **over)
    batch, seq = DEFAULTS["tiny" if args.preset == "tiny" else args.model]
    return cfg, args.batch or batch, args.seq or seq or cfg.max_len


def peak_memory_gb():
    """Peak device memory (GB) where the backend reports it, else peak host RSS."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 1e9, "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "host RSS"


class Progress:
    """A dependency-free progress bar (tqdm when installed)."""

    def __init__(self, total, desc, quiet):
        self.total, self.desc, self.quiet, self.n = total, desc, quiet, 0
        try:
            from tqdm import tqdm  # noqa: PLC0415
            self.bar = None if quiet else tqdm(total=total, desc=desc, file=sys.stderr)
        except ImportError:
            self.bar = None

    def update(self, n, post):
        self.n = n
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.n = n
            self.bar.set_postfix_str(post)
            return
        width = 24
        done = int(width * n / max(1, self.total))
        print(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] {n}/{self.total} {post}",
              end="", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif not self.quiet:
            print(file=sys.stderr)


def train(args, cfg, batch_size, seq, *, impl, params_from=None, label=None):
    """Run one training; returns a dict of losses, step times and figures."""
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else None
    tx, opt_name = training.make_optimizer(args.lr, args.steps, args.warmup,
                                           fused=args.optimizer == "fused")
    graphdef, state = training.create(cfg, impl=impl, dtype=dtype, seed=args.seed, tx=tx,
                                      params_from=params_from)
    start = 0
    if args.resume and args.ckpt_dir and training.latest_step(args.ckpt_dir) is not None:
        state, start = training.restore_checkpoint(args.ckpt_dir, state)
    step_fn = training.make_step(graphdef)
    unit = "images" if cfg.family == "vit" else "tokens"
    prog = Progress(args.steps, label or impl, args.quiet)
    losses, times, seen = [], [], 0
    for step in range(start, args.steps):
        batch = data.make_batch(cfg, args.seed, step, batch_size, seq)
        t0 = time.perf_counter()
        state, loss, aux = step_fn(state, batch)
        loss = float(loss)  # blocks until the step is done
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if not np.isfinite(loss):
            prog.close()
            raise FloatingPointError(f"train: loss is {loss} at step {step}")
        if not bool(aux.get("grads_finite", True)):
            prog.close()
            raise FloatingPointError(f"train: the gradients of step {step} hold inf/NaN (the update "
                                     "was applied; use the optimizer's skip_nonfinite or loss_scale to skip)")
        if step > start:
            seen += data.tokens_in(cfg, batch)
        if args.ckpt_dir and args.save_every and (step + 1) % args.save_every == 0:
            training.save_checkpoint(args.ckpt_dir, step + 1, state)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rate = seen / max(sum(times[1:]), 1e-9)
            mem, _ = peak_memory_gb()
            prog.update(step + 1, f"loss {loss:.4f} | {rate:,.0f} {unit}/s | peak {mem:.2f} GB")
    prog.close()
    mem, where = peak_memory_gb()
    steady = times[1:] or times
    return {"impl": impl, "optimizer": opt_name, "losses": losses, "start": start,
            "ms_median": 1e3 * float(np.median(steady)) if steady else float("nan"),
            "rate": seen / max(sum(times[1:]), 1e-9), "unit": unit, "peak_gb": mem,
            "mem_where": where, "state": state, "graphdef": graphdef}


def summary(r):
    return (f"{r['impl']:>5}: final loss {r['losses'][-1]:.4f} | step {r['ms_median']:.1f} ms "
            f"(median) | {r['rate']:,.0f} {r['unit']}/s | peak {r['peak_gb']:.2f} GB "
            f"({r['mem_where']}) | {r['optimizer']}")


def main(argv=None):
    args = parse_args(argv)
    cfg, batch_size, seq = config_from(args)
    print(f"{cfg.family}/{args.preset}: batch {batch_size} x {seq}, {args.dtype}, "
          f"{args.steps} steps on {jax.devices()[0].device_kind}", flush=True)
    first = train(args, cfg, batch_size, seq, impl=args.impl)
    print(summary(first), flush=True)
    if not args.compare:
        return first
    if args.resume:
        raise SystemExit("train: --compare and --resume cannot be combined")
    import flax.nnx as nnx  # noqa: PLC0415
    twin_impl = "plain" if args.impl == "ls2" else "ls2"
    ref_model = fm.build(cfg, impl=args.impl, dtype=None, seed=args.seed)
    # the plain-Flax baseline trains with optax.adamw (no jax_ls2 code at all)
    twin_opt = "optax" if twin_impl == "plain" else args.optimizer
    twin_args = argparse.Namespace(**{**vars(args), "ckpt_dir": None, "optimizer": twin_opt})
    second = train(twin_args, cfg, batch_size, seq, impl=twin_impl,
                   params_from=ref_model, label=twin_impl)
    print(summary(second), flush=True)
    ls2, base = (first, second) if args.impl == "ls2" else (second, first)
    diff = np.abs(np.asarray(ls2["losses"]) - np.asarray(base["losses"]))
    rel = diff / np.maximum(np.abs(np.asarray(base["losses"])), 1e-12)
    print(f"speedup (plain / jax_ls2 step time): {base['ms_median'] / ls2['ms_median']:.2f}x | "
          f"loss difference: final {diff[-1]:.2e}, max {diff.max():.2e} "
          f"(max relative {rel.max():.2%})")
    del nnx
    return first, second


if __name__ == "__main__":
    main()
