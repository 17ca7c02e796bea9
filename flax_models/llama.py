"""LLaMA-family causal language model: token embedding, pre-norm `DecoderLayer` s
(RMSNorm, rotary, grouped-query attention, gated MLP, no biases), a final norm and an
output projection (its own ``lm_head`` (vocab, hidden), or the embedding table with
``tie_embeddings``). Mistral and Gemma are settings of the same model (see
``jax_ls2.nn.DecoderLayer``); Hugging Face ``LlamaForCausalLM`` checkpoints convert with
``flax_models.convert``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from flax_models.configs import Config
from flax_models.plain.stack import remat_call
from jax_ls2.nn._common import split_sequence
from jax_ls2.nn.decoder import INIT_STDDEV


def segment_positions(segment_ids):
    """int32 (batch, len): each token's position within its segment (a packed row's
    segments are runs of equal ids)."""
    idx = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return idx - jax.lax.cummax(jnp.where(first, idx, 0), axis=1)


def layer_options(cfg: Config) -> dict:
    """The `DecoderLayer` keyword arguments of ``cfg``."""
    return dict(num_kv_heads=cfg.num_kv_heads or None, head_dim=cfg.head_dim or None, norm=cfg.norm,
                activation=cfg.gated_activation, epsilon=cfg.epsilon, unit_offset=cfg.norm_unit_offset,
                rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, attn_dropout=cfg.attn_dropout,
                activation_dropout=cfg.activation_dropout, hidden_dropout=cfg.hidden_dropout)


def num_params(cfg: Config) -> int:
    """The parameter count of ``cfg``'s model, from the shapes alone."""
    h, f, v = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    d = cfg.head_dim or h // cfg.num_heads
    kv = cfg.num_kv_heads or cfg.num_heads
    norm = h if cfg.norm == "rms" else 2 * h
    layer = h * (cfg.num_heads + 2 * kv) * d + cfg.num_heads * d * h + 3 * h * f + 2 * norm
    return v * h * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * layer + norm


class Llama(nnx.Module):
    """``__call__(input_ids, *, positions=None, segment_ids=None, decode=False)``: ids int
    (B, T) -> logits (B, T, vocab). segment_ids (B, T): packed sequences (positions then
    restart at each segment unless given). ``decode=True`` runs on the layers' caches
    (``init_cache`` first; see `flax_models.decode`).
    ``loss(batch)``: batch {"input_ids", "labels"} (labels = next tokens, -100 ignored)
    and optionally "segment_ids" and "positions".

    Modes, as for GPT: ``cfg.fp8`` (the layers' weight GEMMs in FP8), ``cfg.tensor_axis``
    with ``cfg.sequence_parallel`` (grouped-query heads and the MLP split over it; build
    and call under ``jax.set_mesh``), ``cfg.sequence_axis`` (the sequence split, attention
    through ring attention); `flax_models.pipeline.pipeline_model` runs the layers as
    pipeline stages.
    """

    def __init__(self, cfg: Config, lib, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.cfg, self.dtype = cfg, dtype
        scale = math.sqrt(cfg.hidden_size) if cfg.embed_scale else 1.0
        self.embed = lib.Embedding(cfg.vocab_size, cfg.hidden_size, scale=scale, dropout=cfg.hidden_dropout, **kw)
        opts = layer_options(cfg)
        if cfg.fp8 is not None:
            opts["fp8"] = cfg.fp8
        if cfg.sequence_axis is not None:
            opts.update(sequence_axis=cfg.sequence_axis, sequence_balance=cfg.sequence_balance)
        if cfg.tensor_axis is not None:
            opts.update(tensor_axis=cfg.tensor_axis, sequence_parallel=cfg.sequence_parallel)
        self.layers = nnx.List([lib.DecoderLayer(cfg.hidden_size, cfg.ffn_size, cfg.num_heads, **opts, **kw)
                                for _ in range(cfg.num_layers)])
        if cfg.norm == "rms":
            self.final_norm = lib.RMSNorm(cfg.hidden_size, epsilon=cfg.epsilon, unit_offset=cfg.norm_unit_offset,
                                          dtype=dtype, param_dtype=param_dtype)
        else:
            self.final_norm = lib.LayerNorm(cfg.hidden_size, epsilon=cfg.epsilon, dtype=dtype,
                                            param_dtype=param_dtype)
        if cfg.tie_embeddings:
            self.lm_head = nnx.data(None)
        else:
            init = nnx.initializers.normal(INIT_STDDEV)
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), param_dtype))
        seq = {} if cfg.sequence_axis is None else {"sequence_axis": cfg.sequence_axis}
        self.criterion = lib.CrossEntropyCriterion(ignore_index=-100, **seq)

    def init_cache(self, batch: int, max_len: int, dtype=None):
        """Every layer's decode cache, zeroed (see ``DecoderLayer.init_cache``)."""
        for layer in self.layers:
            layer.init_cache(batch, max_len, dtype)

    def hidden(self, input_ids, *, positions=None, segment_ids=None, decode=False):
        """The final norm's output (B, T, hidden)."""
        if positions is None and segment_ids is not None:
            positions = segment_positions(segment_ids)

        def run(layer, x):
            return layer(x, positions=positions, segment_ids=segment_ids, decode=decode)
        x = self.embed(input_ids)
        if not isinstance(self.layers, nnx.List):  # pipeline stages (flax_models.pipeline.PipelinedDecoder)
            if positions is not None or segment_ids is not None or decode:
                raise ValueError("Llama: pipeline stages take no positions, segment_ids or decode; train on "
                                 "unpacked rows")
            return self.final_norm(self.layers(x))
        if self.cfg.sequence_axis is not None:
            x = split_sequence(x, self.cfg.sequence_axis)
        if self.cfg.sequence_parallel and not decode:
            x = split_sequence(x, self.cfg.tensor_axis)
        for layer in self.layers:
            x = remat_call(layer, run, x) if self.cfg.remat and not decode else run(layer, x)
        return self.final_norm(x)

    def projection(self, hidden):
        """``(hidden, table)`` after dtype promotion, table (vocab, hidden): logits are
        ``hidden @ table.T``."""
        if self.lm_head is None:
            return self.embed.projection(hidden)
        return tuple(dtypes.promote_dtype((hidden, self.lm_head[...]), dtype=self.dtype))

    def __call__(self, input_ids, *, positions=None, segment_ids=None, decode=False):
        h, table = self.projection(self.hidden(input_ids, positions=positions, segment_ids=segment_ids,
                                               decode=decode))
        return jnp.dot(h, table.T)

    def loss(self, batch):
        hidden = self.hidden(batch["input_ids"], positions=batch.get("positions"),
                             segment_ids=batch.get("segment_ids"))
        loss, count = self.criterion.linear(*self.projection(hidden), batch["labels"])
        return loss, {"tokens": count}
