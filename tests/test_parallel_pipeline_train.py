"""The training command with ``--mesh pipe=N``: GPT's layer stack as GPipe stages over
the pipe axis, with data, tensor and sequence parallelism (up to all four axes, in a
process of 16 CPU devices), prints the losses of the run without a mesh; what cannot run
as pipeline stages is a usage error."""
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from flax_models import train as T
from flax_models.pipeline import PipelinedEncoder
from train_runs import printed_losses, run_main as _main
from numerics import xla_flags_with_devices

RUN = ["--model", "gpt", "--preset", "tiny", "--batch", "8", "--seq", "16", "--steps", "3", "--dropout", "0.1",
       "--eval-every", "0", "--log-every", "1"]


@pytest.mark.slow
def test_pipeline_mesh_prints_the_same_losses():
    want, want_out = _main(RUN)
    got, out = _main(RUN + ["--mesh", "pipe=2,data=2,tensor=2"])
    assert "mesh pipe=2,data=2,tensor=2 (8 devices, 1 processes)" in out, out
    assert len(printed_losses(out, 3)) == 3 and printed_losses(out, 3) == printed_losses(want_out, 3)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    model, _ = nnx.merge(got["graphdef"], got["state"])
    assert any(isinstance(v, PipelinedEncoder) for v in vars(model).values())


@pytest.mark.slow
def test_pipeline_on_sequence_shards_prints_the_same_losses():
    """Stages on (pipe 2, data 2, seq 2), attention through the ring with dropout: the
    losses of one device with flash attention (whose masks the ring draws)."""
    flash = RUN + ["--attention-backend", "flash"]
    want, want_out = _main(flash)
    got, out = _main(flash + ["--mesh", "pipe=2,data=2,seq=2"])
    assert "attention: ring attention over flash blocks along seq" in out
    assert len(printed_losses(out, 3)) == 3 and printed_losses(out, 3) == printed_losses(want_out, 3)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)


@pytest.mark.slow
def test_command_on_a_4d_mesh_of_16_devices():
    """``python -m flax_models.train ... --mesh pipe=2,data=2,seq=2,tensor=2`` in a process
    of 16 CPU devices (no dropout: attention dropout does not go with seq and tensor
    together in the stages) prints the one-device losses."""
    run = RUN[:RUN.index("--dropout")] + ["--dropout", "0"] + RUN[RUN.index("--dropout") + 2:]
    _, want_out = _main(run)
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(16), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "flax_models.train", *run, "--mesh", "pipe=2,data=2,seq=2,tensor=2"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh pipe=2,data=2,seq=2,tensor=2 (16 devices, 1 processes)" in done.stdout, done.stdout
    assert len(printed_losses(done.stdout, 3)) == 3
    assert printed_losses(done.stdout, 3) == printed_losses(want_out, 3)


@pytest.mark.parametrize("extra, message", [
    (["--model", "vit", "--mesh", "pipe=2,data=4"], "--mesh: pipe=2: vit cannot run as pipeline stages"),
    (["--mesh", "pipe=2,data=4", "--compare"], "--mesh: pipe=2 cannot be combined with --compare"),
    (["--mesh", "pipe=2,seq=2,tensor=2"], "--mesh: pipe=2 with seq=2 and tensor=2 cannot drop attention "
                                          "probabilities"),
    (["--mesh", "pipe=2,data=4", "--microbatches", "3"],
     "--mesh: the batch's data part (2 sequences) is not a multiple of the 3 micro-batches"),
    (["--microbatches", "2"], "--microbatches needs --mesh with pipe above 1"),
    (["--mesh", "pipe=2,data=4", "--microbatches", "-1"], "--microbatches must be >= 1, got -1"),
])
def test_pipeline_usage_errors(capsys, extra, message):
    argv = list(RUN)
    if "--model" in extra:
        argv[1] = extra[1]
        extra = extra[2:]
    if argv[1] == "vit":  # vit takes images: --seq is a usage error of its own
        del argv[argv.index("--seq"):argv.index("--seq") + 2]
    with pytest.raises(SystemExit) as e:
        T.main(argv + extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
