"""`LayerConfig`: the hyper-parameters every Transformer layer and stack takes, named once.

The NNX layers (`TransformerEncoderLayer`, `TransformerDecoderLayer`), the stacks
(`TransformerEncoder`, `TransformerDecoder`) and the Linen front ends all accept either
a `LayerConfig` or its fields as arguments, and build the same `LayerConfig` from them::

    TransformerEncoderLayer(768, 3072, 12, hidden_dropout=0.1, rngs=rngs)
    cfg = LayerConfig(768, 3072, 12, hidden_dropout=0.1)
    TransformerEncoderLayer(cfg, rngs=rngs)                   # the same layer
    TransformerEncoderLayer(cfg, dtype=jnp.bfloat16, rngs=rngs)  # a field overridden
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jax_ls2._deprecation import renamed
from jax_ls2.nn._common import (check_activation, check_fp8, check_heads, check_rate, check_sequence_axis,
                                check_sequence_balance, check_tensor_parallel)
from jax_ls2.nn.backend import BACKENDS
from jax_ls2.ops._normalization import check_epsilon

# jax_ls2's LayerNorm epsilon default (as PyTorch, LightSeq2 and Transformer Engine);
# flax.nnx.LayerNorm's default is 1e-6.
EPSILON = 1e-5


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """One Transformer layer's hyper-parameters (hashable, so Linen modules may hold it).

    Attributes:
      hidden_size, ffn_size, num_heads: model width, FFN width and attention heads
        (hidden_size % num_heads == 0).
      pre_layer_norm: LayerNorm before each sub-block (True) or after the residual add.
      activation: "relu", "gelu" (erf) or "gelu_tanh".
      attn_dropout, activation_dropout, hidden_dropout: LightSeq2's three dropout rates
        (attention probabilities, after the FFN activation, before each residual add),
        each in [0, 1).
      epsilon: LayerNorm epsilon (default 1e-5; ``flax.nnx.LayerNorm``'s is 1e-6).
      attention_backend: "auto", "cudnn", "fused", "xla" or "flash" (see jax_ls2.nn.backend).
      deterministic: default for dropout (``model.train()``/``model.eval()`` set it).
      dtype: compute dtype (None: promote inputs and params); param_dtype: storage dtype.
      fp8: None (default: no FP8) or a `jax_ls2.fp8.DelayedScaling`: every weight GEMM of
        the layer (the q/k/v projections, cross-attention's q and kv, the attention
        output, fc1, fc2) runs through `jax_ls2.fp8.fp8_dot` with its own FP8 meta (an
        ``FP8Meta`` variable beside the GEMM's ``nnx.Linear``, never an ``nnx.Param``);
        attention itself (scores, softmax, context) and the biases stay in ``dtype``.
        hidden_size and ffn_size must then be multiples of 16 (cuBLASLt's FP8 GEMMs),
        and a CUDA GPU must have FP8 (sm_89 or newer); the CPU runs the same FP8 math.
      fp8_amax_axes: mesh axis names (inside ``shard_map``) over which the FP8 amaxes
        are max-reduced (`jax_ls2.fp8.fp8_dot`'s ``amax_axes``); ``()`` under a sharded
        ``jit`` or on one device.
      tensor_axis: None (default: no tensor parallelism) or the name of the mesh axis
        (``jax_ls2.parallel.TENSOR``, "tensor") that Megatron tensor parallelism splits
        the layer over: the q/k/v (and cross-attention q, kv) projections and fc1 are
        column-parallel (heads and FFN features split over the axis), the attention
        output and fc2 row-parallel (one all-reduce each in the forward pass). The fused
        projections' kernels are then ``(hidden, parts, hidden)`` (parts 3 for q, k, v,
        2 for cross-attention's k, v; biases ``(parts, hidden)``): the values of the
        unsplit layer's ``(hidden, parts * hidden)`` reshaped (see
        `jax_ls2.nn.tensor_parallel_state`). Parameters carry their partition specs
        (``nnx.get_partition_spec(nnx.state(layer))``). num_heads and ffn_size must be
        multiples of the axis size. Run under ``jit`` with the mesh set
        (``jax.set_mesh(mesh)``) and the state placed by those specs, or inside
        ``shard_map`` with the parameters passed by them.
      sequence_parallel: Megatron sequence parallelism (needs ``tensor_axis``): outside
        the tensor-parallel regions the activations (LayerNorm, dropout, residual) are
        split along the sequence over the tensor axis; an all-gather before each
        column-parallel GEMM and a reduce-scatter after each row-parallel one replace
        the all-reduces. The layer's x and output are then (batch, len, hidden) split
        along len over the tensor axis (inside ``shard_map``: this device's part).
      sequence_axis: None (default) or the mesh axis (``jax_ls2.parallel.SEQ``,
        "seq") the sequence is split over (context parallelism, under ``jit`` with the
        mesh set): LayerNorm, dropout, residuals and the FFN run on sequence parts as
        the partitioner keeps them (the fused ops draw the unsplit masks), and
        self-attention runs as `jax_ls2.parallel.ring_attention` (impl "flash",
        contiguous chunks) inside ``shard_map`` over the axis, its dropout masks those
        of ``attention_backend="flash"`` on one device. With ``tensor_axis`` too, the
        heads stay split over the tensor axis through the ring. Needs attention_backend
        "flash" or "auto"; not with ``sequence_parallel`` or fp8, nor in cross-attention.
      sequence_balance: with ``sequence_axis``, "none" (default) or "zigzag": causal
        attention exchanges the contiguous chunks for the zigzag layout around the
        ring, so every device does the same work (see `MultiHeadAttention`).
    """
    hidden_size: int
    ffn_size: int
    num_heads: int
    pre_layer_norm: bool = True
    activation: str = "relu"
    attn_dropout: float = 0.0
    activation_dropout: float = 0.0
    hidden_dropout: float = 0.0
    epsilon: float = EPSILON
    attention_backend: str = "auto"
    deterministic: bool | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    fp8: Any = None
    fp8_amax_axes: tuple = ()
    tensor_axis: str | None = None
    sequence_parallel: bool = False
    sequence_axis: str | None = None
    sequence_balance: str = "none"

    def __post_init__(self):
        for name, value in _checked("LayerConfig", _fields(self)).items():
            object.__setattr__(self, name, value)

    def replace(self, **overrides) -> "LayerConfig":
        """A copy with some fields changed (validated again)."""
        return layer_config("LayerConfig.replace", self, None, None, overrides)


FIELDS = tuple(f.name for f in dataclasses.fields(LayerConfig))


def _check_int(owner: str, name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__}")
    return value


def _check_dtype(owner: str, name: str, value, allow_none: bool):
    if value is None and allow_none:
        return
    try:
        ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"{owner}: {name} must be a floating JAX dtype"
                        f"{' or None' if allow_none else ''}, got {value!r}")


def _checked(owner: str, f: dict) -> dict:
    """The fields `f` checked with `owner`'s name; rates and epsilon as Python floats."""
    for name in ("hidden_size", "ffn_size", "num_heads"):
        _check_int(owner, name, f[name])
    if f["hidden_size"] <= 0 or f["ffn_size"] <= 0:
        raise ValueError(f"{owner}: hidden_size and ffn_size must be positive, got "
                         f"{f['hidden_size']} and {f['ffn_size']}")
    check_heads(owner, f["hidden_size"], f["num_heads"])
    if not isinstance(f["pre_layer_norm"], bool):
        raise TypeError(f"{owner}: pre_layer_norm must be a Python bool, got "
                        f"{type(f['pre_layer_norm']).__name__}")
    if not isinstance(f["activation"], str):
        raise TypeError(f"{owner}: activation must be a str, got {type(f['activation']).__name__}")
    check_activation(owner, f["activation"])
    f = dict(f)
    for name in ("attn_dropout", "activation_dropout", "hidden_dropout"):
        f[name] = check_rate(owner, name, f[name])
    eps = f["epsilon"]
    check_epsilon(owner, eps)
    f["epsilon"] = float(eps)
    if f["attention_backend"] not in BACKENDS:
        raise ValueError(f"{owner}: attention_backend must be one of {BACKENDS}, got "
                         f"{f['attention_backend']!r}")
    if f["deterministic"] is not None and not isinstance(f["deterministic"], bool):
        raise TypeError(f"{owner}: deterministic must be a Python bool or None, got "
                        f"{type(f['deterministic']).__name__}")
    _check_dtype(owner, "dtype", f["dtype"], allow_none=True)
    _check_dtype(owner, "param_dtype", f["param_dtype"], allow_none=False)
    f["fp8_amax_axes"] = check_fp8(owner, f["fp8"], f["fp8_amax_axes"],
                                   {"hidden_size": f["hidden_size"], "ffn_size": f["ffn_size"]})
    check_tensor_parallel(owner, f["tensor_axis"], f["sequence_parallel"],
                          {"num_heads": f["num_heads"], "ffn_size": f["ffn_size"]})
    if f["tensor_axis"] is not None and f["fp8"] is not None:
        raise ValueError(f"{owner}: fp8 with tensor_axis is not supported; leave one of them unset")
    check_sequence_axis(owner, f["sequence_axis"], f["attention_backend"], f["fp8"], f["sequence_parallel"])
    check_sequence_balance(owner, f["sequence_balance"])
    return f


def layer_config(owner: str, hidden_size, ffn_size, num_heads, options: dict) -> LayerConfig:
    """The `LayerConfig` a constructor named `owner` was given, checked with its name.

    Either ``hidden_size`` is a `LayerConfig` (then ``ffn_size`` and ``num_heads`` are
    None, and `options` override its fields) or the three sizes are ints and `options`
    are the other fields. Unknown option names raise TypeError.
    """
    options = renamed(owner, options, stacklevel=4, layer_norm_eps="epsilon")  # layer_norm_eps= until 2e8e4ee
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise TypeError(f"{owner}: unexpected keyword argument(s) {unknown}; the layer options "
                        f"are {list(FIELDS[3:])}")
    if isinstance(hidden_size, LayerConfig):
        if ffn_size is not None or num_heads is not None:
            raise TypeError(f"{owner}: pass a LayerConfig or hidden_size, ffn_size, num_heads, "
                            f"not both")
        return LayerConfig(**_checked(owner, {**_fields(hidden_size), **options}))
    return LayerConfig(**_checked(owner, {**_DEFAULTS, "hidden_size": hidden_size,
                                          "ffn_size": ffn_size, "num_heads": num_heads, **options}))


def _fields(cfg: LayerConfig) -> dict:
    return {name: getattr(cfg, name) for name in FIELDS}


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LayerConfig)
             if f.default is not dataclasses.MISSING}
