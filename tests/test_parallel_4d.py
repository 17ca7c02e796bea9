"""Pipeline stages with the sequence split over ``seq`` (ring attention inside each stage)
on the 8 simulated CPU devices: the tiny GPT and BERT (4 heads, 2 layers) trained 3 steps
with the fused AdamW against the same model on one device with flash attention (whose
dropout masks the ring draws), on (pipe 2, data 2, seq 2) with all dropouts on and on
(pipe 2, tensor 2, seq 2) with hidden and activation dropout, and flash attention's
masks in stages without the ring (pipe 2, data 4); the ring's exchanges in the compiled
step; the errors for what the stages cannot take."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parallel_pipeline_zoo import BATCH, LEN, MICROBATCHES, STEPS, _batch, _close, _train

import flax_models as fm
from flax_models.pipeline import pipeline_model, unpipelined_state
from jax_ls2 import parallel
from jax_ls2.nn import tensor_parallel_state
from jax_ls2.parallel.mesh import shard_module

TOL = dict(rtol=2e-5, atol=2e-6)
ALL_DROPOUT = dict(hidden_dropout=0.1, attn_dropout=0.1, activation_dropout=0.1)
NO_ATTN_DROPOUT = dict(hidden_dropout=0.1, attn_dropout=0.0, activation_dropout=0.1)
# mesh -> the dropouts it trains with (heads split over tensor: no attention dropout);
# (pipe 2, data 4): flash attention's masks by micro-batch rows, without the ring
MESHES = {"pipe=2,data=2,seq=2": ALL_DROPOUT, "pipe=2,tensor=2,seq=2": NO_ATTN_DROPOUT, "pipe=2,data=4": ALL_DROPOUT}


@functools.cache
def _one_device(family, dropout):
    cfg = fm.get_config(family, "tiny", attention_backend="flash", **dict(dropout))
    model = nnx.jit(lambda: fm.build(cfg))()
    start = jax.tree.map(jnp.copy, nnx.state(model))
    batches = [_batch(family, cfg, s) for s in range(STEPS)]
    return cfg, start, batches, _train(model, batches)[:3]


@functools.cache
def _four_d(family, spec, balance="none"):
    """`family` on mesh `spec` as pipe stages with the sequence over seq, from the
    one-device model's initial state; gradients and params in the unpipelined layout."""
    cfg, start, batches, _ = _one_device(family, tuple(MESHES[spec].items()))
    mesh = parallel.make_mesh(spec)
    with jax.set_mesh(mesh):
        split = cfg.replace(sequence_axis="seq" if "seq=" in spec else None, sequence_balance=balance,
                            tensor_axis="tensor" if "tensor=" in spec else None)
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: fm.build(split)))
        model = nnx.merge(graphdef, tensor_parallel_state(start, shapes))
        model = shard_module(pipeline_model(model, num_microbatches=MICROBATCHES), mesh)
        sharded = [jax.device_put(b, NamedSharding(mesh, P("data", "seq"))) for b in batches]
        losses, grads, params, hlo = _train(model, sharded, mesh)
    shapes = nnx.state(nnx.eval_shape(lambda: fm.build(split)), nnx.Param)
    return losses, [unpipelined_state(g, shapes) for g in grads], unpipelined_state(params, shapes), hlo


@pytest.mark.slow
@pytest.mark.parametrize("family,spec", [("gpt", "pipe=2,data=2,seq=2"), ("bert", "pipe=2,data=2,seq=2"),
                                         ("gpt", "pipe=2,tensor=2,seq=2"), ("gpt", "pipe=2,data=4")])
@pytest.mark.optimized_cpu_code
def test_stages_on_sequence_shards_train_like_one_device(family, spec):
    *_, (want_losses, want_grads, want_params) = _one_device(family, tuple(MESHES[spec].items()))
    losses, grads, params, hlo = _four_d(family, spec)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads, strict=True):
        _close(g, w)
    _close(params, want_params)
    if "seq=" not in spec:
        return
    # The ring passes this device's micro-batch rows, sequence chunk and heads (q, k, v and
    # the dK, dV accumulators); nothing gathers the sequence.
    heads = 4 // (2 if "tensor=" in spec else 1)
    rows = BATCH // (2 if "data=" in spec else 1) // MICROBATCHES
    passed = set(re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} collective-permute(?:-start)?\(", hlo))
    assert f"{rows},{LEN // 2},{heads},16" in passed, passed
    gathered_over = re.findall(r" all-gather(?:-start)?\(.*?replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", hlo)
    assert not [g for g in gathered_over if "seq" in g], gathered_over


@pytest.mark.slow
def test_stages_with_zigzag_balance_train_like_one_device():
    *_, (want_losses, want_grads, want_params) = _one_device("gpt", tuple(ALL_DROPOUT.items()))
    losses, grads, params, _ = _four_d("gpt", "pipe=2,data=2,seq=2", balance="zigzag")
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads, strict=True):
        _close(g, w)
    _close(params, want_params)


def _loss_shape(cfg, spec, length):
    batch = {"input_ids": jnp.zeros((BATCH, length), jnp.int32), "labels": jnp.zeros((BATCH, length), jnp.int32)}
    with jax.set_mesh(parallel.make_mesh(spec)):
        model = nnx.eval_shape(lambda: pipeline_model(fm.build(cfg), num_microbatches=MICROBATCHES))
        graphdef, state = nnx.split(model)
        return jax.eval_shape(lambda s: nnx.merge(graphdef, s).loss(batch), state)


def test_what_the_stages_refuse_on_sequence_shards():
    cfg = fm.get_config("gpt", "tiny", attention_backend="flash", sequence_axis="seq", **ALL_DROPOUT)
    with pytest.raises(ValueError, match=r"PipelinedEncoder: the sequence length \(15\) must be a multiple of 2 "
                                         r"\(the size 2 of mesh axis 'seq'\)"):
        _loss_shape(cfg, "pipe=2,data=2,seq=2", 15)
    zigzag = cfg.replace(sequence_balance="zigzag")
    with pytest.raises(ValueError, match=r"must be a multiple of 4 \(the size 2 of mesh axis 'seq', twice: zigzag"):
        _loss_shape(zigzag, "pipe=2,data=2,seq=2", 14)
    with pytest.raises(ValueError, match=r"PipelinedEncoder: attention dropout with sequence_axis and a tensor axis "
                                         r"above 1 is not supported"):
        _loss_shape(cfg.replace(tensor_axis="tensor"), "pipe=2,tensor=2,seq=2", LEN)
    _loss_shape(cfg.replace(tensor_axis="tensor", attn_dropout=0.0), "pipe=2,tensor=2,seq=2", LEN)


def test_stages_refuse_a_flash_mask_count_past_32_bits():
    cfg = fm.get_config("gpt", "tiny", attention_backend="flash", sequence_axis="seq", **ALL_DROPOUT)
    length = 2**24  # 8 x 2**23 x 64 = 2**32 query elements before the last rows
    with jax.set_mesh(parallel.make_mesh("pipe=2,data=2,seq=2")):
        model = nnx.eval_shape(lambda: pipeline_model(fm.build(cfg), num_microbatches=MICROBATCHES))
        graphdef, state = nnx.split(model.decoder)
        x = jax.ShapeDtypeStruct((BATCH, length, cfg.hidden_size), jnp.float32)
        with pytest.raises(ValueError, match=r"PipelinedEncoder: with flash attention dropout, batch x sequence "
                                             r"chunk x hidden must stay below 2\*\*32"):
            jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x, causal=True, deterministic=False), state, x)
