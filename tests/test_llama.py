"""The LLaMA-family layers and model (jax_ls2.nn.DecoderLayer / RMSNorm, flax_models.llama)
against their plain-Flax twins, on the CPU (jax_ls2 runs its reference ops here).

Layers and models run through module-scope jitted functions keyed by the graph
definition, so each configuration compiles once."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_models as fm
import flax_models.plain as plain
import jax_ls2.nn as ls2
from flax_models import llama
from flax_models import train as T
from jax_ls2.nn import linen_decoder
from jax_ls2.ops import RotaryScaling
from numerics import rel_err

H, F, HEADS = 64, 96, 4
# LLaMA (GQA), Gemma (1 + scale, tanh GeGLU, head_dim apart from hidden / heads, one kv
# head), and LayerNorm with erf GeGLU, interleaved partial rotary and LLaMA 3.1 scaling.
BLOCKS = {
    "llama": dict(num_kv_heads=2, rope_theta=500000.0),
    "gemma": dict(num_kv_heads=1, head_dim=24, unit_offset=True, activation="geglu_tanh"),
    "layer": dict(norm="layer", activation="geglu", interleaved=True, rotary_dim=8,
                  rope_scaling=RotaryScaling("llama3", 8.0, original_max_position=16)),
}


def _pair(**kw):
    ours = ls2.DecoderLayer(H, F, HEADS, rngs=nnx.Rngs(0), deterministic=True, **kw)
    twin = plain.DecoderLayer(H, F, HEADS, rngs=nnx.Rngs(1), deterministic=True, **kw)
    p = nnx.state(ours, nnx.Param)
    assert jax.tree.structure(p) == jax.tree.structure(nnx.state(twin, nnx.Param))
    # Non-trivial norm weights, so a swapped or skipped one shows.
    p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(a.size), a.shape), p)
    nnx.update(ours, p)
    nnx.update(twin, p)
    return ours, twin


@functools.partial(jax.jit, static_argnums=0)
def _layer_out_and_grads(graphdef, params, rest, x, positions, segment_ids, cotangent):
    def f(p, x):
        y = nnx.merge(graphdef, p, rest)(x, positions=positions, segment_ids=segment_ids)
        return jnp.sum(y * cotangent), y
    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


def _run_layer(layer, x, positions=None, segment_ids=None):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    ct = jax.random.normal(jax.random.key(7), x.shape)
    return _layer_out_and_grads(graphdef, params, rest, x, positions, segment_ids, ct)


@functools.partial(jax.jit, static_argnums=0)
def _layer_forward(graphdef, state, x, positions, segment_ids):
    return nnx.merge(graphdef, state)(x, positions=positions, segment_ids=segment_ids)


def _close(a, b, tol=1e-5):
    """Each leaf of a within ``tol`` of b's in relative norm (fp32 math in both, summed in
    different orders: about 100 ulps)."""
    def check(path, x, y):
        err = rel_err(x, y)
        assert err <= tol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > {tol:.0e}"
    jax.tree_util.tree_map_with_path(check, a, b)


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_decoder_layer_matches_twin(block):
    ours, twin = _pair(**BLOCKS[block])
    x = jax.random.normal(jax.random.key(2), (2, 11, H))
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 11)), jnp.int32)
    _close(_layer_forward(*nnx.split(ours), x, positions, None), _layer_forward(*nnx.split(twin), x, positions, None))


def test_decoder_layer_gradients_match_twin():
    """The gradients of the params and of x (the ops' own backward passes are tested with
    the ops; here their wiring in the layer)."""
    ours, twin = _pair(**BLOCKS["llama"])
    x = jax.random.normal(jax.random.key(2), (2, 11, H))
    positions = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    yo, go = _run_layer(ours, x, positions)
    yt, gt = _run_layer(twin, x, positions)
    _close(yo, yt)
    _close(go, gt, tol=1e-4)  # test_models' rule for the zoo's gradients


def test_rotary_moves_the_result():
    """Positions change the output (the rotary is applied), and a shift of all positions
    does not change it (attention sees relative positions only)."""
    ours, _ = _pair(**BLOCKS["llama"])
    x = jax.random.normal(jax.random.key(3), (2, 11, H))
    pos = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    y0 = _run_layer(ours, x, pos)[0]
    y5 = _run_layer(ours, x, pos + 5)[0]
    y_rev = _run_layer(ours, x, pos[:, ::-1])[0]
    _close(y0, y5)
    assert float(jnp.max(jnp.abs(y0 - y_rev))) > 1e-2


def test_packed_sequences_equal_separate_ones():
    """Two sequences packed in one row (segment ids, positions restarting at each, as
    the model derives them) give the outputs of each sequence alone."""
    ours, _ = _pair(**BLOCKS["llama"])
    graphdef, state = nnx.split(ours)
    x = jax.random.normal(jax.random.key(9), (1, 12, H))
    seg = jnp.asarray([[3] * 5 + [4] * 7], jnp.int32)
    positions = llama.segment_positions(seg)
    np.testing.assert_array_equal(positions, [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    packed = _layer_forward(graphdef, state, x, positions, seg)
    alone = [_layer_forward(graphdef, state, x[:, a:b], None, None) for a, b in ((0, 5), (5, 12))]
    _close(packed, jnp.concatenate(alone, axis=1))


def test_rms_norm_residual_and_unit_offset_match_twin():
    for kw in ({}, {"unit_offset": True}):
        ours, twin = ls2.RMSNorm(H, **kw), plain.RMSNorm(H, **kw)
        w = jax.random.normal(jax.random.key(4), (H,))
        ours.scale[...], twin.scale[...] = w, w
        x, r = jax.random.normal(jax.random.key(5), (3, H)), jax.random.normal(jax.random.key(6), (3, H))
        _close(ours(x), twin(x))
        _close(ours(x, residual=r), twin(x, residual=r))
        want = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (w + 1 if kw else w)
        _close(ours(x), want)


def test_twin_defaults_agree():
    """Unset epsilon is 1e-6 for RMSNorm (Hugging Face's rms_norm_eps default) and 1e-5
    for LayerNorm in both forms; the cache dtype defaults to the compute dtype, else the
    param dtype, in both."""
    for norm, eps in (("rms", 1e-6), ("layer", 1e-5)):
        ours, twin = (lib.DecoderLayer(H, F, HEADS, norm=norm, rngs=nnx.Rngs(0)) for lib in (ls2, plain))
        assert ours.attn_norm.epsilon == twin.attn_norm.epsilon == ours.mlp_norm.epsilon == eps, norm
        assert twin.mlp_norm.epsilon == eps, norm
    for dtype, param_dtype in ((None, jnp.bfloat16), (jnp.float16, jnp.float32)):
        for lib in (ls2, plain):
            layer = lib.DecoderLayer(H, F, HEADS, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
            layer.init_cache(1, 4)
            assert layer.cache_k.dtype == layer.cache_v.dtype == (dtype or param_dtype), (lib.__name__, dtype)


def test_linen_front_ends_share_the_params():
    kw = BLOCKS["llama"]
    layer = linen_decoder.DecoderLayer(H, F, HEADS, **kw)
    x = jax.random.normal(jax.random.key(8), (2, 5, H))
    variables = jax.jit(functools.partial(layer.init, deterministic=True))(jax.random.key(0), x)
    nnx_layer = ls2.DecoderLayer(H, F, HEADS, rngs=nnx.Rngs(0), deterministic=True, **kw)
    params = nnx.state(nnx_layer, nnx.Param)
    assert jax.tree.structure(nnx.to_pure_dict(params)) == jax.tree.structure(
        jax.tree.map(lambda v: v, variables["params"]))
    nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, variables["params"]))
    nnx.update(nnx_layer, params)
    linen_out = jax.jit(functools.partial(layer.apply, deterministic=True))(variables, x)
    _close(linen_out, nnx.jit(lambda m, x: m(x))(nnx_layer, x))
    norm = linen_decoder.RMSNorm(H, epsilon=1e-5)
    assert jax.eval_shape(norm.init, jax.random.key(0), x)["params"]["scale"].shape == (H,)


@pytest.mark.parametrize("kw, message", [
    (dict(num_kv_heads=3), "DecoderLayer: num_kv_heads (3) must divide num_heads (4)"),
    (dict(norm="batch"), "DecoderLayer: norm must be one of ('rms', 'layer'), got 'batch'"),
    (dict(activation="relu"), "DecoderLayer: activation must be one of"),
    (dict(rotary_dim=7), "DecoderLayer: rotary_dim must be an even int from 2 to head_dim (16), got 7"),
    (dict(norm="layer", unit_offset=True), "DecoderLayer: unit_offset applies to norm='rms'"),
    (dict(attn_dropout=1.0), "DecoderLayer: attn_dropout must be in [0, 1), got 1.0"),
    (dict(head_dim=0), "DecoderLayer: head_dim must be a positive int or None, got 0"),
    (dict(attention_backend="fused"), "DecoderLayer: attention_backend must be one of ('auto', 'flash', 'cudnn')"),
])
def test_decoder_layer_rejects_bad_settings(kw, message):
    with pytest.raises(ValueError) as e:
        ls2.DecoderLayer(H, F, HEADS, rngs=nnx.Rngs(0), **kw)
    assert message in str(e.value)


def test_decoder_layer_cudnn_backend_names_what_it_needs():
    layer = ls2.DecoderLayer(H, F, HEADS, attention_backend="cudnn", deterministic=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="DecoderLayer: attention_backend='cudnn' does not take this call"):
        layer(jnp.ones((1, 8, H), jnp.float32))


def test_rms_norm_size_and_unsupported_llama_settings_raise():
    with pytest.raises(ValueError, match="RMSNorm: num_features must be a positive int, got True"):
        ls2.RMSNorm(True)


def test_decoder_layer_rejects_bad_inputs():
    layer = ls2.DecoderLayer(H, F, HEADS, rngs=nnx.Rngs(0), deterministic=True)
    x = jnp.ones((2, 5, H))
    with pytest.raises(ValueError, match=r"DecoderLayer: x must have shape \(\.\.\., 64\), got \(2, 5, 32\)"):
        layer(jnp.ones((2, 5, 32)))
    with pytest.raises(ValueError, match=r"DecoderLayer: segment_ids must be integer of shape \(2, 5\)"):
        layer(x, segment_ids=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"DecoderLayer: decode=True needs a cache; call init_cache"):
        layer(x, decode=True)


def test_presets_and_parameter_counts():
    for preset in ("tiny", "1b"):
        cfg = fm.get_config("llama", preset)
        model = nnx.eval_shape(lambda: fm.build(cfg, impl="plain", train=False))
        count = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert count == llama.num_params(cfg), preset
    big = fm.get_config("llama", "1b")
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.ffn_size, big.vocab_size) == \
        (2048, 16, 32, 8, 8192, 32000)
    assert 1.0e9 < llama.num_params(big) < 1.2e9


def _train_losses(impl, init):
    args = T.parse_args(["--model", "llama", "--steps", "4", "--batch", "2", "--seq", "16", "--dtype", "bfloat16",
                         "--optimizer", "optax", "--quiet", "--eval-every", "0"])
    cfg, b, s = T.config_from(args)
    return np.asarray(T.train(args, cfg, b, s, impl=impl, params_from=init)["losses"])


def test_tiny_llama_trains_to_the_twins_losses_every_step():
    """`python -m flax_models.train --model llama` in bf16 from the same weights and data:
    jax_ls2 and the plain twin within 2% at every step, and it learns."""
    init = fm.build(fm.get_config("llama", "tiny"), impl="ls2", seed=0)
    ours, twin = _train_losses("ls2", init), _train_losses("plain", init)
    assert ours[-1] < ours[0]
    np.testing.assert_allclose(ours, twin, rtol=0.02)


def test_batch_sharded_loss_gathers_no_activations():
    """The loss under jit with the batch (ids, labels, segment ids) split over 8 devices:
    no all-gather in the compiled program (the ops partition along the batch; the loss
    ends in one all-reduce), and the unsharded loss. (The ops' own tests check their
    backward passes sharded.)"""
    from numerics import mesh8, shard
    model = fm.build(fm.get_config("llama", "tiny"), impl="ls2", train=False)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 500, (8, 32)), "labels": rng.integers(0, 500, (8, 32)),
             "segment_ids": np.repeat(np.array([[0] * 10 + [1] * 22]), 8, 0)}
    batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
    loss = jax.jit(lambda p, b: nnx.merge(graphdef, p, rest).loss(b)[0])
    sharded = {k: shard(v, mesh8(), "data") for k, v in batch.items()}
    assert "all-gather" not in loss.lower(params, sharded).compile().as_text()
    _close(loss(params, sharded), loss(params, batch))


def test_lowering_for_cuda_calls_the_fused_kernels(monkeypatch):
    """A bf16 LLaMA block's value and gradients, lowered for CUDA (no GPU needed: the
    targets are declared registered, as in test_ffi_targets), call the fused kernels:
    RMSNorm (plain and with the residual add), rotary, flash attention and the gated
    activation, forward and backward; and a decode step calls the rotary kernel, with
    XLA's attention over the cache unless attention_backend="flash"."""
    import re

    from jax_ls2 import _ffi
    from jax_ls2._dispatch import forget_choices
    from test_ffi_targets import _target_literals
    names = frozenset(name for name, _ in _target_literals())
    monkeypatch.setattr(_ffi, "_load", lambda: (names, None))
    forget_choices()
    try:
        layer = ls2.DecoderLayer(256, 512, 4, num_kv_heads=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                 deterministic=True)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        x = jnp.ones((2, 64, 256), jnp.bfloat16)
        loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x).astype(jnp.float32))
        text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
        called = set(re.findall(r"custom_call @jax_ls2_([a-z0-9_]+)", text))
        assert {"rms_norm_fwd", "rms_norm_bwd", "rotary_fwd", "rotary_bwd", "flash_attention_fwd",
                "flash_attention_bwd", "gated_act_dropout_fwd", "gated_act_dropout_bwd"} <= called, called
        assert any(c.startswith("add_rms_norm") for c in called), called
        # Decoding attends the cache through XLA by default, through the kernel when asked.
        for backend, flash in (("auto", False), ("flash", True)):
            layer.attention_backend = backend
            layer.init_cache(2, 16)
            step = jax.jit(lambda s, x: nnx.merge(*s)(x, decode=True)).trace(nnx.split(layer), x[:, :1])
            text = step.lower(lowering_platforms=("cuda",)).as_text()
            assert ("jax_ls2_flash_attention_fwd" in text) == flash and "jax_ls2_rotary_fwd" in text, backend
    finally:
        forget_choices()


# ---------------------------------------------------------------- GPU
# Head dims 64 and 128 (the flash-attention kernels' sizes), the layer's kernels in bf16 /
# fp16 against the plain twin in the same dtype, both against the twin in float64 on the
# CPU: the 2x rule for the output and every gradient.
GPU_BLOCKS = {"llama": dict(num_kv_heads=2), "gemma": dict(num_kv_heads=1, head_dim=128, unit_offset=True,
                                                           activation="geglu_tanh")}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block", sorted(GPU_BLOCKS))
@pytest.mark.parametrize("attention, length", [("flash", 257), ("cudnn", 256)])
def test_gpu_decoder_layer_against_float64_truth(dtype, block, attention, length):
    from numerics import assert_within_2x
    hidden, ffn, heads, shape = 512, 1376, 8, (2, length)
    kw = dict(GPU_BLOCKS[block], rngs=nnx.Rngs(0), deterministic=True)
    ours = ls2.DecoderLayer(hidden, ffn, heads, dtype=dtype, attention_backend=attention, **kw)
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(a.size), a.shape),
                          nnx.state(ours, nnx.Param))
    nnx.update(ours, params)
    twin = plain.DecoderLayer(hidden, ffn, heads, dtype=dtype, **kw)
    nnx.update(twin, params)
    x = jax.random.normal(jax.random.key(1), (*shape, hidden)).astype(dtype)
    positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
    ct = jax.random.normal(jax.random.key(2), (*shape, hidden))

    def out_and_grads(graphdef, params, rest, x, ct):
        def f(p, x):
            y = nnx.merge(graphdef, p, rest)(x, positions=positions)
            return jnp.sum(y.astype(ct.dtype) * ct), y
        (_, y), g = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
        return y, g

    got = jax.jit(out_and_grads, static_argnums=0)(*nnx.split(ours, nnx.Param, ...), x, ct)
    xla = jax.jit(out_and_grads, static_argnums=0)(*nnx.split(twin, nnx.Param, ...), x, ct)
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        twin64 = plain.DecoderLayer(hidden, ffn, heads, dtype=jnp.float64, param_dtype=jnp.float64, **kw)
        to64 = lambda a: jax.device_put(jnp.asarray(np.asarray(a, np.float64)), cpu)
        graphdef, p64, rest = nnx.split(twin64, nnx.Param, ...)
        p64 = jax.tree.map(to64, params)
        truth = out_and_grads(graphdef, p64, rest, to64(x), to64(ct))
        truth = jax.tree.map(np.asarray, truth)
    assert_within_2x("y", got[0], xla[0], truth[0])
    for (path, g), gx, gt in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(xla[1]),
                                 jax.tree.leaves(truth[1])):
        assert_within_2x(jax.tree_util.keystr(path), g, gx, gt)
