"""GPT-2 style causal language model (pre-LN, tanh-GELU, tied output embedding)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flax_models.configs import Config


class GPT(nnx.Module):
    """``__call__(input_ids)``: ids int (B, T) -> logits (B, T, vocab).
    ``loss(batch)``: batch {"input_ids", "labels"} (labels = next tokens, -100 ignored).

    ``cfg.tensor_axis`` / ``cfg.sequence_parallel`` (see `Config`): the layers, the
    vocabulary-parallel embedding (its table the tied output head) and the
    vocabulary-parallel loss run split over that mesh axis; build and call the model
    under ``jax.set_mesh(mesh)`` and place its state by
    ``nnx.get_partition_spec(nnx.state(model))`` (`jax_ls2.parallel.shard_module`).
    ``cfg.sequence_axis``: the sequence split over that mesh axis (context
    parallelism): the layers and the loss run on sequence parts, attention through
    ring attention."""

    def __init__(self, cfg: Config, lib, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.cfg = cfg
        self.embed = lib.Embedding(cfg.vocab_size, cfg.hidden_size, max_positions=cfg.max_len,
                                   dropout=cfg.hidden_dropout, **cfg.vocab_options(), **kw)
        self.decoder = lib.TransformerEncoder(
            cfg.num_layers, final_layer_norm=True,
            **cfg.layer_options(pre_layer_norm=True, activation="gelu_tanh"), **kw)
        seq = {} if cfg.sequence_axis is None else {"sequence_axis": cfg.sequence_axis}
        self.criterion = lib.CrossEntropyCriterion(ignore_index=-100, **cfg.vocab_options(loss=True), **seq)

    def __call__(self, input_ids):
        return self.embed.attend(self.decoder(self.embed(input_ids), causal=True))

    def loss(self, batch):
        # The output projection and the loss together: with jax_ls2 layers the
        # (tokens, vocab) logits are never held whole.
        hidden = self.decoder(self.embed(batch["input_ids"]), causal=True)
        loss, count = self.criterion.linear(*self.embed.projection(hidden), batch["labels"])
        return loss, {"tokens": count}
