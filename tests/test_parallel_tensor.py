"""Megatron tensor parallelism (jax_ls2.parallel.tensor) on a (data 2, tensor 4) mesh of the
8 simulated CPU devices: a column -> GELU -> row MLP under sharded jit and inside shard_map
against the same model on one device, its partition specs, its compiled collectives and
its per-device parameter bytes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ls2 import parallel

IN, HIDDEN, BATCH, SEQ = 24, 64, 4, 7
TENSOR = 4


class MLP(nnx.Module):
    def __init__(self, *, mesh=None, rngs):
        self.fc1 = parallel.ColumnParallelLinear(IN, HIDDEN, mesh=mesh, rngs=rngs)
        self.fc2 = parallel.RowParallelLinear(HIDDEN, IN, mesh=mesh, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


@pytest.fixture(scope="module")
def setup():
    mesh = parallel.make_mesh(f"data=2,tensor={TENSOR}")
    model = MLP(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    sharded = jax.device_put(state, jax.tree.map(lambda p: NamedSharding(mesh, p), specs))
    kx, kc = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, SEQ, IN), jnp.float32)
    cot = jax.random.normal(kc, (BATCH, SEQ, IN), jnp.float32)
    return mesh, graphdef, state, specs, sharded, x, cot


def _apply(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


def _loss(apply, state, x, cot):
    return jnp.sum(apply(state, x) * cot)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def single_device(setup):
    _, graphdef, state, _, _, x, cot = setup
    apply = functools.partial(_apply, graphdef)
    out = jax.jit(apply)(state, x)
    grads = jax.jit(jax.grad(functools.partial(_loss, apply), argnums=(0, 1)))(state, x, cot)
    return out, grads


def test_partition_specs_split_the_tensor_axis(setup):
    specs = setup[3]
    assert specs["fc1"]["kernel"].get_value() == P(None, "tensor")
    assert specs["fc1"]["bias"].get_value() == P("tensor")
    assert specs["fc2"]["kernel"].get_value() == P("tensor", None)
    assert specs["fc2"]["bias"].get_value() == P(None)


def test_parameter_bytes_per_device_fall_as_one_over_tensor(setup):
    mesh, _, state, _, sharded, _, _ = setup
    split = (("fc1", "kernel"), ("fc1", "bias"), ("fc2", "kernel"))
    assert sharded["fc1"]["kernel"].get_value().addressable_shards[0].data.shape == (IN, HIDDEN // TENSOR)
    assert sharded["fc1"]["bias"].get_value().addressable_shards[0].data.shape == (HIDDEN // TENSOR,)
    assert sharded["fc2"]["kernel"].get_value().addressable_shards[0].data.shape == (HIDDEN // TENSOR, IN)
    whole = sum(state[m][p].get_value().nbytes for m, p in split)
    for device in mesh.devices.flat:
        on_device = sum(s.data.nbytes for m, p in split for s in sharded[m][p].get_value().addressable_shards
                        if s.device == device)
        assert on_device * TENSOR == whole


def test_sharded_jit_matches_one_device_and_keeps_the_batch_sharded(setup, single_device):
    mesh, graphdef, _, _, sharded, x, cot = setup
    apply = functools.partial(_apply, graphdef)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = jax.jit(apply)(sharded, xs)
    _assert_close(out, single_device[0])
    assert out.sharding.spec == P("data")
    grads = jax.jit(jax.grad(functools.partial(_loss, apply), argnums=(0, 1)))(sharded, xs, cot)
    _assert_close(grads, single_device[1])
    assert grads[0]["fc1"]["kernel"].get_value().sharding.spec == P(None, "tensor")


def test_column_output_stays_sharded_on_features(setup):
    mesh, graphdef, _, _, sharded, x, _ = setup
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    hidden = jax.jit(lambda st, a: nnx.merge(graphdef, st).fc1(a))(sharded, xs)
    assert hidden.sharding.spec == P("data", None, "tensor")
    assert hidden.addressable_shards[0].data.shape == (BATCH // 2, SEQ, HIDDEN // TENSOR)


def _collectives(hlo: str) -> dict:
    names = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    return {n: hlo.count(f" {n}(") + hlo.count(f" {n}-start(") for n in names}


def test_forward_hlo_has_exactly_one_all_reduce_over_tensor_groups(setup):
    mesh, graphdef, _, _, sharded, x, _ = setup
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    hlo = jax.jit(functools.partial(_apply, graphdef)).lower(sharded, xs).compile().as_text()
    assert _collectives(hlo) == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0,
                                 "collective-permute": 0}
    (line,) = [ln for ln in hlo.splitlines() if " all-reduce(" in ln]
    # the reduced value is this device's (batch / data, seq, in) output, over the tensor groups
    assert f"f32[{BATCH // 2},{SEQ},{IN}]" in line
    assert "replica_groups=[2,4]<=[8]" in line


def test_gradient_hlo_reduces_the_input_gradient_and_weight_shards_only(setup):
    mesh, graphdef, _, _, sharded, x, cot = setup
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    grad = jax.jit(jax.grad(functools.partial(_loss, functools.partial(_apply, graphdef)), argnums=(0, 1)))
    hlo = grad.lower(sharded, xs, cot).compile().as_text()
    counts = _collectives(hlo)
    assert counts["all-gather"] == 0 and counts["reduce-scatter"] == 0 and counts["all-to-all"] == 0, counts
    reduces = [ln.split(" all-reduce(")[0] for ln in hlo.splitlines() if " all-reduce(" in ln]
    # Megatron's backward: the input gradient summed over each tensor group ...
    assert sum(f"f32[{BATCH // 2},{SEQ},{IN}]" in r for r in reduces) == 1, reduces
    # ... and, over the data axis, weight gradients of this device's shard size, never whole
    for whole in (f"f32[{IN},{HIDDEN}]", f"f32[{HIDDEN},{IN}]", f"f32[{HIDDEN}]"):
        assert not any(whole in r for r in reduces), reduces
    assert any(f"f32[{HIDDEN // TENSOR},{IN}]" in r or f"f32[{IN},{HIDDEN // TENSOR}]" in r for r in reduces)


def _shard_map_apply(graphdef, mesh, specs):
    return jax.shard_map(functools.partial(_apply, graphdef), mesh=mesh, in_specs=(specs, P("data")),
                         out_specs=P("data"))


def test_shard_map_matches_one_device(setup, single_device):
    mesh, graphdef, _, specs, sharded, x, cot = setup
    apply = _shard_map_apply(graphdef, mesh, specs)
    _assert_close(jax.jit(apply)(sharded, x), single_device[0])
    grads = jax.jit(jax.grad(functools.partial(_loss, apply), argnums=(0, 1)))(sharded, x, cot)
    _assert_close(grads, single_device[1])


def test_shard_map_forward_has_one_psum(setup):
    mesh, graphdef, _, specs, sharded, x, _ = setup
    hlo = jax.jit(_shard_map_apply(graphdef, mesh, specs)).lower(sharded, x).compile().as_text()
    counts = _collectives(hlo)
    assert counts["all-reduce"] == 1 and counts["all-gather"] == 0, counts


def test_parameters_made_on_a_mesh_are_placed(setup):
    mesh = setup[0]
    layer = parallel.ColumnParallelLinear(8, 16, mesh=mesh, rngs=nnx.Rngs(0))
    kernel = layer.kernel.get_value()
    assert kernel.sharding.spec == P(None, "tensor") and kernel.addressable_shards[0].data.shape == (8, 4)
    twin = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(twin.kernel.get_value()))


def test_functional_forms_inside_shard_map(setup):
    mesh = setup[0]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(k1, (6, IN))
    w1 = jax.random.normal(k2, (IN, HIDDEN))
    w2 = jax.random.normal(k3, (HIDDEN, IN))
    b2 = jax.random.normal(k4, (IN,))

    def mlp(x, w1, w2, b2):
        return parallel.row_parallel_linear(jnp.tanh(parallel.column_parallel_linear(x, w1)), w2, b2)

    split = jax.shard_map(mlp, mesh=mesh, in_specs=(P(), P(None, "tensor"), P("tensor", None), P()),
                          out_specs=P())
    _assert_close(jax.jit(split)(x, w1, w2, b2), mlp(x, w1, w2, b2))


def test_unsplit_parameters_inside_shard_map_are_refused(setup):
    mesh, graphdef, state, _, _, x, _ = setup
    replicated = jax.tree.map(lambda _: P(), nnx.get_partition_spec(state))
    apply = jax.shard_map(functools.partial(_apply, graphdef), mesh=mesh, in_specs=(replicated, P("data")),
                          out_specs=P("data"))
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: inside shard_map over 'tensor' \(size 4\) "
                                         r"kernel must be this device's shard with out_features 64 / 4, got 64"):
        jax.jit(apply)(state, x)


@pytest.mark.parametrize("fn, x, kernel, bias, words", [
    (parallel.column_parallel_linear, (2, 5), (4, 6), None, r"x must have shape \(\.\.\., 4\) to match kernel \(4, 6\)"),
    (parallel.column_parallel_linear, (2, 4), (4, 6), (3,), r"bias must have shape \(6,\) to match kernel"),
    (parallel.column_parallel_linear, (2, 4), (4,), None, r"kernel must be \(in, \*out\), got shape \(4,\)"),
    (parallel.row_parallel_linear, (2, 4), (4, 3, 2), None, r"kernel must be \(in, out\), got shape \(4, 3, 2\)"),
    (parallel.row_parallel_linear, (2, 4), (4, 3), (4,), r"bias must have shape \(3,\)"),
])
def test_functional_forms_check_their_operands(fn, x, kernel, bias, words):
    with pytest.raises(ValueError, match=f"{fn.__name__}: {words}"):
        fn(jnp.ones(x), jnp.ones(kernel), None if bias is None else jnp.ones(bias))


def test_bad_inputs():
    layer = parallel.RowParallelLinear(8, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"RowParallelLinear: x must have shape \(\.\.\., 8\)"):
        layer(jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="ColumnParallelLinear: out_features must be a positive int, got 0"):
        parallel.ColumnParallelLinear(8, 0, rngs=nnx.Rngs(0))
