"""Plain-Flax twins of the jax_ls2.nn layers (no jax_ls2 code): same constructors and
parameter trees, so one model definition builds either form."""
from flax_models.plain.embedding import CrossEntropyCriterion, Embedding
from flax_models.plain.layers import (BACKENDS, Dropout, LayerNorm, MultiHeadAttention,
                                      TransformerDecoderLayer, TransformerEncoderLayer,
                                      TransformerLayer)
from flax_models.plain.llama import DecoderLayer, RMSNorm
from flax_models.plain.stack import TransformerDecoder, TransformerEncoder

__all__ = ["BACKENDS", "CrossEntropyCriterion", "Dropout", "Embedding", "LayerNorm",
           "MultiHeadAttention", "TransformerDecoder", "TransformerDecoderLayer",
           "TransformerEncoder", "TransformerEncoderLayer", "TransformerLayer"]
__all__ += ["DecoderLayer", "RMSNorm"]
