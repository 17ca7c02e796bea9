"""Tensor-parallel state saved with orbax on one mesh of the 8 simulated CPU devices restores
bit for bit on the same mesh, and loads into another mesh shape with the shardings its
partition specs give there."""
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jax_ls2 import parallel


class MLP(nnx.Module):
    def __init__(self, *, rngs):
        self.fc1 = parallel.ColumnParallelLinear(16, 32, rngs=rngs)
        self.fc2 = parallel.RowParallelLinear(32, 16, rngs=rngs)
        self.embed = parallel.VocabParallelEmbed(24, 16, rngs=rngs)


def _place(state, mesh):
    return jax.device_put(state, nnx.get_named_sharding(state, mesh))


def _target(state, mesh):
    """Shapes, dtypes and shardings of ``state`` on ``mesh``, for orbax to restore into."""
    shardings = nnx.get_named_sharding(state, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    # perturb every leaf so a restore from fresh init values could not pass
    state = jax.tree.map(lambda a: a + jax.random.normal(jax.random.key(5), a.shape, a.dtype), state)
    mesh = parallel.make_mesh("data=2,tensor=4")
    path = tmp_path_factory.mktemp("ckpt") / "state"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, _place(state, mesh))
    return state, path


@pytest.mark.parametrize("spec", ["data=2,tensor=4", "data=4,tensor=2", "tensor=8"])
def test_restore_on_a_mesh(saved, spec):
    state, path = saved
    mesh = parallel.make_mesh(spec)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, _target(state, mesh))
    tensor = dict(mesh.shape)["tensor"]
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    kernel = restored["fc1"]["kernel"].get_value()
    assert kernel.sharding.mesh.shape == mesh.shape
    assert kernel.addressable_shards[0].data.shape == (16, 32 // tensor)
    assert restored["embed"]["embedding"].get_value().addressable_shards[0].data.shape == (24 // tensor, 16)
    assert jnp.dtype(kernel.dtype) == jnp.float32
