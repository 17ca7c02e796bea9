"""Ring attention (``jax_ls2.parallel.ring_attention``) on one device, the ring emulated:
``P`` virtual devices are the mapped axis of ``jax.vmap(..., axis_name="ring")``, so the
same code runs (``ppermute`` becomes a permutation of the mapped axis; the flash op's
kernel runs once per virtual device), timed against one ``ops.flash_attention`` call over
the whole sequence, forward and forward+backward, causal or not. Also the compiled
memory of each program (arguments + outputs + temporaries, ``memory_analysis``), divided
by ``P`` for the ring: the memory of one virtual device.

FLOPs are the whole attention's, ``4 * batch * heads * L^2 * head_dim`` (halved when causal,
3.5x for forward+backward), for both, so ``pct_of_whole`` is the ring's throughput as a
share of the single call's. (The ring's backward recomputes each block's forward, work
not counted.)

With ``--overlap`` (two or more devices, e.g. GPUs) the ring runs over a ``seq`` mesh of
every device instead: the compiled program's asynchronous collective-permutes are listed
with the attention calls scheduled between each start and done (`overlap_report`), and
the exposed communication is measured as the ring's time minus ``P`` times one block's
attention time (non-causal, where every device attends ``P`` full blocks).

    python -m bench.bench_ring_attention --out bench/results/latest          # one GPU, L = 32768
    python -m bench.bench_ring_attention --overlap --out bench/results/latest  # several GPUs
    python -m bench.bench_ring_attention --smoke --out /tmp/ring                # CPU, seconds
"""
from __future__ import annotations

import argparse
import functools
import os
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench.bench_attention import attention_flops
from bench.common import Rows, int_list, time_fn
from jax_ls2 import ops, parallel

EXTRA_FIELDS = ["ring", "balance", "causal", "tflops", "pct_of_whole", "mem_per_device_bytes", "exposed_comm_ms"]
CSV_NAME = "ring_attention.csv"
AXIS = "ring"


# ---------------------------------------------------------------- the programs
def whole_fn(causal):
    return lambda q, k, v: ops.flash_attention(q, k, v, causal=causal)


def ring_fn(ring, causal, impl, balance):
    """(q, k, v) of the whole sequence in natural order -> out, through the ring of
    ``ring`` virtual devices. The layout changes (gathers of the inputs and the output)
    are part of the timed program."""
    attend = functools.partial(parallel.ring_attention, axis_name=AXIS, causal=causal, impl=impl, balance=balance)

    def split(x):
        if balance == "zigzag":
            x = parallel.zigzag_permute(x, ring)
        return x.reshape(x.shape[0], ring, x.shape[1] // ring, *x.shape[2:]).swapaxes(0, 1)

    def join(x):
        x = x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])
        return parallel.zigzag_unpermute(x, ring) if balance == "zigzag" else x

    return lambda q, k, v: join(jax.vmap(attend, axis_name=AXIS)(split(q), split(k), split(v)))


def with_backward(f):
    def step(q, k, v, dout):
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(dout)
    return step


def inputs(b, length, h, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(kk, (b, length, h, d), dtype) for kk in ks)


def compiled_bytes(fn, *args):
    """Arguments + outputs + temporaries of the compiled program, or None where the
    backend does not say."""
    try:
        m = jax.jit(fn).lower(*args).compile().memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)
    except Exception:
        return None


# ---------------------------------------------------------------- overlap in a compiled program
_OPCODE = re.compile(r"\s(collective-permute-start|collective-permute-done|collective-permute|custom-call|fusion|"
                     r"conditional|while|call)\(")


def overlap_report(hlo_text: str, attention_target: str = "flash_attention") -> dict:
    """What runs while each asynchronous collective-permute is in flight, from the text of
    a compiled (scheduled) HLO module.

    Returns ``{"async": [{"start", "done", "overlapped": [attention call names], "compute":
    [other fusions/calls]}], "sync": number of synchronous collective-permutes,
    "attention_calls": custom-calls whose target contains ``attention_target``}``. The
    instructions of each computation are read in the order printed, which is the
    schedule in a scheduled module."""
    report = {"async": [], "sync": 0, "attention_calls": 0}
    body: list = []

    def flush():
        starts = {}
        for i, (name, opcode, line) in enumerate(body):
            if opcode == "collective-permute-start":
                starts[name] = i
            elif opcode == "collective-permute-done":
                src = re.search(r"collective-permute-done\(%?([\w.\-]+)", line).group(1)
                if src not in starts:
                    continue
                first = starts.pop(src)
                between = body[first + 1:i]
                report["async"].append(dict(
                    start=src, done=name,
                    overlapped=[n for n, op, ln in between if op == "custom-call" and attention_target in ln],
                    compute=[n for n, op, ln in between if op != "custom-call" or attention_target not in ln]))
        body.clear()

    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and " = " not in stripped:  # a computation begins
            flush()
            continue
        if " = " not in stripped:
            continue
        name = stripped.split(" = ", 1)[0].replace("ROOT", "").strip().lstrip("%")
        found = _OPCODE.search(" " + stripped.split(" = ", 1)[1])
        if not found:
            continue
        opcode = found.group(1)
        if opcode == "collective-permute":
            report["sync"] += 1
        if opcode == "custom-call" and attention_target in stripped:
            report["attention_calls"] += 1
        body.append((name, opcode, stripped))
    flush()
    return report


# ---------------------------------------------------------------- runs
def _row(rows, *, op, shape, dtype, impl, pass_, t, flops, **extra):
    return rows.add(op=op, shape=shape, dtype=dtype, impl=impl, ms_median=t[0], ms_p20=t[1], ms_p80=t[2],
                    tflops=round(flops / (t[0] * 1e-3) / 1e12, 2), **{"pass": pass_}, **extra)


def run_emulated(rows, args, dtype):
    b, length, h, d = args.batch, args.length, args.heads, args.head_dim
    shape = f"{b}x{length}x{h}x{d}"
    q, k, v, dout = inputs(b, length, h, d, dtype)
    for causal in args.causal:
        for pass_ in args.passes:
            flops = attention_flops(b, h, length, length, d, causal, pass_)
            whole = whole_fn(causal)
            fn = whole if pass_ == "fwd" else with_backward(whole)
            call_args = (q, k, v) if pass_ == "fwd" else (q, k, v, dout)
            t_whole = time_fn(fn, [call_args], reps=args.reps)
            mem_whole = compiled_bytes(fn, *call_args)
            _row(rows, op="attention", shape=shape, dtype=dtype.name, impl="flash_whole", pass_=pass_, t=t_whole,
                 flops=flops, ring=1, causal=causal, pct_of_whole=100.0, mem_per_device_bytes=mem_whole or "",
                 peak_mem_bytes=mem_whole or "")
            for impl in args.impls:
                for ring in args.ring_sizes:
                    f = ring_fn(ring, causal, impl, args.balance)
                    fn = f if pass_ == "fwd" else with_backward(f)
                    if args.check:
                        got, want = jax.jit(f)(q, k, v), jax.jit(whole)(q, k, v)
                        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                        tol = 1e-4 if dtype == jnp.float32 else 3e-2
                        if not err <= tol:
                            raise AssertionError(f"ring {impl} P={ring} causal={causal}: max |ring - whole| = "
                                                 f"{err:.3e} > {tol}")
                    t = time_fn(fn, [call_args], reps=args.reps)
                    mem = compiled_bytes(fn, *call_args)
                    row = _row(rows, op="attention", shape=shape, dtype=dtype.name, impl=f"ring_{impl}",
                               pass_=pass_, t=t, flops=flops, ring=ring, balance=args.balance, causal=causal,
                               pct_of_whole=round(100.0 * t_whole[0] / t[0], 1),
                               mem_per_device_bytes=mem // ring if mem else "", peak_mem_bytes=mem or "",
                               speedup_vs_xla="")
                    print(f"{impl} P={ring} causal={causal} {pass_}: {t[0]:.3f} ms vs whole {t_whole[0]:.3f} ms "
                          f"({row['pct_of_whole']}%), memory/device {row['mem_per_device_bytes']} "
                          f"(whole {mem_whole})", flush=True)


def run_devices(rows, args, dtype):
    """The ring over a ``seq`` mesh of every device: the overlap report of the compiled
    forward+backward, and the exposed communication (non-causal)."""
    devices = jax.devices()
    ring = len(devices)
    if ring < 2:
        raise SystemExit("--overlap needs two or more devices")
    mesh = parallel.make_mesh(f"seq={ring}")
    b, length, h, d = args.batch, args.length, args.heads, args.head_dim
    spec = P(None, "seq")
    q, k, v, dout = (jax.device_put(x, NamedSharding(mesh, spec)) for x in inputs(b, length, h, d, dtype))
    for causal in args.causal:
        attend = functools.partial(parallel.ring_attention, axis_name="seq", causal=causal, impl="flash",
                                   balance=args.balance)
        f = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        step = with_backward(f)
        report = overlap_report(jax.jit(step).lower(q, k, v, dout).compile().as_text())
        covered = sum(1 for r in report["async"] if r["overlapped"])
        print(f"causal={causal}: {len(report['async'])} async collective-permutes, {covered} with an attention "
              f"call between start and done; {report['sync']} synchronous; {report['attention_calls']} attention "
              f"calls", flush=True)
        for r in report["async"]:
            print(f"  {r['start']}: attention {r['overlapped']}, other compute {len(r['compute'])}")
        for pass_, fn, call_args in (("fwd", f, (q, k, v)), ("fwd+bwd", step, (q, k, v, dout))):
            t = time_fn(fn, [call_args], reps=args.reps)
            flops = attention_flops(b, h, length, length, d, causal, pass_)
            exposed = ""
            if not causal:
                c = length // ring
                blk = inputs(b, c, h, d, dtype, seed=1)
                block = whole_fn(False)
                t_blk = time_fn(block if pass_ == "fwd" else with_backward(block),
                                [blk[:3] if pass_ == "fwd" else blk], reps=args.reps)
                exposed = round(t[0] - ring * t_blk[0], 4)
            _row(rows, op="attention_devices", shape=f"{b}x{length}x{h}x{d}", dtype=dtype.name, impl="ring_flash",
                 pass_=pass_, t=t, flops=flops / ring, ring=ring, balance=args.balance, causal=causal,
                 exposed_comm_ms=exposed)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, float32, few reps: runs on the CPU in seconds")
    p.add_argument("--overlap", action="store_true", help="the ring over every device (needs >= 2)")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ring-sizes", type=int_list, default=[2, 4, 8])
    p.add_argument("--impls", default="flash", help="comma-separated: flash,rsa (rsa holds chunk x L scores)")
    p.add_argument("--balance", default="zigzag", choices=("zigzag", "none"))
    p.add_argument("--causal", type=lambda s: [x.strip().lower() in ("1", "true") for x in s.split(",")],
                   default=[False, True])
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--check", action="store_true", help="compare each ring's output with the whole call first")
    args = p.parse_args(argv)
    args.impls = [x for x in args.impls.split(",") if x]
    args.passes = [x for x in args.passes.split(",") if x]
    if args.smoke:
        args.length, args.batch, args.heads, args.head_dim, args.dtype = 64, 1, 2, 16, "float32"
        args.ring_sizes, args.reps, args.check, args.causal = [2], 3, True, [True]
        args.passes = ["fwd+bwd"]
    dtype = jnp.dtype(args.dtype)
    rows = Rows()
    (run_devices if args.overlap else run_emulated)(rows, args, dtype)
    path = os.path.join(args.out, CSV_NAME)
    rows.write(path, EXTRA_FIELDS)
    print(f"wrote {len(rows.rows)} rows to {path}")


if __name__ == "__main__":
    main()
