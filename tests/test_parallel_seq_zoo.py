"""Sequence parallelism (the sequence split over the ``seq`` axis, attention through ring
attention) in the zoo, alone and with tensor parallelism, on the 8 simulated CPU
devices: the tiny GPT and BERT trained 3 steps with the fused AdamW, dropout on, on
(data 2, tensor 2, seq 2) and BERT on (seq 4), against the same model on one device
with flash attention (whose dropout masks the ring draws)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parallel_zoo import BATCH, DROPOUT, LEN, TOL, _close, _collectives, _mesh, _one_device, _train

import flax_models as fm
from jax_ls2 import nn
from jax_ls2.nn import tensor_parallel_state
from jax_ls2.parallel.mesh import shard_module
from jax_ls2.parallel.ring_attention import from_zigzag_chunks, to_zigzag_chunks, zigzag_permute

HIDDEN, FFN, HEADS = 64, 128, 4


@pytest.fixture(scope="module")
def reference():
    """family -> its one-device run (`test_parallel_zoo._one_device`), each made once here."""
    return functools.cache(_one_device)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_zoo_on_data_tensor_and_sequence_trains_like_one_device(reference, family):
    """Heads, FFN and vocabulary split over tensor, the sequence over seq, the batch over
    data: losses, all gradients and the params after 3 steps equal the one-device run's."""
    _, _, start, batches, (want_losses, want_grads, want_params) = reference(f"{family}-flash")
    cfg = fm.get_config(family, "tiny", attention_backend="flash", sequence_axis="seq", tensor_axis="tensor",
                        **DROPOUT)
    mesh = _mesh("data=2,tensor=2,seq=2")
    with jax.set_mesh(mesh):
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: fm.build(cfg)))
        model = shard_module(nnx.merge(graphdef, tensor_parallel_state(start, shapes)), mesh)
        sharded = [jax.device_put(b, NamedSharding(mesh, P("data", "seq"))) for b in batches]
        losses, grads, params = _train(model, sharded)
        hlo = _train.last_program()
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(tensor_parallel_state(g, w), w)
    _close(tensor_parallel_state(params, want_params), want_params)
    qkv = params["decoder" if family == "gpt" else "encoder"]["layers"][0]["attn"]["qkv"]["kernel"]
    assert qkv.get_value().sharding.spec == P(None, None, "tensor")  # kept split by the optimizer
    # The ring passes this device's batch part, sequence chunk and heads (q, k, v and
    # the dK, dV accumulators; BERT's padding mask as pred[...]).
    passed = set(re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} collective-permute(?:-start)?\(", hlo))
    assert passed == {f"{BATCH // 2},{LEN // 2},{cfg.num_heads // 2},{cfg.hidden_size // cfg.num_heads}"}, passed
    # Only the tensor axis gathers (the gradients this step returns replicated);
    # nothing is gathered over seq (the sequence) or data.
    gathered_over = re.findall(r" all-gather(?:-start)?\(.*?replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", hlo)
    assert len(gathered_over) == _collectives(hlo)["all-gather"]
    assert set(gathered_over) <= {"'tensor'"}, gathered_over


@pytest.mark.slow
def test_bert_on_sequence_shards_trains_like_one_device(reference):
    """Tiny BERT (post-LN, padded sequences) on (seq 4): non-causal attention through the
    ring with the padding mask travelling with the keys, embeddings, LayerNorms, dropout,
    FFN, MLM head and loss on sequence parts; losses, all gradients and the params after
    3 steps equal the one-device run's; nothing gathered."""
    _, _, start, batches, (want_losses, want_grads, want_params) = reference("bert-flash")
    cfg = fm.get_config("bert", "tiny", attention_backend="flash", sequence_axis="seq", **DROPOUT)
    mesh = _mesh("seq=4")
    with jax.set_mesh(mesh):
        model = shard_module(nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: fm.build(cfg))), start), mesh)
        sharded = [jax.device_put(b, NamedSharding(mesh, P(None, "seq"))) for b in batches]
        losses, grads, params = _train(model, sharded)
        hlo = _train.last_program()
    assert any(not b["padding_mask"].all() for b in batches)  # padding present
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(g, w)
    _close(params, want_params)
    counts = _collectives(hlo)
    assert counts["all-gather"] == 0 and counts["collective-permute"] > 0, counts


@pytest.mark.slow
def test_gpt_with_zigzag_balance_trains_like_one_device(reference):
    """Causal attention with sequence_balance="zigzag" on (data 2, seq 4): the layers keep
    contiguous chunks, the ring runs on the zigzag layout; the same losses, gradients and
    params as one device, nothing gathered."""
    _, _, start, batches, (want_losses, want_grads, want_params) = reference("gpt-flash")
    cfg = fm.get_config("gpt", "tiny", attention_backend="flash", sequence_axis="seq", sequence_balance="zigzag",
                        **DROPOUT)
    mesh = _mesh("data=2,seq=4")
    with jax.set_mesh(mesh):
        model = shard_module(nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: fm.build(cfg))), start), mesh)
        sharded = [jax.device_put(b, NamedSharding(mesh, P("data", "seq"))) for b in batches]
        losses, grads, params = _train(model, sharded)
        hlo = _train.last_program()
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(g, w)
    _close(params, want_params)
    counts = _collectives(hlo)
    assert counts["all-gather"] == 0 and counts["collective-permute"] > 0, counts
    # half-chunk exchanges into and out of the zigzag layout, beside the ring's whole chunks
    passed = set(re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} collective-permute(?:-start)?\(", hlo))
    head_dim = cfg.hidden_size // cfg.num_heads
    assert f"{BATCH // 2},{LEN // 8},{cfg.num_heads},{head_dim}" in passed, passed


def test_zigzag_chunks_are_the_zigzag_layout_split_over_the_axis():
    mesh = _mesh("seq=4")
    x = jax.random.normal(jax.random.key(0), (2, 16, 3))
    split = P(None, "seq")
    to = jax.jit(jax.shard_map(lambda c: to_zigzag_chunks(c, "seq"), mesh=mesh, in_specs=split, out_specs=split))
    back = jax.jit(jax.shard_map(lambda c: from_zigzag_chunks(c, "seq"), mesh=mesh, in_specs=split, out_specs=split))
    zig = to(x)
    np.testing.assert_array_equal(zig, zigzag_permute(x, 4))
    np.testing.assert_array_equal(back(zig), x)
    with pytest.raises(ValueError, match="to_zigzag_chunks: the chunk length \\(3\\) must be even"):
        jax.shard_map(lambda c: to_zigzag_chunks(c, "seq"), mesh=mesh, in_specs=split, out_specs=split)(
            jnp.zeros((2, 12, 3)))


def test_zigzag_needs_twice_the_axis_in_the_sequence():
    with pytest.raises(ValueError, match="LayerConfig: sequence_balance must be one of"):
        nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_axis="seq", sequence_balance="striped")
    with jax.set_mesh(_mesh("seq=4")):
        layer = nn.TransformerEncoderLayer(HIDDEN, FFN, HEADS, attention_backend="flash", sequence_axis="seq",
                                           sequence_balance="zigzag", deterministic=True, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"the sequence length \(12\) must be a multiple of 2 x the size \(4\)"):
            jax.eval_shape(lambda x: layer(x, causal=True), jax.ShapeDtypeStruct((2, 12, HIDDEN), jnp.float32))
        jax.eval_shape(lambda x: layer(x), jax.ShapeDtypeStruct((2, 12, HIDDEN), jnp.float32))  # non-causal: no zigzag


@pytest.mark.parametrize("balance", ["none", "zigzag"])
def test_attention_inside_shard_map_over_seq_takes_any_chunk(balance):
    """Inside shard_map over (seq 4) the attention gets one chunk (here 2 positions, not a
    multiple of 4) and gives the rows of one-device flash attention, dropout included."""
    mha = nn.MultiHeadAttention(HIDDEN, HEADS, attn_dropout=0.1, attention_backend="flash", sequence_axis="seq",
                                sequence_balance=balance, rngs=nnx.Rngs(0))
    whole = nn.MultiHeadAttention(HIDDEN, HEADS, attn_dropout=0.1, attention_backend="flash", rngs=nnx.Rngs(0))
    nnx.update(whole, nnx.state(mha))
    x = jax.random.normal(jax.random.key(1), (2, 8, HIDDEN))
    want = whole(x, causal=True, deterministic=False)
    mha = nn.MultiHeadAttention(HIDDEN, HEADS, attn_dropout=0.1, attention_backend="flash", sequence_axis="seq",
                                sequence_balance=balance, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(mha)
    mesh = _mesh("seq=4")

    def chunk(state, x):
        return nnx.merge(graphdef, state)(x, causal=True, deterministic=False)
    got = jax.jit(jax.shard_map(chunk, mesh=mesh, in_specs=(P(), P(None, "seq")), out_specs=P(None, "seq"),
                                check_vma=False))(state, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bert_refuses_mlm_max_predictions_on_sequence_shards():
    cfg = fm.get_config("bert", "tiny", attention_backend="flash", sequence_axis="seq", mlm_max_predictions=4)
    with pytest.raises(ValueError, match="Bert: mlm_max_predictions with sequence_axis is not supported"):
        nnx.eval_shape(lambda: fm.build(cfg))


def test_sequence_axis_with_tensor_axis_is_accepted_and_megatron_split_refused():
    nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_axis="seq", tensor_axis="tensor")
    with pytest.raises(ValueError, match="LayerConfig: sequence_axis with sequence_parallel .* is not supported"):
        nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_axis="seq", tensor_axis="tensor", sequence_parallel=True)
    with pytest.raises(ValueError, match="MultiHeadAttention: sequence_axis with fp8 is not supported"):
        nn.MultiHeadAttention(HIDDEN, HEADS, sequence_axis="seq", fp8=object(), rngs=nnx.Rngs(0))
