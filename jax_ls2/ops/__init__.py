"""Functional fused ops. Arrays are positional, options keyword-only."""
from jax_ls2.ops.layer_norm import layer_norm

__all__ = ["layer_norm"]
from jax_ls2.ops.cross_entropy import cross_entropy, linear_cross_entropy

__all__ += ["cross_entropy", "linear_cross_entropy"]
from jax_ls2.ops.dropout import bias_act_dropout, bias_dropout_residual, dropout

__all__ += ["bias_dropout_residual", "bias_act_dropout", "dropout"]
from jax_ls2.ops.softmax import softmax_dropout, xla_softmax_dropout

__all__ += ["softmax_dropout", "xla_softmax_dropout"]
from jax_ls2.ops.embedding import embedding

__all__ += ["embedding"]
from jax_ls2.ops.flash_attention import flash_attention, flash_attention_bwd, merge_attention

__all__ += ["flash_attention", "flash_attention_bwd", "merge_attention"]
from jax_ls2.ops.fp8_cast import (bias_gelu_fp8, cast_transpose, dgelu_cast_transpose_dbias, layer_norm_fp8,
                                  layer_norm_fp8_backward)

__all__ += ["bias_gelu_fp8", "cast_transpose", "dgelu_cast_transpose_dbias", "layer_norm_fp8",
            "layer_norm_fp8_backward"]
from jax_ls2.ops.gated_act import gated_act_dropout
from jax_ls2.ops.rms_norm import rms_norm
from jax_ls2.ops.rotary import RotaryScaling, rotary, rotary_frequencies

__all__ += ["gated_act_dropout", "rms_norm", "rotary", "RotaryScaling", "rotary_frequencies"]
