"""Train a zoo model end to end: ``python -m flax_models.train --model gpt --preset tiny``.

Prints a header (model, shapes, device, and which implementation runs the jax_ls2 ops),
a log line every ``--log-every`` steps (loss, tokens/s or images/s, elapsed time, ETA),
the loss on held-out data every ``--eval-every`` steps, and a summary per run: final
loss, the median step time after the run's first step (which compiles), the throughput
from that same median, and the run's peak device memory ("n/a" where the device keeps no
memory statistics, as on the CPU).

``--compare`` also trains the plain-Flax twin from the same weights, seed and data and
prints the speedup (the ratio of the two median step times) and the loss difference.
``--fp8`` runs the Transformer layers' weight GEMMs in FP8 with delayed scaling
(``jax_ls2.fp8.DelayedScaling``; the run is named "ls2-fp8"); with ``--compare`` the
twin is then the same jax_ls2 model without FP8 (named "ls2").
``--ckpt-dir`` saves the full state with orbax every ``--save-every`` steps, with a
checksum of its arrays and one of its metadata; ``--resume`` continues from the latest
checkpoint bit for bit and refuses a checkpoint that is corrupted (its step included) or
belongs to another model. ``--metrics``
(by default ``<ckpt-dir>/metrics.jsonl`` when there is a ``--ckpt-dir``) writes one JSON
line per step, evaluation and run; ``python -m flax_models.plot FILE... -o loss.png``
draws loss and throughput from them.

``--mesh data=..,tensor=..,seq=..,pipe=..`` trains on a device mesh
(``jax_ls2.parallel.make_mesh``) over every device of every process: the batch split
over the data axis, the sequence over the seq axis (GPT, BERT: attention through ring
attention), the state placed by its partition specs, the fused optimizer
updating the params where they lie (``--zero1`` also splits its state over the data
axis, ``--fsdp`` the params and the state). With several processes
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, or a Slurm /
Open MPI job) ``jax.distributed`` is started first, with gloo collectives for CPU
devices; every process runs the same command.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_models as fm
from flax_models import data, training
from flax_models.metrics import MetricsWriter
from jax_ls2 import parallel

DEFAULTS = {  # (batch, seq) per family and preset size
    "tiny": (8, 64), "bert": (32, 128), "gpt": (16, 1024), "transformer": (64, 128), "vit": (128, 0),
    "llama": (8, 2048)}


def _attention_backends() -> tuple:
    from jax_ls2.nn.attention import BACKENDS  # noqa: PLC0415
    return BACKENDS


def _plain_backends() -> tuple:
    from flax_models.plain.layers import BACKENDS  # noqa: PLC0415
    return BACKENDS


def _fp8_formats() -> tuple:
    from jax_ls2.fp8 import FORMATS  # noqa: PLC0415
    return FORMATS


def build_parser() -> argparse.ArgumentParser:
    presets = "; ".join(f"{f}: {', '.join(fm.PRESETS[f])}" for f in fm.ALL_FAMILIES)
    sizes = ", ".join(f"{k} {b}" for k, (b, _) in DEFAULTS.items())
    seqs = ", ".join(f"{k} {s}" for k, (_, s) in DEFAULTS.items() if s)
    p = argparse.ArgumentParser(prog="python -m flax_models.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", required=True, choices=fm.ALL_FAMILIES,
      help=f"model family, one of {', '.join(fm.ALL_FAMILIES)} (required)")
    a("--preset", default="tiny", help=f"model size per family ({presets}) (default: tiny)")
    a("--impl", default="ls2", choices=fm.IMPLS,
      help="ls2: jax_ls2's fused layers and optimizer; plain: the plain-Flax twin with "
           "optax (default: ls2)")
    a("--compare", action="store_true",
      help="also train the other implementation from the same weights, seed and data, and "
           "print the speedup and the loss difference (default: off)")
    a("--steps", type=int, default=100, help="training steps, at least 1 (default: 100)")
    a("--batch", type=int, help=f"sequences (images) per batch (default: per preset: {sizes})")
    a("--seq", type=int, help=f"tokens per sequence; not for vit, which takes images "
                              f"(default: per preset: {seqs})")
    a("--max-len", type=int,
      help="the model's longest sequence (the size of learned position tables), to train on "
           "sequences longer than the preset's (default: the preset's)")
    a("--dtype", default="float32", choices=["float32", "bfloat16"],
      help="compute dtype; parameters stay float32 (default: float32)")
    a("--lr", type=float, default=1e-3,
      help="peak learning rate, finite and >= 0 (default: 0.001)")
    a("--warmup", type=int, default=10,
      help="linear warm-up steps before the cosine decay to lr/10 (default: 10)")
    a("--seed", type=int, default=0, help="seed of the weights, dropout and data (default: 0)")
    a("--dropout", type=float,
      help="override every dropout rate, in [0, 1) (default: the preset's rates)")
    a("--mlm-max-predictions", type=int, default=0,
      help="bert only: mask at most this many tokens per sequence and run the MLM head on "
           "them only; 0 = every token (default: 0)")
    a("--attention-backend", default="auto", choices=_attention_backends(),
      help=f"attention backend, one of {', '.join(_attention_backends())}; the plain twin "
           f"has {', '.join(_plain_backends())} (default: auto)")
    a("--remat", action="store_true", help="rematerialise each layer in the backward pass "
                                           "(default: off)")
    a("--optimizer", default="fused", choices=["fused", "optax"],
      help="fused: jax_ls2.optim.adamw; optax: optax.adamw (default: fused; the plain twin "
           "under --compare always uses optax)")
    a("--fp8", action="store_true",
      help="run the Transformer layers' weight GEMMs in FP8 with delayed scaling (jax_ls2 only; "
           "with --compare the twin is jax_ls2 without FP8) (default: off)")
    a("--fp8-format", choices=_fp8_formats(),
      help="with --fp8: hybrid (E4M3 forward, E5M2 gradients) or e4m3 (default: hybrid)")
    a("--fp8-amax-history", type=int,
      help="with --fp8: amax history length per GEMM operand, at least 1 (default: 1024)")
    a("--mesh", help="train on a device mesh over all devices of all processes, e.g. data=8 or "
                      "data=2,tensor=4 (axes: pipe, data, seq, tensor; unnamed axes size 1; the "
                      "sizes must multiply to the device count); tensor splits heads, FFN and "
                      f"vocabulary ({', '.join(TENSOR_FAMILIES)}); seq splits the sequence, "
                      f"attention through ring attention ({', '.join(SEQ_FAMILIES)}); pipe runs the "
                      f"layer stack as GPipe stages ({', '.join(PIPE_FAMILIES)}; see --microbatches) "
                      "(default: one device, no mesh)")
    a("--microbatches", type=int, default=0,
      help="with --mesh pipe=N: micro-batches a data part of the batch is cut into for the "
           "pipeline schedule (default: N)")
    a("--sequence-balance", default="none", choices=["none", "zigzag"],
      help="with --mesh seq=N and gpt: zigzag hands every device the same causal attention work around "
           "the ring (chunks exchanged for the zigzag layout; --seq a multiple of 2N) (default: none)")
    a("--sequence-parallel", action="store_true",
      help="with --mesh tensor=N: Megatron sequence parallelism (LayerNorm, dropout and "
           "residuals on sequence parts over the tensor axis) (default: off)")
    a("--zero1", action="store_true",
      help="with --mesh: split the fused optimizer's moments over the data axis (ZeRO-1) "
           "(default: off)")
    a("--fsdp", action="store_true",
      help="with --mesh: also split the params and the fused optimizer's state over the data "
           "axis (FSDP-style; each param all-gathered for the step's passes) (default: off)")
    a("--ckpt-dir", help="directory for orbax checkpoints of the full training state "
                         "(default: none, nothing saved)")
    a("--save-every", type=int, default=0,
      help="save a checkpoint every N steps; needs --ckpt-dir; 0 = never (default: 0)")
    a("--resume", action="store_true",
      help="continue from the latest checkpoint under --ckpt-dir; start afresh when there "
           "is none (default: off)")
    a("--eval-every", type=int, default=100,
      help="loss on held-out data every N steps and at the last step; 0 = never "
           "(default: 100)")
    a("--eval-batches", type=int, default=4,
      help="held-out batches per evaluation (default: 4)")
    a("--metrics", help="JSONL metrics file of the run; under --compare the twin's goes "
                        "beside it with its implementation's name added (default: "
                        "<ckpt-dir>/metrics.jsonl with --ckpt-dir, else none)")
    a("--log-every", type=int, default=10, help="a log line every N steps, at least 1 "
                                                "(default: 10)")
    a("--quiet", action="store_true",
      help="no log or evaluation lines; the header, checkpoint lines and summaries still "
           "print (default: off)")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Usage errors (``p.error``: message and exit status 2) before anything runs."""
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    for flag in ("batch", "seq"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            p.error(f"--{flag} must be at least 1, got {v}")
    if args.seq is not None and args.model == "vit":
        p.error(f"--seq applies to token sequences; vit takes images (their size and patches come from "
                f"--preset {args.preset}), got --seq {args.seq}")
    if not math.isfinite(args.lr) or args.lr < 0:
        p.error(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.log_every < 1:
        p.error(f"--log-every must be at least 1, got {args.log_every}")
    if args.eval_every < 0:
        p.error(f"--eval-every must be >= 0 (0 = never), got {args.eval_every}")
    if args.eval_batches < 1:
        p.error(f"--eval-batches must be at least 1, got {args.eval_batches}")
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0 (0 = never), got {args.save_every}")
    if args.save_every and not args.ckpt_dir:
        p.error("--save-every needs --ckpt-dir (where to save)")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir (where to resume from)")
    if args.compare and args.resume:
        p.error("--compare and --resume cannot be combined (a comparison starts both runs "
                "from the same weights)")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.max_len is not None and args.max_len < 1:
        p.error(f"--max-len must be at least 1, got {args.max_len}")
    if args.mlm_max_predictions < 0:
        p.error(f"--mlm-max-predictions must be >= 0, got {args.mlm_max_predictions}")
    if args.mlm_max_predictions and args.model != "bert":
        p.error(f"--mlm-max-predictions applies to bert, not {args.model}")
    if args.preset not in fm.PRESETS[args.model]:
        p.error(f"--preset for {args.model} must be one of {', '.join(fm.PRESETS[args.model])}, "
                f"got {args.preset!r}")
    if args.fp8 and args.impl != "ls2":
        p.error("--fp8 needs --impl ls2 (the plain-Flax twin has no FP8 layers)")
    for flag in ("fp8_format", "fp8_amax_history"):
        if getattr(args, flag) is not None and not args.fp8:
            p.error(f"--{flag.replace('_', '-')} applies with --fp8")
    if args.fp8_amax_history is not None and args.fp8_amax_history < 1:
        p.error(f"--fp8-amax-history must be at least 1, got {args.fp8_amax_history}")
    if args.mesh is not None:
        try:
            parallel.parse_mesh_spec(args.mesh)
        except (TypeError, ValueError) as e:
            p.error(f"--mesh: {e}")
    if args.sequence_parallel and (args.mesh is None or parallel.parse_mesh_spec(args.mesh)[parallel.TENSOR] == 1):
        p.error("--sequence-parallel needs --mesh with tensor above 1 (it splits sequences over the tensor axis)")
    seq_split = args.mesh is not None and parallel.parse_mesh_spec(args.mesh)[parallel.SEQ] > 1
    if args.sequence_balance != "none" and not seq_split:
        p.error(f"--sequence-balance {args.sequence_balance} needs --mesh with seq above 1 (it lays out the sequence "
                "over the seq axis)")
    if args.microbatches < 0:
        p.error(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.microbatches and (args.mesh is None or parallel.parse_mesh_spec(args.mesh)[parallel.PIPE] == 1):
        p.error("--microbatches needs --mesh with pipe above 1 (it cuts the batch for the pipeline stages)")
    if args.zero1 and args.mesh is None:
        p.error("--zero1 needs --mesh (the data axis to split the optimizer state over)")
    if args.zero1 and (args.optimizer != "fused" or args.impl != "ls2" or args.compare):
        p.error("--zero1 needs the fused optimizer: --impl ls2 --optimizer fused, without --compare")
    if args.fsdp and args.mesh is None:
        p.error("--fsdp needs --mesh (the data axis to split the params over)")
    if args.fsdp and (args.optimizer != "fused" or args.impl != "ls2" or args.compare or args.zero1):
        p.error("--fsdp needs the fused optimizer: --impl ls2 --optimizer fused, without --compare or --zero1")
    if args.fsdp and parallel.parse_mesh_spec(args.mesh)[parallel.PIPE] > 1:
        p.error("--fsdp does not combine with --mesh pipe above 1; use --zero1 to split the optimizer state")
    if args.compare and not args.fp8 and args.attention_backend not in _plain_backends():
        p.error(f"--attention-backend {args.attention_backend} has no plain-Flax counterpart; "
                f"--compare takes one of {', '.join(_plain_backends())}")


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def config_from(args):
    over = {"attention_backend": args.attention_backend, "remat": args.remat}
    if args.dropout is not None:
        over.update(hidden_dropout=args.dropout, attn_dropout=args.dropout,
                    activation_dropout=args.dropout)
    if args.max_len is not None:
        over["max_len"] = args.max_len
    if args.mlm_max_predictions:
        if args.model != "bert":
            raise ValueError(f"train: --mlm-max-predictions applies to bert, not {args.model}")
        over["mlm_max_predictions"] = args.mlm_max_predictions
    if args.fp8:
        from jax_ls2.fp8 import DelayedScaling  # noqa: PLC0415
        recipe = {k: v for k, v in (("fp8_format", args.fp8_format), ("amax_history_len", args.fp8_amax_history))
                  if v is not None}
        over["fp8"] = DelayedScaling(**recipe)
    cfg = fm.get_config(args.model, args.preset, **over)
    batch, seq = DEFAULTS["tiny" if args.preset == "tiny" else args.model]
    return cfg, args.batch or batch, args.seq or seq or cfg.max_len


# ---------------------------------------------------------------------------- the mesh
PIPE_FAMILIES = ("bert", "gpt", "llama")
"""The families whose layer stack runs as pipeline stages over the pipe axis
(`flax_models.pipeline`)."""
TENSOR_FAMILIES = ("bert", "gpt", "llama", "transformer")
"""The families whose layers split over the tensor axis (``Config.tensor_axis``)."""
TEXT_FAMILIES = ("bert", "gpt", "llama")
"""The families trained on token sequences of at most ``max_len`` (`flax_models.data`)."""

SEQ_FAMILIES = ("bert", "gpt", "llama")
"""The families whose layers and loss run on sequence parts over the seq axis
(``Config.sequence_axis``), attention through ring attention."""


def mesh_from(p: argparse.ArgumentParser, args, cfg, batch_size, seq_len):
    """(mesh, cfg) for ``--mesh``: (None, cfg) without it; else the mesh, checked against
    the devices, the model, the batch and the sequence length (a mismatch is a usage
    error naming what to change), and cfg split over its tensor and seq axes where they
    are above 1."""
    if args.mesh is None:
        if jax.process_count() > 1:
            p.error(f"{jax.process_count()} processes run; give --mesh (e.g. --mesh data={jax.device_count()}) "
                    "so that they train one model together")
        return None, cfg
    sizes = parallel.parse_mesh_spec(args.mesh)
    try:
        mesh = parallel.make_mesh(sizes)
    except ValueError as e:
        p.error(f"--mesh: {e}")
    tensor = sizes[parallel.TENSOR]
    kv_heads = (cfg.num_kv_heads or cfg.num_heads) if cfg.family == "llama" else cfg.num_heads
    for what, n in (("heads", cfg.num_heads), ("key/value heads", kv_heads), ("FFN width", cfg.ffn_size),
                    ("vocabulary", cfg.vocab_size)):
        if n % tensor:
            p.error(f"--mesh: tensor={tensor} does not divide the {n} {what} of {cfg.family}/{args.preset}; "
                    f"use a tensor size dividing {n}")
    if tensor > 1 and args.compare:
        p.error(f"--mesh: tensor={tensor} cannot be combined with --compare (the plain-Flax twin has no "
                "tensor-parallel layers)")
    if tensor > 1 and cfg.family not in TENSOR_FAMILIES:
        p.error(f"--mesh: tensor={tensor}: {cfg.family} cannot be split over the tensor axis; it can for "
                f"{', '.join(TENSOR_FAMILIES)} (or use a mesh without tensor)")
    if cfg.num_layers % sizes[parallel.PIPE]:
        p.error(f"--mesh: pipe={sizes[parallel.PIPE]} does not divide the {cfg.num_layers} layers of "
                f"{cfg.family}/{args.preset}; use a pipe size dividing {cfg.num_layers}")
    if batch_size % sizes[parallel.DATA]:
        p.error(f"--mesh: data={sizes[parallel.DATA]} does not divide --batch {batch_size}; use a batch that "
                "is a multiple of the data size")
    if sizes[parallel.PIPE] > 1:
        check_pipeline_split(p, args, cfg, sizes, batch_size)
    if sizes[parallel.SEQ] > 1:
        check_sequence_split(p, args, cfg, sizes[parallel.SEQ], seq_len)
        cfg = cfg.replace(sequence_axis=parallel.SEQ, sequence_balance=args.sequence_balance)
    if tensor > 1:
        cfg = cfg.replace(tensor_axis=parallel.TENSOR, sequence_parallel=args.sequence_parallel)
    return mesh, cfg


def microbatches(args) -> int:
    """The pipeline's micro-batches per data part: --microbatches, else the pipe size."""
    if args.mesh is None:
        return 1
    return args.microbatches or parallel.parse_mesh_spec(args.mesh)[parallel.PIPE]


def check_pipeline_split(p: argparse.ArgumentParser, args, cfg, sizes, batch_size: int) -> None:
    """Usage errors for a pipe axis above 1 that the model, the options or the batch do not take."""
    pipe = sizes[parallel.PIPE]
    if cfg.family not in PIPE_FAMILIES:
        p.error(f"--mesh: pipe={pipe}: {cfg.family} cannot run as pipeline stages; it can for "
                f"{', '.join(PIPE_FAMILIES)} (or use a mesh without pipe)")
    for flag, given in (("--compare", args.compare), ("--fp8", cfg.fp8 is not None)):
        if given:
            p.error(f"--mesh: pipe={pipe} cannot be combined with {flag}")
    if sizes[parallel.SEQ] > 1 and sizes[parallel.TENSOR] > 1 and cfg.attn_dropout > 0:
        p.error(f"--mesh: pipe={pipe} with seq={sizes[parallel.SEQ]} and tensor={sizes[parallel.TENSOR]} cannot "
                f"drop attention probabilities (attention dropout {cfg.attn_dropout}: the ring numbers its masks "
                f"over the heads it is given); give --dropout 0 or leave out one of the axes")
    per_data = batch_size // sizes[parallel.DATA]
    if per_data % microbatches(args):
        p.error(f"--mesh: the batch's data part ({per_data} sequences) is not a multiple of the "
                f"{microbatches(args)} micro-batches; give --batch or --microbatches to match")


def check_sequence_split(p: argparse.ArgumentParser, args, cfg, size: int, seq_len: int) -> None:
    """Usage errors for ``--mesh seq=size``: a model without a sequence-parallel path, a
    sequence length it does not divide, and options the ring cannot go with."""
    name = f"seq={size}"
    if cfg.family not in SEQ_FAMILIES:
        p.error(f"--mesh: {name}: {cfg.family} has no sequence-parallel path; it has for "
                f"{', '.join(SEQ_FAMILIES)} (or use a mesh without seq)")
    if seq_len % size:
        p.error(f"--mesh: {name} does not divide --seq {seq_len}; use a sequence length that is a multiple "
                f"of {size}")
    if args.sequence_balance == "zigzag":
        if cfg.family not in ("gpt", "llama"):
            p.error(f"--sequence-balance zigzag balances causal attention (gpt), not {cfg.family}'s; it applies "
                    "to gpt and llama; leave it out")
        if seq_len % (2 * size):
            p.error(f"--mesh: {name} with --sequence-balance zigzag needs --seq a multiple of {2 * size} "
                    f"(2 x seq), got {seq_len}")
    if args.mlm_max_predictions:
        p.error(f"--mesh: {name} cannot be combined with --mlm-max-predictions (picking the predicted positions "
                "would gather the split sequence)")
    if args.sequence_parallel:
        p.error(f"--mesh: {name} cannot be combined with --sequence-parallel (the sequence is already split "
                "over the seq axis); drop one of them")
    if args.compare:
        p.error(f"--mesh: {name} cannot be combined with --compare (the plain-Flax twin has no "
                "sequence-parallel layers)")
    if args.fp8:
        p.error(f"--mesh: {name} cannot be combined with --fp8 (no FP8 layers on sequence parts yet)")
    if args.attention_backend not in ("auto", "flash"):
        p.error(f"--mesh: {name} runs attention as ring attention over flash blocks; use --attention-backend "
                f"flash or auto, not {args.attention_backend}")


def split_sequences(batch: dict, mesh, seq_len: int) -> dict:
    """A batch placed by `training.shard_batch` with its (batch, seq_len) token arrays
    also split along the sequence over the mesh's seq axis."""
    split = NamedSharding(mesh, P(parallel.DATA, parallel.SEQ))
    return {k: jax.device_put(v, split) if v.ndim == 2 and v.shape[1] == seq_len else v
            for k, v in batch.items()}


def describe_mesh(mesh) -> str:
    if mesh is None:
        return "one device"
    shape = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "all axes 1"
    return f"mesh {shape} ({mesh.size} devices, {jax.process_count()} processes)"


# ---------------------------------------------------------------------------- what ran
def ls2_implementation() -> str:
    """What runs jax_ls2's ops here: "cuda" (its kernels) or "reference" (pure JAX)."""
    import jax_ls2  # noqa: PLC0415
    implementation = getattr(jax_ls2, "implementation", None)
    if implementation is not None:
        return implementation()
    return "cuda" if jax_ls2.cuda_available() and jax.default_backend() == "gpu" else "reference"


def describe_impl(impl: str) -> str:
    if impl == "plain":
        return "plain: plain Flax layers (no jax_ls2 code)"
    how = ls2_implementation()
    if how == "cuda":
        return "ls2: jax_ls2 on its CUDA kernels"
    return (f"ls2: jax_ls2 on its pure-JAX reference path, not its CUDA kernels (backend "
            f"{jax.default_backend()})")


# ---------------------------------------------------------------------------- measuring
class PeakMemory:
    """The peak device memory of one run, from the allocator's ``peak_bytes_in_use``.

    That figure is the process's peak so far; a run whose peak stays below an earlier
    run's cannot be measured exactly and is reported as at most the earlier peak."""

    def __init__(self):
        self.before = self._peak()

    @staticmethod
    def _peak():
        stats = jax.local_devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")

    def result(self):
        """(bytes or None, text for the summary)."""
        after = self._peak()
        if after is None:
            return None, f"n/a ({jax.default_backend()} reports no device memory statistics)"
        if self.before is not None and after <= self.before:
            return None, f"<= {after / 1e9:.2f} GB (below an earlier run's peak)"
        return after, f"{after / 1e9:.2f} GB"


def steady(times: list) -> list:
    """Step times after a run's first step, which includes compilation."""
    return times[1:] or times


def clock(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def run_name(args) -> str:
    """The name of the main run: its implementation, "ls2-fp8" with --fp8."""
    return f"{args.impl}-fp8" if args.fp8 else args.impl


def metrics_path(args, name: str):
    """The metrics file of the run named ``name`` (an implementation, or `run_name`);
    None: no file."""
    path = args.metrics or (os.path.join(args.ckpt_dir, "metrics.jsonl") if args.ckpt_dir else None)
    if path is None or name == run_name(args):
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{name}{ext}"


# ---------------------------------------------------------------------------- training
def train(args, cfg, batch_size, seq, *, impl, params_from=None, label=None, metrics=None, mesh=None):
    """Run one training; returns a dict of losses, step times and figures. ``metrics``: the
    JSONL file to write (see `flax_models.metrics`), or None. ``mesh``: None (one
    device) or the mesh of `mesh_from`."""
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        return _train(args, cfg, batch_size, seq, impl=impl, params_from=params_from, label=label,
                      metrics=metrics, mesh=mesh)


def _train(args, cfg, batch_size, seq, *, impl, params_from, label, metrics, mesh):
    t_start = time.perf_counter()
    label = label or impl
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else None
    memory = PeakMemory()
    tx, opt_name = training.make_optimizer(args.lr, args.steps, args.warmup,
                                           fused=args.optimizer == "fused")
    graphdef, state = training.create(cfg, impl=impl, dtype=dtype, seed=args.seed, tx=tx,
                                      params_from=params_from, mesh=mesh,
                                      zero=bool(getattr(args, "zero1", False)),
                                      fsdp=bool(getattr(args, "fsdp", False)),
                                      microbatches=microbatches(args))
    layout = training.optimizer_layout(graphdef, state)
    if layout:
        opt_name = f"{opt_name} (state split over {layout})"

    def place(batch):
        if mesh is None:
            return batch
        batch = training.shard_batch(batch, mesh)
        return batch if cfg.sequence_axis is None else split_sequences(batch, mesh, seq)
    start = 0
    if args.resume:
        if training.latest_step(args.ckpt_dir) is None:
            print(f"{label}: no checkpoint under {args.ckpt_dir}; starting afresh", flush=True)
        else:
            state, start = training.restore_checkpoint(args.ckpt_dir, state, optimizer_layout=layout)
            print(f"{label}: resumed from step {start} ({args.ckpt_dir})", flush=True)
    step_fn = training.make_step(graphdef) if mesh is None else training.make_mesh_step(graphdef, state)
    eval_fn = training.make_eval_step(graphdef) if args.eval_every else None
    eval_data = [place(data.make_batch(cfg, args.seed, i, batch_size, seq, "eval"))
                 for i in range(args.eval_batches)] if eval_fn else []
    unit = "images" if cfg.family == "vit" else "tokens"
    writer = metrics and MetricsWriter(metrics, label, append=bool(args.resume and start))
    if writer:
        writer.write("run", model=cfg.family, preset=args.preset,
                     implementation="plain" if impl == "plain" else ls2_implementation(),
                     batch=batch_size, seq=seq, dtype=args.dtype, steps=args.steps,
                     start_step=start, device=jax.local_devices()[0].device_kind, unit=unit)
    per_step = None
    losses, times, evals = [], [], []
    for step in range(start, args.steps):
        batch = data.make_batch(cfg, args.seed, step, batch_size, seq)
        per_step = data.tokens_in(cfg, batch)
        batch = place(batch)
        t0 = time.perf_counter()
        state, loss, aux = step_fn(state, batch)
        loss = float(training.to_host(loss))  # blocks until the step is done
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        done = step + 1
        if not np.isfinite(loss):
            raise FloatingPointError(f"train: loss is {loss} at step {step}")
        if not bool(training.to_host(aux.get("grads_finite", True))):
            raise FloatingPointError(f"train: the optimizer flagged step {step}: its gradients hold inf/NaN "
                                     "(the update was applied; the optimizer's skip_nonfinite or loss_scale "
                                     "skips such steps), or its learning rate is not a finite number >= 0 "
                                     "(the params were left as they were)")
        if writer:
            writer.write("step", step=done, loss=loss, step_ms=1e3 * times[-1],
                         rate=per_step / times[-1] if len(times) > 1 else None,
                         elapsed_s=time.perf_counter() - t_start)
        if args.ckpt_dir and args.save_every and done % args.save_every == 0:
            training.save_checkpoint(args.ckpt_dir, done, state,
                                     model=f"{cfg.family}/{args.preset} {impl}", optimizer_layout=layout)
            print(f"{label}: saved step {done} ({args.ckpt_dir})", flush=True)
        if eval_fn and (done % args.eval_every == 0 or done == args.steps):
            ev = float(np.mean([float(training.to_host(eval_fn(state, b))) for b in eval_data]))
            evals.append((done, ev))
            if writer:
                writer.write("eval", step=done, eval_loss=ev)
            say(f"{label} step {done}: held-out loss {ev:.4f} ({args.eval_batches} batches)")
        if done % args.log_every == 0 or done == args.steps:
            median = float(np.median(steady(times)))
            say(f"{label} step {done}/{args.steps} | loss {loss:.4f} | "
                f"{per_step / median:,.0f} {unit}/s | elapsed {clock(time.perf_counter() - t_start)} "
                f"| ETA {clock(median * (args.steps - done))}")
    peak, peak_text = memory.result()
    median_s = float(np.median(steady(times))) if times else float("nan")
    rate = per_step / median_s if times else float("nan")
    if writer:
        writer.write("summary", final_loss=losses[-1] if losses else None,
                     median_ms=1e3 * median_s if times else None,
                     rate=rate if times else None, peak_bytes=peak)
        writer.close()
    return {"impl": impl, "label": label, "optimizer": opt_name, "losses": losses, "evals": evals,
            "start": start, "ms_median": 1e3 * median_s, "rate": rate, "unit": unit,
            "peak_bytes": peak, "peak": peak_text, "metrics": metrics, "state": state,
            "graphdef": graphdef}


def summary(r):
    if not r["losses"]:
        return f"{r['label']:>5}: no steps left to run (the checkpoint is at step {r['start']})"
    ev = f" | held-out loss {r['evals'][-1][1]:.4f}" if r["evals"] else ""
    return (f"{r['label']:>5}: final loss {r['losses'][-1]:.4f}{ev} | step {r['ms_median']:.1f} ms "
            f"(median after the first step) | {r['rate']:,.0f} {r['unit']}/s (from that median) "
            f"| peak memory {r['peak']} | {r['optimizer']}")


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    # first, before anything touches a device: with several processes, jax.devices()
    # then lists the devices of all of them
    parallel.initialize_distributed(cpu_collectives="gloo")
    cfg, batch_size, seq = config_from(args)
    if cfg.family in TEXT_FAMILIES and seq > cfg.max_len:
        p.error(f"--seq {seq} exceeds the {cfg.max_len} positions of {cfg.family}/{args.preset}; give --max-len "
                f"{seq} (or more) to train on longer sequences")
    mesh, cfg = mesh_from(p, args, cfg, batch_size, seq)
    # with --fp8 the twin is jax_ls2 without FP8, else the other implementation
    twin = "ls2" if args.fp8 else ("plain" if args.impl == "ls2" else "ls2")
    impls = [args.impl] + ([twin] if args.compare and twin != args.impl else [])
    fp8_text = f", FP8 GEMMs ({cfg.fp8})" if cfg.fp8 is not None else ""
    per_example = (f"{cfg.image_size}x{cfg.image_size} images" if cfg.family == "vit" else f"{seq}")
    print(f"{cfg.family}/{args.preset}: batch {batch_size} x {per_example}, {args.dtype}{fp8_text}, "
          f"{args.steps} steps on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"{describe_mesh(mesh)}",
          flush=True)
    for impl in impls:
        print(f"implementation {describe_impl(impl)}", flush=True)
    if cfg.sequence_axis is not None:
        print("attention: ring attention over flash blocks along seq (its dropout masks are those of "
              "--attention-backend flash on one device)", flush=True)
    first = train(args, cfg, batch_size, seq, impl=args.impl, label=run_name(args),
                  metrics=metrics_path(args, run_name(args)), mesh=mesh)
    print(summary(first), flush=True)
    if not args.compare:
        return first
    first.pop("state")  # frees its buffers before the twin's run, whose memory is measured
    ref_model = fm.build(cfg, impl=args.impl, dtype=None, seed=args.seed)
    # the plain-Flax baseline trains with optax.adamw (no jax_ls2 code at all)
    twin_opt = "optax" if twin == "plain" else args.optimizer
    twin_args = argparse.Namespace(**{**vars(args), "ckpt_dir": None, "save_every": 0,
                                      "optimizer": twin_opt, "fp8": False, "zero1": False,
                                      "fsdp": False})
    second = train(twin_args, cfg.replace(fp8=None), batch_size, seq, impl=twin, params_from=ref_model,
                   label=twin, metrics=metrics_path(args, twin), mesh=mesh)
    print(summary(second), flush=True)
    ls2, base = (first, second) if args.impl == "ls2" else (second, first)
    diff = np.abs(np.asarray(ls2["losses"]) - np.asarray(base["losses"]))
    rel = diff / np.maximum(np.abs(np.asarray(base["losses"])), 1e-12)
    ratio = "jax_ls2 / jax_ls2 FP8" if args.fp8 else "plain / jax_ls2"
    print(f"speedup ({ratio} step time): {base['ms_median'] / ls2['ms_median']:.2f}x "
          f"(ratio of the median step times above) | loss difference: final {diff[-1]:.2e}, "
          f"max {diff.max():.2e} (max relative {rel.max():.2%})")
    if ls2_implementation() != "cuda":
        print(f"note: on {jax.default_backend()} jax_ls2 runs its pure-JAX reference path, so "
              "this speedup compares two reference (XLA) paths, not the CUDA kernels",
              flush=True)
    if first["metrics"]:
        print(f"metrics: {first['metrics']} {second['metrics']} (plot: python -m flax_models.plot "
              f"{first['metrics']} {second['metrics']} -o loss.png)", flush=True)
    return first, second


def cli(argv=None) -> None:
    """``main`` with a checkpoint that cannot be restored reported as one line, exit 1."""
    try:
        main(argv)
    except training.CheckpointError as e:
        sys.exit(f"train: {e}")


if __name__ == "__main__":
    cli()
