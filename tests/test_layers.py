"""jax_ls2.nn layers against their plain-Flax twins (flax_models.plain)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models import plain
import jax_ls2.ops
from jax_ls2 import _ffi, nn
from jax_ls2._dispatch import forget_choices

H, F, N = 32, 64, 4


def _pair(cls_name, *args, **kw):
    ours = getattr(nn, cls_name)(*args, rngs=nnx.Rngs(0, dropout=1), **kw)
    twin = getattr(plain, cls_name)(*args, rngs=nnx.Rngs(5, dropout=2), **kw)
    ours_params = nnx.state(ours, nnx.Param)
    assert jax.tree.structure(ours_params) == jax.tree.structure(nnx.state(twin, nnx.Param))
    nnx.update(twin, ours_params)
    return ours, twin


def _grads(model, fn):
    params = nnx.state(model, nnx.Param)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(graphdef, p, rest)
        return jnp.sum(jnp.sin(fn(m)))
    return jax.jit(jax.grad(loss))(params)


def _close(a, b, rtol=2e-5, atol=2e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float32),
                                                        np.asarray(y, np.float32),
                                                        rtol=rtol, atol=atol), a, b)


def _close_to_scale(a, b, rel):
    """Equal within `rel` times each leaf's largest magnitude: float32 sums of the same
    terms in another order differ by ulps of the terms, not of the (possibly tiny) result."""
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=0,
        atol=rel * float(np.max(np.abs(np.asarray(y, np.float32))))), a, b)


def _x(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


@pytest.mark.parametrize("pre_ln,act,causal", [(True, "relu", False), (False, "gelu", False),
                                               (True, "gelu_tanh", True)])
def test_encoder_layer_matches_twin(pre_ln, act, causal):
    ours, twin = _pair("TransformerEncoderLayer", H, F, N, pre_layer_norm=pre_ln, activation=act,
                       attn_dropout=0.1, hidden_dropout=0.1, activation_dropout=0.1,
                       deterministic=True)
    x = _x((2, 7, H))
    pad = jnp.arange(7)[None, :] < jnp.array([[7], [4]])
    call = lambda m: m(x, padding_mask=None if causal else pad, causal=causal)
    _close(call(ours), call(twin))
    _close(_grads(ours, call), _grads(twin, call))


def test_decoder_layer_matches_twin():
    ours, twin = _pair("TransformerDecoderLayer", H, F, N, activation="relu", deterministic=True)
    x, mem = _x((2, 5, H)), _x((2, 9, H), 1)
    mpad = jnp.arange(9)[None, :] < jnp.array([[9], [3]])
    call = lambda m: m(x, mem, memory_padding_mask=mpad)
    _close(call(ours), call(twin))
    _close(_grads(ours, call), _grads(twin, call))


@pytest.mark.parametrize("pre_ln", [True, False])
def test_decoder_stack_batched_cross_kv_equals_per_layer(pre_ln):
    dec = nn.TransformerDecoder(3, H, F, N, pre_layer_norm=pre_ln, deterministic=True,
                                rngs=nnx.Rngs(0))
    x, mem = _x((2, 5, H)), _x((2, 6, H), 1)

    def call(batched):
        def f(m):
            m.batched_cross_kv = batched
            return m(x, mem)
        return f
    out_b, out_p = call(True)(dec), call(False)(dec)
    _close(out_b, out_p, rtol=1e-6, atol=1e-6)
    gb, gp = _grads(dec, call(True)), _grads(dec, call(False))
    _close(gb, gp, rtol=1e-6, atol=1e-6)
    # gradients reach each layer's own kv kernel
    assert all(float(jnp.abs(g).sum()) > 0 for g in
               [gb["layers"][i]["cross_attn"]["kv"]["kernel"][...] for i in range(3)])
    twin = plain.TransformerDecoder(3, H, F, N, pre_layer_norm=pre_ln, deterministic=True,
                                    rngs=nnx.Rngs(0))
    nnx.update(twin, nnx.state(dec, nnx.Param))
    _close(twin(x, mem), out_b)
    _close(_grads(twin, lambda m: m(x, mem)), gb)


@pytest.mark.parametrize("layout", ["batch", "seq"])
@pytest.mark.parametrize("pre_ln", [True, False])
def test_encoder_stack_equals_twin(pre_ln, layout):
    """Post-LN, each layer hands the next four copies of its output (output_copies=4):
    outputs and gradients stay those of the twin, in either layout."""
    enc = nn.TransformerEncoder(3, H, F, N, pre_layer_norm=pre_ln, deterministic=True, layout=layout,
                                rngs=nnx.Rngs(0))
    twin = plain.TransformerEncoder(3, H, F, N, pre_layer_norm=pre_ln, deterministic=True, rngs=nnx.Rngs(4))
    nnx.update(twin, nnx.state(enc, nnx.Param))
    x = _x((2, 5, H))
    pad = jnp.arange(5)[None, :] < jnp.array([[5], [3]])
    call = lambda m: m(x, padding_mask=pad)
    _close(call(enc), call(twin))
    _close(_grads(enc, call), _grads(twin, call))


@pytest.mark.parametrize("pre_ln", [True, False])
def test_stack_layouts_agree_with_every_dropout(pre_ln):
    """Attention, activation and hidden dropout active: "auto" runs the layers
    sequence-first (the attention is GEMMs around the fused softmax) and gives what
    batch-first gives, masks included (the attention masks are drawn over the (batch,
    heads, q, k) probabilities in both layouts, the others in batch-first order); in
    eval "auto" stays batch-first. Encoder and decoder (memory transposed with x)."""
    from jax_ls2.nn.stack import _seq_first
    x, mem = _x((3, 8, H)), _x((3, 6, H), 1)
    pad = jnp.arange(8)[None, :] < jnp.array([[8], [5], [2]])
    results = {}
    for layout in ("batch", "seq", "auto"):
        kw = dict(pre_layer_norm=pre_ln, attn_dropout=0.2, activation_dropout=0.1, hidden_dropout=0.1,
                  layout=layout, rngs=nnx.Rngs(0, dropout=3))
        enc, dec = nn.TransformerEncoder(2, H, F, N, **kw), nn.TransformerDecoder(2, H, F, N, **kw)
        if layout == "auto":
            assert jax.device_count() > 1  # conftest: 8 CPU devices; the choice does not depend on it
            assert _seq_first("TransformerEncoder", enc, x, False)
            assert _seq_first("TransformerDecoder", dec, x, False, mem)
            assert not _seq_first("TransformerEncoder", enc, x, True)
            assert not _seq_first("TransformerDecoder", dec, x, True, mem)
        results[layout] = [
            nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x, padding_mask=pad, deterministic=False))))(enc),
            nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x, mem, deterministic=False))))(dec)]
        if layout == "batch":  # the dropout is active
            assert abs(float(results[layout][0][0]) - float(jnp.sum(jnp.sin(
                enc(x, padding_mask=pad, deterministic=True))))) > 1e-3
    for layout in ("seq", "auto"):
        _close(results[layout], results["batch"])


def test_stack_layout_validation():
    with pytest.raises(ValueError, match="TransformerEncoder: layout must be one of"):
        nn.TransformerEncoder(1, H, F, N, layout="tbc", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="TransformerDecoder: layout must be one of"):
        nn.TransformerDecoder(1, H, F, N, layout=None, rngs=nnx.Rngs(0))
    enc = nn.TransformerEncoder(1, H, F, N, layout="seq", deterministic=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layout='seq' needs x of shape \(batch, len, hidden\)"):
        enc(_x((5, H)))
    dec = nn.TransformerDecoder(1, H, F, N, layout="seq", deterministic=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"TransformerDecoder: layout='seq' needs memory of shape"):
        dec(_x((2, 5, H)), _x((6, H)))


def test_output_copies_validation():
    post = nn.TransformerEncoderLayer(H, F, N, pre_layer_norm=False, deterministic=True, rngs=nnx.Rngs(0))
    pre = nn.TransformerEncoderLayer(H, F, N, deterministic=True, rngs=nnx.Rngs(0))
    x = _x((2, 5, H))
    four = post(x, output_copies=4)
    assert isinstance(four, tuple) and len(four) == 4
    _close(four[0], post(x), rtol=0, atol=0)
    _close(post(four), post(post(x)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="TransformerEncoderLayer: output_copies must be 1 or 4, got 2"):
        post(x, output_copies=2)
    with pytest.raises(ValueError, match="output_copies applies to post-LN layers"):
        pre(x, output_copies=4)
    with pytest.raises(ValueError, match="x may be a tuple only of the 4 copies"):
        pre(four)
    with pytest.raises(ValueError, match="x may be a tuple only of the 4 copies"):
        post(four[:2])


def test_dropout_train_eval_and_keys():
    layer = nn.TransformerEncoderLayer(H, F, N, attn_dropout=0.2, hidden_dropout=0.2,
                                       activation_dropout=0.2, rngs=nnx.Rngs(0, dropout=3))
    x = _x((2, 8, H))
    layer.eval()
    a, b = layer(x), layer(x)
    np.testing.assert_array_equal(a, b)
    layer.train()
    c, d = layer(x), layer(x)
    assert not np.allclose(c, a) and not np.allclose(c, d)  # fresh keys each call
    key = jax.random.key(7)
    np.testing.assert_array_equal(layer(x, rngs=key), layer(x, rngs=key))
    np.testing.assert_array_equal(layer(x, deterministic=True), a)


def test_fused_and_xla_backends_draw_the_same_mask():
    kw = dict(attn_dropout=0.3, deterministic=False, rngs=nnx.Rngs(0, dropout=1))
    fused = nn.MultiHeadAttention(H, N, attention_backend="fused", **kw)
    xla = nn.MultiHeadAttention(H, N, attention_backend="xla", **kw)
    nnx.update(xla, nnx.state(fused, nnx.Param))
    x, key = _x((2, 6, H)), jax.random.key(3)
    pad = jnp.arange(6)[None, :] < jnp.array([[6], [2]])
    call = lambda m: m(x, padding_mask=pad, rngs=key)
    _close(call(fused), call(xla), rtol=1e-6, atol=1e-6)
    _close_to_scale(_grads(fused, call), _grads(xla, call), rel=2e-7)


def test_backend_selection():
    sel = lambda req, act: nn.select_backend(req, dropout_active=act, q_len=128, k_len=128,
                                             head_dim=64, dtype=jnp.bfloat16)
    expect_auto = "cudnn" if jax.default_backend() == "gpu" else "xla"
    assert sel("auto", False) == expect_auto
    assert sel("auto", True) == "fused"
    assert sel("xla", True) == "xla"
    with pytest.raises(ValueError, match="cudnn"):
        sel("cudnn", True)
    assert sel("flash", False) == sel("flash", True) == "flash"  # "auto" never picks it
    with pytest.raises(ValueError, match="attention_backend"):
        sel("tiled", False)


def _flash_and_xla(**kw):
    """MultiHeadAttention with the "flash" backend and its "xla" twin (same params)."""
    flash = nn.MultiHeadAttention(H, N, attention_backend="flash", rngs=nnx.Rngs(0, dropout=1), **kw)
    xla = nn.MultiHeadAttention(H, N, attention_backend="xla", rngs=nnx.Rngs(0, dropout=1), **kw)
    nnx.update(xla, nnx.state(flash, nnx.Param))
    return flash, xla


@pytest.mark.parametrize("causal", [False, True])
def test_flash_backend_matches_xla(causal):
    flash, xla = _flash_and_xla(deterministic=True)
    x = _x((2, 7, H))
    pad = jnp.arange(7)[None, :] < jnp.array([[7], [3]])
    call = jax.jit(lambda m: m(x, padding_mask=pad, causal=causal))
    _close(call(flash), call(xla), rtol=1e-5, atol=1e-5)
    _close(_grads(flash, call), _grads(xla, call), rtol=1e-5, atol=1e-5)


def test_flash_backend_dropout_draws_flash_attention_masks():
    """With dropout the "flash" backend is ops.flash_attention with the call's key: its
    own masks (numbered as flash attention numbers them), checked against the op called
    on the module's projections."""
    flash, _ = _flash_and_xla(attn_dropout=0.3, deterministic=False)
    x, key = _x((2, 7, H)), jax.random.key(3)
    pad = jnp.arange(7)[None, :] < jnp.array([[7], [3]])

    def by_hand(m):
        qkv = (x @ m.qkv.kernel[...] + m.qkv.bias[...]).reshape(2, 7, 3, N, H // N)
        ctx = jax_ls2.ops.flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], padding_mask=pad, causal=True,
                                          rate=0.3, key=key)
        return ctx.reshape(2, 7, H) @ m.out.kernel[...] + m.out.bias[...]
    got = jax.jit(lambda m: m(x, padding_mask=pad, causal=True, rngs=key))(flash)
    _close(got, jax.jit(by_hand)(flash), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, jax.jit(lambda m: m(x, padding_mask=pad, causal=True, deterministic=True))(flash))


def test_flash_backend_lowers_to_the_flash_kernels(monkeypatch):
    """A layer with attention_backend="flash" (bf16, head_dim 64), differentiated and
    lowered for CUDA, calls the flash attention kernels (the targets declared
    registered, as when the extension is built)."""
    targets = ("jax_ls2_flash_attention_fwd", "jax_ls2_flash_attention_bwd")
    monkeypatch.setattr(_ffi, "_load", lambda: (frozenset(targets), None))
    forget_choices()
    try:
        layer = nn.TransformerEncoderLayer(128, 256, 2, attention_backend="flash", attn_dropout=0.1,
                                           dtype=jnp.bfloat16, deterministic=False, rngs=nnx.Rngs(0, dropout=1))
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        x = _x((2, 8, 128), dtype=jnp.bfloat16)
        loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x, causal=True, rngs=jax.random.key(0)).astype(
            jnp.float32))
        text = jax.jit(jax.grad(loss)).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        forget_choices()
    for t in targets:
        assert f"custom_call @{t}" in text, t


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_embedding_matches_twin(kind):
    kw = dict(max_positions=16) if kind == "learned" else dict(sinusoidal=True)
    ours, twin = _pair("Embedding", 50, H, scale=H ** 0.5, padding_idx=1, dropout=0.1,
                       deterministic=True, **kw)
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, 50).at[1, 6:].set(1)
    call = lambda m: m(ids)
    out = call(ours)
    assert np.all(np.asarray(out[1, 6:]) == 0)
    _close(out, call(twin))
    _close(_grads(ours, call), _grads(twin, call))


@pytest.mark.parametrize("smoothing,ignore", [(0.0, None), (0.1, -100)])
def test_criterion_matches_twin(smoothing, ignore):
    logits = _x((3, 5, 37))
    labels = jax.random.randint(jax.random.key(1), (3, 5), 0, 37)
    if ignore is not None:
        labels = labels.at[0, :2].set(ignore)
    ours = nn.CrossEntropyCriterion(label_smoothing=smoothing, ignore_index=ignore)
    twin = plain.CrossEntropyCriterion(label_smoothing=smoothing, ignore_index=ignore)
    (lo, co), (lt, ct) = ours(logits, labels), twin(logits, labels)
    assert float(co) == float(ct) == (13 if ignore is not None else 15)
    _close(lo, lt, rtol=1e-6)
    _close(jax.grad(lambda l: ours(l, labels)[0])(logits),
           jax.grad(lambda l: twin(l, labels)[0])(logits), rtol=1e-5, atol=1e-7)


def test_bf16_compute_fp32_params():
    ours, twin = _pair("TransformerEncoderLayer", H, F, N, dtype=jnp.bfloat16, deterministic=True)
    x = _x((2, 8, H))
    out = ours(x)
    assert out.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(ours, nnx.Param)))
    _close(out, twin(x), rtol=3e-2, atol=3e-2)


def test_jit_remat_and_scan_over_layers():
    layers = [nn.TransformerEncoderLayer(H, F, N, deterministic=True, rngs=nnx.Rngs(i))
              for i in range(3)]
    x = _x((2, 8, H))
    ref = x
    for layer in layers:
        ref = layer(ref)

    @nnx.jit
    def jitted(layer, x):
        return nnx.remat(lambda l, y: l(y))(layer, x)
    out = x
    for layer in layers:
        out = jitted(layer, out)
    _close(out, ref, rtol=1e-5, atol=1e-5)

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return nn.TransformerEncoderLayer(H, F, N, deterministic=True, rngs=nnx.Rngs(key))
    stacked = make(jax.random.split(jax.random.key(0), 3))
    for i, layer in enumerate(layers):  # load the per-layer params into the stack
        nnx.update(layers[i], jax.tree.map(lambda a: a[i], nnx.state(stacked, nnx.Param)))
    ref = x
    for layer in layers:
        ref = layer(ref)

    def scan_apply(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(carry, layer):
            return nnx.remat(lambda l, y: l(y))(layer, carry)
        return body(x, stack)
    _close(nnx.jit(scan_apply)(stacked, x), ref, rtol=1e-5, atol=1e-5)
    g_scan = nnx.grad(lambda m: jnp.sum(jnp.sin(scan_apply(m, x))))(stacked)
    for i, layer in enumerate(layers):
        def upto(m, i=i):
            y = x
            for j, l in enumerate(layers):
                y = (m if j == i else l)(y)
            return y
        _close(jax.tree.map(lambda a: a[i], g_scan), _grads(layer, upto), rtol=1e-4, atol=1e-5)


def test_transformer_layer_factory():
    enc = nn.TransformerLayer(H, F, N, rngs=nnx.Rngs(0))
    dec = nn.TransformerLayer(H, F, N, layer_type="decoder", rngs=nnx.Rngs(0))
    assert isinstance(enc, nn.TransformerEncoderLayer) and enc.activation == "gelu"
    assert isinstance(dec, nn.TransformerDecoderLayer)
    assert enc.hidden_dropout == 0.1 and enc.attn.attn_dropout == 0.1
    with pytest.raises(ValueError, match="layer_type"):
        nn.TransformerLayer(H, F, N, layer_type="moe", rngs=nnx.Rngs(0))


def test_transformer_layer_takes_transformer_engine_aliases():
    te = nn.TransformerLayer(hidden_size=H, ffn_hidden_size=F, num_attention_heads=N,
                             attention_dropout=0.2, layernorm_epsilon=1e-6, rngs=nnx.Rngs(0))
    ours = nn.TransformerLayer(H, F, N, attn_dropout=0.2, epsilon=1e-6, rngs=nnx.Rngs(0))
    assert te.config == ours.config
    assert (te.ffn_size, te.num_heads, te.attn.attn_dropout, te.ffn_ln.epsilon) == (F, N, 0.2, 1e-6)
    for name, alias in (("epsilon", "layernorm_epsilon"), ("attn_dropout", "attention_dropout")):
        with pytest.raises(TypeError, match=f"TransformerLayer: got both {name}= and its alias {alias}="):
            nn.TransformerLayer(H, F, N, rngs=nnx.Rngs(0), **{name: 0.1, alias: 0.1})
    with pytest.raises(TypeError, match="TransformerLayer: got both ffn_size= and its alias"):
        nn.TransformerLayer(H, F, N, ffn_hidden_size=F, rngs=nnx.Rngs(0))
    # a LayerConfig keeps its own values (no Transformer Engine defaults on top)
    cfg = nn.LayerConfig(H, F, N)
    assert nn.TransformerLayer(cfg, rngs=nnx.Rngs(0)).config == cfg
    # the plain twin takes the same aliases and builds the same tree
    ours, twin = _pair("TransformerLayer", H, ffn_hidden_size=F, num_attention_heads=N, layernorm_epsilon=1e-6,
                       layer_type="decoder")
    assert twin.ffn_ln.epsilon == ours.ffn_ln.epsilon == 1e-6


def test_layer_config_is_the_one_signature():
    """Keywords, a LayerConfig, and a LayerConfig with overrides build the same layer;
    the stacks hand their config to every layer."""
    kw = dict(pre_layer_norm=False, activation="gelu", attn_dropout=0.1, hidden_dropout=0.2,
              activation_dropout=0.3, epsilon=1e-6, attention_backend="xla", dtype=jnp.bfloat16)
    cfg = nn.LayerConfig(H, F, N, **kw)
    by_kw = nn.TransformerEncoderLayer(H, F, N, rngs=nnx.Rngs(0), **kw)
    by_cfg = nn.TransformerEncoderLayer(cfg, rngs=nnx.Rngs(0))
    assert by_kw.config == by_cfg.config == cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.state(by_kw, nnx.Param), nnx.state(by_cfg, nnx.Param))
    assert (by_cfg.hidden_dropout, by_cfg.activation_dropout, by_cfg.attn.attn_dropout,
            by_cfg.attn_ln.epsilon, by_cfg.dtype) == (0.2, 0.3, 0.1, 1e-6, jnp.bfloat16)
    over = nn.TransformerDecoderLayer(cfg, hidden_dropout=0.0, rngs=nnx.Rngs(0))
    assert over.config == cfg.replace(hidden_dropout=0.0) and over.hidden_dropout == 0.0
    enc = nn.TransformerEncoder(2, cfg, final_layer_norm=True, rngs=nnx.Rngs(0))
    assert enc.config == cfg and all(l.config == cfg for l in enc.layers)
    assert enc.final_ln.epsilon == 1e-6
    dec = nn.TransformerDecoder(2, H, F, N, rngs=nnx.Rngs(0), **kw)
    assert all(l.config == cfg for l in dec.layers) and dec.dtype == jnp.bfloat16


def test_layer_config_errors_name_the_constructor():
    with pytest.raises(TypeError,
                       match=r"TransformerEncoderLayer: unexpected keyword argument\(s\) \['norm_eps'\]"):
        nn.TransformerEncoderLayer(H, F, N, norm_eps=1e-5, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="TransformerEncoder: unexpected keyword"):
        nn.TransformerEncoder(2, H, F, N, eps=1e-5, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="TransformerDecoderLayer: pass a LayerConfig or hidden_size"):
        nn.TransformerDecoderLayer(nn.LayerConfig(H, F, N), F, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="TransformerEncoderLayer: num_heads must be an int, got NoneType"):
        nn.TransformerEncoderLayer(H, F, rngs=nnx.Rngs(0))
    for bad in (0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"TransformerEncoderLayer: epsilon must be a positive finite Python "
                                             f"float, got {bad}"):
            nn.TransformerEncoderLayer(H, F, N, epsilon=bad, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError,
                       match="TransformerEncoderLayer: dtype must be a floating JAX dtype or None, got 'foo'"):
        nn.TransformerEncoderLayer(H, F, N, dtype="foo", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="TransformerEncoderLayer: pre_layer_norm must be a Python bool"):
        nn.TransformerEncoderLayer(H, F, N, pre_layer_norm="yes", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="LayerConfig: attention_backend must be one of"):
        nn.LayerConfig(H, F, N, attention_backend="tiled")
    with pytest.raises(ValueError, match="LayerConfig.replace: attn_dropout must be in"):
        nn.LayerConfig(H, F, N).replace(attn_dropout=1.0)


def test_layer_norm_epsilon_is_one_name_with_one_default():
    """ops.layer_norm, nn.LayerNorm and LayerConfig spell it ``epsilon``, default to 1e-5
    and say that nnx.LayerNorm's default is 1e-6; the epsilon reaches the op."""
    import inspect
    from jax_ls2 import ops
    defaults = {inspect.signature(ops.layer_norm).parameters["epsilon"].default,
                inspect.signature(nn.LayerNorm.__init__).parameters["epsilon"].default,
                nn.LayerConfig(H, F, N).epsilon}
    assert defaults == {1e-5}
    assert inspect.signature(nnx.LayerNorm.__init__).parameters["epsilon"].default == 1e-6
    for doc in (ops.layer_norm.__doc__, nn.LayerNorm.__doc__):
        assert "1e-5" in doc and "1e-6" in doc
    x = _x((3, H)) * 1e-3  # variance ~1e-6: epsilon matters
    for eps in (1e-5, 1e-6):
        ln = nn.LayerNorm(H, epsilon=eps)
        twin = nnx.LayerNorm(H, epsilon=eps, rngs=nnx.Rngs(0))
        _close(ln(x), twin(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dropout_module_is_the_public_op(dtype):
    """nn.Dropout draws the mask of jax_ls2.ops.dropout (that of the fused ops) and scales
    in float32, rounding once."""
    from jax_ls2 import ops
    x = _x((4, 9, H), 3).astype(dtype)
    key = jax.random.key(7)
    got = nn.Dropout(0.1, deterministic=False)(x, rngs=key)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.dropout(x, rate=0.1, key=key)))
    kept = np.asarray(got) != 0
    assert 0.05 < 1 - kept.mean() < 0.15
    from jax_ls2._random import keep_scale  # 1 / keep probability, the rate quantised
    want = (np.asarray(x, np.float32) * np.float32(keep_scale(0.1))).astype(np.asarray(x).dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32)[kept], np.asarray(want, np.float32)[kept],
                               rtol=1e-6)


def test_validation_messages():
    with pytest.raises(ValueError, match=r"hidden_size \(30\).*num_heads \(4\)"):
        nn.TransformerEncoderLayer(30, F, N, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="activation"):
        nn.TransformerEncoderLayer(H, F, N, activation="swish", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden_dropout"):
        nn.TransformerEncoderLayer(H, F, N, hidden_dropout=1.5, rngs=nnx.Rngs(0))
    layer = nn.TransformerEncoderLayer(H, F, N, deterministic=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"TransformerEncoderLayer: x must have shape \(\.\.\., 32\)"):
        layer(jnp.ones((2, 3, 16)))
    with pytest.raises(ValueError, match="Dropout: dropout is active.*no rngs"):
        nn.Dropout(0.1, deterministic=False)(jnp.ones((2, 3, H)))


@pytest.mark.gpu
def test_gpu_seq_first_stack_drops_the_attention_transposes():
    """With attention dropout (GEMMs around the fused softmax), the sequence-first stack
    compiles to fewer transpose kernels than the batch-first one: q, k, v and their
    gradients reach the attention GEMMs in place."""
    import re
    x = _x((8, 128, 256)).astype(jnp.bfloat16)
    counts = {}
    for layout in ("batch", "seq"):
        enc = nn.TransformerEncoder(2, 256, 512, 4, pre_layer_norm=False, attn_dropout=0.1, layout=layout,
                                    dtype=jnp.bfloat16, rngs=nnx.Rngs(0, dropout=1))
        graphdef, state = nnx.split(enc)

        def grads(state, x):
            m = nnx.merge(graphdef, state)
            return nnx.grad(lambda m: jnp.sum(m(x, deterministic=False).astype(jnp.float32)))(m)
        text = jax.jit(grads).lower(state, x).compile().as_text()
        counts[layout] = len(re.findall(r"^\s*(?:ROOT )?%?\w*transpose[\w.]* = ", text, re.M))
    assert counts["seq"] + 2 * 2 <= counts["batch"], counts


@pytest.mark.parametrize("layout", ["auto", "batch", "seq"])
def test_batch_sharded_stack_keeps_its_shards(layout):
    """Data parallel over 8 devices with every dropout on, in each layout ("auto" runs
    sequence-first here): the stack compiles without gathering activations and gives
    the unsharded result."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from numerics import mesh8
    mesh = mesh8()
    enc = nn.TransformerEncoder(2, H, F, N, attn_dropout=0.1, hidden_dropout=0.1, activation_dropout=0.1,
                                layout=layout, rngs=nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(enc)
    x = _x((8, 16, H))

    def step(state, x):
        m = nnx.merge(graphdef, state)
        return nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x, deterministic=False))))(m)
    fn = jax.jit(step)
    want = fn(state, x)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert "all-gather" not in fn.lower(state, xs).compile().as_text()
    _close(fn(state, xs), want)


@pytest.mark.parametrize("lib", ["jax_ls2", "plain"])
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_remat_stack_draws_new_masks_each_call_as_without_remat(stack, lib):
    """A rematerialised stack (jax_ls2's, and the plain-Flax twin's) advances its layers'
    dropout streams as the stack without remat does: consecutive calls draw new masks,
    the same as without remat."""
    kw = dict(hidden_dropout=0.1, attn_dropout=0.1, activation_dropout=0.1)
    stacks = nn if lib == "jax_ls2" else plain
    cls = stacks.TransformerEncoder if stack == "encoder" else stacks.TransformerDecoder
    plain_stack, remat_stack = (cls(2, 32, 64, 4, remat=r, rngs=nnx.Rngs(params=0, dropout=1), **kw)
                                for r in (False, True))
    x = jax.random.normal(jax.random.key(2), (2, 8, 32))
    args = (x,) if stack == "encoder" else (x, x)
    outs = {}
    for name, s in (("plain", plain_stack), ("remat", remat_stack)):
        s.train()
        graphdef, state = nnx.split(s)

        @jax.jit
        def call(state):
            m = nnx.merge(graphdef, state)
            y = m(*args)
            return y, nnx.state(m)
        first, state = call(state)
        second, _ = call(state)
        outs[name] = (first, second)
    assert not np.allclose(outs["plain"][0], outs["plain"][1])
    for got, want in zip(outs["remat"], outs["plain"]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_renamed_layer_keywords_warn_once_and_work():
    from numerics import assert_renamed_keyword

    from jax_ls2.nn import kv_cache
    make = lambda **kw: nn.TransformerEncoderLayer(32, 64, 4, rngs=nnx.Rngs(0), **kw).config
    cfg = assert_renamed_keyword(lambda: make(layer_norm_eps=1e-3), lambda: make(epsilon=1e-3),
                                 "TransformerEncoderLayer", "layer_norm_eps", "epsilon")
    assert cfg.epsilon == 1e-3
    cache = lambda **kw: kv_cache.new_cache(2, 8, head_dim=4, dtype=jnp.float32, owner="test", **kw)
    assert_renamed_keyword(lambda: cache(kv_heads=3)[0][...].shape, lambda: cache(num_kv_heads=3)[0][...].shape,
                           "new_cache", "kv_heads", "num_kv_heads")
