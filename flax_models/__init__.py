"""Model zoo: BERT, GPT, encoder-decoder Transformer, ViT and a LLaMA-family decoder.

Each model class takes a layer library: ``jax_ls2.nn`` (the fused layers) or
``flax_models.plain`` (the plain-Flax twin, no jax_ls2 code). Both build the same
parameter tree. ``build(family, preset, impl=...)`` does the wiring.
"""
from __future__ import annotations

import importlib

import jax.numpy as jnp
from flax import nnx

from flax_models.configs import PRESETS, Config, get_config

FAMILIES = ("bert", "gpt", "transformer", "vit")
# Every family `build` and the training command take: FAMILIES (built on the
# Transformer layer stacks, FP8 included) and the LLaMA family (`DecoderLayer`s).
ALL_FAMILIES = FAMILIES + ("llama",)
_CLASSES = {"bert": ("flax_models.bert", "Bert"), "gpt": ("flax_models.gpt", "GPT"),
            "transformer": ("flax_models.transformer", "Transformer"),
            "vit": ("flax_models.vit", "ViT"), "llama": ("flax_models.llama", "Llama")}
IMPLS = ("ls2", "plain")


def layer_library(impl: str):
    """The layer library of an implementation: "ls2" -> jax_ls2.nn, "plain" -> flax_models.plain."""
    if impl == "ls2":
        return importlib.import_module("jax_ls2.nn")
    if impl == "plain":
        return importlib.import_module("flax_models.plain")
    raise ValueError(f"layer_library: impl must be one of {IMPLS}, got {impl!r}")


def build(cfg: Config, *, impl: str = "ls2", dtype=None, param_dtype=jnp.float32,
          seed: int = 0, train: bool = True):
    """A model of ``cfg.family`` built on ``impl``'s layers, params from ``seed``, dropout
    keys from ``seed + 1``, in train mode (``train=False``: eval mode). ``cfg.fp8`` (FP8
    GEMMs) needs ``impl="ls2"``."""
    if cfg.fp8 is not None and impl != "ls2":
        raise ValueError(f"build: cfg.fp8 needs impl='ls2' (the plain-Flax twin has no FP8 layers), got "
                         f"impl={impl!r}")
    module, name = _CLASSES[cfg.family]
    cls = getattr(importlib.import_module(module), name)
    model = cls(cfg, layer_library(impl), dtype=dtype, param_dtype=param_dtype,
                rngs=nnx.Rngs(params=seed, dropout=seed + 1))
    model.train() if train else model.eval()
    return model


__all__ = ["ALL_FAMILIES", "FAMILIES", "IMPLS", "PRESETS", "Config", "build", "get_config", "layer_library"]
