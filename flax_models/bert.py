"""BERT for masked language modelling (post-LN, GELU), HF ``BertForMaskedLM`` layout."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.configs import Config


class Bert(nnx.Module):
    """``__call__(input_ids, *, token_type_ids=None, padding_mask=None)``: ids int (B, T),
    padding_mask bool (B, T) True = token -> logits (B, T, vocab).
    ``loss(batch)``: batch {"input_ids", "labels" (-100 = not predicted), optional
    "padding_mask"} -> (mean loss, {"tokens": counted tokens, "dropped_predictions"}).
    With ``cfg.mlm_max_predictions = P > 0`` the MLM head (dense, LayerNorm, output
    projection, loss) runs on the first P predicted tokens of each sequence only, as in
    BERT's pre-training; predictions beyond P are left out of the loss and counted in
    "dropped_predictions" (0 when the data masks at most P tokens per sequence, see
    ``flax_models.data.bert_batch(max_predictions=...)``).

    ``cfg.tensor_axis`` / ``cfg.sequence_parallel``: as for `flax_models.gpt.GPT` (the
    layers, the tied vocabulary-parallel embedding and head, ``mlm_bias`` split by
    vocabulary, the vocabulary-parallel loss; the token-type embedding, its LayerNorm
    and the MLM transform stay whole). ``cfg.sequence_axis``: as for GPT, attention
    non-causal through the ring with the padding mask split along with the keys; not
    with ``mlm_max_predictions``."""

    def __init__(self, cfg: Config, lib, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        h = cfg.hidden_size
        self.cfg = cfg
        self.embed = lib.Embedding(cfg.vocab_size, h, max_positions=cfg.max_len, **cfg.vocab_options(), **kw)
        self.token_type = nnx.Embed(cfg.type_vocab_size, h,
                                    embedding_init=nnx.initializers.normal(0.02), **kw)
        self.embed_ln = lib.LayerNorm(h, epsilon=cfg.epsilon, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        self.embed_drop = lib.Dropout(cfg.hidden_dropout, rngs=rngs)
        self.encoder = lib.TransformerEncoder(
            cfg.num_layers, **cfg.layer_options(pre_layer_norm=False, activation="gelu"), **kw)
        self.mlm_dense = nnx.Linear(h, h, **kw)
        self.mlm_ln = lib.LayerNorm(h, epsilon=cfg.epsilon, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
        split = {} if cfg.tensor_axis is None else {"out_sharding": (cfg.tensor_axis,), "eager_sharding": False}
        self.mlm_bias = nnx.Param(jnp.zeros((cfg.vocab_size,), param_dtype), **split)
        if cfg.sequence_axis is not None and cfg.mlm_max_predictions > 0:
            raise ValueError("Bert: mlm_max_predictions with sequence_axis is not supported (picking the predicted "
                             "positions would gather the split sequence); set mlm_max_predictions=0")
        seq = {} if cfg.sequence_axis is None else {"sequence_axis": cfg.sequence_axis}
        self.criterion = lib.CrossEntropyCriterion(ignore_index=-100, **cfg.vocab_options(loss=True), **seq)

    def features(self, input_ids, *, token_type_ids=None, padding_mask=None):
        """The MLM head's input to the tied output projection: (B, T, hidden)."""
        return self.head(self.encode(input_ids, token_type_ids=token_type_ids, padding_mask=padding_mask))

    def head(self, x):
        """MLM transform of encoder states (..., hidden) -> (..., hidden)."""
        return self.mlm_ln(jax.nn.gelu(self.mlm_dense(x), approximate=False))

    def encode(self, input_ids, *, token_type_ids=None, padding_mask=None):
        """Encoder output: (B, T, hidden)."""
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = self.embed(input_ids)
        # A one-hot product rather than a gather: with two rows, the gather's gradient is
        # a scatter-add of every token into the same row, which XLA serialises on GPU.
        types = jax.nn.one_hot(token_type_ids, self.cfg.type_vocab_size, dtype=x.dtype)
        x = self.embed_drop(self.embed_ln(x + types @ self.token_type.embedding[...].astype(x.dtype)))
        return self.encoder(x, padding_mask=padding_mask)

    def __call__(self, input_ids, *, token_type_ids=None, padding_mask=None):
        logits = self.embed.attend(self.features(input_ids, token_type_ids=token_type_ids,
                                                 padding_mask=padding_mask))
        return logits + self.mlm_bias[...].astype(logits.dtype)

    def loss(self, batch):
        x = self.encode(batch["input_ids"], token_type_ids=batch.get("token_type_ids"),
                        padding_mask=batch.get("padding_mask"))
        labels = batch["labels"]
        dropped = jnp.zeros((), jnp.int32)
        p = self.cfg.mlm_max_predictions
        if p > 0:
            # The predicted positions first, in order (a stable sort of "not predicted"),
            # then the first p of them: the fillers after the last prediction carry -100.
            order = jnp.argsort(labels == -100, axis=-1, stable=True)[:, :p]
            x = jnp.take_along_axis(x, order[..., None], axis=1)
            dropped = jnp.sum(jnp.maximum(jnp.sum(labels != -100, axis=-1) - p, 0)).astype(jnp.int32)
            labels = jnp.take_along_axis(labels, order, axis=1)
        # Output projection and loss together: with jax_ls2 layers the logits are never whole.
        x, table = self.embed.projection(self.head(x))
        loss, count = self.criterion.linear(x, table, labels, bias=self.mlm_bias[...].astype(x.dtype))
        return loss, {"tokens": count, "dropped_predictions": dropped}
