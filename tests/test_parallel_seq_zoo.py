"""Sequence parallelism (the sequence split over the ``seq`` axis, attention through ring
attention) together with tensor parallelism in the zoo, on the 8 simulated CPU devices:
the tiny GPT trained 3 steps with the fused AdamW, dropout on, on (data 2, tensor 2,
seq 2) against the same model on one device with flash attention (whose dropout masks
the ring draws)."""
import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parallel_zoo import DROPOUT, TOL, _close, _collectives, _mesh, _one_device, _train

import flax_models as fm
from jax_ls2 import nn
from jax_ls2.nn import tensor_parallel_state
from jax_ls2.parallel.mesh import shard_module

HIDDEN, FFN, HEADS = 64, 128, 4


@pytest.fixture(scope="module")
def reference():
    """family -> its one-device run (`test_parallel_zoo._one_device`), each made once here."""
    return functools.cache(_one_device)


@pytest.mark.slow
def test_gpt_on_data_tensor_and_sequence_trains_like_one_device(reference):
    """Heads, FFN and vocabulary split over tensor, the sequence over seq, the batch over
    data: losses, all gradients and the params after 3 steps equal the one-device run's."""
    _, _, start, batches, (want_losses, want_grads, want_params) = reference("gpt-flash")
    cfg = fm.get_config("gpt", "tiny", attention_backend="flash", sequence_axis="seq", tensor_axis="tensor",
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
    qkv = params["decoder"]["layers"][0]["attn"]["qkv"]["kernel"]
    assert qkv.get_value().sharding.spec == P(None, None, "tensor")  # kept split by the optimizer
    assert _collectives(hlo)["collective-permute"] > 0  # the ring
    # Only the tensor axis gathers (the gradients this step returns replicated);
    # nothing is gathered over seq (the sequence) or data.
    gathered_over = re.findall(r" all-gather(?:-start)?\(.*?replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", hlo)
    assert len(gathered_over) == _collectives(hlo)["all-gather"]
    assert set(gathered_over) <= {"'tensor'"}, gathered_over


def test_sequence_axis_with_tensor_axis_is_accepted_and_megatron_split_refused():
    nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_axis="seq", tensor_axis="tensor")
    with pytest.raises(ValueError, match="LayerConfig: sequence_axis with sequence_parallel .* is not supported"):
        nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_axis="seq", tensor_axis="tensor", sequence_parallel=True)
    with pytest.raises(ValueError, match="MultiHeadAttention: sequence_axis with fp8 is not supported"):
        nn.MultiHeadAttention(HIDDEN, HEADS, sequence_axis="seq", fp8=object(), rngs=nnx.Rngs(0))
