"""The training command with ``--mesh seq=N``: GPT's and BERT's sequence split over the
seq axis (attention through ring attention), alone and with the data and tensor axes,
prints the losses of the run without a mesh; what cannot be split over seq is a usage
error."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_models as fm
from flax_models import data, training
from flax_models import train as T
from jax_ls2 import parallel
from train_runs import printed_losses, run_main as _main
from numerics import xla_flags_with_devices

# the ring runs flash attention blocks, whose dropout masks are the one-device "flash"
# backend's (not the "fused" ones "auto" picks under dropout on one device)
RUN = ["--model", "gpt", "--preset", "tiny", "--batch", "8", "--seq", "16", "--steps", "3", "--dropout", "0.1",
       "--attention-backend", "flash", "--eval-every", "0", "--log-every", "1"]


@pytest.fixture(scope="module")
def one_device_run():
    return _main(RUN)


@pytest.mark.slow
@pytest.mark.parametrize("spec, balance", [("seq=8", "none"), ("data=2,seq=4", "none"),
                                           ("data=2,seq=2,tensor=2", "none"), ("data=2,seq=4", "zigzag")])
def test_sequence_mesh_prints_the_same_losses(one_device_run, spec, balance):
    want, want_out = one_device_run
    got, out = _main(RUN + ["--mesh", spec, "--zero1", "--sequence-balance", balance])
    assert f"mesh {spec} (8 devices, 1 processes)" in out
    assert "attention: ring attention over flash blocks along seq" in out
    assert "ring attention" not in want_out
    assert len(printed_losses(out, 3)) == 3 and printed_losses(out, 3) == printed_losses(want_out, 3)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    model, _ = nnx.merge(got["graphdef"], got["state"])
    assert model.cfg.sequence_axis == "seq" and model.cfg.sequence_balance == balance


@pytest.mark.slow
def test_command_on_four_devices_with_seq_4(one_device_run, tmp_path):
    """``python -m flax_models.train ... --mesh seq=4`` in a process of 4 CPU devices,
    evaluating on held-out data as it goes."""
    _, want_out = one_device_run
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(4), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "flax_models.train", *RUN, "--mesh", "seq=4", "--eval-every", "3",
                           "--eval-batches", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh seq=4 (4 devices, 1 processes)" in done.stdout
    assert len(printed_losses(done.stdout, 3)) == 3 and printed_losses(done.stdout, 3) == printed_losses(want_out, 3)
    assert re.search(r"^ls2 step 3: held-out loss \d+\.\d{4}", done.stdout, re.M), done.stdout


@pytest.mark.slow
def test_bert_on_a_sequence_mesh_prints_the_same_losses():
    bert = RUN[:1] + ["bert"] + RUN[2:]
    want, want_out = _main(bert)
    got, out = _main(bert + ["--mesh", "data=2,seq=4"])
    assert len(printed_losses(out, 3)) == 3 and printed_losses(out, 3) == printed_losses(want_out, 3)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)


@pytest.mark.slow
def test_sequence_mesh_with_the_default_backend_trains():
    """``--mesh data=2,seq=4`` with ``--attention-backend auto`` (no dropout, so the one-device
    run's attention backend does not change the masks) prints the one-device losses."""
    plain = [a for a in RUN if a not in ("--attention-backend", "flash")]
    plain[plain.index("--dropout") + 1] = "0"
    want, want_out = _main(plain)
    got, out = _main(plain + ["--mesh", "data=2,seq=4"])
    assert printed_losses(out, 3) == printed_losses(want_out, 3)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)


def test_token_arrays_are_split_over_data_and_seq():
    mesh = parallel.make_mesh("data=2,seq=4")
    cfg = fm.get_config("gpt", "tiny")
    batch = T.split_sequences(training.shard_batch(data.make_batch(cfg, 0, 0, 4, 16), mesh), mesh, 16)
    assert {k: v.sharding.spec for k, v in batch.items()} == {"input_ids": P("data", "seq"),
                                                              "labels": P("data", "seq")}
    assert batch["input_ids"].addressable_shards[0].data.shape == (2, 4)


@pytest.mark.parametrize("extra, message", [
    (["--model", "transformer", "--mesh", "data=2,seq=4"],
     "--mesh: seq=4: transformer has no sequence-parallel path; it has for bert, gpt"),
    (["--model", "vit", "--mesh", "seq=8"], "vit has no sequence-parallel path"),
    (["--model", "bert", "--mesh", "seq=8", "--mlm-max-predictions", "4"],
     "seq=8 cannot be combined with --mlm-max-predictions"),
    (["--model", "gpt", "--seq", "18", "--mesh", "data=2,seq=4"], "--mesh: seq=4 does not divide --seq 18"),
    (["--model", "gpt", "--seq", "20", "--mesh", "data=2,seq=4", "--sequence-balance", "zigzag"],
     "--mesh: seq=4 with --sequence-balance zigzag needs --seq a multiple of 8 (2 x seq), got 20"),
    (["--model", "gpt", "--mesh", "data=8", "--sequence-balance", "zigzag"],
     "--sequence-balance zigzag needs --mesh with seq above 1"),
    (["--model", "bert", "--mesh", "seq=8", "--sequence-balance", "zigzag"],
     "--sequence-balance zigzag balances causal attention (gpt), not bert's"),
    (["--model", "gpt", "--mesh", "data=2,tensor=2,seq=2", "--sequence-parallel"],
     "seq=2 cannot be combined with --sequence-parallel"),
    (["--model", "gpt", "--mesh", "seq=8", "--compare"], "seq=8 cannot be combined with --compare"),
    (["--model", "gpt", "--mesh", "seq=8", "--fp8"], "seq=8 cannot be combined with --fp8"),
    (["--model", "gpt", "--mesh", "seq=8", "--attention-backend", "fused"],
     "seq=8 runs attention as ring attention over flash blocks; use --attention-backend flash or auto"),
])
def test_sequence_mesh_usage_errors(monkeypatch, capsys, extra, message):
    monkeypatch.setattr(T, "train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as e:
        T.main(["--preset", "tiny"] + extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
