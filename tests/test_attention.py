"""The one MultiHeadAttention (jax_ls2.nn.attention) in the settings the LLaMA family
needs (grouped-query heads, head_dim apart from hidden / heads, no biases, rotary,
segment ids, a KV cache), against a jnp reference written here; and the one backend
table (jax_ls2.nn.backend)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_ls2.nn as nn
from flax_models.plain.llama import apply_rotary, rotary_frequencies
from jax_ls2.nn import backend
from numerics import rel_err

H, HEADS, KV, D = 64, 4, 2, 24


def _mha(**kw):
    opts = dict(num_kv_heads=KV, head_dim=D, use_bias=False, rotary=nn.RotaryConfig(theta=500000.0))
    opts.update(kw)
    return nn.MultiHeadAttention(H, HEADS, deterministic=True, rngs=nnx.Rngs(0), **opts)


def _reference(m, x, positions, mask):
    """Grouped-query attention written out: projections, rotary, repeated kv heads, a
    softmax over ``mask`` (batch, 1, len, len), the output projection."""
    b, t, _ = x.shape
    w = m.qkv.kernel[...]
    q, k, v = jnp.split(x @ w, [HEADS * D, (HEADS + KV) * D], axis=-1)
    q, k, v = q.reshape(b, t, HEADS, D), k.reshape(b, t, KV, D), v.reshape(b, t, KV, D)
    inv = rotary_frequencies(D, 500000.0, None)
    q, k = apply_rotary(q, positions, inv, False), apply_rotary(k, positions, inv, False)
    k, v = jnp.repeat(k, HEADS // KV, 2), jnp.repeat(v, HEADS // KV, 2)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(D)
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknd->bqnd", p, v).reshape(b, t, HEADS * D) @ m.out.kernel[...]


def _causal(t):
    return jnp.tril(jnp.ones((t, t), bool))[None, None]


def test_parameter_shapes():
    m = _mha()
    assert m.qkv.kernel.shape == (H, (HEADS + 2 * KV) * D) and m.qkv.bias is None
    assert m.out.kernel.shape == (HEADS * D, H) and m.out.bias is None
    cross = _mha(self_attention=False, rotary=None)
    assert cross.q.kernel.shape == (H, HEADS * D) and cross.kv.kernel.shape == (H, 2 * KV * D)
    default = nn.MultiHeadAttention(H, HEADS, rngs=nnx.Rngs(0))
    assert default.qkv.kernel.shape == (H, 3 * H) and default.qkv.bias.shape == (3 * H,)


@pytest.mark.parametrize("backend_name", ["auto", "flash", "xla", "fused"])
def test_grouped_query_rotary_attention_matches_reference(backend_name):
    m = _mha(attention_backend=backend_name)
    x = jax.random.normal(jax.random.key(1), (2, 9, H))
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 9)), jnp.int32)
    got = m(x, causal=True, positions=pos)
    assert rel_err(got, _reference(m, x, pos, _causal(9))) < 1e-5


def test_segment_ids_match_reference():
    m = _mha()
    x = jax.random.normal(jax.random.key(2), (1, 10, H))
    seg = jnp.asarray([[1] * 4 + [2] * 6], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]], jnp.int32)
    mask = _causal(10) & (seg[:, None, :, None] == seg[:, None, None, :])
    for name in ("auto", "flash", "xla"):
        m.attention_backend = name
        assert rel_err(m(x, causal=True, positions=pos, segment_ids=seg), _reference(m, x, pos, mask)) < 1e-5, name


@pytest.mark.parametrize("backend_name", ["auto", "flash"])
def test_decode_equals_the_full_causal_forward(backend_name):
    m = _mha(attention_backend=backend_name)
    x = jax.random.normal(jax.random.key(3), (2, 7, H))
    full = m(x, causal=True)
    m.init_cache(2, 8)
    steps = [m(x[:, :4], decode=True)] + [m(x[:, i:i + 1], decode=True) for i in range(4, 7)]
    assert rel_err(jnp.concatenate(steps, axis=1), full) < 1e-5
    assert int(m.cache_index[...]) == 7
    assert np.isnan(np.asarray(m(x[:, :2], decode=True))).all()  # 9 > 8 positions: NaN


def test_gpt_layer_decodes_on_its_attention_cache():
    """A LightSeq2 layer (biases, multi-head) decodes through its own attention's cache."""
    layer = nn.TransformerEncoderLayer(H, 96, HEADS, deterministic=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (2, 6, H))
    full = layer(x, causal=True)
    layer.attn.init_cache(2, 6)
    got = jnp.concatenate([layer(x[:, :5], causal=True, decode=True), layer(x[:, 5:], causal=True, decode=True)], 1)
    assert rel_err(got, full) < 1e-5


def test_auto_table():
    sel = lambda **kw: backend.select_backend("auto", **dict(dict(dropout_active=False, q_len=128, k_len=128,
                                                                  head_dim=64, dtype=jnp.float32), **kw))
    assert sel() == "xla"
    assert sel(dropout_active=True) == "fused"
    assert sel(grouped=True) == sel(segments=True) == sel(segments=True, dropout_active=True) == "flash"
    assert sel(cache_mask=True) == "xla" and sel(cache_mask=True, dropout_active=True) == "flash"
    for name in ("fused", "xla"):
        with pytest.raises(ValueError, match=f"X: attention_backend='{name}' with attention dropout takes no segment"):
            backend.select_backend(name, dropout_active=True, q_len=8, k_len=8, head_dim=8, dtype=jnp.float32,
                                   segments=True, owner="X")


def test_bad_settings_name_the_module():
    with pytest.raises(ValueError, match=r"MultiHeadAttention: num_kv_heads \(3\) must divide num_heads \(4\)"):
        _mha(num_kv_heads=3)
    with pytest.raises(TypeError, match="MultiHeadAttention: rotary must be None or a jax_ls2.nn.RotaryConfig, got dict"):
        _mha(rotary={"theta": 1.0})
    with pytest.raises(ValueError, match=r"MultiHeadAttention: rotary_dim must be an even int from 2 to head_dim \(24\)"):
        _mha(rotary=nn.RotaryConfig(rotary_dim=5))
    x = jnp.ones((2, 5, H))
    with pytest.raises(ValueError, match="MultiHeadAttention: positions apply to rotary embeddings"):
        _mha(rotary=None)(x, positions=jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"MultiHeadAttention: segment_ids must be integer of shape \(2, 5\)"):
        _mha()(x, segment_ids=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="MultiHeadAttention: decode=True needs a cache; call init_cache"):
        _mha()(x, decode=True)
    with pytest.raises(ValueError, match="MultiHeadAttention: init_cache applies to self-attention only"):
        _mha(self_attention=False, rotary=None).init_cache(2, 4)


def test_tensor_parallel_grouped_layout():
    """With tensor_axis, a grouped-query qkv kernel is (hidden, r + 2, kv_heads * d):
    part j < r holds query head g * r + j of each group g; the layout is a permutation of
    [q | k | v] that tensor_parallel_state applies and undoes."""
    from jax_ls2.nn.attention import grouped_qkv, ungrouped_qkv
    m = _mha(tensor_axis="tensor")
    r = HEADS // KV
    assert m.qkv.kernel.shape == (H, r + 2, KV * D)
    w = jax.random.normal(jax.random.key(5), (H, (HEADS + 2 * KV) * D))
    g = grouped_qkv(w, (r, KV, D))
    q = w[:, :HEADS * D].reshape(H, HEADS, D)
    for head in range(HEADS):
        grp, j = divmod(head, r)
        np.testing.assert_array_equal(g[:, j, grp * D:(grp + 1) * D], q[:, head])
    np.testing.assert_array_equal(g[:, r], w[:, HEADS * D:(HEADS + KV) * D])
    np.testing.assert_array_equal(ungrouped_qkv(g, (r, KV, D)), w)
    one = _mha()
    state = nn.tensor_parallel_state(nnx.state(one, nnx.Param), nnx.state(m, nnx.Param))
    back = nn.tensor_parallel_state(state, nnx.state(one, nnx.Param))
    np.testing.assert_array_equal(back["qkv"]["kernel"].get_value(), one.qkv.kernel.get_value())
