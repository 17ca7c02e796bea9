"""jax_ls2.parallel.initialize_distributed: the settings it reads, and two real processes
on localhost (CPU devices, gloo collectives) computing a jitted sum and a tensor-parallel
MLP's loss and gradients over one mesh spanning both, and running the training command
(data parallelism with ZeRO-1) with the losses of one process."""
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jax_ls2 import parallel
from jax_ls2.parallel import distributed
from numerics import xla_flags_with_devices

_ALL_VARS = (distributed.ENV_COORDINATOR_ADDRESS, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
             *distributed.CLUSTER_PROCESS_COUNTS)


@pytest.fixture
def calls(monkeypatch):
    """A clean environment, and jax.distributed.initialize replaced by a recorder."""
    for var in _ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    made = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: made.append(args))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    return made


def test_single_process_is_a_no_op(calls, monkeypatch):
    assert parallel.initialize_distributed() is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert parallel.initialize_distributed() is False
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert parallel.initialize_distributed(num_processes=1, process_id=0) is False
    assert calls == []


def test_settings_come_from_the_environment(calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert parallel.initialize_distributed() is True
    assert calls == [("10.0.0.1:1234", 4, 3)]


def test_arguments_override_the_environment(calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert parallel.initialize_distributed("host:99", 2, 0) is True
    assert calls == [("host:99", 2, 0)]


def test_a_scheduler_job_is_left_to_jax_cluster_detection(calls, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert parallel.initialize_distributed() is True
    assert calls == [(None, None, None)]


def test_already_initialised_returns_true_without_a_second_call(calls, monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert parallel.initialize_distributed("host:1", 2, 0) is True
    assert calls == []


@pytest.mark.parametrize("env, kwargs, words", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, {}, ["2 processes need JAX_COORDINATOR_ADDRESS"]),
    ({"JAX_NUM_PROCESSES": "2"}, {"coordinator_address": "h:1"}, ["2 processes need JAX_PROCESS_ID"]),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, {}, ["set JAX_NUM_PROCESSES"]),
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, {"process_id": 2}, ["process_id must be in [0, 2)"]),
    ({"JAX_NUM_PROCESSES": "two"}, {}, ["num_processes (JAX_NUM_PROCESSES)", "'two'"]),
    ({"JAX_NUM_PROCESSES": "0"}, {}, ["num_processes (JAX_NUM_PROCESSES) must be an integer >= 1, got 0"]),
    ({"JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "1"}, {}, ["process_id must be 0 in a single process"]),
    ({}, {"cpu_collectives": "nccl"}, ["cpu_collectives must be one of ('gloo', 'mpi')", "'nccl'"]),
])
def test_incomplete_or_bad_settings(calls, monkeypatch, env, kwargs, words):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match="initialize_distributed") as info:
        parallel.initialize_distributed(**kwargs)
    for word in words:
        assert word in str(info.value)
    assert calls == []


_WORKER = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_ls2 import parallel
    assert parallel.initialize_distributed(cpu_collectives="gloo") is True
    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = parallel.make_mesh("data=2,tensor=2")
    # each tensor group (the innermost axis) lies within one process
    for group in mesh.devices.reshape(-1, 2):
        assert len({d.process_index for d in group}) == 1, mesh.devices
    whole = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) ** 1.5
    x = jax.make_array_from_callback(whole.shape, NamedSharding(mesh, P("data", "tensor")), lambda i: whole[i])
    total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, P()))(x)
    print("RESULT", jax.process_index(), repr(float(total)), repr(float(np.sum(whole * whole))))

    # a column -> tanh -> row MLP split over the tensor axis across the two processes
    from flax import nnx
    fc1 = parallel.ColumnParallelLinear(6, 8, rngs=nnx.Rngs(0))
    fc2 = parallel.RowParallelLinear(8, 6, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split((fc1, fc2))
    def loss(st, a):
        first, second = nnx.merge(graphdef, st)
        return jnp.sum(second(jnp.tanh(first(a))) ** 2)
    inputs = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, jnp.asarray(inputs))
    def place(value, spec):
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda i: host[i])
    split_state = jax.tree.map(place, state, nnx.get_partition_spec(state))
    xs = place(inputs, P("data"))
    replicated = NamedSharding(mesh, P())
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), out_shardings=replicated)(split_state, xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g.addressable_data(0)), np.asarray(w), rtol=1e-5, atol=1e-6)
    print("MLP", jax.process_index(), "matches")
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_compute_over_one_mesh():
    port = _free_port()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if k not in _ALL_VARS}
        env.update(XLA_FLAGS=xla_flags_with_devices(2), JAX_PLATFORMS="cpu",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = {}
    for rc, out, err in outs:
        assert rc == 0, err[-3000:]
        for line in out.splitlines():
            if line.startswith("RESULT"):
                _, index, got, want = line.split()
                results[int(index)] = (float(got), float(want))
    assert sorted(results) == [0, 1]
    assert all(f"MLP {i} matches" in out for i, (_, out, _) in enumerate(outs))
    for got, want in results.values():
        assert got == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------------------- the training command
# 3 steps of GPT tiny with dropout on: two processes of 2 CPU devices each (mesh data=4,
# ZeRO-1 over it, a checkpoint at step 2) against one device in this process.
TRAIN_ARGS = ["--model", "gpt", "--preset", "tiny", "--batch", "8", "--seq", "16", "--steps", "3",
              "--dropout", "0.1", "--eval-every", "0", "--log-every", "1", "--quiet"]


def _launch(argv_of, devices_each: int = 2, timeout: int = 240) -> list:
    """Runs ``argv_of(i)`` (a command line) as processes 0 and 1 of one jax.distributed
    job on localhost; returns their (returncode, stdout, stderr)."""
    port = _free_port()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if k not in _ALL_VARS}
        env.update(XLA_FLAGS=xla_flags_with_devices(devices_each), JAX_PLATFORMS="cpu",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen(argv_of(i), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.fixture(scope="module")
def two_process_training(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_process_training")
    ckpt = root / "ckpt"
    outs = _launch(lambda i: [sys.executable, "-m", "flax_models.train", *TRAIN_ARGS, "--mesh", "data=4", "--zero1",
                              "--metrics", str(root / f"metrics{i}.jsonl"), "--ckpt-dir", str(ckpt),
                              "--save-every", "2"])
    for rc, _, err in outs:
        assert rc == 0, err[-3000:]
    from flax_models import metrics
    losses = [[r["loss"] for r in metrics.read(str(root / f"metrics{i}.jsonl")) if r["kind"] == "step"]
              for i in range(2)]
    return losses, [out for _, out, _ in outs], str(ckpt)


@pytest.mark.slow
def test_two_processes_train_with_the_losses_of_one(two_process_training):
    from flax_models import train
    losses, outs, _ = two_process_training
    for out in outs:
        assert "mesh data=4 (4 devices, 2 processes)" in out and "state split over data=4 (ZeRO-1)" in out
    one = train.main(TRAIN_ARGS)["losses"]
    assert len(one) == 3
    for got in losses:
        # the batch split over 4 devices of 2 processes: the same masks, sums in another order
        np.testing.assert_allclose(got, one, rtol=1e-6)


@pytest.mark.slow
def test_checkpoint_of_two_processes_resumes_in_one(two_process_training):
    """The step-2 checkpoint written shard by shard by both processes restores (its
    checksum verified) onto a one-process mesh of the same shape, and step 3 from it
    gives the two-process step-3 loss."""
    from flax_models import train
    losses, _, ckpt = two_process_training
    args = train.parse_args(TRAIN_ARGS + ["--mesh", "data=4", "--zero1", "--ckpt-dir", ckpt, "--resume"])
    cfg, batch, seq = train.config_from(args)
    mesh = parallel.make_mesh("data=4", devices=jax.devices()[:4])
    resumed = train.train(args, cfg, batch, seq, impl="ls2", mesh=mesh)
    assert resumed["start"] == 2 and len(resumed["losses"]) == 1
    np.testing.assert_allclose(resumed["losses"], losses[0][2:], rtol=1e-6)
