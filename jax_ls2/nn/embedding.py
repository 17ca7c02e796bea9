"""Token + position embedding over the fused ``embedding`` op."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_ls2.nn import _ops_compat as ops
from jax_ls2.nn._common import check_rate, draw_key, resolve_deterministic, rng_stream


class Embedding(nnx.Module):
    """``dropout(scale * tokens[ids] + pos)``, padding tokens zeroed.

    Params: ``tokens`` (nnx.Embed, table (vocab_size, hidden_size)) and, with
    ``max_positions``, learned ``positions`` (nnx.Embed, (max_positions, hidden_size));
    ``sinusoidal=True`` uses fixed sinusoids instead (no params).

    ``__call__(ids, *, positions=None, deterministic=None, rngs=None)``: ids int (batch, len)
    -> (batch, len, hidden) in ``dtype`` (None: param dtype). positions default to 0..len-1.
    ``attend(x)``: x (..., hidden) -> logits (..., vocab_size) against the token table.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, max_positions: int | None = None,
                 sinusoidal: bool = False, scale: float = 1.0, padding_idx: int | None = None,
                 dropout: float = 0.0, deterministic: bool | None = None, dtype=None,
                 param_dtype=jnp.float32,
                 embedding_init=nnx.initializers.normal(0.02), rngs: nnx.Rngs):
        if max_positions is not None and sinusoidal:
            raise ValueError("Embedding: pass max_positions (learned) or sinusoidal=True, not both")
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_positions, self.sinusoidal = max_positions, sinusoidal
        self.scale, self.padding_idx = float(scale), padding_idx
        self.dropout = check_rate("Embedding", "dropout", dropout)
        self.deterministic, self.dtype = deterministic, dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, embedding_init=embedding_init, rngs=rngs)
        self.tokens = nnx.Embed(vocab_size, hidden_size, **kw)
        self.positions = (nnx.Embed(max_positions, hidden_size, **kw) if max_positions
                          else nnx.data(None))
        self.rngs = rng_stream(rngs)

    def __call__(self, ids, *, positions=None, deterministic: bool | None = None, rngs=None):
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"Embedding: ids must be integer (batch, len), got "
                             f"{ids.dtype}{tuple(ids.shape)}")
        if self.max_positions is not None and positions is None and ids.shape[1] > self.max_positions:
            raise ValueError(f"Embedding: sequence length {ids.shape[1]} exceeds max_positions "
                             f"{self.max_positions}")
        det = resolve_deterministic("Embedding", deterministic, self.deterministic)
        key = None
        if not det and self.dropout > 0:
            key = draw_key("Embedding", self.rngs, rngs)
        dtype = self.dtype or self.tokens.embedding.dtype
        table = self.tokens.embedding[...].astype(dtype)
        pos_table = None if self.positions is None else self.positions.embedding[...].astype(dtype)
        return ops.embedding(ids, table, scale=self.scale, positions=positions,
                             pos_table=pos_table, sinusoidal=self.sinusoidal,
                             padding_idx=self.padding_idx, rate=self.dropout, key=key,
                             deterministic=det or self.dropout == 0)

    def attend(self, x):
        return self.tokens.attend(x)

    def projection(self, x):
        """The operands of `attend` after its dtype promotion: ``(x, table)`` with
        table ``(vocab, hidden)``, so ``x @ table.T`` equals ``attend(x)``."""
        return self.tokens.promote_dtype((x, self.tokens.embedding[...]), dtype=self.tokens.dtype)
