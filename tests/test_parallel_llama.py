"""The LLaMA family on meshes of the 8 simulated CPU devices: the tiny model trained 3
steps with the fused AdamW, the sequence split over seq (attention through ring
attention, zigzag-balanced or not) with the batch over data, against the same model on
one device with flash attention (whose dropout masks the ring draws): losses, every
gradient and the params after the steps."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parallel_zoo import DROPOUT, STEPS, TOL, _batch, _close, _mesh, _train

import flax_models as fm
from jax_ls2.parallel.mesh import shard_module


@functools.cache
def _one_device(dropout: bool):
    cfg = fm.get_config("llama", "tiny", attention_backend="flash", **(DROPOUT if dropout else {}))
    model = nnx.jit(lambda: fm.build(cfg))()
    start = jax.tree.map(jnp.copy, nnx.state(model))
    batches = [_batch("llama", cfg, s) for s in range(STEPS)]
    return cfg, start, batches, _train(model, batches)


@pytest.mark.parametrize("spec, balance, dropout", [("data=2,seq=2", "none", False), ("seq=4", "zigzag", False),
                                                     ("data=2,seq=4", "none", True)])
def test_llama_on_a_sequence_mesh_trains_like_one_device(spec, balance, dropout):
    cfg, start, batches, (want_losses, want_grads, want_params) = _one_device(dropout)
    cfg = cfg.replace(sequence_axis="seq", sequence_balance=balance)
    mesh = _mesh(spec)
    with jax.set_mesh(mesh):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: fm.build(cfg)))
        model = shard_module(nnx.merge(graphdef, start), mesh)
        data_axes = ("data", "seq") if "data" in spec else (None, "seq")
        sharded = [jax.device_put(b, NamedSharding(mesh, P(*data_axes))) for b in batches]
        losses, grads, params = _train(model, sharded)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(g, w)
    _close(params, want_params)
