"""Megatron sequence parallelism in jax_ls2.parallel's column/row linears (``sequence_dim``) on a
(data 2, tensor 4) mesh of the 8 simulated CPU devices: activations split along the sequence
over the tensor axis outside the column -> row region, against the same MLP on one device."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ls2 import parallel

IN, HIDDEN, BATCH, SEQ, TENSOR = 24, 64, 4, 8, 4


class MLP(nnx.Module):
    def __init__(self, *, sequence_dim, rngs):
        self.fc1 = parallel.ColumnParallelLinear(IN, HIDDEN, sequence_dim=sequence_dim, rngs=rngs)
        self.fc2 = parallel.RowParallelLinear(HIDDEN, IN, sequence_dim=sequence_dim, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


@pytest.fixture(scope="module")
def setup():
    mesh = parallel.make_mesh(f"data=2,tensor={TENSOR}")
    graphdef, state = nnx.split(MLP(sequence_dim=1, rngs=nnx.Rngs(0)))
    plain_graphdef, plain_state = nnx.split(MLP(sequence_dim=None, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(state)
    sharded = jax.device_put(state, jax.tree.map(lambda p: NamedSharding(mesh, p), specs))
    kx, kc = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (BATCH, SEQ, IN))
    cot = jax.random.normal(kc, (BATCH, SEQ, IN))
    apply = lambda st, a: nnx.merge(plain_graphdef, st)(a)
    want = (jax.jit(apply)(plain_state, x),
            jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))(plain_state, x))
    return mesh, graphdef, specs, sharded, x, cot, want


def _apply(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


def _loss(apply, cot, state, x):
    # quadratic in the output, so the gradient needs the forward collectives too
    return jnp.sum(apply(state, x) ** 2 * cot)


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def _collectives(hlo):
    names = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    return {n: [ln for ln in hlo.splitlines() if f" {n}(" in ln or f" {n}-start(" in ln] for n in names}


def _shard_map_apply(mesh, graphdef, specs):
    return jax.shard_map(functools.partial(_apply, graphdef), mesh=mesh, in_specs=(specs, P("data", "tensor")),
                         out_specs=P("data", "tensor"))


def test_shard_map_matches_one_device(setup):
    mesh, graphdef, specs, sharded, x, cot, want = setup
    apply = _shard_map_apply(mesh, graphdef, specs)
    _close(jax.jit(apply)(sharded, x), want[0])
    _close(jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))(sharded, x), want[1])


def test_shard_map_collectives_are_one_all_gather_and_one_reduce_scatter_each_way(setup):
    mesh, graphdef, specs, sharded, x, cot, _ = setup
    apply = _shard_map_apply(mesh, graphdef, specs)
    fwd = _collectives(jax.jit(apply).lower(sharded, x).compile().as_text())
    assert {n: len(v) for n, v in fwd.items()} == {"all-reduce": 0, "all-gather": 1, "reduce-scatter": 1,
                                                   "all-to-all": 0, "collective-permute": 0}
    assert f"f32[{BATCH // 2},{SEQ},{IN}]" in fwd["all-gather"][0].split("all-gather(")[0]
    assert f"f32[{BATCH // 2},{SEQ // TENSOR},{IN}]" in fwd["reduce-scatter"][0].split("reduce-scatter(")[0]
    grad = jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))
    both = _collectives(grad.lower(sharded, x).compile().as_text())
    assert len(both["all-gather"]) == 2 and len(both["reduce-scatter"]) == 2, both
    # the only all-reduces left sum weight-gradient shards over the data axis
    for line in both["all-reduce"]:
        assert f"{SEQ}," not in line.split("all-reduce(")[0], line


def test_sharded_jit_with_the_mesh_set(setup):
    mesh, graphdef, _, sharded, x, cot, want = setup
    apply = functools.partial(_apply, graphdef)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
    with jax.set_mesh(mesh):
        out = jax.jit(apply)(sharded, xs)
        grads = jax.jit(jax.grad(functools.partial(_loss, apply, cot), argnums=(0, 1)))(sharded, xs)
        hlo = jax.jit(apply).lower(sharded, xs).compile().as_text()
    _close(out, want[0])
    _close(grads, want[1])
    assert out.sharding.spec == P("data", "tensor")
    found = _collectives(hlo)
    # one all-gather of the input along the sequence, then one reduction of the output
    # (an all-reduce and a slice on the CPU); no parameter moves
    assert len(found["all-gather"]) == 1 and f"f32[{BATCH // 2},{SEQ},{IN}]" in found["all-gather"][0]
    assert len(found["all-reduce"]) + len(found["reduce-scatter"]) == 1
    assert not found["all-to-all"] and not found["collective-permute"]


def test_sharded_jit_without_a_mesh_set_is_refused(setup):
    mesh, graphdef, _, sharded, x, _, _ = setup
    with pytest.raises(ValueError, match=r"column_parallel_linear: sequence parallelism under jit needs the mesh "
                                         r"set with jax.set_mesh\(mesh\)"):
        jax.jit(functools.partial(_apply, graphdef))(sharded, x)


@pytest.mark.parametrize("dim, error, words", [
    (2, ValueError, "sequence_dim must name a dim of x other than the last"),
    (-1, ValueError, "sequence_dim must name a dim of x other than the last"),
    (3, ValueError, "sequence_dim must name a dim of x other than the last"),
    (1.0, TypeError, "sequence_dim must be an int or None"),
])
def test_bad_sequence_dim(dim, error, words):
    with pytest.raises(error, match=f"row_parallel_linear: {words}"):
        parallel.row_parallel_linear(jnp.ones((2, 4, 3)), jnp.ones((3, 5)), sequence_dim=dim)
