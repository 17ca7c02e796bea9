"""Plain-Flax twins of jax_ls2.nn.Embedding and CrossEntropyCriterion."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def sinusoid(positions, dim):
    """fp32 (*positions.shape, dim): [sin(p*w_i) | cos(p*w_i)], w_i = 10000^(-i/(dim/2-1))."""
    half = dim // 2
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000.0) / max(half - 1, 1)))
    ang = positions.astype(jnp.float32)[..., None] * freq
    table = jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)
    return jnp.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, dim % 2)])


class Embedding(nnx.Module):
    def __init__(self, vocab_size, hidden_size, *, max_positions=None, sinusoidal=False,
                 scale=1.0, padding_idx=None, dropout=0.0, deterministic=None, dtype=None,
                 param_dtype=jnp.float32, embedding_init=nnx.initializers.normal(0.02), rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, embedding_init=embedding_init, rngs=rngs)
        self.tokens = nnx.Embed(vocab_size, hidden_size, **kw)
        self.positions = nnx.Embed(max_positions, hidden_size, **kw) if max_positions else nnx.data(None)
        self.sinusoidal, self.scale, self.padding_idx = sinusoidal, scale, padding_idx
        self.dtype, self.hidden_size = dtype, hidden_size
        self.drop = nnx.Dropout(dropout, deterministic=deterministic, rngs=rngs)

    def __call__(self, ids, *, positions=None, deterministic=None):
        dtype = self.dtype or self.tokens.embedding.dtype
        # Rows are gathered from the parameter (fp32) and then cast, which equals a gather
        # from the cast table but makes the gradient an fp32 scatter-add: XLA's bf16
        # scatter-add crawls on real text, where frequent tokens repeat.
        x = jnp.take(self.tokens.embedding[...], ids, axis=0).astype(dtype).astype(jnp.float32)
        x = x * self.scale
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
        if self.positions is not None:
            x = x + jnp.take(self.positions.embedding[...], positions, axis=0).astype(dtype).astype(jnp.float32)
        elif self.sinusoidal:
            x = x + sinusoid(positions, self.hidden_size)
        if self.padding_idx is not None:
            x = jnp.where((ids == self.padding_idx)[..., None], 0.0, x)
        return self.drop(x, deterministic=deterministic).astype(dtype)

    def attend(self, x):
        return self.tokens.attend(x)

    def projection(self, x):
        """The operands of `attend` after its dtype promotion: ``(x, table)`` with
        table ``(vocab, hidden)``, so ``x @ table.T`` equals ``attend(x)``."""
        return self.tokens.promote_dtype((x, self.tokens.embedding[...]), dtype=self.tokens.dtype)


class CrossEntropyCriterion(nnx.Module):
    def __init__(self, *, label_smoothing=0.0, ignore_index=None, z_loss=0.0):
        self.label_smoothing, self.ignore_index, self.z_loss = label_smoothing, ignore_index, z_loss

    def __call__(self, logits, labels):
        lf = logits.astype(jnp.float32)
        safe = labels if self.ignore_index is None else jnp.where(labels == self.ignore_index, 0, labels)
        loss = optax.softmax_cross_entropy_with_integer_labels(lf, safe)
        lse = jax.nn.logsumexp(lf, axis=-1)
        if self.label_smoothing:
            loss = (1 - self.label_smoothing) * loss + self.label_smoothing * (lse - lf.mean(-1))
        if self.z_loss:
            loss = loss + self.z_loss * lse ** 2
        keep = jnp.ones(labels.shape, bool) if self.ignore_index is None else labels != self.ignore_index
        count = jnp.sum(keep).astype(jnp.float32)
        return jnp.sum(jnp.where(keep, loss, 0.0)) / jnp.maximum(count, 1.0), count

    def linear(self, hidden, weight, labels, bias=None):
        logits = jnp.dot(hidden, weight.T)
        return self(logits if bias is None else logits + bias, labels)
