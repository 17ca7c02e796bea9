"""Linen front ends (jax_ls2.nn.linen): init/apply, params tree and outputs equal to the
NNX layers with the same params, dropout from the Linen "dropout" stream, nesting."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jax_ls2.nn import TransformerDecoderLayer, TransformerEncoderLayer
from jax_ls2.nn import linen as ls2_linen

H, F, N = 32, 48, 4
KW = dict(pre_layer_norm=False, activation="gelu", hidden_dropout=0.1, attn_dropout=0.1,
          activation_dropout=0.1)


def nnx_with(cls, params, **kw):
    layer = cls(H, F, N, rngs=nnx.Rngs(params=0, dropout=1), **KW, **kw)
    state = nnx.state(layer, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(layer, state)
    return layer


def tree_shapes(t):
    return jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), t)


def test_encoder_init_apply_matches_nnx():
    x = jax.random.normal(jax.random.key(1), (2, 6, H))
    mask = jnp.array([[True] * 6, [True] * 4 + [False] * 2])
    layer = ls2_linen.TransformerEncoderLayer(H, F, N, **KW)
    variables = layer.init(jax.random.key(0), x, padding_mask=mask, deterministic=True)
    assert set(variables) == {"params"}
    ref = TransformerEncoderLayer(H, F, N, rngs=nnx.Rngs(0), **KW)
    assert tree_shapes(variables["params"]) == tree_shapes(
        nnx.to_pure_dict(nnx.state(ref, nnx.Param)))
    ref = nnx_with(TransformerEncoderLayer, variables["params"])
    for causal in (False, True):
        got = layer.apply(variables, x, padding_mask=mask, causal=causal, deterministic=True)
        want = ref(x, padding_mask=mask, causal=causal, deterministic=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jitted = jax.jit(lambda v, x: layer.apply(v, x, padding_mask=mask, deterministic=True))
    np.testing.assert_allclose(jitted(variables, x), ref(x, padding_mask=mask, deterministic=True),
                               rtol=1e-5, atol=1e-6)


def test_decoder_init_apply_matches_nnx():
    x = jax.random.normal(jax.random.key(1), (2, 5, H))
    memory = jax.random.normal(jax.random.key(2), (2, 7, H))
    mmask = jnp.array([[True] * 7, [True] * 3 + [False] * 4])
    layer = ls2_linen.TransformerDecoderLayer(H, F, N, **KW)
    variables = layer.init(jax.random.key(0), x, memory, memory_padding_mask=mmask,
                           deterministic=True)
    p = variables["params"]
    assert set(p) == {"attn", "attn_ln", "cross_attn", "cross_ln", "fc1", "fc2", "ffn_ln"}
    assert set(p["cross_attn"]) == {"q", "kv", "out"}
    ref = nnx_with(TransformerDecoderLayer, p)
    got = layer.apply(variables, x, memory, memory_padding_mask=mmask, deterministic=True)
    want = ref(x, memory, memory_padding_mask=mmask, deterministic=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # precomputed cross K/V, as TransformerDecoder passes them
    kv = memory @ p["cross_attn"]["kv"]["kernel"] + p["cross_attn"]["kv"]["bias"]
    got_kv = layer.apply(variables, x, cross_kv=kv, memory_padding_mask=mmask,
                         deterministic=True)
    np.testing.assert_allclose(got_kv, want, rtol=1e-5, atol=1e-5)


def test_dropout_uses_the_linen_stream():
    x = jax.random.normal(jax.random.key(1), (2, 6, H))
    layer = ls2_linen.TransformerEncoderLayer(H, F, N, **KW)
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    det = layer.apply(variables, x, deterministic=True)
    a = layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    a2 = layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    b = layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(4)})
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    with pytest.raises(ValueError, match="dropout is active.*no rngs"):
        layer.apply(variables, x, deterministic=False)
    assert float(jnp.abs(a - det).max()) > 1e-2
    assert float(jnp.abs(a - b).max()) > 1e-2


def test_nested_in_a_linen_model_and_gradients():
    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic):
            x = nn.Dense(H, name="proj")(x)
            for i in range(2):
                x = ls2_linen.TransformerEncoderLayer(H, F, N, name=f"layer{i}")(
                    x, deterministic=deterministic)
            return x.sum()

    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    model = Tiny()
    variables = model.init(jax.random.key(0), x, True)
    assert set(variables["params"]) == {"proj", "layer0", "layer1"}
    assert set(variables["params"]["layer0"]) == {"attn", "attn_ln", "fc1", "fc2", "ffn_ln"}
    grads = jax.grad(lambda v: model.apply(v, x, True))(variables)
    assert float(jnp.abs(grads["params"]["layer1"]["fc2"]["kernel"]).max()) > 0
    # the NNX layer with layer1's params reproduces the nested output
    h = x @ variables["params"]["proj"]["kernel"] + variables["params"]["proj"]["bias"]
    for i in range(2):
        h = nnx_with_plain(variables["params"][f"layer{i}"])(h, deterministic=True)
    np.testing.assert_allclose(model.apply(variables, x, True), h.sum(), rtol=1e-5)


def nnx_with_plain(params):
    layer = TransformerEncoderLayer(H, F, N, rngs=nnx.Rngs(0))
    state = nnx.state(layer, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(layer, state)
    return layer


def test_errors():
    with pytest.raises(TypeError, match="linen.TransformerEncoderLayer: hidden_size must be an int"):
        ls2_linen.TransformerEncoderLayer(32.0, F, N)
    with pytest.raises(TypeError, match="linen.TransformerDecoderLayer: num_heads must be an int"):
        ls2_linen.TransformerDecoderLayer(H, F, None)
