"""Hugging Face checkpoint translation (flax_models.convert) against checkpoints and logits
written by transformers' own BertForMaskedLM / GPT2LMHeadModel / ViTForImageClassification
(tests/fixtures/hf/<family>/, made by scripts/make_hf_fixtures.py). Needs only safetensors,
numpy and jax."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")
from safetensors.flax import load_file, save_file  # noqa: E402

import flax_models as fm  # noqa: E402
from flax_models import convert  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
FAMILIES = ("bert", "gpt", "vit")


def fixture(family):
    return os.path.join(FIXTURES, family)


def run(model, family):
    """Our model on the fixture's inputs -> logits as numpy fp32."""
    d = fixture(family)
    load = lambda n: jnp.asarray(np.load(os.path.join(d, f"{n}.npy")))
    if family == "bert":
        out = model(load("input_ids"), token_type_ids=load("token_type_ids"),
                    padding_mask=load("attention_mask").astype(bool))
    elif family == "gpt":
        out = model(load("input_ids"))
    else:  # HF takes NCHW pixel values, our ViT NHWC images
        out = model(load("pixel_values").transpose(0, 2, 3, 1))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("impl", fm.IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_import_reproduces_hf_logits(family, impl):
    cfg, model = convert.import_hf(family, fixture(family), impl=impl)
    assert cfg.family == family
    want = np.load(os.path.join(fixture(family), "logits.npy"))
    got = run(model, family)
    assert got.shape == want.shape
    # fp32 on both sides; observed max |diff| ~1e-6 on logits of magnitude ~2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fixture_configs_map_to_our_fields():
    cfgs = {f: convert.import_hf(f, fixture(f), impl="plain")[0] for f in FAMILIES}
    b, g, v = cfgs["bert"], cfgs["gpt"], cfgs["vit"]
    assert (b.vocab_size, b.hidden_size, b.num_layers, b.num_heads, b.ffn_size, b.max_len,
            b.type_vocab_size, b.epsilon) == (99, 32, 2, 4, 37, 64, 2, 1e-12)
    assert (g.vocab_size, g.hidden_size, g.num_layers, g.num_heads, g.ffn_size, g.max_len,
            g.epsilon) == (128, 32, 2, 2, 128, 64, 1e-5)
    assert (v.hidden_size, v.num_layers, v.num_heads, v.ffn_size, v.image_size, v.patch_size,
            v.channels, v.num_classes, v.epsilon) == (32, 2, 4, 37, 32, 8, 3, 5, 1e-12)
    assert b.hidden_dropout == 0.1 and b.attn_dropout == 0.1 and g.attn_dropout == 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_fixture_files(family, tmp_path):
    """import -> export gives the HF file back: same key set, bit-identical tensors."""
    cfg, model = convert.import_hf(family, fixture(family), impl="ls2")
    out = convert.export_hf(model, cfg, str(tmp_path / family))
    want = load_file(os.path.join(fixture(family), "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    with open(os.path.join(out, "config.json")) as f:
        exported = json.load(f)
    with open(os.path.join(fixture(family), "config.json")) as f:
        original = json.load(f)
    for key in ("model_type", "architectures"):
        assert exported[key] == original[key]
    assert convert.config_from_hf(family, exported) == cfg


@pytest.mark.parametrize("impl", fm.IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_import_is_identity(family, impl, tmp_path):
    """Any of our models (own shapes, random init) survives export -> import exactly."""
    own = {"bert": dict(vocab_size=77, max_len=40, type_vocab_size=3),
           "gpt": dict(vocab_size=77, max_len=40),
           "vit": dict(num_classes=3, image_size=16, patch_size=4, channels=2)}[family]
    cfg = fm.get_config(family, num_layers=2, hidden_size=32, num_heads=4, ffn_size=48,
                        hidden_dropout=0.1, attn_dropout=0.1, **own)
    model = fm.build(cfg, impl=impl, seed=3, train=False)
    if family == "vit":  # cls starts at zeros: give it values that a mix-up would show
        model.cls[...] = jax.random.normal(jax.random.key(0), model.cls.shape)
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    convert.export_hf(model, cfg, str(tmp_path))
    cfg2, model2 = convert.import_hf(family, str(tmp_path), impl=impl)
    assert cfg2 == cfg.replace(activation_dropout=0.0)
    after = nnx.to_pure_dict(nnx.state(model2, nnx.Param))
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(before)
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(after)
    assert tree_a == tree_b
    for (path, x), (_, y) in zip(flat_b, flat_a):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_params_round_trip_bfloat16(tmp_path):
    cfg = fm.get_config("gpt", hidden_size=32, num_heads=2, ffn_size=64, vocab_size=50,
                        max_len=16)
    model = fm.build(cfg, impl="plain", param_dtype=jnp.bfloat16, train=False)
    convert.export_hf(model, cfg, str(tmp_path))
    assert {v.dtype for v in load_file(str(tmp_path / "model.safetensors")).values()} == {
        jnp.dtype(jnp.bfloat16)}
    _, model2 = convert.import_hf("gpt2", str(tmp_path), impl="plain")
    a = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    b = jax.tree_util.tree_leaves(nnx.state(model2, nnx.Param))
    assert all(x.dtype == y.dtype == jnp.bfloat16 and bool(jnp.all(x == y)) for x, y in zip(a, b))


def test_hf_layouts():
    """The layout rules by hand: Linear transposed, GPT-2 Conv1D copied, QKV concatenated
    [q | k | v] along the output axis, ViT conv weight to (row, col, channel) patches."""
    tensors, hf_cfg = convert.read_hf(fixture("vit"))
    cfg = convert.config_from_hf("vit", hf_cfg)
    params = convert.hf_to_params("vit", tensors, cfg)
    a = "vit.encoder.layer.1.attention.attention"
    qkv = params["encoder"]["layers"][1]["attn"]["qkv"]
    np.testing.assert_array_equal(qkv["kernel"][:, 32:64], tensors[f"{a}.key.weight"].T)
    np.testing.assert_array_equal(qkv["bias"][64:], tensors[f"{a}.value.bias"])
    np.testing.assert_array_equal(params["head"]["kernel"], tensors["classifier.weight"].T)
    w = tensors["vit.embeddings.patch_embeddings.projection.weight"]  # (hidden, C, p, p)
    r, c, ch = 5, 2, 1
    np.testing.assert_array_equal(params["patch"]["kernel"][(r * 8 + c) * 3 + ch], w[:, ch, r, c])
    gt, gcfg = convert.read_hf(fixture("gpt"))
    gp = convert.hf_to_params("gpt", gt, convert.config_from_hf("gpt", gcfg))
    np.testing.assert_array_equal(gp["decoder"]["layers"][0]["fc1"]["kernel"],
                                  gt["transformer.h.0.mlp.c_fc.weight"])


def test_import_accepts_legacy_keys():
    """Older BERT / GPT-2 checkpoints: gamma/beta LayerNorm names, pooler and NSP head,
    position_ids, tied copies stored, no model prefix, GPT-2 causal-mask buffers."""
    tensors, hf_cfg = convert.read_hf(fixture("bert"))
    cfg = convert.config_from_hf("bert", hf_cfg)
    want = convert.hf_to_params("bert", tensors, cfg)
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                       "LayerNorm.beta"): v
              for k, v in tensors.items()}
    legacy.update({"bert.pooler.dense.weight": jnp.zeros((32, 32)),
                   "bert.pooler.dense.bias": jnp.zeros((32,)),
                   "cls.seq_relationship.weight": jnp.zeros((2, 32)),
                   "cls.seq_relationship.bias": jnp.zeros((2,)),
                   "bert.embeddings.position_ids": jnp.arange(64)[None],
                   "cls.predictions.decoder.weight": tensors["bert.embeddings.word_embeddings.weight"],
                   "cls.predictions.decoder.bias": tensors["cls.predictions.bias"]})
    got = convert.hf_to_params("bert", legacy, cfg)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(jnp.all(x == y)), got, want))

    gt, gcfg = convert.read_hf(fixture("gpt"))
    gc = convert.config_from_hf("gpt", gcfg)
    bare = {k.removeprefix("transformer."): v for k, v in gt.items()}
    bare["h.0.attn.bias"] = jnp.tril(jnp.ones((1, 1, 64, 64)))
    bare["lm_head.weight"] = gt["transformer.wte.weight"]
    got = convert.hf_to_params("gpt", bare, gc)
    want = convert.hf_to_params("gpt", gt, gc)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(jnp.all(x == y)), got, want))


def test_errors():
    tensors, hf_cfg = convert.read_hf(fixture("bert"))
    cfg = convert.config_from_hf("bert", hf_cfg)
    missing = dict(tensors)
    missing.pop("bert.encoder.layer.1.attention.self.key.weight")
    with pytest.raises(KeyError, match="lacks 1 keys.*layer.1.attention.self.key.weight"):
        convert.hf_to_params("bert", missing, cfg)
    extra = {**tensors, "bert.encoder.layer.2.output.dense.bias": jnp.zeros((32,))}
    with pytest.raises(KeyError, match="no place for.*layer.2.output.dense.bias"):
        convert.hf_to_params("bert", extra, cfg)
    with pytest.raises(ValueError, match=r"word_embeddings.weight must have shape \(100, 32\)"):
        convert.hf_to_params("bert", tensors, cfg.replace(vocab_size=100))
    untied = {**tensors, "cls.predictions.decoder.weight":
              tensors["bert.embeddings.word_embeddings.weight"] + 1}
    with pytest.raises(ValueError, match="decoder.weight must equal"):
        convert.hf_to_params("bert", untied, cfg)
    with pytest.raises(ValueError, match="family must be one of"):
        convert.hf_to_params("t5", tensors, cfg)
    with pytest.raises(ValueError, match="model_type 'gpt2', got 'bert'"):
        convert.config_from_hf("gpt", hf_cfg)
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        convert.config_from_hf("bert", {**hf_cfg, "hidden_act": "relu"})
    with pytest.raises(FileNotFoundError, match="read_hf"):
        convert.read_hf(os.path.join(FIXTURES, "missing"))
    with pytest.raises(TypeError, match="export_hf: model_or_params"):
        convert.export_hf([1, 2], cfg, "/nonexistent")


def _broken(name):
    """(file, edit) pairs that leave a copy of the gpt fixture unreadable."""
    def edit_header(path):
        data = bytearray(path.read_bytes())
        n = int.from_bytes(data[:8], "little")
        header = bytes(data[8:8 + n])
        at = header.index(b"data_offsets") + len(b'data_offsets":[')
        data[8 + at] = ord("9")  # one offset digit changed: the offsets no longer tile the buffer
        path.write_bytes(bytes(data))

    def as_directory(path):
        path.unlink()
        path.mkdir()

    return {
        "config not JSON": ("config.json", lambda p: p.write_text("{'vocab_size': 3,")),
        "config a list": ("config.json", lambda p: p.write_text("[1, 2]")),
        "weights truncated": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-100])),
        "weights empty": ("model.safetensors", lambda p: p.write_bytes(b"")),
        "weights header edited": ("model.safetensors", edit_header),
        "weights a directory": ("model.safetensors", as_directory),
    }[name]


@pytest.mark.parametrize("case", ["config not JSON", "config a list", "weights truncated", "weights empty",
                                  "weights header edited", "weights a directory"])
def test_unreadable_checkpoint_names_the_folder_and_the_file(case, tmp_path):
    import shutil
    folder = tmp_path / "ckpt"
    shutil.copytree(fixture("gpt"), folder)
    name, edit = _broken(case)
    edit(folder / name)
    want = rf"read_hf: '{folder}' is not a readable Hugging Face checkpoint: {name} \("
    with pytest.raises(ValueError, match=want):
        convert.read_hf(str(folder))
    with pytest.raises(ValueError, match=want):
        convert.import_hf("gpt", str(folder), impl="plain")


def test_import_hf_refuses_kv_heads_not_dividing_heads_and_bad_dtypes(tmp_path):
    _, hf_cfg = convert.read_hf(fixture("llama"))
    with pytest.raises(ValueError, match=r"config_from_hf: config.json num_key_value_heads \(3\) must be a positive "
                                         r"int dividing num_attention_heads \(4\)"):
        convert.config_from_hf("llama", {**hf_cfg, "num_key_value_heads": 3})
    for kw in (dict(dtype="foo"), dict(param_dtype=jnp.int32)):
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"import_hf: {name} must be a floating dtype"):
            convert.import_hf("gpt", fixture("gpt"), impl="plain", **kw)
    cfg, _ = convert.import_hf("gpt", fixture("gpt"), impl="plain", dtype="bfloat16")  # a dtype name is fine
    assert cfg.vocab_size > 0


def test_read_sharded_checkpoint(tmp_path):
    tensors, hf_cfg = convert.read_hf(fixture("gpt"))
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[:10],
              "model-00002-of-00002.safetensors": keys[10:]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(tmp_path / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    got, _ = convert.read_hf(str(tmp_path))
    assert sorted(got) == keys
    _, model = convert.import_hf("gpt", str(tmp_path), impl="plain")
    np.testing.assert_allclose(run(model, "gpt"),
                               np.load(os.path.join(fixture("gpt"), "logits.npy")),
                               rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- LLaMA
# tests/fixtures/hf/llama: LlamaForCausalLM (4 heads over 2 kv heads, untied lm_head,
# LLaMA 3.1 rope scaling) saved by transformers with its logits.

def _llama_logits(model):
    ids = jnp.asarray(np.load(os.path.join(fixture("llama"), "input_ids.npy")))
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, ids), np.float32)


@pytest.mark.parametrize("impl", fm.IMPLS)
def test_llama_import_reproduces_hf_logits(impl):
    cfg, model = convert.import_hf("llama", fixture("llama"), impl=impl)
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_size, cfg.tie_embeddings) == \
        ("llama", 4, 2, 48, False)
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.original_max_position == 32
    want = np.load(os.path.join(fixture("llama"), "logits.npy"))
    # fp32 on both sides; observed max |diff| ~1e-6 on logits of magnitude ~2
    np.testing.assert_allclose(_llama_logits(model), want, rtol=1e-4, atol=1e-5)
    if impl == "ls2":  # the fixture's rope scaling shows in its logits
        _, unscaled = convert.import_hf("llama", fixture("llama"), impl=impl, rope_scaling=None)
        assert np.max(np.abs(_llama_logits(unscaled) - want)) > 1e-3


def test_llama_export_writes_the_fixture_files(tmp_path):
    cfg, model = convert.import_hf("llama", fixture("llama"), impl="ls2")
    out = convert.export_hf(model, cfg, str(tmp_path))
    want = load_file(os.path.join(fixture("llama"), "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    with open(os.path.join(out, "config.json")) as f:
        exported = json.load(f)
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["model_type"] == "llama"
    assert convert.config_from_hf("llama", exported) == cfg


@pytest.mark.parametrize("tie", [False, True])
def test_llama_export_then_import_is_identity(tie, tmp_path):
    cfg = fm.get_config("llama", vocab_size=77, hidden_size=48, num_heads=6, num_kv_heads=3, ffn_size=40,
                        max_len=40, tie_embeddings=tie, rope_theta=500000.0)
    model = fm.build(cfg, impl="plain", seed=3, train=False)
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    convert.export_hf(model, cfg, str(tmp_path))
    assert ("lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))) is not tie
    cfg2, model2 = convert.import_hf("llama", str(tmp_path), impl="ls2")
    assert cfg2 == cfg
    after = nnx.to_pure_dict(nnx.state(model2, nnx.Param))
    assert jax.tree.structure(after) == jax.tree.structure(before)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), before, after)


def test_llama_layouts_and_errors():
    tensors, hf_cfg = convert.read_hf(fixture("llama"))
    cfg = convert.config_from_hf("llama", hf_cfg)
    params = convert.hf_to_params("llama", tensors, cfg)
    a = "model.layers.1.self_attn"
    qkv = params["layers"][1]["qkv"]["kernel"]  # [q (32) | k (16) | v (16)] along the output axis
    np.testing.assert_array_equal(qkv[:, 32:48], tensors[f"{a}.k_proj.weight"].T)
    np.testing.assert_array_equal(qkv[:, 48:], tensors[f"{a}.v_proj.weight"].T)
    gate_up = params["layers"][0]["gate_up"]["kernel"]
    np.testing.assert_array_equal(gate_up[:, 48:], tensors["model.layers.0.mlp.up_proj.weight"].T)
    # older checkpoints store the rotary inv_freq buffers; skipped
    legacy = {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": jnp.ones((4,))}
    got = convert.hf_to_params("llama", legacy, cfg)
    assert jax.tree_util.tree_all(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), got, params))
    with pytest.raises(ValueError, match=r"k_proj.weight must have shape \(8, 32\)"):
        convert.hf_to_params("llama", tensors, cfg.replace(num_kv_heads=1))
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        convert.config_from_hf("llama", {**hf_cfg, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope type must be one of"):
        convert.config_from_hf("llama", {**hf_cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    v4 = {k: v for k, v in hf_cfg.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling={k: v for k, v in hf_cfg["rope_parameters"].items()
                                                if k != "rope_theta"})
    assert convert.config_from_hf("llama", v4) == cfg  # transformers 4's keys
    with pytest.raises(ValueError, match="config_to_hf: LlamaForCausalLM has RMSNorm, SwiGLU"):
        convert.config_to_hf(cfg.replace(gated_activation="geglu_tanh"))


def test_llama_export_loads_in_transformers(tmp_path):
    """The exported checkpoint in transformers' own LlamaForCausalLM: every key loaded,
    the fixture's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, model = convert.import_hf("llama", fixture("llama"), impl="ls2")
    convert.export_hf(model, cfg, str(tmp_path))
    hf, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.from_numpy(np.load(os.path.join(fixture("llama"), "input_ids.npy")))
    with torch.no_grad():
        got = hf.eval()(input_ids=ids).logits.float().numpy()
    np.testing.assert_allclose(got, np.load(os.path.join(fixture("llama"), "logits.npy")), rtol=1e-5, atol=1e-6)
