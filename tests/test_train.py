"""The training command: bit-for-bit resume, convergence of the jax_ls2 models against
their plain-Flax twins (the command's interface and --compare: test_train_cli.py)."""
import functools

import numpy as np
import pytest

import flax_models as fm
from flax_models import train as T
from flax_models import training


def _run(argv):
    args = T.parse_args(argv + ["--quiet", "--eval-every", "0"])
    cfg, b, s = T.config_from(args)
    return args, cfg, b, s


def _losses(argv, impl, params_from=None):
    args, cfg, b, s = _run(argv)
    return T.train(args, cfg, b, s, impl=impl, params_from=params_from)["losses"]


@pytest.mark.slow
def test_resume_is_bit_for_bit(tmp_path):
    base = ["--model", "bert", "--steps", "6", "--batch", "2", "--seq", "16", "--dropout", "0.1"]
    hits = training.make_step.cache_info().hits
    straight = _losses(base, "ls2")
    ckpt = str(tmp_path / "ckpt")
    _losses(["--model", "bert", "--steps", "3", "--batch", "2", "--seq", "16", "--dropout", "0.1",
             "--ckpt-dir", ckpt, "--save-every", "3"], "ls2")
    resumed = _losses(base + ["--ckpt-dir", ckpt, "--resume"], "ls2")
    assert len(resumed) == 3
    assert resumed == straight[3:]  # exact
    # the three runs build equal models and optimizers, so they share one compiled step
    assert training.make_step.cache_info().hits >= hits + 2


@functools.cache
def _initial_model(family, seed):
    """The weights both implementations start from, built once per family: the params
    depend on the seed and the layer shapes only (dropout rates and dtype create none)."""
    return fm.build(fm.get_config(family, "tiny"), impl="ls2", seed=seed)


def _converge(family, steps, dtype="float32", dropout=0.0, batch=4):
    seq = [] if family == "vit" else ["--seq", "32"]  # vit takes images
    argv = ["--model", family, "--steps", str(steps), "--batch", str(batch), *seq,
            "--dtype", dtype, "--dropout", str(dropout), "--optimizer", "optax"]
    args, cfg, _, _ = _run(argv)
    init = _initial_model(family, args.seed)
    ours = np.asarray(_losses(argv, "ls2", params_from=init))
    twin = np.asarray(_losses(argv, "plain", params_from=init))
    return ours, twin


@pytest.mark.slow
@pytest.mark.parametrize("family", fm.FAMILIES)
def test_convergence_fp32_every_step(family):
    ours, twin = _converge(family, 100)
    assert ours[-1] < ours[0]  # it learns
    np.testing.assert_allclose(ours, twin, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", fm.FAMILIES)
def test_convergence_bf16_every_step(family):
    ours, twin = _converge(family, 100, dtype="bfloat16")
    np.testing.assert_allclose(ours, twin, rtol=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("family", fm.FAMILIES)
@pytest.mark.optimized_cpu_code
def test_convergence_with_dropout_final_loss(family):
    # different masks: compare the mean of the last 20 steps, batch 16 to tame the noise
    ours, twin = _converge(family, 100, dropout=0.1, batch=16)
    assert abs(ours[-20:].mean() - twin[-20:].mean()) <= 0.02 * twin[-20:].mean()
