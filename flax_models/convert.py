"""Hugging Face checkpoint translation for BERT, GPT-2, ViT and LLaMA.

Reads and writes the files of HF's ``save_pretrained`` (``model.safetensors`` or a sharded
``model.safetensors.index.json``, plus ``config.json``) with only ``safetensors``, numpy and
jax -- no torch or transformers:

* ``"bert"`` <-> ``BertForMaskedLM`` (post-LN, erf GELU; embeddings with token types, the
  MLM head's dense + GELU + LayerNorm transform, decoder tied to the word embeddings, its
  bias ``cls.predictions.bias``),
* ``"gpt"`` (alias ``"gpt2"``) <-> ``GPT2LMHeadModel`` (pre-LN, tanh GELU "gelu_new";
  ``lm_head`` tied to ``wte``),
* ``"vit"`` <-> ``ViTForImageClassification`` (pre-LN, erf GELU, CLS token, no pooler),
* ``"llama"`` <-> ``LlamaForCausalLM`` (RMSNorm, SwiGLU, rotary in the rotate-half
  layout, grouped-query attention, no biases; its q/k/v and gate/up weights joined into
  our ``qkv`` and ``gate_up`` kernels; ``lm_head`` its own or tied).

Layouts. Our ``nnx.Linear`` kernels are (in, out); HF ``nn.Linear`` weights are (out, in)
and are transposed; GPT-2's ``Conv1D`` weights are already (in, out) and are copied. Our
fused self-attention ``qkv`` kernel (hidden, 3*hidden) is [q | k | v] along the output
axis, each heads-major -- the layout of GPT-2's ``c_attn`` -- and is split into / joined
from BERT's and ViT's separate ``query``/``key``/``value``. ViT's patch convolution weight
(hidden, channels, p, p) becomes our ``patch`` kernel (p*p*channels, hidden) in (row, col,
channel) order; HF takes images NCHW, our ViT NHWC (``images = pixel_values.transpose(0, 2,
3, 1)``).

Keys that older checkpoints carry and our models do not use are skipped on import (BERT's
pooler and next-sentence head, ``position_ids`` buffers, GPT-2's causal-mask buffers) and
tied copies (``cls.predictions.decoder.*``, ``lm_head.weight``) are checked to equal the
tensor they are tied to; any other unused or missing key is an error.

API: `import_hf` (file -> (Config, model)), `export_hf` (model or params -> files),
`read_hf` / `hf_to_params` / `params_to_hf` / `config_from_hf` / `config_to_hf` for the
pieces. ``params`` everywhere is the nested dict of ``nnx.to_pure_dict(nnx.state(model,
nnx.Param))`` (layer indices as int keys).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_models.configs import Config, get_config

FAMILIES = ("bert", "gpt", "vit", "llama")
_ALIASES = {"gpt2": "gpt"}
_MODEL_TYPE = {"bert": "bert", "gpt": "gpt2", "vit": "vit", "llama": "llama"}
_ARCH = {"bert": "BertForMaskedLM", "gpt": "GPT2LMHeadModel", "vit": "ViTForImageClassification",
         "llama": "LlamaForCausalLM"}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

# Keys that HF checkpoints may hold and our models have no use for (regex, full match).
_IGNORED = {
    "bert": [r"(bert\.)?embeddings\.position_ids", r"(bert\.)?pooler\..*",
             r"cls\.seq_relationship\..*"],
    "gpt": [r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias"],
    "vit": [r"(vit\.)?embeddings\.position_ids", r"(vit\.)?pooler\..*"],
    "llama": [r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"],
}


def _family(fn: str, family: str) -> str:
    family = _ALIASES.get(family, family)
    if family not in FAMILIES:
        raise ValueError(f"{fn}: family must be one of {FAMILIES} (or 'gpt2'), got {family!r}")
    return family


# --------------------------------------------------------------------------- files


def read_hf(path_or_dir: str) -> tuple[dict[str, jnp.ndarray], dict[str, Any]]:
    """The tensors and config of an HF checkpoint.

    ``path_or_dir``: a directory holding ``model.safetensors`` (or the shards of
    ``model.safetensors.index.json``) and ``config.json``, or the path of a ``.safetensors``
    file with ``config.json`` beside it. Returns ({key: jax array in the stored dtype},
    config dict).
    """
    if os.path.isdir(path_or_dir):
        folder, single = path_or_dir, os.path.join(path_or_dir, WEIGHTS_NAME)
        index = os.path.join(path_or_dir, INDEX_NAME)
        if os.path.exists(single):
            files = [single]
        elif os.path.exists(index):
            weight_map = _read_json(folder, index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
                raise _unreadable(folder, index, "its weight_map must be a JSON object of {key: file name}, got "
                                                 f"{type(weight_map).__name__}")
            files = [os.path.join(folder, n) for n in sorted(set(weight_map.values()))]
        else:
            raise FileNotFoundError(f"read_hf: path_or_dir {path_or_dir!r} holds neither "
                                    f"{WEIGHTS_NAME} nor {INDEX_NAME}")
    elif os.path.isfile(path_or_dir) and path_or_dir.endswith(".safetensors"):
        folder, files = os.path.dirname(path_or_dir), [path_or_dir]
    else:
        raise FileNotFoundError(f"read_hf: path_or_dir must be a checkpoint directory or a "
                                f".safetensors file, got {path_or_dir!r}")
    cfg_path = os.path.join(folder, CONFIG_NAME)
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"read_hf: expected {CONFIG_NAME} next to the weights, "
                                f"got no {cfg_path!r}")
    hf_config = _read_json(folder, cfg_path)
    tensors: dict[str, jnp.ndarray] = {}
    for file in files:
        tensors.update(_load_safetensors(folder, file))
    return tensors, hf_config


def _unreadable(folder, file, reason) -> ValueError:
    return ValueError(f"read_hf: {folder!r} is not a readable Hugging Face checkpoint: {os.path.basename(file)} "
                      f"({file}): {reason}")


def _read_json(folder, file) -> dict:
    """A JSON object from ``file``, or a ValueError naming the folder and the file."""
    try:
        with open(file) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _unreadable(folder, file, f"{type(e).__name__}: {e}") from e
    if not isinstance(value, dict):
        raise _unreadable(folder, file, f"must hold a JSON object, got a JSON {type(value).__name__}")
    return value


def _load_safetensors(folder, file) -> dict:
    from safetensors import SafetensorError
    from safetensors.flax import load_file

    if not os.path.isfile(file):
        raise _unreadable(folder, file, ("a directory, not a file" if os.path.isdir(file) else "not a regular file")
                          if os.path.exists(file) else "missing")
    try:
        return load_file(file)
    except (OSError, SafetensorError, ValueError) as e:
        size = os.path.getsize(file)
        raise _unreadable(folder, file, f"{type(e).__name__}: {e} (file of {size} bytes; truncated, empty or an "
                                        f"edited header?)") from e


# --------------------------------------------------------------------------- configs


def _require(fn, hf, key, allowed):
    value = hf.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(f"{fn}: config.json {key} must be one of {allowed} for our model, "
                         f"got {value!r}")


def config_from_hf(family: str, hf_config: dict[str, Any], **overrides) -> Config:
    """Our `Config` from an HF ``config.json`` dict (dropout rates included; features our
    models do not have -- other activations, relative positions, scaled attention by layer
    index, no QKV bias -- raise ``ValueError``). ``overrides`` go to ``Config.replace``."""
    fn = "config_from_hf"
    family = _family(fn, family)
    hf = hf_config
    mt = hf.get("model_type")
    if mt is not None and mt != _MODEL_TYPE[family]:
        raise ValueError(f"{fn}: family {family!r} expects model_type "
                         f"{_MODEL_TYPE[family]!r}, got {mt!r}")
    if family == "llama":
        cfg = _llama_config_from_hf(fn, hf)
    elif family == "bert":
        _require(fn, hf, "hidden_act", ["gelu"])
        _require(fn, hf, "position_embedding_type", ["absolute"])
        _require(fn, hf, "is_decoder", [False])
        cfg = get_config("bert").replace(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            ffn_size=hf["intermediate_size"], max_len=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            epsilon=hf.get("layer_norm_eps", 1e-12),
            hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
            attn_dropout=hf.get("attention_probs_dropout_prob", 0.1), activation_dropout=0.0)
    elif family == "gpt":
        _require(fn, hf, "activation_function", ["gelu_new", "gelu_pytorch_tanh"])
        _require(fn, hf, "scale_attn_weights", [True])
        _require(fn, hf, "scale_attn_by_inverse_layer_idx", [False])
        _require(fn, hf, "add_cross_attention", [False])
        h = hf.get("n_embd", 768)
        cfg = get_config("gpt").replace(
            vocab_size=hf.get("vocab_size", 50257), hidden_size=h,
            num_layers=hf.get("n_layer", 12), num_heads=hf.get("n_head", 12),
            ffn_size=hf.get("n_inner") or 4 * h, max_len=hf.get("n_positions", 1024),
            epsilon=hf.get("layer_norm_epsilon", 1e-5),
            hidden_dropout=hf.get("resid_pdrop", 0.1), attn_dropout=hf.get("attn_pdrop", 0.1),
            activation_dropout=0.0)
        if hf.get("embd_pdrop", cfg.hidden_dropout) != cfg.hidden_dropout:
            raise ValueError(f"{fn}: our GPT uses one rate for embd_pdrop and resid_pdrop, got "
                             f"{hf.get('embd_pdrop')} and {cfg.hidden_dropout}")
    else:
        _require(fn, hf, "hidden_act", ["gelu"])
        _require(fn, hf, "qkv_bias", [True])
        labels = hf.get("id2label")
        num = len(labels) if labels else hf.get("num_labels", 2)
        cfg = get_config("vit").replace(
            hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"], ffn_size=hf["intermediate_size"],
            image_size=hf["image_size"], patch_size=hf["patch_size"],
            channels=hf.get("num_channels", 3), num_classes=num,
            epsilon=hf.get("layer_norm_eps", 1e-12),
            hidden_dropout=hf.get("hidden_dropout_prob", 0.0),
            attn_dropout=hf.get("attention_probs_dropout_prob", 0.0), activation_dropout=0.0)
    return cfg.replace(**overrides) if overrides else cfg


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg`` (``model_type`` and ``architectures`` set, so
    ``AutoModel*.from_pretrained`` picks the class)."""
    family = _family("config_to_hf", cfg.family)
    base = {"architectures": [_ARCH[family]], "model_type": _MODEL_TYPE[family],
            "dtype": "float32"}
    if family == "llama":
        return {**base, **_llama_config_to_hf(cfg)}
    if family == "bert":
        return {**base, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "intermediate_size": cfg.ffn_size, "max_position_embeddings": cfg.max_len,
                "type_vocab_size": cfg.type_vocab_size, "hidden_act": "gelu",
                "layer_norm_eps": cfg.epsilon, "hidden_dropout_prob": cfg.hidden_dropout,
                "attention_probs_dropout_prob": cfg.attn_dropout,
                "position_embedding_type": "absolute", "tie_word_embeddings": True,
                "pad_token_id": 0}
    if family == "gpt":
        return {**base, "vocab_size": cfg.vocab_size, "n_embd": cfg.hidden_size,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_size,
                "n_positions": cfg.max_len, "activation_function": "gelu_new",
                "layer_norm_epsilon": cfg.epsilon, "resid_pdrop": cfg.hidden_dropout,
                "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attn_dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "tie_word_embeddings": True, "bos_token_id": cfg.vocab_size - 1,
                "eos_token_id": cfg.vocab_size - 1}
    return {**base, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.ffn_size,
            "image_size": cfg.image_size, "patch_size": cfg.patch_size,
            "num_channels": cfg.channels, "hidden_act": "gelu", "qkv_bias": True,
            "layer_norm_eps": cfg.epsilon, "hidden_dropout_prob": cfg.hidden_dropout,
            "attention_probs_dropout_prob": cfg.attn_dropout,
            "id2label": {str(i): f"LABEL_{i}" for i in range(cfg.num_classes)},
            "label2id": {f"LABEL_{i}": i for i in range(cfg.num_classes)}}


# --------------------------------------------------------------------------- key maps
#
# A plan is a list of (hf keys, our path, kind). Kinds: "copy" (same layout), "linear"
# (HF (out, in) <-> our (in, out)), "qkv_w" / "qkv_b" (three HF Linear weights / biases
# <-> our fused kernel / bias), "patch" (ViT conv weight <-> our patch kernel).


def _linear(hf, ours):
    return [((f"{hf}.weight",), (*ours, "kernel"), "linear"), ((f"{hf}.bias",), (*ours, "bias"), "copy")]


def _ln(hf, ours, w="weight", b="bias"):
    return [((f"{hf}.{w}",), (*ours, "scale"), "copy"), ((f"{hf}.{b}",), (*ours, "bias"), "copy")]


def _qkv(hf, ours, q="query", k="key", v="value"):
    names = tuple(f"{hf}.{n}" for n in (q, k, v))
    return [(tuple(f"{n}.weight" for n in names), (*ours, "qkv", "kernel"), "qkv_w"),
            (tuple(f"{n}.bias" for n in names), (*ours, "qkv", "bias"), "qkv_b")]


def _plan(family: str, cfg: Config) -> list:
    if family == "llama":
        return _llama_plan(cfg)
    plan = []
    if family == "bert":
        e = "bert.embeddings"
        plan += [((f"{e}.word_embeddings.weight",), ("embed", "tokens", "embedding"), "copy"),
                 ((f"{e}.position_embeddings.weight",), ("embed", "positions", "embedding"), "copy"),
                 ((f"{e}.token_type_embeddings.weight",), ("token_type", "embedding"), "copy")]
        plan += _ln(f"{e}.LayerNorm", ("embed_ln",))
        for i in range(cfg.num_layers):
            hf, ours = f"bert.encoder.layer.{i}", ("encoder", "layers", i)
            plan += _qkv(f"{hf}.attention.self", (*ours, "attn"))
            plan += _linear(f"{hf}.attention.output.dense", (*ours, "attn", "out"))
            plan += _ln(f"{hf}.attention.output.LayerNorm", (*ours, "attn_ln"))
            plan += _linear(f"{hf}.intermediate.dense", (*ours, "fc1"))
            plan += _linear(f"{hf}.output.dense", (*ours, "fc2"))
            plan += _ln(f"{hf}.output.LayerNorm", (*ours, "ffn_ln"))
        plan += _linear("cls.predictions.transform.dense", ("mlm_dense",))
        plan += _ln("cls.predictions.transform.LayerNorm", ("mlm_ln",))
        plan += [(("cls.predictions.bias",), ("mlm_bias",), "copy")]
    elif family == "gpt":
        plan += [(("transformer.wte.weight",), ("embed", "tokens", "embedding"), "copy"),
                 (("transformer.wpe.weight",), ("embed", "positions", "embedding"), "copy")]
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.h.{i}", ("decoder", "layers", i)
            plan += _ln(f"{hf}.ln_1", (*ours, "attn_ln"))
            for name, path in (("attn.c_attn", ("attn", "qkv")), ("attn.c_proj", ("attn", "out")),
                               ("mlp.c_fc", ("fc1",)), ("mlp.c_proj", ("fc2",))):
                # GPT-2 Conv1D weights are (in, out): our kernel layout as stored.
                plan += [((f"{hf}.{name}.weight",), (*ours, *path, "kernel"), "copy"),
                         ((f"{hf}.{name}.bias",), (*ours, *path, "bias"), "copy")]
            plan += _ln(f"{hf}.ln_2", (*ours, "ffn_ln"))
        plan += _ln("transformer.ln_f", ("decoder", "final_ln"))
    else:
        e = "vit.embeddings"
        plan += [((f"{e}.cls_token",), ("cls",), "copy"),
                 ((f"{e}.position_embeddings",), ("pos",), "copy"),
                 ((f"{e}.patch_embeddings.projection.weight",), ("patch", "kernel"), "patch"),
                 ((f"{e}.patch_embeddings.projection.bias",), ("patch", "bias"), "copy")]
        for i in range(cfg.num_layers):
            hf, ours = f"vit.encoder.layer.{i}", ("encoder", "layers", i)
            plan += _ln(f"{hf}.layernorm_before", (*ours, "attn_ln"))
            plan += _qkv(f"{hf}.attention.attention", (*ours, "attn"))
            plan += _linear(f"{hf}.attention.output.dense", (*ours, "attn", "out"))
            plan += _ln(f"{hf}.layernorm_after", (*ours, "ffn_ln"))
            plan += _linear(f"{hf}.intermediate.dense", (*ours, "fc1"))
            plan += _linear(f"{hf}.output.dense", (*ours, "fc2"))
        plan += _ln("vit.layernorm", ("encoder", "final_ln"))
        plan += _linear("classifier", ("head",))
    return plan


def _hf_shapes(kind, shape, cfg):
    """The HF shapes of the tensors behind one of our params of ``shape``."""
    if isinstance(kind, tuple):
        return _joined_hf_shapes(kind, shape)
    if kind == "linear":
        return [shape[::-1]]
    if kind == "qkv_w":
        return [(shape[1] // 3, shape[0])] * 3
    if kind == "qkv_b":
        return [(shape[0] // 3,)] * 3
    if kind == "patch":
        return [(cfg.hidden_size, cfg.channels, cfg.patch_size, cfg.patch_size)]
    return [shape]


def _to_ours(kind, ts, cfg):
    if isinstance(kind, tuple):
        return jnp.concatenate([t.T for t in ts], axis=1)
    if kind == "copy":
        return ts[0]
    if kind == "linear":
        return ts[0].T
    if kind == "qkv_w":
        return jnp.concatenate([t.T for t in ts], axis=1)
    if kind == "qkv_b":
        return jnp.concatenate(ts, axis=0)
    # patch: (hidden, C, p, p) -> (p, p, C, hidden) -> (p*p*C, hidden), (row, col, channel)
    return ts[0].transpose(2, 3, 1, 0).reshape(-1, cfg.hidden_size)


def _to_hf(kind, x, cfg):
    if isinstance(kind, tuple):
        return [t.T for t in jnp.split(x, np.cumsum(kind[1])[:-1], axis=1)]
    if kind == "copy":
        return [x]
    if kind == "linear":
        return [x.T]
    if kind == "qkv_w":
        return [t.T for t in jnp.split(x, 3, axis=1)]
    if kind == "qkv_b":
        return list(jnp.split(x, 3, axis=0))
    p, c = cfg.patch_size, cfg.channels
    return [x.reshape(p, p, c, cfg.hidden_size).transpose(3, 2, 0, 1)]


def _expected_shapes(cfg: Config) -> dict:
    """{our path: shape} of the model ``cfg`` builds (no arrays allocated)."""
    import flax_models

    model = nnx.eval_shape(lambda: flax_models.build(cfg, impl="plain", train=False))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {tuple(path): tuple(v.get_value().shape) for path, v in flat}


def _normalise_keys(family: str, tensors: dict) -> dict:
    """Adds the ``transformer.`` / ``bert.`` / ``vit.`` prefix some checkpoints omit (those
    saved from the base model) and renames TF-era ``gamma``/``beta`` LayerNorm keys."""
    prefix = {"bert": "bert.", "gpt": "transformer.", "vit": "vit.", "llama": "model."}[family]
    heads = ("cls.", "lm_head.", "classifier.")
    out = {}
    for k, v in tensors.items():
        k = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", k)
        k = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)
        if not k.startswith(prefix) and not k.startswith(heads):
            k = prefix + k
        out[k] = v
    return out


def hf_to_params(family: str, tensors: dict[str, Any], cfg: Config) -> dict:
    """Our params (nested dict, arrays in the stored dtype) from HF ``tensors`` {key: array}.

    Raises ``KeyError`` naming missing keys and unused keys, ``ValueError`` naming a tensor
    of the wrong shape or a tied copy that differs from the tensor it is tied to.
    """
    fn = "hf_to_params"
    family = _family(fn, family)
    tensors = _normalise_keys(family, {k: jnp.asarray(v) for k, v in tensors.items()})
    shapes = _expected_shapes(cfg)
    plan = _plan(family, cfg)
    missing = [k for keys, _, _ in plan for k in keys if k not in tensors]
    if missing:
        raise KeyError(f"{fn}: the {family!r} checkpoint lacks {len(missing)} keys our model "
                       f"needs, e.g. {missing[:5]}")
    flat, used = {}, set()
    for keys, path, kind in plan:
        want = _hf_shapes(kind, shapes[path], cfg)
        ts = [tensors[k] for k in keys]
        for k, t, w in zip(keys, ts, want):
            if tuple(t.shape) != tuple(w):
                raise ValueError(f"{fn}: {k} must have shape {tuple(w)} for config "
                                 f"(hidden {cfg.hidden_size}, ffn {cfg.ffn_size}, vocab "
                                 f"{cfg.vocab_size}), got {tuple(t.shape)}")
        flat[path] = _to_ours(kind, ts, cfg)
        used.update(keys)
    tied = {"bert": {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                     "cls.predictions.decoder.bias": "cls.predictions.bias"},
            "gpt": {"lm_head.weight": "transformer.wte.weight"}, "vit": {},
            "llama": {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}}[family]
    for copy, source in tied.items():
        if copy in tensors:
            if not np.array_equal(np.asarray(tensors[copy]), np.asarray(tensors[source])):
                raise ValueError(f"{fn}: {copy} must equal {source} (our model ties them), "
                                 f"got different values")
            used.add(copy)
    ignored = [re.compile(p) for p in _IGNORED[family]]
    unused = [k for k in tensors if k not in used and not any(p.fullmatch(k) for p in ignored)]
    if unused:
        raise KeyError(f"{fn}: the {family!r} checkpoint has {len(unused)} keys our model has "
                       f"no place for, e.g. {sorted(unused)[:5]}")
    params: dict = {}
    for path, value in flat.items():
        node = params
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return params


def params_to_hf(family: str, params: dict, cfg: Config) -> dict[str, jnp.ndarray]:
    """HF tensors {key: array, params' dtype} from our params (nested dict): the key set
    ``save_pretrained`` writes (tied copies left out, as HF does)."""
    fn = "params_to_hf"
    family = _family(fn, family)
    out = {}
    for keys, path, kind in _plan(family, cfg):
        node = params
        for i, p in enumerate(path):
            if not isinstance(node, dict) or p not in node:
                raise KeyError(f"{fn}: params lack {'/'.join(map(str, path[:i + 1]))} "
                               f"(expected the tree of a {family!r} model)")
            node = node[p]
        for k, t in zip(keys, _to_hf(kind, jnp.asarray(node), cfg)):
            out[k] = t
    return out


# --------------------------------------------------------------------------- LLaMA
#
# LlamaForCausalLM <-> flax_models.llama.Llama. HF keeps q/k/v and gate/up as separate
# nn.Linear weights (out, in); ours are one kernel (in, sum of outs) each, so their plan
# kind is ("joined", (out sizes)): the HF weights transposed and concatenated along our
# output axis. HF's rotary uses the rotate-half pairs (i, i + head_dim / 2), our
# ``interleaved=False``, so no weight permutation is needed.

_ROPE_KINDS = {"linear": "linear", "llama3": "llama3"}


def _llama_rope_from_hf(fn, hf):
    """(theta, RotaryScaling or None) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` / ``rope_scaling`` (transformers 4)."""
    from jax_ls2.ops import RotaryScaling

    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in _ROPE_KINDS:
        raise ValueError(f"{fn}: config.json rope type must be one of {['default', *_ROPE_KINDS]} for our model, "
                         f"got {kind!r}")
    if kind == "linear":
        return theta, RotaryScaling("linear", float(rope["factor"]))
    return theta, RotaryScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))


def _llama_config_from_hf(fn, hf) -> Config:
    _require(fn, hf, "hidden_act", ["silu"])
    _require(fn, hf, "attention_bias", [False])
    _require(fn, hf, "mlp_bias", [False])
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{fn}: config.json num_key_value_heads ({kv_heads!r}) must be a positive int dividing "
                         f"num_attention_heads ({heads!r}): grouped-query attention shares each kv head by a "
                         f"whole group of query heads")
    head_dim = hf.get("head_dim") or h // heads
    theta, scaling = _llama_rope_from_hf(fn, hf)
    return get_config("llama").replace(
        vocab_size=hf["vocab_size"], hidden_size=h, num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=kv_heads, head_dim=0 if head_dim * heads == h else head_dim,
        ffn_size=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 2048),
        epsilon=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), attn_dropout=hf.get("attention_dropout", 0.0),
        hidden_dropout=0.0, activation_dropout=0.0)


def _llama_config_to_hf(cfg: Config) -> dict:
    fn = "config_to_hf"
    if cfg.norm != "rms" or cfg.gated_activation != "swiglu" or cfg.norm_unit_offset or cfg.embed_scale:
        raise ValueError(f"{fn}: LlamaForCausalLM has RMSNorm, SwiGLU, no unit offset and no embedding scale; got "
                         f"norm={cfg.norm!r}, gated_activation={cfg.gated_activation!r}, "
                         f"norm_unit_offset={cfg.norm_unit_offset}, embed_scale={cfg.embed_scale}")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s is not None and s.kind not in _ROPE_KINDS:
        raise ValueError(f"{fn}: LlamaForCausalLM takes rope scaling {sorted(_ROPE_KINDS)}, got {s.kind!r}")
    if s is not None:
        rope.update(rope_type=s.kind, factor=s.factor)
        if s.kind == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position)
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
            "head_dim": cfg.head_dim or cfg.hidden_size // cfg.num_heads, "intermediate_size": cfg.ffn_size,
            "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.epsilon, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.attn_dropout,
            "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings}


def _llama_plan(cfg: Config) -> list:
    d = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    q, kv = cfg.num_heads * d, (cfg.num_kv_heads or cfg.num_heads) * d
    plan = [(("model.embed_tokens.weight",), ("embed", "tokens", "embedding"), "copy")]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", ("layers", i)
        a, m = f"{hf}.self_attn", f"{hf}.mlp"
        plan += [((f"{hf}.input_layernorm.weight",), (*ours, "attn_norm", "scale"), "copy"),
                 ((f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"), (*ours, "qkv", "kernel"),
                  ("joined", (q, kv, kv))),
                 ((f"{a}.o_proj.weight",), (*ours, "out", "kernel"), "linear"),
                 ((f"{hf}.post_attention_layernorm.weight",), (*ours, "mlp_norm", "scale"), "copy"),
                 ((f"{m}.gate_proj.weight", f"{m}.up_proj.weight"), (*ours, "gate_up", "kernel"),
                  ("joined", (cfg.ffn_size, cfg.ffn_size))),
                 ((f"{m}.down_proj.weight",), (*ours, "down", "kernel"), "linear")]
    plan.append((("model.norm.weight",), ("final_norm", "scale"), "copy"))
    if not cfg.tie_embeddings:
        plan.append((("lm_head.weight",), ("lm_head",), "copy"))
    return plan


def _joined_hf_shapes(kind, shape):
    """HF (out_i, in) shapes of the weights joined into our (in, sum out_i) kernel."""
    return [(n, shape[0]) for n in kind[1]]


# --------------------------------------------------------------------------- models


def _check_float_dtype(fn, name, value):
    if value is None:
        return
    try:
        ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"{fn}: {name} must be a floating dtype (jnp.float32, jnp.bfloat16, ...) or None, "
                        f"got {value!r}")


def import_hf(family: str, path_or_dir: str, *, impl: str = "ls2", dtype=None,
              param_dtype=None, train: bool = False, **overrides):
    """An HF checkpoint as one of our models.

    Args:
      family: "bert", "gpt" (or "gpt2"), "vit" or "llama".
      path_or_dir: as for `read_hf`.
      impl: "ls2" (jax_ls2 layers) or "plain" (plain Flax).
      dtype: compute dtype (None: from the params). param_dtype: storage dtype (None: the
        checkpoint's dtype, float32 if it holds several).
      train: train mode (dropout active) instead of eval mode.
      overrides: `Config` fields to change (e.g. ``attention_backend``, dropout rates).
    Returns:
      (cfg, model): our `Config` and the `flax_models.build` model holding the weights.
    """
    import flax_models

    family = _family("import_hf", family)
    for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        _check_float_dtype("import_hf", name, value)
    tensors, hf_config = read_hf(path_or_dir)
    cfg = config_from_hf(family, hf_config, **overrides)
    params = hf_to_params(family, tensors, cfg)
    if param_dtype is None:
        kinds = {t.dtype for t in tensors.values() if jnp.issubdtype(t.dtype, jnp.floating)}
        param_dtype = kinds.pop() if len(kinds) == 1 else jnp.float32
    model = flax_models.build(cfg, impl=impl, dtype=dtype, param_dtype=param_dtype, train=train)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(lambda a: jnp.asarray(a, param_dtype),
                                                           params))
    nnx.update(model, state)
    return cfg, model


def export_hf(model_or_params, cfg: Config, out_dir: str) -> str:
    """Writes ``out_dir/model.safetensors`` (metadata format "pt") and ``out_dir/config.json``
    that ``transformers``' ``from_pretrained`` loads into ``BertForMaskedLM`` /
    ``GPT2LMHeadModel`` / ``ViTForImageClassification`` / ``LlamaForCausalLM``.

    ``model_or_params``: one of our models (any impl) or its params nested dict. Tensors
    keep the params' dtype. Returns ``out_dir``.
    """
    from safetensors.flax import save_file

    family = _family("export_hf", cfg.family)
    if isinstance(model_or_params, nnx.Module):
        params = nnx.to_pure_dict(nnx.state(model_or_params, nnx.Param))
    elif isinstance(model_or_params, dict):
        params = model_or_params
    else:
        raise TypeError(f"export_hf: model_or_params must be an nnx.Module or a params dict, "
                        f"got {type(model_or_params).__name__}")
    tensors = params_to_hf(family, params, cfg)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: jnp.asarray(v) for k, v in tensors.items()},
              os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(config_to_hf(cfg), f, indent=2, sort_keys=True)
    return out_dir


__all__ = ["FAMILIES", "config_from_hf", "config_to_hf", "export_hf", "hf_to_params",
           "import_hf", "params_to_hf", "read_hf"]
