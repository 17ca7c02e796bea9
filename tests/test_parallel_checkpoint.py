"""Tensor-parallel state saved with orbax on one mesh of the 8 simulated CPU devices restores
bit for bit on the same mesh, and loads into another mesh shape with the shardings its
partition specs give there. The same for a training state of flax_models.training on a
data mesh: ZeRO-1 state resumes bit for bit on its mesh and is refused on another data
size; replicated optimizer state loads into another mesh shape or onto one device."""
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


# ---------------------------------------------------------------------------- training state
# GPT tiny (dropout on) trained on a data=8 mesh by flax_models.training, checkpointed
# after 2 steps, with the fused optimizer's state replicated or split over data (ZeRO-1).
# Marked slow: building and compiling the two runs takes about 30 s.
def _gpt_run(tmp_path, *, zero):
    import flax_models as fm
    from flax_models import data, training
    cfg = fm.get_config("gpt", "tiny", hidden_dropout=0.1, attn_dropout=0.1, activation_dropout=0.1)
    tx, _ = training.make_optimizer(1e-3, 3, 1)
    mesh = parallel.make_mesh("data=8")
    graphdef, state = training.create(cfg, impl="ls2", dtype=None, seed=0, tx=tx, mesh=mesh, zero=zero)
    layout = training.optimizer_layout(graphdef, state)
    step = training.make_step(graphdef)
    batches = [training.shard_batch(data.make_batch(cfg, 0, i, 8, 16), mesh) for i in range(3)]
    for b in batches[:2]:
        state, _, _ = step(state, b)
    path = str(tmp_path / ("zero" if zero else "replicated"))
    training.save_checkpoint(path, 2, state, model="gpt/tiny", optimizer_layout=layout)
    state, loss, _ = step(state, batches[2])
    return dict(cfg=cfg, tx=tx, graphdef=graphdef, layout=layout, step=step, path=path, state=state, loss=loss,
                batch=data.make_batch(cfg, 0, 2, 8, 16))


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory):
    return _gpt_run(tmp_path_factory.mktemp("gpt_zero"), zero=True)


@pytest.fixture(scope="module")
def replicated_run(tmp_path_factory):
    return _gpt_run(tmp_path_factory.mktemp("gpt_replicated"), zero=False)


def _equal_trees(a, b):
    from flax_models import training
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(training.to_host(x), training.to_host(y))


@pytest.mark.slow
def test_zero1_state_resumes_bit_for_bit_on_the_same_mesh(zero_run):
    from flax_models import training
    r = zero_run
    assert r["layout"] == "data=8 (ZeRO-1)"
    restored, step = training.restore_checkpoint(r["path"], r["state"], optimizer_layout=r["layout"])
    assert step == 2
    mu = [x for x in jax.tree.leaves(restored) if x.ndim == 1 and x.size > 1000][0]
    assert mu.addressable_shards[0].data.size * 8 == mu.size  # restored split as saved
    state, loss, _ = r["step"](restored, training.shard_batch(r["batch"], mu.sharding.mesh))
    assert float(loss) == float(r["loss"])
    _equal_trees(state, r["state"])


@pytest.mark.slow
def test_zero1_state_is_refused_on_another_data_size(zero_run):
    from flax_models import training
    r = zero_run
    mesh = parallel.make_mesh("data=4", devices=jax.devices()[:4])
    _, template = training.create(r["cfg"], impl="ls2", dtype=None, seed=0, tx=r["tx"], mesh=mesh, zero=True)
    with pytest.raises(training.CheckpointError, match=r"split as \[data=8 \(ZeRO-1\)\], this run's is split "
                                                       r"as \[data=4 \(ZeRO-1\)\]"):
        training.restore_checkpoint(r["path"], template, optimizer_layout="data=4 (ZeRO-1)")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["data=4,tensor=2", None])
@pytest.mark.optimized_cpu_code
def test_replicated_state_loads_into_another_mesh_shape(replicated_run, spec):
    from flax_models import training
    r = replicated_run
    assert r["layout"] == ""
    mesh = None if spec is None else parallel.make_mesh(spec)
    graphdef, template = training.create(r["cfg"], impl="ls2", dtype=None, seed=0, tx=r["tx"], mesh=mesh)
    restored, _ = training.restore_checkpoint(r["path"], template)
    if mesh is not None:
        assert all(x.sharding.mesh.shape == mesh.shape for x in jax.tree.leaves(restored))
        state, loss, _ = training.make_step(graphdef)(restored, training.shard_batch(r["batch"], mesh))
        # the same step on a mesh of another shape: the same masks, sums in another order
        np.testing.assert_allclose(float(loss), float(r["loss"]), rtol=1e-6)
    else:
        _, mine = training.create(r["cfg"], impl="ls2", dtype=None, seed=0, tx=r["tx"],
                                  mesh=parallel.make_mesh("data=8"))
        saved, _ = training.restore_checkpoint(r["path"], mine)
        _equal_trees(restored, saved)
