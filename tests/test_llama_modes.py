"""The LLaMA family in the library's modes: FP8 GEMMs (``--fp8``) tracking bf16 for 50
steps of the tiny model, with the FP8 meta beside unchanged params."""
import jax
import numpy as np
import pytest
from flax import nnx

import flax_models as fm
from jax_ls2 import fp8
from train_runs import run_main

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
