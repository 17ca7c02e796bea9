"""Layer stacks: `TransformerEncoder` and `TransformerDecoder`.

`TransformerDecoder` computes the cross-attention keys and values of all its layers from
the encoder output with one GEMM against the layers' ``cross_attn.kv`` kernels
concatenated along the output axis (LightSeq2's layer-batched cross attention). The
parameters stay per layer, so the parameter tree and the gradients are those of the
per-layer form (``batched_cross_kv=False``). With ``fp8`` each layer's kv projection is
its own FP8 GEMM (one meta per GEMM), so the stack then computes them layer by layer.

Both stacks take ``fp8`` and ``fp8_amax_axes`` as `LayerConfig` fields and give them to
every layer (see `jax_ls2.nn.TransformerEncoderLayer`), and so ``tensor_axis`` and
``sequence_parallel`` (Megatron tensor and sequence parallelism, see `LayerConfig`):
the layers then run batch-first, the decoder projects each layer's cross-attention keys
and values with its own column-parallel GEMM, and with ``sequence_parallel`` the stack
splits x along the sequence over the tensor axis on entry (under ``jit``; inside
``shard_map`` x comes as this device's part) and returns it so split.
``sequence_axis`` (context parallelism, see `LayerConfig`): the stack splits x along the
sequence over that axis on entry and the layers keep it so split.

``gather_layer_params = True`` (set by ``flax_models.training.create(..., fsdp=True)``,
whose params are split over the data axis too): each layer's call first gathers its own
params to their annotated shardings (`jax_ls2.parallel.mesh.gather_as_annotated`), so
the step holds one layer's gathered params at a time, and with ``remat`` the backward
gathers them again rather than keeping them from the forward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2.nn._common import resolve_deterministic, split_sequence, tensor_axis_size
from jax_ls2.nn.config import LayerConfig, layer_config
from jax_ls2.nn.layers import LayerNorm, TransformerDecoderLayer, TransformerEncoderLayer
from jax_ls2.parallel.mesh import gather_as_annotated

LAYOUTS = ("auto", "batch", "seq")


def remat_call(layer, fn, *args):
    """``fn(layer, *args)`` under ``jax.checkpoint``; the layer's state updates (dropout
    RNG counters) are written back. Works inside both nnx and plain jax transforms."""
    graphdef, state = nnx.split(layer)

    def pure(state, *args):
        # Only the variables the call changed (dropout RNG counters) go back, so a layer
        # run without dropout mutates nothing. Read before the call: the merged module
        # may share its variables with `state`.
        before = {k: v.get_raw_value() for k, v in nnx.to_flat_state(state)}
        m = nnx.merge(graphdef, state)
        out = fn(m, *args)
        changed = [(k, v) for k, v in nnx.to_flat_state(nnx.state(m)) if v.get_raw_value() is not before[k]]
        return out, nnx.from_flat_state(changed)
    out, changed = jax.checkpoint(pure)(state, *args)
    nnx.update(layer, changed)
    return out


def _final_layer_norm(config: LayerConfig, final_layer_norm):
    """The stack's closing LayerNorm: by default present for pre-LN layers only."""
    if final_layer_norm is None:
        final_layer_norm = config.pre_layer_norm
    if not final_layer_norm:
        return nnx.data(None)
    return LayerNorm(config.hidden_size, epsilon=config.epsilon, dtype=config.dtype,
                     param_dtype=config.param_dtype)


def _check_layout(owner, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"{owner}: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _seq_first(owner, stack, x, deterministic, memory=None) -> bool:
    """The layout the layers run in. "auto": sequence-first when the first layer's
    self-attention runs as XLA GEMMs around a softmax (attention dropout active, or
    ``attention_backend="fused"``): those GEMMs then read q, k, v in place instead of
    through four transposes each way per layer. Batch-first otherwise (cuDNN attention
    takes batch-first operands as they are). The dropout ops number a sequence-first
    activation's elements in batch-first order, so masks do not depend on the layout and
    a batch-sharded sequence-first activation keeps its shards."""
    if stack.config.tensor_axis is not None or stack.config.sequence_axis is not None:
        if stack.layout == "seq":
            raise ValueError(f"{owner}: tensor_axis and sequence_axis need layout 'batch' or 'auto' (batch-first), "
                             f"got 'seq'")
        return False
    if stack.layout == "seq":
        for name, a in (("x", x), ("memory", memory)):
            if a is not None and a.ndim != 3:
                raise ValueError(f"{owner}: layout='seq' needs {name} of shape (batch, len, hidden), "
                                 f"got {tuple(a.shape)}")
    if stack.layout != "auto" or x.ndim != 3 or (memory is not None and memory.ndim != 3):
        return stack.layout == "seq"
    layer = stack.layers[0]
    det = resolve_deterministic(owner, deterministic, layer.deterministic)
    dtype = layer.dtype or jnp.promote_types(x.dtype, layer.attn.qkv.kernel[...].dtype)
    return layer.attn.explicit_gemm_path(x.shape[1], x.shape[1], not det, dtype)


def _copies_for_next(layers, i) -> int:
    """Post-LN: every layer but the last hands the next one four copies of its output
    (q, k, v projections and residual), whose gradients the closing LayerNorm's backward
    kernel sums; one where the next layer runs in FP8."""
    if i + 1 == len(layers) or layers[i].pre_layer_norm or layers[i + 1].pre_layer_norm:
        return 1
    # An FP8 layer's q, k, v GEMMs share one input: a pair would suit it, one copy is close;
    # a tensor-parallel layer's q, k, v are one GEMM.
    nxt = layers[i + 1].config
    return 1 if nxt.fp8 is not None or nxt.tensor_axis is not None else 4


def _enter(config: LayerConfig, x):
    """x as the layers take it: split along the sequence over the tensor axis under
    sequence parallelism, or over ``sequence_axis`` (under ``jit``, where the mesh splits it)."""
    if config.sequence_axis is not None and (tensor_axis_size(config.sequence_axis) or 1) > 1:
        x = split_sequence(x, config.sequence_axis)
    return split_sequence(x, config.tensor_axis) if config.sequence_parallel else x


class TransformerEncoder(nnx.Module):
    """``num_layers`` `TransformerEncoderLayer` s (``layers``) and, when
    ``final_layer_norm`` (default: pre_layer_norm), a last LayerNorm ``final_ln``.

    ``__call__(x, *, padding_mask=None, causal=False, deterministic=None)``:
    x (batch, len, hidden) -> same shape. ``remat=True`` rematerialises each layer.
    ``layout``: the layout the layers run in, "batch", "seq" (sequence-first: the stack
    transposes x in and the result out) or "auto" (see `_seq_first`). Results, dropout
    masks included, are the same in every layout. The layers' hyper-parameters: a
    `LayerConfig` as ``hidden_size``, or ``hidden_size, ffn_size, num_heads`` and the other
    `LayerConfig` fields as keyword arguments (see `TransformerEncoderLayer`); the stack
    keeps it as ``config``.
    """

    def __init__(self, num_layers: int, hidden_size: int | LayerConfig, ffn_size: int | None = None,
                 num_heads: int | None = None, *, final_layer_norm: bool | None = None,
                 remat: bool = False, layout: str = "auto", rngs: nnx.Rngs, **options):
        self.layout = _check_layout("TransformerEncoder", layout)
        if num_layers <= 0:
            raise ValueError(f"TransformerEncoder: num_layers must be positive, got {num_layers}")
        self.config = layer_config("TransformerEncoder", hidden_size, ffn_size, num_heads, options)
        self.layers = nnx.List([TransformerEncoderLayer(self.config, rngs=rngs)
                                for _ in range(num_layers)])
        self.final_ln = _final_layer_norm(self.config, final_layer_norm)
        self.remat = remat
        self.gather_layer_params = False

    def __call__(self, x, *, padding_mask=None, causal: bool = False,
                 deterministic: bool | None = None):
        seq_first = _seq_first("TransformerEncoder", self, x, deterministic)

        def run(layer, x, *, copies):
            if self.gather_layer_params:
                gather_as_annotated("TransformerEncoder", layer)
            return layer(x, padding_mask=padding_mask, causal=causal, deterministic=deterministic,
                         output_copies=copies, seq_first=seq_first)
        if seq_first:
            x = x.swapaxes(0, 1)
        x = _enter(self.config, x)
        for i, layer in enumerate(self.layers):
            fn = functools.partial(run, copies=_copies_for_next(self.layers, i))
            x = remat_call(layer, fn, x) if self.remat else fn(layer, x)
        x = x if self.final_ln is None else self.final_ln(x)
        return x.swapaxes(0, 1) if seq_first else x


class TransformerDecoder(nnx.Module):
    """``num_layers`` `TransformerDecoderLayer` s and an optional ``final_ln``.

    ``__call__(x, memory, *, padding_mask=None, memory_padding_mask=None, deterministic=None)``:
    x (batch, tgt_len, hidden), memory (batch, src_len, hidden) -> (batch, tgt_len, hidden).
    ``batched_cross_kv=True`` (default) projects memory for all layers in one GEMM.
    ``layout``: as in `TransformerEncoder` (memory is transposed with x). The layers'
    hyper-parameters: as in `TransformerEncoder`.
    """

    def __init__(self, num_layers: int, hidden_size: int | LayerConfig, ffn_size: int | None = None,
                 num_heads: int | None = None, *, final_layer_norm: bool | None = None,
                 batched_cross_kv: bool = True, remat: bool = False, layout: str = "auto",
                 rngs: nnx.Rngs, **options):
        self.layout = _check_layout("TransformerDecoder", layout)
        if num_layers <= 0:
            raise ValueError(f"TransformerDecoder: num_layers must be positive, got {num_layers}")
        self.config = layer_config("TransformerDecoder", hidden_size, ffn_size, num_heads, options)
        self.layers = nnx.List([TransformerDecoderLayer(self.config, rngs=rngs)
                                for _ in range(num_layers)])
        self.final_ln = _final_layer_norm(self.config, final_layer_norm)
        self.batched_cross_kv = batched_cross_kv
        self.remat = remat
        self.gather_layer_params = False
        self.dtype = self.config.dtype

    def cross_kv(self, memory):
        """All layers' cross-attention K/V from one GEMM: a list of (batch, src_len, 2*hidden)
        ((src_len, batch, 2*hidden) from sequence-first memory). With fp8: one FP8 GEMM
        per layer, each with its layer's meta. With ``tensor_axis``: one column-parallel
        GEMM per layer, each (batch, src_len, 2, hidden) split on the last dim."""
        if self.gather_layer_params:
            for layer in self.layers:
                gather_as_annotated("TransformerDecoder", layer.cross_attn.kv)
        if self.config.fp8 is not None or self.config.tensor_axis is not None:
            return [l.cross_attn.project_kv(memory) for l in self.layers]
        kernels = [l.cross_attn.kv.kernel[...] for l in self.layers]
        biases = [l.cross_attn.kv.bias[...] for l in self.layers]
        kernel, bias = jnp.concatenate(kernels, axis=1), jnp.concatenate(biases, axis=0)
        memory, kernel, bias = dtypes.promote_dtype((memory, kernel, bias), dtype=self.dtype)
        kv = jnp.dot(memory, kernel) + bias
        return jnp.split(kv, len(self.layers), axis=-1)

    def __call__(self, x, memory, *, padding_mask=None, memory_padding_mask=None,
                 deterministic: bool | None = None):
        seq_first = _seq_first("TransformerDecoder", self, x, deterministic, memory)
        if seq_first:
            x, memory = x.swapaxes(0, 1), memory.swapaxes(0, 1)
        x, memory = _enter(self.config, x), _enter(self.config, memory)
        kvs = self.cross_kv(memory) if self.batched_cross_kv else [None] * len(self.layers)

        def run(layer, x, kv, *, copies):
            if self.gather_layer_params:
                gather_as_annotated("TransformerDecoder", layer)
            return layer(x, None if kv is not None else memory, cross_kv=kv,
                         padding_mask=padding_mask, memory_padding_mask=memory_padding_mask,
                         deterministic=deterministic, output_copies=copies, seq_first=seq_first)
        for i, (layer, kv) in enumerate(zip(self.layers, kvs)):
            fn = functools.partial(run, copies=_copies_for_next(self.layers, i))
            x = remat_call(layer, fn, x, kv) if self.remat else fn(layer, x, kv)
        x = x if self.final_ln is None else self.final_ln(x)
        return x.swapaxes(0, 1) if seq_first else x
