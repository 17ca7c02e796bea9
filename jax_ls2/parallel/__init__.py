"""Parallel training on a device mesh: the mesh and its axes, the multi-process runtime,
and Megatron tensor-parallel building blocks.

``make_mesh("data=2,tensor=4")`` builds a mesh with axes ``("pipe", "data", "seq",
"tensor")`` (tensor innermost, all ``AxisType.Auto``) over every device of every process;
``initialize_distributed()`` starts ``jax.distributed`` from the environment when several
processes run. `ColumnParallelLinear` / `RowParallelLinear` (and their functional forms)
split GEMMs over the tensor axis, with their parameters annotated for
``nnx.get_partition_spec``; they work under sharded ``jit`` and inside ``shard_map``, and
with ``sequence_dim`` run Megatron sequence parallelism (all-gather before the
column-parallel GEMM, reduce-scatter after the row-parallel one).
`VocabParallelEmbed` splits the embedding table by vocabulary (its ``attend`` is the tied
output head), and `vocab_parallel_cross_entropy` is ``ops.cross_entropy`` on logits split
by vocabulary, inside ``shard_map``, never gathering them. `pipeline` runs a stage
function as a GPipe pipeline over the ``pipe`` axis inside ``shard_map``. `ring_attention`
is attention over a sequence split across the ``seq`` axis (ring self-attention, or flash
attention blocks merged around the ring), with `zigzag_permute` for its balanced layout.
"""
from jax_ls2.parallel.cross_entropy import vocab_parallel_cross_entropy
from jax_ls2.parallel.distributed import initialize_distributed
from jax_ls2.parallel.embedding import VocabParallelEmbed, vocab_parallel_embed
from jax_ls2.parallel.mesh import AXES, DATA, PIPE, SEQ, TENSOR, make_mesh, parse_mesh_spec
from jax_ls2.parallel.pipeline import pipeline
from jax_ls2.parallel.ring_attention import ring_attention, zigzag_order, zigzag_permute, zigzag_unpermute
from jax_ls2.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, column_parallel_linear,
                                     row_parallel_linear)

__all__ = ["AXES", "DATA", "PIPE", "SEQ", "TENSOR", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbed", "column_parallel_linear", "initialize_distributed", "make_mesh", "parse_mesh_spec",
           "pipeline", "ring_attention", "row_parallel_linear", "vocab_parallel_cross_entropy", "vocab_parallel_embed",
           "zigzag_order", "zigzag_permute", "zigzag_unpermute"]
