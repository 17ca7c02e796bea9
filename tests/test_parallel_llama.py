"""The LLaMA family on meshes of the 8 simulated CPU devices: the tiny model trained 3
steps with the fused AdamW, the sequence split over seq (attention through ring
attention, zigzag-balanced or not), the heads (grouped-query) and the MLP over tensor
(with Megatron sequence parallelism or not), the batch over data, against the same
model on one device with flash attention (whose dropout masks the ring draws): losses, every
gradient and the params after the steps. Every mesh takes all 8 devices (the one-device
runs are shared, and their arrays end up committed to those devices)."""
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
from jax_ls2.nn import tensor_parallel_state
from jax_ls2.parallel.mesh import shard_module


@functools.cache
def _one_device(dropout: bool):
    cfg = fm.get_config("llama", "tiny", attention_backend="flash", **(DROPOUT if dropout else {}))
    model = nnx.jit(lambda: fm.build(cfg))()
    start = jax.tree.map(jnp.copy, nnx.state(model))
    batches = [_batch("llama", cfg, s) for s in range(STEPS)]
    return cfg, start, batches, _train(model, batches)


@pytest.mark.parametrize("spec, balance, dropout", [("data=4,seq=2", "none", False), ("data=2,seq=4", "zigzag", False),
                                                     ("data=2,seq=4", "none", True)])
def test_llama_on_a_sequence_mesh_trains_like_one_device(spec, balance, dropout):
    cfg, start, batches, (want_losses, want_grads, want_params) = _one_device(dropout)
    cfg = cfg.replace(sequence_axis="seq", sequence_balance=balance)
    mesh = _mesh(spec)
    with jax.set_mesh(mesh):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: fm.build(cfg)))
        model = shard_module(nnx.merge(graphdef, start), mesh)
        sharded = [jax.device_put(b, NamedSharding(mesh, P("data", "seq"))) for b in batches]
        losses, grads, params = _train(model, sharded)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(g, w)
    _close(params, want_params)


@pytest.mark.parametrize("spec, sequence_parallel, dropout", [("data=4,tensor=2", False, False),
                                                               ("data=4,tensor=2", True, True),
                                                               ("data=2,seq=2,tensor=2", False, False)])
def test_llama_tensor_parallel_trains_like_one_device(spec, sequence_parallel, dropout):
    cfg, start, batches, (want_losses, want_grads, want_params) = _one_device(dropout)
    over = dict(tensor_axis="tensor", sequence_parallel=sequence_parallel)
    if "seq" in spec:
        over["sequence_axis"] = "seq"
    cfg = cfg.replace(**over)
    mesh = _mesh(spec)
    with jax.set_mesh(mesh):
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: fm.build(cfg)))
        model = shard_module(nnx.merge(graphdef, tensor_parallel_state(start, shapes)), mesh)
        axes = ("data", "seq") if "seq" in spec else ("data",)
        sharded = [jax.device_put(b, NamedSharding(mesh, P(*axes))) for b in batches]
        losses, grads, params = _train(model, sharded)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(tensor_parallel_state(g, w), w)
    _close(tensor_parallel_state(params, want_params), want_params)
    qkv = params["layers"][0]["qkv"]["kernel"].get_value()
    assert qkv.shape == (cfg.hidden_size, cfg.num_heads // cfg.num_kv_heads + 2, cfg.num_kv_heads * 16)
    assert qkv.sharding.spec == P(None, None, "tensor")


@pytest.mark.parametrize("spec, dropout", [("pipe=2,data=2,tensor=2", False), ("pipe=2,seq=2,tensor=2", False),
                                           ("pipe=2,data=2,seq=2", True)])
def test_pipelined_llama_trains_like_one_device(spec, dropout):
    """The decoder layers as 2 GPipe stages (2 micro-batches), with the other axes inside."""
    from flax_models.pipeline import pipeline_model, unpipelined_state
    from test_parallel_pipeline_zoo import MICROBATCHES, _train as train_on_mesh
    cfg, start, batches, (want_losses, want_grads, want_params) = _one_device(dropout)
    over = {"tensor_axis": "tensor"} if "tensor" in spec else {}
    if "seq" in spec:
        over["sequence_axis"] = "seq"
    split = cfg.replace(**over)
    mesh = _mesh(spec)
    with jax.set_mesh(mesh):
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: fm.build(split)))
        model = nnx.merge(graphdef, tensor_parallel_state(start, shapes))
        model = shard_module(pipeline_model(model, num_microbatches=MICROBATCHES), mesh)
        axes = ("data", "seq") if "seq" in spec else ("data",)
        sharded = [jax.device_put(b, NamedSharding(mesh, P(*axes))) for b in batches]
        losses, grads, params, _ = train_on_mesh(model, sharded, mesh)
    shapes = nnx.state(nnx.eval_shape(lambda: fm.build(split)), nnx.Param)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(tensor_parallel_state(unpipelined_state(g, shapes), w), w)
    _close(tensor_parallel_state(unpipelined_state(params, shapes), want_params), want_params)
