"""Zoo models on jax_ls2 layers against their plain-Flax twins.

Models run through module-scope jitted functions (loss and gradients, loss, forward)
whose compilations are cached by the model's graph definition and the inputs' shapes,
so tests that run the same model on the same shapes (the fp32 twin test and the BERT
head tests) compile each step once: they use the batch shape ``(BATCH, SEQ)``.
Nothing runs op by op, which would compile every op of every model separately.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_models as fm
from flax_models import data

BATCH, SEQ = 3, 64


def _twins(family, dtype=None, **over):
    cfg = fm.get_config(family, "tiny", **over)
    ours = fm.build(cfg, impl="ls2", dtype=dtype, seed=0)
    twin = fm.build(cfg, impl="plain", dtype=dtype, seed=1)
    p = nnx.state(ours, nnx.Param)
    assert jax.tree.structure(p) == jax.tree.structure(nnx.state(twin, nnx.Param))
    nnx.update(twin, p)
    return cfg, ours, twin


@functools.partial(jax.jit, static_argnums=0)
def _jit_loss_and_grads(graphdef, params, rest, batch):
    return jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest).loss(batch), has_aux=True)(params)


@nnx.jit
def _loss(model, batch):
    """``model.loss(batch)``; dropout RNG counters advance as in an eager call."""
    return model.loss(batch)


@nnx.jit
def _nnx_loss_and_grads(model, batch):
    """The loss and its gradients through nnx.value_and_grad (an NNX transform)."""
    return nnx.value_and_grad(lambda m: m.loss(batch)[0])(model)


@nnx.jit
def _forward(model, ids, padding_mask):
    return model(ids, padding_mask=padding_mask)


def _loss_and_grads(model, batch):
    """((loss, aux), grads of the params) of ``model.loss(batch)``; the model must not
    draw dropout keys (eval mode, or no dropout): its RNG state is not written back."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return _jit_loss_and_grads(graphdef, params, rest, batch)


def _close(a, b, rtol, atol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float32),
                                                        np.asarray(y, np.float32),
                                                        rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("family", fm.FAMILIES)
def test_model_matches_twin_fp32(family):
    cfg, ours, twin = _twins(family)
    ours.eval(), twin.eval()
    batch = data.make_batch(cfg, 0, 0, BATCH, SEQ)
    (lo, _), go = _loss_and_grads(ours, batch)
    (lt, _), gt = _loss_and_grads(twin, batch)
    np.testing.assert_allclose(lo, lt, rtol=1e-6)
    _close(go, gt, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt", "vit"])
def test_model_matches_twin_bf16(family):
    cfg, ours, twin = _twins(family, dtype=jnp.bfloat16)
    ours.eval(), twin.eval()
    batch = data.make_batch(cfg, 0, 0, 2, 16)
    lo, lt = _loss(ours, batch)[0], _loss(twin, batch)[0]
    np.testing.assert_allclose(lo, lt, rtol=1e-2)


@pytest.mark.parametrize("impl", fm.IMPLS)
def test_bert_head_on_predicted_tokens_only_gives_the_same_loss(impl):
    """mlm_max_predictions: the MLM head on the gathered predicted tokens gives the loss
    and gradients of the head on every token, when no sequence has more predictions."""
    cfg = fm.get_config("bert", "tiny")
    batch = data.make_batch(cfg.replace(mlm_max_predictions=12), 0, 0, BATCH, SEQ)
    counts = (batch["labels"] != -100).sum(-1)
    assert counts.max() <= 12 and counts.min() > 0
    full = fm.build(cfg, impl=impl, seed=0)
    gathered = fm.build(cfg.replace(mlm_max_predictions=12), impl=impl, seed=0)
    full.eval(), gathered.eval()
    (lf, _), gf = _loss_and_grads(full, batch)
    (lg, aux), gg = _loss_and_grads(gathered, batch)
    np.testing.assert_allclose(lg, lf, rtol=1e-6)
    _close(gg, gf, rtol=1e-4, atol=1e-6)
    assert int(aux["dropped_predictions"]) == 0
    assert int(aux["tokens"]) == int(counts.sum())


def test_bert_predictions_beyond_the_cap_are_counted():
    cfg = fm.get_config("bert", "tiny", mlm_max_predictions=2)
    batch = data.make_batch(fm.get_config("bert", "tiny"), 0, 0, BATCH, SEQ)  # uncapped masks
    counts = (batch["labels"] != -100).sum(-1)
    model = fm.build(cfg, impl="plain", seed=0)
    model.eval()
    _, aux = _loss(model, batch)
    assert int(aux["dropped_predictions"]) == int(np.maximum(counts - 2, 0).sum()) > 0
    assert int(aux["tokens"]) == int(np.minimum(counts, 2).sum())


def test_dropout_modes_and_keys():
    cfg, ours, _ = _twins("bert", hidden_dropout=0.1, attn_dropout=0.1)
    batch = data.make_batch(cfg, 0, 0, 2, 16)
    ours.eval()
    a, b = _loss(ours, batch)[0], _loss(ours, batch)[0]
    assert float(a) == float(b)
    ours.train()
    c, d = _loss(ours, batch)[0], _loss(ours, batch)[0]
    assert float(c) != float(a) and float(c) != float(d)


def test_remat_and_batched_cross_kv_do_not_change_the_model():
    cfg, ours, _ = _twins("transformer")
    remat = fm.build(cfg.replace(remat=True), impl="ls2", seed=0)
    nnx.update(remat, nnx.state(ours, nnx.Param))
    ours.eval(), remat.eval()
    batch = data.make_batch(cfg, 0, 0, 2, 12)
    lo, go = _nnx_loss_and_grads(ours, batch)
    lr, gr = _nnx_loss_and_grads(remat, batch)
    np.testing.assert_allclose(lo, lr, rtol=1e-6)
    _close(go, gr, rtol=1e-5, atol=1e-7)
    assert ours.decoder.batched_cross_kv


@pytest.mark.parametrize("impl", ["ls2", "plain"])
def test_remat_under_plain_jax_grad_over_merge(impl):
    # jax.grad over nnx.merge (no nnx transform): remat must not write back variables it
    # did not change; with dropout on, counters advance as without remat (copy=True).
    cfg = fm.get_config("gpt", "tiny")
    batch = data.make_batch(cfg, 0, 0, 2, 12)
    losses = {}
    for remat in (False, True):
        for drop in (0.0, 0.1):
            m = fm.build(cfg.replace(remat=remat, hidden_dropout=drop, attn_dropout=drop), impl=impl,
                         seed=0, train=True)
            g, p, rest = nnx.split(m, nnx.Param, ...)
            f = jax.jit(jax.value_and_grad(lambda p: nnx.merge(g, p, rest, copy=drop > 0).loss(batch)[0]))
            losses[remat, drop] = f(p)
    for drop in (0.0, 0.1):
        np.testing.assert_allclose(losses[False, drop][0], losses[True, drop][0], rtol=1e-6)
        _close(losses[False, drop][1], losses[True, drop][1], rtol=1e-5, atol=1e-7)
    assert float(losses[True, 0.0][0]) != float(losses[True, 0.1][0])


def test_bert_padding_mask_changes_only_padded_view():
    cfg, ours, twin = _twins("bert")
    ours.eval(), twin.eval()
    ids = jnp.asarray(data.make_batch(cfg, 0, 0, 2, 16)["input_ids"])
    pad = jnp.arange(16)[None] < jnp.array([[16], [9]])
    lo, lt = _forward(ours, ids, pad), _forward(twin, ids, pad)
    _close(lo, lt, rtol=1e-4, atol=1e-5)
    # tokens after the padding do not influence the kept ones
    ids2 = ids.at[1, 9:].set(7)
    _close(_forward(ours, ids2, pad)[1, :9], lo[1, :9], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,preset,expected", [
    ("gpt", "small", 124_439_808),       # Hugging Face gpt2
    ("gpt", "medium", 354_823_168),      # Hugging Face gpt2-medium
    ("vit", "b16", 86_567_656),          # google/vit-base-patch16-224
])
def test_standard_presets_parameter_counts(family, preset, expected):
    cfg = fm.get_config(family, preset)
    lib = fm.layer_library("ls2")
    cls = type(fm.build(fm.get_config(family, "tiny"), seed=0))
    abstract = nnx.eval_shape(lambda: cls(cfg, lib, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n == expected


def test_presets_validate():
    with pytest.raises(ValueError, match="preset"):
        fm.get_config("gpt", "huge")
    with pytest.raises(ValueError, match="unknown fields"):
        fm.get_config("gpt", "tiny", hidden=3)
    with pytest.raises(ValueError, match="impl"):
        fm.layer_library("torch")


def test_config_old_layer_norm_eps_keyword_warns_once_and_works():
    from numerics import assert_renamed_keyword
    cfg = assert_renamed_keyword(lambda: fm.get_config("bert", "tiny", layer_norm_eps=1e-7),
                                 lambda: fm.get_config("bert", "tiny", epsilon=1e-7),
                                 "Config.replace", "layer_norm_eps", "epsilon")
    assert cfg.epsilon == 1e-7
