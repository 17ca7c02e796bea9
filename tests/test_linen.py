"""Linen front ends (jax_ls2.nn.linen): init/apply, params tree and outputs equal to the
NNX layers and building blocks with the same params, dropout from the Linen "dropout"
stream, nesting."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jax_ls2 import nn as ls2
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


def with_params(module, params):
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(module, state)
    return module


def randomized(params, seed):
    """params with fresh random values (ones and zeros would hide a scale/bias mix-up)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, l.shape, l.dtype) for k, l in zip(keys, leaves)])


def test_layer_norm_block_matches_nnx_and_flax():
    x = jax.random.normal(jax.random.key(1), (3, 5, H)) * 3 + 1
    ln = ls2_linen.LayerNorm(H, epsilon=1e-6)
    variables = ln.init(jax.random.key(0), x)
    assert tree_shapes(variables) == {"params": {"scale": ((H,), jnp.float32), "bias": ((H,), jnp.float32)}}
    params = randomized(variables["params"], 2)
    got = ln.apply({"params": params}, x)
    want = with_params(ls2.LayerNorm(H, epsilon=1e-6), params)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    flax_ln = nn.LayerNorm(epsilon=1e-6).apply({"params": params}, x)
    np.testing.assert_allclose(got, flax_ln, rtol=1e-5, atol=1e-5)
    # the residual form goes through as well: (LN(x + r), x + r)
    r = jax.random.normal(jax.random.key(3), x.shape)
    y, s = ln.apply({"params": params}, x, r)
    np.testing.assert_allclose(s, x + r, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ln.apply({"params": params}, x + r)))


def test_embedding_block_matches_nnx():
    ids = jax.random.randint(jax.random.key(1), (2, 7), 0, 50)
    emb = ls2_linen.Embedding(50, H, max_positions=16, dropout=0.1)
    variables = emb.init(jax.random.key(0), ids, deterministic=True)
    assert tree_shapes(variables["params"]) == {"tokens": {"embedding": ((50, H), jnp.float32)},
                                                "positions": {"embedding": ((16, H), jnp.float32)}}
    ref = with_params(ls2.Embedding(50, H, max_positions=16, dropout=0.1, rngs=nnx.Rngs(5)),
                      variables["params"])
    got = emb.apply(variables, ids, deterministic=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref(ids, deterministic=True)))
    logits = emb.apply(variables, got, nnx_method="attend")
    assert logits.shape == (2, 7, 50)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref.attend(got)))
    a = emb.apply(variables, ids, deterministic=False, rngs={"dropout": jax.random.key(3)})
    a2 = emb.apply(variables, ids, deterministic=False, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    dropped = np.asarray(a) == 0
    assert 0.03 < dropped.mean() < 0.2
    np.testing.assert_allclose(np.asarray(a)[~dropped], np.asarray(got)[~dropped] / 0.9, rtol=1e-5)
    with pytest.raises(ValueError, match="Embedding: dropout is active.*no rngs"):
        emb.apply(variables, ids, deterministic=False)


@pytest.mark.parametrize("self_attention", [True, False])
def test_multi_head_attention_block_matches_nnx(self_attention):
    x = jax.random.normal(jax.random.key(1), (2, 6, H))
    memory = jax.random.normal(jax.random.key(2), (2, 9, H))
    mask = jnp.arange(6 if self_attention else 9)[None] < jnp.array([[9], [4]])
    args = (x,) if self_attention else (x, memory)
    attn = ls2_linen.MultiHeadAttention(H, N, self_attention=self_attention, attn_dropout=0.1)
    variables = attn.init(jax.random.key(0), *args, padding_mask=mask, deterministic=True)
    names = {"qkv", "out"} if self_attention else {"q", "kv", "out"}
    assert set(variables["params"]) == names
    params = randomized(variables["params"], 4)
    ref = with_params(ls2.MultiHeadAttention(H, N, self_attention=self_attention, attn_dropout=0.1,
                                             rngs=nnx.Rngs(5)), params)
    for causal in ((False, True) if self_attention else (False,)):
        got = attn.apply({"params": params}, *args, padding_mask=mask, causal=causal, deterministic=True)
        want = ref(*args, padding_mask=mask, causal=causal, deterministic=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    det = attn.apply({"params": params}, *args, deterministic=True)
    a = attn.apply({"params": params}, *args, deterministic=False, rngs={"dropout": jax.random.key(3)})
    b = attn.apply({"params": params}, *args, deterministic=False, rngs={"dropout": jax.random.key(4)})
    assert float(jnp.abs(a - det).max()) > 1e-3 and float(jnp.abs(a - b).max()) > 1e-3
    with pytest.raises(ValueError, match="MultiHeadAttention: dropout is active.*no rngs"):
        attn.apply({"params": params}, *args, deterministic=False)


def test_building_block_argument_errors():
    with pytest.raises(TypeError, match="linen.LayerNorm: .*'eps'.*jax_ls2.nn.LayerNorm"):
        ls2_linen.LayerNorm(H, eps=1e-6)
    with pytest.raises(TypeError, match="linen.MultiHeadAttention: .*'self_attn'"):
        ls2_linen.MultiHeadAttention(H, N, self_attn=False)
    with pytest.raises(TypeError, match="linen.Embedding: .*'dropout_rate'"):
        ls2_linen.Embedding(50, H, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"MultiHeadAttention: hidden_size \(32\) must be a positive "
                                         r"multiple of num_heads \(5\)"):
        ls2_linen.MultiHeadAttention(H, 5).init(jax.random.key(0), jnp.ones((1, 2, H)), deterministic=True)
