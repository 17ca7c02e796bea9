"""A pre-LN Transformer block assembled from jax_ls2.parallel's column/row linears (fused QKV
split by heads, attention on each device's heads, Megatron MLP) and the fused LayerNorm, on
a (data 2, tensor 4) mesh of the 8 simulated CPU devices: against the same block on one
device, and the collectives of its compiled forward pass (2 all-reduces; with sequence
parallelism 2 all-gathers and 2 reduce-scatters instead)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ls2 import ops, parallel

HIDDEN, HEADS, FFN, BATCH, SEQ, TENSOR = 64, 8, 128, 4, 8, 4
HEAD_DIM = HIDDEN // HEADS


class Block(nnx.Module):
    def __init__(self, *, sequence_dim=None, rngs):
        kw = dict(sequence_dim=sequence_dim, rngs=rngs)
        self.ln1_scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (HIDDEN,)))
        self.ln2_scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (HIDDEN,)))
        self.ln_bias = nnx.Param(jnp.zeros((HIDDEN,)))
        self.qkv = parallel.ColumnParallelLinear(HIDDEN, (3, HIDDEN), **kw)
        self.out = parallel.RowParallelLinear(HIDDEN, HIDDEN, **kw)
        self.fc1 = parallel.ColumnParallelLinear(HIDDEN, FFN, **kw)
        self.fc2 = parallel.RowParallelLinear(FFN, HIDDEN, **kw)

    def __call__(self, x):  # x: (batch, seq, hidden), or its sequence shard with sequence_dim
        h = ops.layer_norm(x, self.ln1_scale[...], self.ln_bias[...])
        qkv = self.qkv(h)  # (batch, seq, 3, this device's heads * head_dim)
        q, k, v = (qkv[:, :, i].reshape(*qkv.shape[:2], -1, HEAD_DIM) for i in range(3))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.reshape(*a.shape[:2], -1))
        h = ops.layer_norm(x, self.ln2_scale[...], self.ln_bias[...])
        return x + self.fc2(jax.nn.gelu(self.fc1(h)))


def _apply(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


def _loss(apply, cot, state, x):
    return jnp.sum(apply(state, x) ** 2 * cot)


@pytest.fixture(scope="module")
def setup():
    mesh = parallel.make_mesh(f"data=2,tensor={TENSOR}")
    graphdef, state = nnx.split(Block(rngs=nnx.Rngs(0)))
    sp_graphdef = nnx.graphdef(Block(sequence_dim=1, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(state)
    sharded = jax.device_put(state, jax.tree.map(lambda p: NamedSharding(mesh, p), specs))
    kx, kc = jax.random.split(jax.random.key(11))
    x = jax.random.normal(kx, (BATCH, SEQ, HIDDEN))
    cot = jax.random.normal(kc, (BATCH, SEQ, HIDDEN))
    apply = functools.partial(_apply, graphdef)
    want = (jax.jit(apply)(state, x), jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))(state, x))
    return mesh, graphdef, sp_graphdef, specs, sharded, x, cot, want


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def _counts(fn, *args):
    hlo = fn.lower(*args).compile().as_text()
    names = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    return {n: hlo.count(f" {n}(") + hlo.count(f" {n}-start(") for n in names}


def test_qkv_kernel_holds_whole_heads_and_matches_nnx_linear():
    layer = parallel.ColumnParallelLinear(HIDDEN, (3, HIDDEN), rngs=nnx.Rngs(0))
    twin = nnx.Linear(HIDDEN, 3 * HIDDEN, rngs=nnx.Rngs(0))
    assert nnx.get_partition_spec(layer.kernel).get_value() == P(None, None, "tensor")
    np.testing.assert_array_equal(np.asarray(layer.kernel.get_value()),
                                  np.asarray(twin.kernel.get_value()).reshape(HIDDEN, 3, HIDDEN))
    x = jax.random.normal(jax.random.key(0), (2, HIDDEN))
    np.testing.assert_allclose(layer(x).reshape(2, -1), twin(x), rtol=1e-6, atol=1e-6)


def test_tensor_parallel_block_inside_shard_map(setup):
    mesh, graphdef, _, specs, sharded, x, cot, want = setup
    apply = jax.shard_map(functools.partial(_apply, graphdef), mesh=mesh, in_specs=(specs, P("data")),
                          out_specs=P("data"))
    _close(jax.jit(apply)(sharded, x), want[0])
    _close(jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))(sharded, x), want[1])
    assert _counts(jax.jit(apply), sharded, x) == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0,
                                                   "all-to-all": 0, "collective-permute": 0}


def test_tensor_parallel_block_under_sharded_jit(setup):
    mesh, graphdef, _, _, sharded, x, cot, want = setup
    apply = functools.partial(_apply, graphdef)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    _close(jax.jit(apply)(sharded, xs), want[0])
    _close(jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))(sharded, xs), want[1])
    assert _counts(jax.jit(apply), sharded, xs) == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0,
                                                    "all-to-all": 0, "collective-permute": 0}


def test_sequence_parallel_block_inside_shard_map(setup):
    mesh, _, sp_graphdef, specs, sharded, x, cot, want = setup
    apply = jax.shard_map(functools.partial(_apply, sp_graphdef), mesh=mesh, in_specs=(specs, P("data", "tensor")),
                          out_specs=P("data", "tensor"))
    _close(jax.jit(apply)(sharded, x), want[0])
    _close(jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))(sharded, x), want[1])
    assert _counts(jax.jit(apply), sharded, x) == {"all-reduce": 0, "all-gather": 2, "reduce-scatter": 2,
                                                   "all-to-all": 0, "collective-permute": 0}
