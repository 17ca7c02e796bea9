"""The LLaMA family in the library's modes: FP8 GEMMs (``--fp8``) tracking bf16 for 50
steps of the tiny model, with the FP8 meta beside unchanged params; the training command
on a pipe x data x seq x tensor mesh of 16 CPU devices printing the one-device losses."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import flax_models as fm
from jax_ls2 import fp8
from numerics import xla_flags_with_devices
from train_runs import printed_losses, run_main

STEPS = 50


@pytest.fixture(scope="module")
def fp8_compare_run():
    argv = ["--model", "llama", "--preset", "tiny", "--batch", "2", "--seq", "16", "--steps", str(STEPS),
            "--dtype", "bfloat16", "--lr", "3e-3", "--warmup", "1", "--eval-every", "0", "--quiet", "--fp8",
            "--fp8-amax-history", "8", "--compare"]
    return run_main(argv)


def test_llama_fp8_tracks_bf16_within_2_percent_every_step(fp8_compare_run):
    (first, second), _ = fp8_compare_run
    assert first["label"] == "ls2-fp8" and second["label"] == "ls2"
    f8, bf16 = np.asarray(first["losses"]), np.asarray(second["losses"])
    assert len(f8) == len(bf16) == STEPS
    rel = np.abs(f8 - bf16) / np.abs(bf16)
    assert np.all(rel <= 0.02), (f8, bf16, rel)
    assert bf16[0] - bf16[-1] > 0.02 * bf16[0], bf16  # it trained: the loss moved beyond the tolerance


def test_llama_fp8_has_a_meta_per_gemm_and_the_bf16_params():
    recipe = fp8.DelayedScaling()
    cfg = fm.get_config("llama", "tiny", fp8=recipe)
    model = fm.build(cfg, impl="ls2")
    assert fp8.count_metas(model) == 4 * cfg.num_layers  # qkv, out, gate_up, down
    bf16 = fm.build(cfg.replace(fp8=None), impl="ls2")
    assert jax.tree.structure(nnx.state(model, nnx.Param)) == jax.tree.structure(nnx.state(bf16, nnx.Param))
    assert fp8.count_metas(bf16) == 0


def test_command_on_a_4d_mesh_of_16_devices():
    """``python -m flax_models.train --model llama ... --mesh pipe=2,data=2,seq=2,tensor=2
    --zero1``: layers as pipeline stages, grouped-query heads and the MLP over tensor, the
    sequence through the ring, the optimizer state over data."""
    run = ["--model", "llama", "--preset", "tiny", "--batch", "8", "--seq", "16", "--steps", "3", "--eval-every",
           "0", "--log-every", "1"]
    _, want_out = run_main(run)
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(16), JAX_PLATFORMS="cpu")
    mesh = "pipe=2,data=2,seq=2,tensor=2"
    done = subprocess.run([sys.executable, "-m", "flax_models.train", *run, "--mesh", mesh, "--zero1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"mesh {mesh} (16 devices, 1 processes)" in done.stdout, done.stdout
    assert len(printed_losses(done.stdout, 3)) == 3
    assert printed_losses(done.stdout, 3) == printed_losses(want_out, 3)
