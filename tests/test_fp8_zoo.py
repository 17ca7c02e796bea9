"""FP8 in the model zoo: ``python -m flax_models.train ... --fp8 --compare`` trains the
tiny GPT and BERT with FP8 GEMMs beside their bf16 jax_ls2 twins from the same weights
and data; the FP8 loss tracks the bf16 one within 2% at every step, and the step
updates the FP8 meta."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_models as fm
from flax_models import data, training
from flax_models import train as T
from jax_ls2 import fp8
from train_runs import run_main as _main

STEPS = 6
# A learning rate that moves the loss within the few steps, so that tracking means something.
ARGS = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--steps", str(STEPS), "--dtype", "bfloat16",
        "--lr", "1e-2", "--warmup", "1", "--eval-every", "0", "--quiet", "--fp8", "--fp8-amax-history", "8",
        "--compare"]


@pytest.fixture(scope="module", params=["gpt", "bert"])
def fp8_compare_run(request):
    return request.param, *_main(["--model", request.param] + ARGS)


def test_fp8_loss_tracks_bf16_within_2_percent_every_step(fp8_compare_run):
    family, (first, second), out = fp8_compare_run
    assert first["label"] == "ls2-fp8" and second["label"] == "ls2" and second["impl"] == "ls2"
    f8, bf16 = np.asarray(first["losses"]), np.asarray(second["losses"])
    assert len(f8) == len(bf16) == STEPS
    rel = np.abs(f8 - bf16) / np.abs(bf16)
    assert np.all(rel <= 0.02), (family, f8, bf16, rel)
    # The runs trained: the loss moved by more than the tolerance.
    assert bf16[0] - bf16[-1] > 0.02 * bf16[0], bf16
    assert "speedup (jax_ls2 / jax_ls2 FP8 step time)" in out
    assert f"{family}/tiny: batch 4 x 32, bfloat16, FP8 GEMMs (DelayedScaling(" in out


def test_train_step_steps_the_meta_every_step(fp8_compare_run):
    family = fp8_compare_run[0]
    # The run's model, optimizer and data again (the compiled step is the run's).
    args = T.parse_args(["--model", family] + ARGS)
    cfg, batch, seq = T.config_from(args)
    tx, _ = training.make_optimizer(args.lr, args.steps, args.warmup)
    graphdef, state = training.create(cfg, impl="ls2", dtype=jnp.bfloat16, seed=args.seed, tx=tx)
    step = training.make_step(graphdef)
    for i in range(STEPS):
        state, _, _ = step(state, data.make_batch(cfg, args.seed, i, batch, seq))
    model, _ = nnx.merge(graphdef, state)
    metas = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, fp8.FP8Meta))]
    assert len(metas) == 4 * fm.get_config(family).num_layers  # q|k|v, out, fc1, fc2
    for meta in metas:
        history = np.asarray(meta.amax_history)
        # One entry per step (newest first), every operand observed at every step,
        # and the scales follow the recipe ("max" over the history, margin 0).
        assert np.all(history[:, :STEPS] > 0) and np.all(history[:, STEPS:] == 0), history
        limits = np.asarray([fp8.fp8_max(d) for d in fp8.DelayedScaling().operand_dtypes()], np.float32)
        np.testing.assert_array_equal(meta.scale, limits / history.max(axis=1))
        np.testing.assert_array_equal(meta.scale_inv, (1.0 / np.asarray(meta.scale)).astype(np.float32))


def test_the_bf16_twin_holds_no_meta(fp8_compare_run):
    _, (_, second), _ = fp8_compare_run
    model, _ = nnx.merge(second["graphdef"], second["state"])
    assert fp8.count_metas(model) == 0 and model.cfg.fp8 is None


@pytest.mark.parametrize("argv, message", [
    (["--fp8", "--impl", "plain"], "--fp8 needs --impl ls2"),
    (["--fp8-format", "e4m3"], "--fp8-format applies with --fp8"),
    (["--fp8", "--fp8-amax-history", "0"], "--fp8-amax-history must be at least 1, got 0"),
])
def test_fp8_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--model", "gpt"] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_fp8_config_reaches_the_layers_and_not_the_plain_twin():
    recipe = fp8.DelayedScaling(fp8_format="e4m3", amax_history_len=2)
    args = T.parse_args(["--model", "vit", "--fp8", "--fp8-format", "e4m3", "--fp8-amax-history", "2"])
    cfg, _, _ = T.config_from(args)
    assert cfg.fp8 == recipe
    for family in fm.FAMILIES:
        cfg = fm.get_config(family, fp8=recipe)
        model = fm.build(cfg, impl="ls2")
        per_layer = 7 if family == "transformer" else 4  # q, k and v share one meta
        encoder_layers = cfg.num_layers if family == "transformer" else 0
        assert fp8.count_metas(model) == per_layer * cfg.num_layers + 4 * encoder_layers, family
        with pytest.raises(ValueError, match="build: cfg.fp8 needs impl='ls2'"):
            fm.build(cfg, impl="plain")
    assert jax.tree.structure(nnx.state(fm.build(fm.get_config("gpt", fp8=recipe)), nnx.Param)) == \
        jax.tree.structure(nnx.state(fm.build(fm.get_config("gpt")), nnx.Param))
