"""Flax NNX layers over the jax_ls2 fused ops (LightSeq2's Transformer layers).

Each layer has a plain-Flax twin with the same constructor and parameter tree in
``flax_models.plain``. The Transformer layers and stacks take their hyper-parameters as a
`LayerConfig` or as its fields.
"""
from jax_ls2.nn.attention import BACKENDS, MultiHeadAttention, attention_core, select_backend
from jax_ls2.nn.config import LayerConfig
from jax_ls2.nn.rope import RotaryConfig
from jax_ls2.nn.mlp import MLP
from jax_ls2.nn.criterion import CrossEntropyCriterion
from jax_ls2.nn.embedding import Embedding
from jax_ls2.nn.layers import (Dropout, LayerNorm, TransformerDecoderLayer,
                               TransformerEncoderLayer, TransformerLayer, tensor_parallel_state)
from jax_ls2.nn.stack import TransformerDecoder, TransformerEncoder
from jax_ls2.nn.decoder import DecoderLayer
from jax_ls2.nn.kv_cache import KVCache
from jax_ls2.nn.rms_norm import RMSNorm

__all__ = ["BACKENDS", "CrossEntropyCriterion", "Dropout", "Embedding", "LayerConfig", "LayerNorm",
           "MultiHeadAttention", "TransformerDecoder", "TransformerDecoderLayer",
           "TransformerEncoder", "TransformerEncoderLayer", "TransformerLayer",
           "attention_core", "select_backend"]
__all__ += ["DecoderLayer", "KVCache", "RMSNorm"]
__all__ += ["tensor_parallel_state", "RotaryConfig", "MLP"]
