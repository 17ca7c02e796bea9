"""The vocabulary-parallel embedding (Megatron): the ``(vocab, features)`` table split by rows
over the tensor axis, each device holding a contiguous block of ``vocab / n`` token rows.

A lookup is answered by the device that holds the row; the others contribute zeros and
one all-reduce over the tensor axis completes it. ``attend`` (the tied output head)
gives logits split by vocabulary, for `vocab_parallel_cross_entropy`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2.ops import _checks
from jax_ls2.ops.embedding import _check_index_range
from jax_ls2.parallel.mesh import TENSOR
from jax_ls2.parallel.tensor import _check_features, _local_width, _param, bound_axis_size

_default_embed_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def vocab_parallel_embed(ids: jax.Array, table: jax.Array, *, vocab: int | None = None,
                         axis_name: str = TENSOR) -> jax.Array:
    """``table[ids]`` with the table split by rows (the vocabulary) over ``axis_name``.

    Args:
      ids: ``(...)`` integer token ids in ``[0, vocab)``, replicated over ``axis_name``;
        as for ``ops.embedding``, concrete ids outside the range raise ``ValueError``
        and traced ones are clamped into it.
      table: ``(vocab, features)`` sharded ``P(tensor, None)`` under ``jit``; inside
        ``shard_map`` this device's ``(vocab / n, features)`` block of rows, rows
        ``[i * vocab / n, (i + 1) * vocab / n)`` on device ``i`` of the axis.
      vocab: the full vocabulary; default ``table.shape[0]`` times the axis size inside
        ``shard_map``, ``table.shape[0]`` outside it.
      axis_name: the tensor axis.

    Returns:
      ``(..., features)`` in ``table.dtype``, replicated over ``axis_name``. Inside
      ``shard_map``: a masked local lookup and one ``psum`` of ``(..., features)``; under
      ``jit`` the partitioner makes the same masked lookup and all-reduce. The backward
      pass scatters into the local rows only.
    """
    op = "vocab_parallel_embed"
    _checks.check_array(op, "ids", ids, dtypes=None)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{op}: ids must have an integer dtype, got {ids.dtype}")
    _checks.check_array(op, "table", table, ndim=2)
    size = bound_axis_size(axis_name)
    rows = table.shape[0]
    vocab = rows * (size or 1) if vocab is None else vocab
    if vocab != rows * (size or 1):
        raise ValueError(f"{op}: table must hold vocab ({vocab}) rows split over {size or 1} device(s), "
                         f"got {rows} rows")
    _check_index_range(op, "ids", ids, vocab, "the table's rows")
    ids = jnp.clip(ids, 0, vocab - 1)
    if size is None:
        return jnp.take(table, ids, axis=0)
    local = ids - jax.lax.axis_index(axis_name) * rows
    mine = (local >= 0) & (local < rows)
    found = jnp.take(table, jnp.where(mine, local, 0), axis=0)
    return jax.lax.psum(jnp.where(mine[..., None], found, jnp.zeros((), table.dtype)), axis_name)


class VocabParallelEmbed(nnx.Module):
    """``nnx.Embed`` with its ``(num_embeddings, features)`` table split by rows over the tensor axis.

    Param ``embedding`` ``(num_embeddings, features)`` partitioned ``(tensor_axis, None)``,
    made as ``nnx.Embed`` makes it (same initialiser, same values for the same key).
    ``num_embeddings`` must be a multiple of the tensor axis size (pad the vocabulary).

    ``__call__(ids)``: ids ``(...)`` integer; returns ``(..., features)`` in ``dtype``
    (default the table's), replicated over the tensor axis (see `vocab_parallel_embed`).

    ``attend(query)``: query ``(..., features)`` replicated over the tensor axis; returns
    the logits ``query @ embedding.T``, ``(..., num_embeddings)`` sharded by vocabulary
    over the tensor axis (inside ``shard_map``: this device's ``(..., num_embeddings / n)``
    block), with no collective; feed them to `vocab_parallel_cross_entropy`.
    ``mesh`` as for `ColumnParallelLinear`.
    """

    def __init__(self, num_embeddings: int, features: int, *, tensor_axis: str = TENSOR, dtype=None,
                 param_dtype=jnp.float32, embedding_init=_default_embed_init,
                 mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        owner = "VocabParallelEmbed"
        self.num_embeddings = _check_features(owner, "num_embeddings", num_embeddings)
        self.features = _check_features(owner, "features", features)
        self.tensor_axis, self.dtype = tensor_axis, dtype
        self.embedding = _param(embedding_init(rngs.params(), (num_embeddings, features), param_dtype),
                                (tensor_axis, None), mesh)

    def _table(self):
        table = self.embedding[...]
        _local_width("VocabParallelEmbed", self.tensor_axis, self.num_embeddings, table.shape[0], "embedding",
                     "num_embeddings")
        return table if self.dtype is None else table.astype(self.dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return vocab_parallel_embed(ids, self._table(), vocab=self.num_embeddings, axis_name=self.tensor_axis)

    def attend(self, query: jax.Array) -> jax.Array:
        table = self._table()
        if query.ndim < 1 or query.shape[-1] != self.features:
            raise ValueError(f"VocabParallelEmbed: query must have shape (..., {self.features}), "
                             f"got {tuple(query.shape)}")
        query, table = dtypes.promote_dtype((query, table), dtype=self.dtype)
        return jnp.dot(query, table.T)
