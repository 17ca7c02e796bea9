"""Encoder-decoder Transformer for translation-style tasks (pre-LN, ReLU, sinusoidal
positions, one embedding shared by source, target and output; label-smoothed loss)."""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from flax_models.configs import Config


class Transformer(nnx.Module):
    """``__call__(src, tgt_in)``: int (B, S), (B, T), ``cfg.pad_id`` padding -> logits
    (B, T, vocab). ``loss(batch)``: batch {"src", "tgt_in", "tgt_out"}. ``cfg.tensor_axis`` /
    ``cfg.sequence_parallel``: as for `flax_models.gpt.GPT`."""

    def __init__(self, cfg: Config, lib, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        layers = dict(cfg.layer_options(pre_layer_norm=True, activation="relu"), **kw)
        self.cfg = cfg
        self.embed = lib.Embedding(cfg.vocab_size, cfg.hidden_size, sinusoidal=True,
                                   scale=math.sqrt(cfg.hidden_size), padding_idx=cfg.pad_id,
                                   dropout=cfg.hidden_dropout,
                                   embedding_init=nnx.initializers.normal(cfg.hidden_size ** -0.5),
                                   **cfg.vocab_options(), **kw)
        self.encoder = lib.TransformerEncoder(cfg.num_layers, **layers)
        self.decoder = lib.TransformerDecoder(cfg.num_layers, **layers)
        self.criterion = lib.CrossEntropyCriterion(label_smoothing=cfg.label_smoothing,
                                                   ignore_index=cfg.pad_id, **cfg.vocab_options(loss=True))

    def features(self, src, tgt_in):
        """Decoder output before the tied output projection: (B, T_tgt, hidden)."""
        src_mask = src != self.cfg.pad_id
        memory = self.encoder(self.embed(src), padding_mask=src_mask)
        return self.decoder(self.embed(tgt_in), memory, memory_padding_mask=src_mask)

    def __call__(self, src, tgt_in):
        return self.embed.attend(self.features(src, tgt_in))

    def loss(self, batch):
        # Output projection and label-smoothed loss together (no whole logits with jax_ls2).
        out = self.features(batch["src"], batch["tgt_in"])
        loss, count = self.criterion.linear(*self.embed.projection(out), batch["tgt_out"])
        return loss, {"tokens": count}
