"""jax_ls2.nn.MLP, plain and gated, with and without biases, against a jnp reference;
its dropout wiring against the fused ops; tensor parallelism on 4 simulated devices
against one device."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ls2.nn as nn
from flax_models.plain.layers import ACTIVATION_FNS
from flax_models.plain.llama import _GATED
from jax_ls2 import ops, parallel
from numerics import rel_err

H, F = 32, 48


def _reference(m, x):
    w1, w2 = m.fc1.kernel[...], m.fc2.kernel[...]
    y = x @ w1 + (0 if m.fc1.bias is None else m.fc1.bias[...])
    if m.activation in _GATED:
        gate, up = jnp.split(y, 2, axis=-1)
        a = _GATED[m.activation](gate) * up
    else:
        a = ACTIVATION_FNS[m.activation](y)
    return a @ w2 + (0 if m.fc2.bias is None else m.fc2.bias[...])


@pytest.mark.parametrize("activation", nn.mlp.MLP_ACTIVATIONS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_mlp_matches_reference(activation, use_bias):
    m = nn.MLP(H, F, activation=activation, use_bias=use_bias, deterministic=True, rngs=nnx.Rngs(0))
    if use_bias:  # non-zero biases, so a dropped one shows
        nnx.update(m, jax.tree.map(lambda a: a + 0.1 if a.ndim == 1 else a, nnx.state(m, nnx.Param)))
    parts = 2 if activation in _GATED else 1
    assert m.fc1.kernel.shape == (H, parts * F) and m.fc2.kernel.shape == (F, H)
    x = jax.random.normal(jax.random.key(1), (2, 5, H))
    assert rel_err(m(x), _reference(m, x)) < 1e-5


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_dropout_is_the_fused_ops_mask(activation):
    m = nn.MLP(H, F, activation=activation, activation_dropout=0.3, rngs=nnx.Rngs(params=0, dropout=1))
    x = jax.random.normal(jax.random.key(2), (2, 5, H))
    key = jax.random.key(9)
    y = m(x, deterministic=False, rngs=key)
    h = x @ m.fc1.kernel[...]
    if activation == "swiglu":
        a = ops.gated_act_dropout(h + m.fc1.bias[...], activation=activation, rate=0.3, key=key)
    else:
        a = ops.bias_act_dropout(h, m.fc1.bias[...], activation=activation, rate=0.3, key=key)
    assert rel_err(y, a @ m.fc2.kernel[...] + m.fc2.bias[...]) < 1e-5
    assert rel_err(m(x, deterministic=True), y) > 1e-2


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_tensor_parallel_mlp_equals_one_device(activation):
    mesh = parallel.make_mesh("data=2,tensor=4")
    one = nn.MLP(H, F, activation=activation, deterministic=True, rngs=nnx.Rngs(0))
    tp = nn.MLP(H, F, activation=activation, tensor_axis="tensor", deterministic=True, rngs=nnx.Rngs(3))
    graphdef, tp_params, tp_rest = nnx.split(tp, nnx.Param, ...)
    one_graphdef, params, one_rest = nnx.split(one, nnx.Param, ...)
    state = nn.tensor_parallel_state(params, tp_params)
    specs = nnx.get_partition_spec(state)
    x = jax.random.normal(jax.random.key(4), (4, 6, H))

    def loss(apply, s, x):
        return jnp.sum(apply(s, x) ** 2)
    run_tp = jax.shard_map(lambda s, x: nnx.merge(graphdef, s, tp_rest)(x), mesh=mesh, in_specs=(specs, P("data")),
                           out_specs=P("data"))
    run_one = lambda s, x: nnx.merge(one_graphdef, s, one_rest)(x)
    np.testing.assert_allclose(jax.jit(run_tp)(state, x), jax.jit(run_one)(params, x), rtol=2e-5, atol=2e-5)
    g_tp = jax.jit(jax.grad(functools.partial(loss, run_tp)))(state, x)
    g_one = jax.jit(jax.grad(functools.partial(loss, run_one)))(params, x)
    g_one = nn.tensor_parallel_state(g_one, g_tp)
    for a, b in zip(jax.tree.leaves(g_tp), jax.tree.leaves(g_one)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_bad_settings_name_the_module():
    with pytest.raises(ValueError, match=r"MLP: activation must be one of \('relu'"):
        nn.MLP(H, F, activation="tanh", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MLP: activation_dropout must be in \[0, 1\), got 1.5"):
        nn.MLP(H, F, activation_dropout=1.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="MLP: ffn_size must be a positive int"):
        nn.MLP(H, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MLP: x must have shape \(\.\.\., 32\), got \(2, 16\)"):
        nn.MLP(H, F, rngs=nnx.Rngs(0))(jnp.ones((2, 16)))
