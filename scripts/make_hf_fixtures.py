"""Make the Hugging Face checkpoint fixtures under tests/fixtures/hf/<family>/.

Needs torch and transformers (not dependencies of jax_ls2; the tests only read the files
this writes, with safetensors + numpy). For each of BertForMaskedLM, GPT2LMHeadModel,
ViTForImageClassification and LlamaForCausalLM it builds a tiny model (hidden 32, 2
layers, small vocab / 32x32 images with 8x8 patches) from a fixed seed, adds noise to every parameter (so LayerNorm
scales and all biases are non-trivial and a swapped or dropped tensor changes the
logits), saves it with ``save_pretrained`` (``model.safetensors`` + ``config.json``) and
writes, in fp32 and eval mode:

* bert: ``input_ids.npy``, ``token_type_ids.npy``, ``attention_mask.npy`` int64 (2, 7)
  and ``logits.npy`` float32 (2, 7, 99);
* gpt:  ``input_ids.npy`` int64 (2, 9) and ``logits.npy`` float32 (2, 9, 128);
* vit:  ``pixel_values.npy`` float32 (2, 3, 32, 32) (NCHW, as HF takes it) and
  ``logits.npy`` float32 (2, 5);
* llama: ``input_ids.npy`` int64 (2, 9) and ``logits.npy`` float32 (2, 9, 128) (4 heads
  over 2 kv heads, untied lm_head, LLaMA 3.1 rope scaling whose original context, 32, is
  below the longest wavelengths, so the scaling changes the logits).

Usage::

    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--families llama ...]
    python scripts/make_hf_fixtures.py --check-export DIR --family bert
        # load an exported checkpoint with HF's from_pretrained and compare its logits
        # with the fixture's (strict: no missing or unexpected keys)
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import transformers


def _noise(model, scale=0.1, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied tensors appear once
            p.add_(scale * torch.randn(p.shape, generator=g))


def _bert():
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=37,
                                  max_position_embeddings=64, type_vocab_size=2,
                                  hidden_act="gelu", layer_norm_eps=1e-12)
    model = transformers.BertForMaskedLM(cfg)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 99, (2, 7)).astype(np.int64)
    types = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]], np.int64)
    mask = np.array([[1] * 7, [1] * 5 + [0] * 2], np.int64)
    inputs = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    return model, inputs


def _gpt():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, n_inner=None,
                                  activation_function="gelu_new", layer_norm_epsilon=1e-5,
                                  bos_token_id=127, eos_token_id=127)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = np.random.default_rng(0).integers(0, 128, (2, 9)).astype(np.int64)
    return model, {"input_ids": ids}


def _vit():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=37, image_size=32, patch_size=8,
                                 num_channels=3, num_labels=5, hidden_act="gelu",
                                 layer_norm_eps=1e-12)
    model = transformers.ViTForImageClassification(cfg)
    px = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    return model, {"pixel_values": px}


def _llama():
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=48, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_parameters=rope,
                                   tie_word_embeddings=False, hidden_act="silu")
    model = transformers.LlamaForCausalLM(cfg)
    ids = np.random.default_rng(0).integers(0, 128, (2, 9)).astype(np.int64)
    return model, {"input_ids": ids}


MAKERS = {"bert": _bert, "gpt": _gpt, "vit": _vit, "llama": _llama}
CLASSES = {"bert": "BertForMaskedLM", "gpt": "GPT2LMHeadModel",
           "vit": "ViTForImageClassification", "llama": "LlamaForCausalLM"}


def _logits(model, inputs):
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    return out.logits.float().numpy()


def make(out_root: str, families=tuple(MAKERS)):
    for i, (family, maker) in enumerate(MAKERS.items()):
        if family not in families:
            continue
        torch.manual_seed(i)
        model, inputs = maker()
        _noise(model, seed=100 + i)
        model.eval()
        out = os.path.join(out_root, family)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        for name, value in inputs.items():
            np.save(os.path.join(out, f"{name}.npy"), value)
        logits = _logits(model, inputs)
        np.save(os.path.join(out, "logits.npy"), logits)
        sizes = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
        print(family, logits.shape, sizes)


def check_export(path: str, family: str, fixtures: str):
    """from_pretrained(path) must load every tensor (no missing/unexpected keys) and give
    the fixture's logits."""
    cls = getattr(transformers, CLASSES[family])
    model, info = cls.from_pretrained(path, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}  # missing, unexpected, mismatched, errors
    if bad:
        raise SystemExit(f"check_export: from_pretrained({path!r}) reported {bad}")
    model.eval()
    src = os.path.join(fixtures, family)
    names = {"bert": ["input_ids", "token_type_ids", "attention_mask"], "gpt": ["input_ids"],
             "vit": ["pixel_values"], "llama": ["input_ids"]}[family]
    inputs = {n: np.load(os.path.join(src, f"{n}.npy")) for n in names}
    got, want = _logits(model, inputs), np.load(os.path.join(src, "logits.npy"))
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"{family}: from_pretrained({path}) loaded all keys; max |diff| / max |logit| = {err:.2e}")
    if err > 1e-5:
        raise SystemExit(f"check_export: logits differ from the fixture (rel {err:.2e})")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "tests", "fixtures", "hf")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=default)
    ap.add_argument("--check-export", metavar="DIR")
    ap.add_argument("--family", choices=sorted(MAKERS))
    ap.add_argument("--families", nargs="+", choices=sorted(MAKERS), default=sorted(MAKERS),
                    help="the fixtures to (re)make (default: all)")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    if args.check_export:
        if not args.family:
            ap.error("--check-export needs --family")
        check_export(args.check_export, args.family, args.out)
    else:
        make(args.out, args.families)


if __name__ == "__main__":
    main()
