"""Model configurations and presets (tiny for CPUs, and the standard sizes)."""
from __future__ import annotations

import dataclasses
from typing import Any

from jax_ls2._deprecation import renamed
from jax_ls2.nn.config import EPSILON


@dataclasses.dataclass(frozen=True)
class Config:
    """One model's hyper-parameters. ``family`` picks the model class.

    Common: vocab_size, hidden_size, num_layers (decoder layers for "transformer" too),
    num_heads, ffn_size, max_len (positions / longest sequence), the three dropout rates,
    epsilon (LayerNorm), attention_backend, remat, fp8 (None or a
    ``jax_ls2.fp8.DelayedScaling``: the Transformer layers' weight GEMMs in FP8; jax_ls2
    layers only); the layer fields are named as in ``jax_ls2.nn.LayerConfig``. Family-specific: type_vocab_size and
    mlm_max_predictions (bert: > 0 runs the MLM head on at most that many predicted
    tokens per sequence instead of on every token), label_smoothing / pad_id
    (transformer), image_size / patch_size / channels / num_classes (vit); llama (see
    ``jax_ls2.nn.DecoderLayer``): num_kv_heads (0: num_heads), head_dim (0: hidden_size
    // num_heads), norm ("rms" or "layer"; epsilon is its epsilon), gated_activation,
    norm_unit_offset (Gemma's ``1 + scale``), rope_theta, rope_scaling (None or a
    ``jax_ls2.ops.RotaryScaling``), embed_scale (embeddings times sqrt(hidden_size), as
    Gemma) and tie_embeddings (the output projection is the embedding table).

    Parallelism (jax_ls2 layers; GPT, BERT and the Transformer): ``tensor_axis`` None
    (default) or the mesh axis name (``"tensor"``) for Megatron tensor parallelism:
    heads, FFN and the vocabulary (tied embedding, output head and loss) split over it;
    num_heads, ffn_size and vocab_size must be multiples of its size.
    ``sequence_parallel``: with ``tensor_axis``, Megatron sequence parallelism
    (LayerNorm, dropout and residuals on sequence parts over the tensor axis).
    ``sequence_axis``: None or the mesh axis (``"seq"``) the sequence is split over,
    attention through ring attention (see ``jax_ls2.nn.LayerConfig``; GPT so far), with
    or without ``tensor_axis`` (not with ``sequence_parallel``); ``sequence_balance``
    "zigzag" balances causal attention's work over the ring.
    """
    family: str
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_size: int = 128
    max_len: int = 128
    hidden_dropout: float = 0.0
    attn_dropout: float = 0.0
    activation_dropout: float = 0.0
    epsilon: float = EPSILON
    attention_backend: str = "auto"
    remat: bool = False
    fp8: Any = None
    type_vocab_size: int = 2
    mlm_max_predictions: int = 0
    label_smoothing: float = 0.1
    pad_id: int = 0
    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    num_classes: int = 10
    num_kv_heads: int = 0
    head_dim: int = 0
    norm: str = "rms"
    gated_activation: str = "swiglu"
    norm_unit_offset: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    embed_scale: bool = False
    tie_embeddings: bool = False
    tensor_axis: str | None = None
    sequence_parallel: bool = False
    sequence_axis: str | None = None
    sequence_balance: str = "none"

    def layer_options(self, **fixed) -> dict:
        """The keyword arguments of a layer stack (``lib.TransformerEncoder`` /
        ``TransformerDecoder``) that this config sets, plus the model's `fixed` ones
        (pre_layer_norm, activation, ...). ``fp8`` is among them only when set (the
        plain-Flax twin has no FP8 layers)."""
        if self.fp8 is not None:
            fixed = dict(fixed, fp8=self.fp8)
        if self.tensor_axis is not None:
            fixed = dict(fixed, tensor_axis=self.tensor_axis, sequence_parallel=self.sequence_parallel)
        if self.sequence_axis is not None:
            fixed = dict(fixed, sequence_axis=self.sequence_axis, sequence_balance=self.sequence_balance)
        return dict(hidden_size=self.hidden_size, ffn_size=self.ffn_size, num_heads=self.num_heads,
                    attn_dropout=self.attn_dropout, activation_dropout=self.activation_dropout,
                    hidden_dropout=self.hidden_dropout, epsilon=self.epsilon,
                    attention_backend=self.attention_backend, remat=self.remat, **fixed)

    def vocab_options(self, *, loss: bool = False) -> dict:
        """The tensor-parallel keyword arguments of the model's ``lib.Embedding`` (or,
        with ``loss``, of its ``lib.CrossEntropyCriterion``): none without
        ``tensor_axis``."""
        if self.tensor_axis is None:
            return {}
        return ({"tensor_axis": self.tensor_axis} if loss
                else {"tensor_axis": self.tensor_axis, "sequence_parallel": self.sequence_parallel})

    def replace(self, **kw) -> "Config":
        kw = renamed("Config.replace", kw, layer_norm_eps="epsilon")  # layer_norm_eps= until 2e8e4ee
        unknown = set(kw) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"Config: unknown fields {sorted(unknown)}")
        return dataclasses.replace(self, **kw)


PRESETS: dict[str, dict[str, Config]] = {
    "bert": {
        "tiny": Config("bert", epsilon=1e-12),
        "base": Config("bert", vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12,
                       ffn_size=3072, max_len=512, hidden_dropout=0.1, attn_dropout=0.1,
                       epsilon=1e-12),
    },
    "gpt": {
        "tiny": Config("gpt"),
        "small": Config("gpt", vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                        ffn_size=3072, max_len=1024, hidden_dropout=0.1, attn_dropout=0.1),
        "medium": Config("gpt", vocab_size=50257, hidden_size=1024, num_layers=24, num_heads=16,
                         ffn_size=4096, max_len=1024, hidden_dropout=0.1, attn_dropout=0.1),
    },
    "transformer": {
        "tiny": Config("transformer", vocab_size=64),
        "base": Config("transformer", vocab_size=32768, hidden_size=512, num_layers=6,
                       num_heads=8, ffn_size=2048, max_len=256, hidden_dropout=0.1,
                       attn_dropout=0.1, activation_dropout=0.1),
    },
    "vit": {
        "tiny": Config("vit", epsilon=1e-12),
        "b16": Config("vit", hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072,
                      image_size=224, patch_size=16, num_classes=1000, epsilon=1e-12),
    },
    # ffn_size is the width of each of the gate and up projections.
    "llama": {
        "tiny": Config("llama", num_kv_heads=2, epsilon=1e-5),
        # 1.10e9 parameters (flax_models.llama.num_params), untied output projection.
        "1b": Config("llama", vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32,
                     num_kv_heads=8, ffn_size=8192, max_len=2048, epsilon=1e-5),
    },
}


def get_config(family: str, preset: str = "tiny", **overrides) -> Config:
    if family not in PRESETS:
        raise ValueError(f"get_config: family must be one of {sorted(PRESETS)}, got {family!r}")
    if preset not in PRESETS[family]:
        raise ValueError(f"get_config: preset for {family!r} must be one of "
                         f"{sorted(PRESETS[family])}, got {preset!r}")
    return PRESETS[family][preset].replace(**overrides)
