"""Sequence against tensor parallelism at equal device count: a memory model from the compiler.

    python -m bench.bench_sequence_memory --out bench/results/latest     # BERT-base on the devices found
    python -m bench.bench_sequence_memory --out /tmp/m --smoke            # tiny preset, small capacity

The Ring Self-Attention paper's comparison (on 64 P100s: 3.0x longer sequences and
13.7x larger batches than Megatron) for the zoo's BERT at P devices, on two meshes:

    seq=P       the sequence split over the devices, attention through
                ``jax_ls2.parallel.ring_attention`` over flash blocks
    tensor=P    Megatron: heads, FFN width and vocabulary split over the devices

and two searches per mesh: (a) the longest sequence that trains at a fixed batch
(--batch), (b) the largest batch that trains at a fixed length (--seq-len).

Nothing is run or allocated. Each probe builds the train step that ``python -m
flax_models.train --model bert --mesh seq=P`` (resp. ``tensor=P``) runs: the config
changes of ``train.mesh_from`` (``sequence_axis="seq"``, resp. ``tensor_axis="tensor"``),
the state of ``training.create`` with the fused AdamW placed on the mesh, the step of
``training.make_mesh_step`` (state donated), the batch split as ``training.shard_batch``
and ``train.split_sequences`` split it; bf16 compute where the backend takes it (a GPU;
on the CPU fp32, as bench_scaling runs, since XLA's CPU compiler aborts on the bf16
tensor-parallel step), fp32 params, the preset's dropout. The state is built abstractly
(``nnx.eval_shape``; arrays as ``jax.ShapeDtypeStruct`` with their shardings, which
`abstract_state` gives exactly as ``training.create`` places them), the step is lowered
and compiled for those shapes, and the compiler's ``memory_analysis()`` is read:

    per_device_bytes = argument + output + temp - alias

of the per-device program: arguments are the state (params, AdamW moments, dropout
counters) and the batch; outputs the new state, loss and aux; the state is donated, so
its outputs alias its arguments and count once; temp is the compiler's buffer
assignment for everything else live at the step's peak (activations kept for the
backward pass, gradients, attention blocks, collective buffers). Not counted: generated
code, the runtime's own reservations and fragmentation, so a real run needs some
headroom above this figure. A probe fits when per_device_bytes <= the capacity:
``--capacity-gb`` (GB = 1e9 bytes), else the device's ``memory_stats()["bytes_limit"]``
where it reports one, else 141 (one H200's HBM); the CSV's capacity_source says which.

Both meshes use the same model: ``mlm_max_predictions = 0`` (the MLM head on every
token; a seq mesh cannot pick predicted positions without gathering the sequence) and
``max_len`` = max(the preset's, the probed length), so the position table grows with
the length on both meshes alike.

Search: from a start (a multiple of the granularity), double until a probe does not fit,
then narrow the bracket between the largest fitting and the smallest failing probe
(interpolating the bytes, with bisection steps; see `search`) down to the granularity:
for the length a multiple of 2P and of 64 (``--granularity`` overrides the 64), for the
batch a multiple of the data-parallel size (1 on both meshes). At most ``--max-probes``
compiles per search; when they run out, the maximum found is a lower bound and
``min_failing`` the bracket's top. A start that does not fit is halved down to the
granularity (no maximum when even that does not fit). The batch search's default length
is 512, or the next multiple of P above it (516 for P = 6).

Backend caveat (the ``backend`` column: cpu or gpu). On the CPU, jax_ls2's ops run their
pure-JAX references: the flash reference materialises each (batch, heads, block_q,
block_k) logits block in fp32, which the CUDA kernel never does, while the tensor mesh's
attention (the "fused" backend, q k^T then softmax-dropout) materialises (batch,
heads / P, L, L) on any backend. So the CPU model overstates the ring's attention memory
and understates its advantage; its figures are not GPU figures. Compute is fp32 on the
CPU and bf16 on a GPU, which also changes the activation bytes.

Output: ``sequence_memory_<date>[_smoke].csv`` in --out, one row per probe (search
"seq_len" or "batch") and one per (mesh, search) with its maximum (search "max seq_len"
or "max batch"; on the seq mesh's also ``ratio_seq_over_tensor`` and the range
[``ratio_low``, ``ratio_high``] the brackets leave for it), and a table printed.

BERT-base has 12 heads, FFN width 3072 and a 30522-token vocabulary (2 x 3 x 5087), so
``python -m flax_models.train --mesh tensor=P`` takes P in {1, 2, 3, 6} only (not 4 or
8): the default P is the largest size not above the device count that the tensor mesh
takes (6 on 8 devices), used by both meshes; a --devices it does not take is refused.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_models as fm
from flax_models import data, train, training
from jax_ls2 import parallel
from jax_ls2.nn.attention import select_backend
from jax_ls2.optim import shard_optimizer

H200_GB = 141.0
MESHES = ("seq", "tensor")
LENGTH_ALIGN = 64
FIELDS = ["model", "mesh", "devices", "search", "probe", "shape", "batch", "seq_len", "dtype", "attention",
          "per_device_bytes", "per_device_gb", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
          "capacity_gb", "capacity_source", "fits", "max_fitting", "min_failing", "granularity", "probes",
          "ratio_seq_over_tensor", "ratio_low", "ratio_high", "compile_s", "backend", "gpu", "jax_version",
          "git_commit", "date"]


class Refused(Exception):
    """A mesh the model, the device count or the sizes do not take; the message says why."""


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message):
        raise Refused(message)


# ---------------------------------------------------------------------------- the step
def tensor_sizes(cfg) -> tuple:
    """The (heads, FFN width, vocabulary) a tensor axis must divide (``train.mesh_from``'s check)."""
    return cfg.num_heads, cfg.ffn_size, cfg.vocab_size


def default_devices(cfg, count: int) -> int:
    """The largest P <= count that divides every size of `tensor_sizes`."""
    return max(p for p in range(1, count + 1) if all(n % p == 0 for n in tensor_sizes(cfg)))


def mesh_config(kind: str, size: int, cfg, preset: str, batch: int, seq_len: int):
    """(mesh over the first `size` devices, cfg) for ``--mesh {kind}={size}``, checked and
    changed as ``train.mesh_from`` does (Refused with its message otherwise)."""
    spec = f"{kind}={size}"
    if size > jax.device_count():
        raise Refused(f"--mesh {spec}: only {jax.device_count()} devices")
    parser = _RefusingParser()
    if kind == parallel.TENSOR:
        for what, n in zip(("heads", "FFN width", "vocabulary"), tensor_sizes(cfg)):
            if n % size:
                raise Refused(f"--mesh: tensor={size} does not divide the {n} {what} of {cfg.family}/{preset}")
        cfg = cfg.replace(tensor_axis=parallel.TENSOR, sequence_parallel=False)
    else:
        args = train.build_parser().parse_args(["--model", cfg.family, "--preset", preset, "--mesh", spec,
                                                "--batch", str(batch), "--seq", str(seq_len)])
        train.check_sequence_split(parser, args, cfg, size, seq_len)
        cfg = cfg.replace(sequence_axis=parallel.SEQ, sequence_balance="none")
    mesh = parallel.make_mesh(parallel.parse_mesh_spec(spec), devices=jax.devices()[:size])
    return mesh, cfg


def _replicated_if_none(spec):
    return P() if spec is None else spec


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def abstract_state(cfg, mesh, *, dtype, tx, seed: int = 0):
    """(graphdef, state) of ``training.create(cfg, impl="ls2", dtype=dtype, seed=seed,
    tx=tx, mesh=mesh)`` without allocating it: every array a ``jax.ShapeDtypeStruct``
    with the sharding create places it with (params by their partition specs, the
    fused optimizer's flat buffers as ``shard_optimizer`` lays them, the rest
    replicated). Call under ``jax.set_mesh(mesh)``. The graphdef's optimizer is an
    equal but distinct ``shard_optimizer`` object."""
    build = lambda: fm.build(cfg, impl="ls2", dtype=dtype, seed=seed, train=True)  # noqa: E731
    params = nnx.state(nnx.eval_shape(build), nnx.Param)
    specs = jax.tree.map(_replicated_if_none, nnx.get_partition_spec(params), is_leaf=_is_spec)
    sharded_tx = shard_optimizer(tx, mesh, specs)

    def model_and_optimizer():
        model = build()
        return model, nnx.Optimizer(model, sharded_tx, wrt=nnx.Param)
    graphdef, state = nnx.split(nnx.eval_shape(model_and_optimizer))
    opt_shardings = sharded_tx.update.state_shardings(params)

    def placed(path, x, spec):
        keys = [getattr(k, "key", None) for k in path]
        if "opt_state" in keys:  # the fused optimizer's FusedState fields
            sharding = getattr(opt_shardings, str(keys[keys.index("opt_state") + 1]), None)
            if sharding is not None:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _replicated_if_none(spec)))
    return graphdef, jax.tree_util.tree_map_with_path(placed, state, nnx.get_partition_spec(state))


def abstract_batch(cfg, mesh, batch: int, seq_len: int) -> dict:
    """The (batch, seq_len) token arrays of ``data.make_batch`` as ``jax.ShapeDtypeStruct``s
    split as the train command splits them: over data, and along the sequence over seq
    when ``cfg.sequence_axis`` is set."""
    sample = data.make_batch(cfg.replace(max_len=8), 0, 0, 1, 8)  # the keys and dtypes only
    spec = P(parallel.DATA, parallel.SEQ) if cfg.sequence_axis is not None else P(parallel.DATA)
    return {k: jax.ShapeDtypeStruct((batch, seq_len), v.dtype, sharding=NamedSharding(mesh, spec))
            for k, v in sample.items()}


def attention_path(cfg, dtype, seq_len: int) -> str:
    """What runs attention in the step of `cfg` at `seq_len` tokens (for the CSV)."""
    if cfg.sequence_axis is not None:
        return "ring over flash blocks"
    return select_backend(cfg.attention_backend, dropout_active=cfg.attn_dropout > 0, q_len=seq_len, k_len=seq_len,
                          head_dim=cfg.hidden_size // cfg.num_heads, dtype=dtype or jnp.float32)


def step_memory(cfg, mesh, batch: int, seq_len: int, dtype) -> dict:
    """The compiled train step's memory analysis at (batch, seq_len) on `mesh`: argument,
    output, temp and alias bytes of the per-device program, and per_device_bytes =
    argument + output + temp - alias. Compiles; runs and allocates nothing."""

    cfg = cfg.replace(max_len=max(cfg.max_len, seq_len))
    tx, _ = training.make_optimizer(1e-4, 1000, 10, fused=True)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        graphdef, state = abstract_state(cfg, mesh, dtype=dtype, tx=tx)
        step = training.make_mesh_step(graphdef, state)
        compiled = step.lower(state, abstract_batch(cfg, mesh, batch, seq_len)).compile()
    m = compiled.memory_analysis()
    out = dict(argument_bytes=int(m.argument_size_in_bytes), output_bytes=int(m.output_size_in_bytes),
               temp_bytes=int(m.temp_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes))
    out["per_device_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    return out


# ---------------------------------------------------------------------------- the search
def search(measure, start: int, granularity: int, max_probes: int, limit: float) -> tuple:
    """(max_fitting or None, min_failing or None, probes) for a size n whose bytes
    `measure(n)` (one compile per call, growing with n) must stay <= `limit`: from
    `start` double until a probe does not fit, then narrow the bracket to `granularity`,
    each probe at the bracket's linear interpolation of the bytes to `limit` and, after
    a probe that moved the same end as the one before, at its middle (so a curved
    bytes(n) still halves the bracket). A failing start is halved down to `granularity`.
    At most `max_probes` calls; `probes` lists (n, bytes) in call order."""
    if start % granularity:
        raise ValueError(f"search: start {start} is not a multiple of the granularity {granularity}")
    probes = []

    def probe(n):
        probes.append((n, measure(n)))
        return probes[-1][1] <= limit
    best, fail, n = None, None, start
    while len(probes) < max_probes:
        if probe(n):
            best = n
            if fail is not None:
                break
            n *= 2
        else:
            fail = n
            if best is not None or n == granularity:
                break
            n = max(granularity, n // 2 // granularity * granularity)
    bytes_at = dict(probes)
    last_side = None
    while best is not None and fail is not None and fail - best > granularity and len(probes) < max_probes:
        lo, hi = bytes_at[best], bytes_at[fail]
        mid = (best + fail) / 2 if last_side == "repeat" else best + (limit - lo) / max(hi - lo, 1) * (fail - best)
        n = min(max(int(mid) // granularity * granularity, best + granularity), fail - granularity)
        side = "best" if probe(n) else "fail"
        best, fail = (n, fail) if side == "best" else (best, n)
        bytes_at[n] = probes[-1][1]
        last_side = "repeat" if side == last_side else side
    return best, fail, probes


# ---------------------------------------------------------------------------- the run
def capacity(given):
    """(capacity in GB, where it comes from)."""
    if given is not None:
        return float(given), "--capacity-gb"
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit:
        return limit / 1e9, "device bytes_limit"
    return H200_GB, "H200 HBM (the device reports no limit)"


def run_search(kind: str, what: str, cfg, preset: str, size: int, args, cap_bytes: float, dtype, meta: dict) -> list:
    """The rows of one search: a row per probe, then the summary row."""
    name = f"{kind}={size}"
    if what == "seq_len":
        granularity = math.lcm(2 * size, args.granularity)
        start = -(-args.length_start // granularity) * granularity
    else:
        granularity = 1  # the data axis is 1 on both meshes
        start = args.batch_start
    rows = []

    def measure(n):
        batch, seq_len = (args.batch, n) if what == "seq_len" else (n, args.seq_len)
        mesh, mesh_cfg = mesh_config(kind, size, cfg, preset, batch, seq_len)
        m = step_memory(mesh_cfg, mesh, batch, seq_len, dtype)
        ok = m["per_device_bytes"] <= cap_bytes
        rows.append(dict(meta, mesh=name, search=what, probe=len(rows) + 1, shape=f"{batch}x{seq_len}", batch=batch,
                         seq_len=seq_len, attention=attention_path(mesh_cfg, dtype, seq_len), fits=int(ok),
                         per_device_gb=round(m["per_device_bytes"] / 1e9, 4), **m))
        print(f"{name:<10}{what:<8}{batch:>7}{seq_len:>8}{m['per_device_bytes'] / 1e9:>11.3f} GB"
              f"{'  fits' if ok else '  does not fit':<15}({m['compile_s']:.1f} s)", flush=True)
        return m["per_device_bytes"]
    try:
        best, fail, probes = search(measure, start, granularity, args.max_probes, cap_bytes)
    except Refused as e:
        return [dict(meta, mesh=name, search=f"max {what}", probes=0, skipped=" ".join(str(e).split()))]
    top = next((r for r in rows if r[what] == best), None)
    summary = dict(meta, mesh=name, search=f"max {what}", max_fitting=best if best is not None else "",
                   min_failing=fail if fail is not None else "", granularity=granularity, probes=len(probes))
    if top is not None:
        summary.update({k: top[k] for k in ("shape", "batch", "seq_len", "attention", "per_device_bytes",
                                            "per_device_gb", "fits")})
    return rows + [summary]


def add_ratios(rows) -> None:
    """On the seq mesh's summary rows, where both searches found a probe that does not fit
    (else a maximum is only the largest size probed): ratio_seq_over_tensor, its maximum
    over the tensor mesh's, and the range the true ratio lies in given the brackets
    (ratio_low: seq's maximum over the largest size below tensor's first failure;
    ratio_high: the largest size below seq's first failure over tensor's maximum)."""
    summaries = {(r["mesh"].split("=")[0], r["search"]): r for r in rows
                 if r["search"].startswith("max ") and r.get("min_failing") not in (None, "")}
    for (kind, what), s in summaries.items():
        t = summaries.get(("tensor", what))
        if kind != "seq" or t is None:
            continue
        s["ratio_seq_over_tensor"] = round(s["max_fitting"] / t["max_fitting"], 3)
        s["ratio_low"] = round(s["max_fitting"] / (t["min_failing"] - t["granularity"]), 3)
        s["ratio_high"] = round((s["min_failing"] - s["granularity"]) / t["max_fitting"], 3)


def print_table(rows, cap_gb: float, source: str) -> None:
    print(f"\ncapacity {cap_gb:.3f} GB per device ({source}); backend {rows[0]['backend']}, {rows[0]['dtype']}")
    print(f"{'mesh':<11}{'search':<14}{'max':>9}{'first failing':>15}{'probes':>8}{'GB at max':>11}{'seq/tensor':>12}"
          f"{'range':>16}")
    for r in rows:
        if not r["search"].startswith("max "):
            continue
        gb = r.get("per_device_gb", "")
        bounds = f"{r['ratio_low']}-{r['ratio_high']}" if r.get("ratio_low") else ""
        print(f"{r['mesh']:<11}{r['search']:<14}{str(r.get('max_fitting', '-') or '-'):>9}"
              f"{str(r.get('min_failing', '-') or '-'):>15}{r.get('probes', 0):>8}"
              f"{(format(gb, '.3f') if gb != '' else '-'):>11}{str(r.get('ratio_seq_over_tensor', '')):>12}"
              f"{bounds:>16}"
              + (f"  skipped: {r['skipped']}" if r.get("skipped") else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the CSV")
    p.add_argument("--preset", default="base", help="BERT preset (default: base)")
    p.add_argument("--devices", type=int, help="P, the devices of each mesh (default: the largest the tensor mesh "
                                               "takes, up to every device)")
    p.add_argument("--batch", type=int, help="batch of the length search (default: 64; smoke: 8)")
    p.add_argument("--seq-len", type=int, help="length of the batch search, a multiple of P (default: 512, or the "
                                               "next multiple of P above; smoke: 64)")
    p.add_argument("--length-start", type=int, help="first length probed, rounded up to the granularity "
                                                    "(default: 1024; smoke: 256)")
    p.add_argument("--batch-start", type=int, help="first batch probed (default: 256; smoke: 32)")
    p.add_argument("--granularity", type=int, default=LENGTH_ALIGN,
                   help="lengths are multiples of this and of 2P (default: 64)")
    p.add_argument("--capacity-gb", type=float, help="memory per device in GB (1e9 bytes) (default: the device's "
                                                     "bytes_limit, else 141, one H200)")
    p.add_argument("--max-probes", type=int, help="compiles per search at most (default: 5; smoke: 3)")
    p.add_argument("--searches", default="seq_len,batch", help="which searches: seq_len, batch or both")
    p.add_argument("--smoke", action="store_true", help="tiny preset, 0.03 GB capacity: ends in seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "tiny"
        args.capacity_gb = 0.03 if args.capacity_gb is None else args.capacity_gb
    seq_len_given = args.seq_len is not None
    for name, default, smoke in (("batch", 64, 8), ("seq_len", 512, 64), ("batch_start", 256, 32),
                                 ("length_start", 1024, 256), ("max_probes", 5, 3)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else default)
    searches = [s for s in args.searches.split(",") if s]
    if not searches or set(searches) - {"seq_len", "batch"}:
        p.error(f"--searches must name seq_len and/or batch, got {args.searches!r}")
    for name in ("batch", "seq_len", "length_start", "batch_start", "granularity", "max_probes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.preset not in fm.PRESETS["bert"]:
        p.error(f"--preset must be one of {', '.join(fm.PRESETS['bert'])}, got {args.preset!r}")
    # the same model on both meshes: the MLM head on every token (a seq mesh cannot pick positions)
    cfg = fm.get_config("bert", args.preset, mlm_max_predictions=0)
    size = args.devices or default_devices(cfg, jax.device_count())
    if args.devices is not None and not 1 <= args.devices <= jax.device_count():
        p.error(f"--devices must be in [1, {jax.device_count()}] (the devices found), got {args.devices}")
    if any(n % size for n in tensor_sizes(cfg)):
        p.error(f"--devices {size}: tensor={size} must divide the heads, FFN width and vocabulary "
                f"{tensor_sizes(cfg)} of bert/{args.preset}; the largest that does on {jax.device_count()} devices "
                f"is {default_devices(cfg, jax.device_count())}")
    if not seq_len_given:
        args.seq_len = -(-args.seq_len // size) * size
    if args.seq_len % size:
        p.error(f"--seq-len {args.seq_len} must be a multiple of the devices ({size}) for the seq mesh")
    backend = "cpu" if jax.default_backend() == "cpu" else "gpu"
    # XLA's CPU compiler aborts on the bf16 tensor-parallel step (see bench_scaling)
    dtype = None if backend == "cpu" else jnp.bfloat16
    cap_gb, source = capacity(args.capacity_gb)
    from bench.common import git_commit  # noqa: PLC0415
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = dict(model=f"bert-{args.preset}", devices=size, dtype="bf16" if dtype else "fp32",
                capacity_gb=round(cap_gb, 4), capacity_source=source, backend=backend,
                gpu=jax.devices()[0].device_kind, jax_version=jax.__version__, git_commit=git_commit(), date=date)
    print(f"bert/{args.preset} on seq={size} and tensor={size} ({jax.device_count()} {backend} devices found), "
          f"{meta['dtype']}, length search at batch {args.batch}, batch search at length {args.seq_len}, "
          f"capacity {cap_gb:.3f} GB ({source}); the model of the compiler, nothing runs", flush=True)
    rows = []
    for what in searches:
        for kind in MESHES:
            rows += run_search(kind, what, cfg, args.preset, size, args, cap_gb * 1e9, dtype, meta)
    add_ratios(rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sequence_memory_{date[:10]}{'_smoke' if args.smoke else ''}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS + ["skipped"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print_table(rows, cap_gb, source)
    if backend == "cpu":
        print("cpu: jax_ls2's references ran; the flash reference materialises its logits blocks, the CUDA "
              "kernel does not, so the seq mesh's attention memory is overstated here")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
