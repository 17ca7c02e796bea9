"""The training command with ``--mesh pipe=N``: GPT's layer stack as GPipe stages over
the pipe axis, with data and tensor parallelism, prints the losses of the run without a
mesh; what cannot run as pipeline stages is a usage error."""

import numpy as np
import pytest
from flax import nnx

from flax_models import train as T
from flax_models.pipeline import PipelinedEncoder
from train_runs import printed_losses, run_main as _main

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


@pytest.mark.parametrize("extra, message", [
    (["--model", "vit", "--mesh", "pipe=2,data=4"], "--mesh: pipe=2: vit cannot run as pipeline stages"),
    (["--mesh", "pipe=2,data=4", "--compare"], "--mesh: pipe=2 cannot be combined with --compare"),
    (["--mesh", "pipe=2,seq=4"], "--mesh: pipe=2 cannot be combined with --mesh seq"),
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
    with pytest.raises(SystemExit) as e:
        T.main(argv + extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
