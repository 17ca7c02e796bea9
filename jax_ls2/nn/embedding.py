"""Token + position embedding over the fused ``embedding`` op."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2 import ops
from jax_ls2.nn._common import (check_rate, check_tensor_parallel, draw_key, require_tensor_axis,
                                resolve_deterministic, rng_stream, split_sequence)
from jax_ls2.ops.embedding import sinusoid_inv_freq
from jax_ls2.parallel.embedding import VocabParallelEmbed, vocab_parallel_embed
from jax_ls2.parallel.tensor import bound_axis_size


class Embedding(nnx.Module):
    """``dropout(scale * tokens[ids] + pos)``, padding tokens zeroed.

    Params: ``tokens`` (nnx.Embed, table (vocab_size, hidden_size)) and, with
    ``max_positions``, learned ``positions`` (nnx.Embed, (max_positions, hidden_size));
    ``sinusoidal=True`` uses fixed sinusoids instead (no params).

    ``__call__(ids, *, positions=None, deterministic=None, rngs=None)``: ids int (batch, len)
    -> (batch, len, hidden) in ``dtype`` (None: param dtype). positions default to 0..len-1.
    ``attend(x)``: x (..., hidden) -> logits (..., vocab_size) against the token table.

    ``tensor_axis``: None, or the mesh axis the token table is split over by vocabulary
    rows (Megatron's vocabulary-parallel embedding; vocab_size a multiple of its size):
    ``tokens`` is then a `jax_ls2.parallel.VocabParallelEmbed` (same param name and
    values), the lookup a masked local lookup and one all-reduce, and ``attend`` gives
    logits split by vocabulary (for ``CrossEntropyCriterion(tensor_axis=...)``). The
    positions, scale, padding and dropout then run as jnp with ``ops.dropout`` (the
    fused op's float32 math and mask; the fused op looks tokens up in a whole table).
    ``sequence_parallel`` (with ``tensor_axis``): the output comes split along the
    sequence over the tensor axis, each part with its block of the unsplit mask.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, max_positions: int | None = None,
                 sinusoidal: bool = False, scale: float = 1.0, padding_idx: int | None = None,
                 dropout: float = 0.0, deterministic: bool | None = None, dtype=None,
                 param_dtype=jnp.float32,
                 embedding_init=nnx.initializers.normal(0.02), tensor_axis: str | None = None,
                 sequence_parallel: bool = False, rngs: nnx.Rngs):
        if max_positions is not None and sinusoidal:
            raise ValueError("Embedding: pass max_positions (learned) or sinusoidal=True, not both")
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_positions, self.sinusoidal = max_positions, sinusoidal
        self.scale, self.padding_idx = float(scale), padding_idx
        self.dropout = check_rate("Embedding", "dropout", dropout)
        self.deterministic, self.dtype = deterministic, dtype
        check_tensor_parallel("Embedding", tensor_axis, sequence_parallel, {"vocab_size": vocab_size})
        self.tensor_axis, self.sequence_parallel = tensor_axis, sequence_parallel
        kw = dict(dtype=dtype, param_dtype=param_dtype, embedding_init=embedding_init, rngs=rngs)
        self.tokens = (nnx.Embed(vocab_size, hidden_size, **kw) if tensor_axis is None
                       else VocabParallelEmbed(vocab_size, hidden_size, tensor_axis=tensor_axis, **kw))
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
        if self.tensor_axis is not None:
            return self._vocab_parallel(ids, table, positions, pos_table, key, det or self.dropout == 0)
        return ops.embedding(ids, table, scale=self.scale, positions=positions,
                             pos_table=pos_table, sinusoidal=self.sinusoidal,
                             padding_idx=self.padding_idx, rate=self.dropout, key=key,
                             deterministic=det or self.dropout == 0)

    def _vocab_parallel(self, ids, table, positions, pos_table, key, det):
        """`ops.embedding`'s math with the table split by vocabulary over the tensor axis."""
        axis = self.tensor_axis
        require_tensor_axis("Embedding", axis, {"vocab_size": self.vocab_size})
        f32 = jnp.float32
        x = vocab_parallel_embed(ids, table, vocab=self.vocab_size, axis_name=axis).astype(f32) * f32(self.scale)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(ids.shape[-1], dtype=jnp.int32), ids.shape)
        if pos_table is not None:
            x = x + jnp.take(pos_table, jnp.clip(positions, 0, pos_table.shape[0] - 1), axis=0).astype(f32)
        elif self.sinusoidal:
            half = self.hidden_size // 2
            ang = positions.astype(f32)[..., None] * sinusoid_inv_freq(self.hidden_size)[:half]
            sin = jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)
            x = x + jnp.pad(sin, [(0, 0)] * (sin.ndim - 1) + [(0, self.hidden_size % 2)])
        if self.padding_idx is not None:
            x = jnp.where((jnp.clip(ids, 0, self.vocab_size - 1) == self.padding_idx)[..., None], 0.0, x)
        spec = None
        if self.sequence_parallel:
            x = self._sequence_part(x)
            if bound_axis_size(axis) is not None:  # this device's positions of the whole mask
                spec = (None, axis, None)
        return ops.dropout(x, rate=self.dropout, key=key, deterministic=det, shard_spec=spec).astype(table.dtype)

    def _sequence_part(self, x):
        """x (batch, len, hidden) split along len over the tensor axis: a sharding under
        ``jit``, this device's slice inside ``shard_map``."""
        axis = self.tensor_axis
        n = bound_axis_size(axis)
        if n is None:
            return split_sequence(x, axis)
        part = x.shape[1] // n
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * part, part, axis=1)

    def attend(self, x):
        return self.tokens.attend(x)

    def projection(self, x):
        """The operands of `attend` after its dtype promotion: ``(x, table)`` with
        table ``(vocab, hidden)``, so ``x @ table.T`` equals ``attend(x)``."""
        if self.tensor_axis is not None:
            return tuple(dtypes.promote_dtype((x, self.tokens.embedding[...]), dtype=self.tokens.dtype))
        return self.tokens.promote_dtype((x, self.tokens.embedding[...]), dtype=self.tokens.dtype)
