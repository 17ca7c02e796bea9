"""`MLP`: the feed-forward block of every layer family, and `mlp_forward`, its math over
two given projections (the layers keep their own parameter names: ``fc1``/``fc2`` in the
LightSeq2 layers, ``gate_up``/``down`` in the decoder layer).

Plain: ``fc2(dropout(act(fc1(x) + b1)))`` through the fused ``bias_act_dropout`` op
(relu, gelu, gelu_tanh). Gated: ``fc2(dropout(act(gate) * up))`` with ``[gate | up] =
fc1(x)`` through the fused ``gated_act_dropout`` op (swiglu, geglu, geglu_tanh). With or
without biases, each GEMM in FP8 (an `FP8Gemm` each) or the compute dtype, and Megatron
tensor parallelism (``fc1`` column-parallel, ``fc2`` row-parallel).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_ls2.fp8 import FP8DotMeta
from jax_ls2 import ops
from jax_ls2.nn._common import (FP8Gemm, check_fp8, check_fp8_device, check_hidden, check_positive_int, check_rate,
                                draw_key, matmul, promoted_dtype, require_tensor_axis, resolve_deterministic,
                                rng_stream)
from jax_ls2.ops import gated_act_dropout
from jax_ls2.ops.dropout import ACTIVATIONS as PLAIN_ACTIVATIONS
from jax_ls2.ops.gated_act import GATED_ACTIVATIONS
from jax_ls2.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, bound_axis_size,
                                     column_parallel_linear, row_parallel_linear)

MLP_ACTIVATIONS = PLAIN_ACTIVATIONS + GATED_ACTIVATIONS


def is_gated(activation: str) -> bool:
    return activation in GATED_ACTIVATIONS


def _gemm(x, linear, dtype, fp8):
    """``x @ linear.kernel`` (fp8: an `FP8Gemm` or None) and the bias (None without)."""
    if linear.bias is not None:
        return matmul(x, linear, dtype, fp8)
    if fp8 is not None:
        return fp8(x, linear.kernel[...], dtype), None
    return linear(x), None


def mlp_forward(h, fc1, fc2, *, activation: str, rate: float = 0.0, key=None, deterministic: bool = True,
                dtype=None, fp8=(None, None), tensor_axis: str | None = None, sequence_dim: int | None = None,
                shard_spec=None, seq_first: bool = False):
    """The MLP over the projections ``fc1`` and ``fc2`` (``nnx.Linear``, or the parallel
    linears with ``tensor_axis``).

    h: (..., hidden) (or (len, batch, hidden) with ``seq_first``) -> (y (..., hidden),
    fc2's bias (hidden,) or None), the bias left for a fused epilogue. fc1's kernel is
    (hidden, ffn), or (hidden, 2 * ffn) laid out [gate | up] for a gated activation
    ((hidden, 2, ffn) column-parallel); fc2's (ffn, hidden). fp8: an `FP8Gemm` (or None)
    per GEMM. shard_spec: None, or ``f(ndim, dim)`` giving the fused ops' ``shard_spec``
    of an activation whose dim ``dim`` (None: none) is split over the tensor axis.
    Activations in the compute dtype ``dtype`` (None: promoted); fp32 math inside the
    fused ops.
    """
    spec = (lambda ndim, dim: None) if shard_spec is None else shard_spec
    gated = is_gated(activation)
    if tensor_axis is not None:
        kw = dict(axis_name=tensor_axis, sequence_dim=sequence_dim, dtype=dtype)
        w1 = fc1.kernel[...]
        y = column_parallel_linear(h, w1, None, **kw)
        if gated:
            active = rate > 0 and not deterministic
            if active and bound_axis_size(tensor_axis) is not None:
                raise ValueError("MLP: activation_dropout with a gated activation inside shard_map over the tensor "
                                 "axis is not supported (the gated op numbers its mask over whole rows); call the "
                                 "layer under jit with the mesh set, or set activation_dropout=0")
            if fc1.bias is not None:
                y = y + fc1.bias[...].astype(y.dtype)
            # [gate | up] of this device's features inside shard_map; under jit the
            # partitioner regroups the whole rows the op takes.
            a = gated_act_dropout(y.reshape(*y.shape[:-2], -1), activation=activation, rate=rate if active else 0.0,
                                  key=key if active else None, deterministic=not active)
        else:
            b1 = fc1.bias[...]
            a = ops.bias_act_dropout(y, b1.astype(y.dtype), activation=activation, rate=rate, key=key,
                                     deterministic=deterministic, shard_spec=spec(y.ndim, y.ndim - 1))
        w2 = fc2.kernel[...]
        y = row_parallel_linear(a, w2, None, **kw)
        if fc2.bias is None:
            return y, None
        b2 = fc2.bias[...]
        return y, b2.astype(promoted_dtype(dtype, a, w2, b2))
    fp8_1, fp8_2 = fp8
    y, b = _gemm(h, fc1, dtype, fp8_1)
    if gated:
        if b is not None:
            y = y + b
        y = gated_act_dropout(y, activation=activation, rate=rate, key=key, deterministic=deterministic,
                              shard_spec=spec(y.ndim, None))
    else:
        y = ops.bias_act_dropout(y, b, activation=activation, rate=rate, key=key, deterministic=deterministic,
                                 seq_first=seq_first, shard_spec=spec(y.ndim, None))
    return _gemm(y, fc2, dtype, fp8_2)


class MLP(nnx.Module):
    """The feed-forward block: ``fc2(dropout(act(fc1(x))))``, plain or gated.

    Parameters: ``fc1`` (hidden, ffn), or (hidden, 2 * ffn) laid out [gate | up] for a
    gated activation; ``fc2`` (ffn, hidden); ``nnx.Linear`` with biases unless
    ``use_bias=False``. With ``tensor_axis``, ``fc1`` is a
    `jax_ls2.parallel.ColumnParallelLinear` ((hidden, ffn), or (hidden, 2, ffn) gated:
    each device holds the gate and up columns of its features) and ``fc2`` a
    `RowParallelLinear`. With ``fp8``, metas ``fc1_fp8`` and ``fc2_fp8`` beside them.

    Args:
      hidden_size, ffn_size: widths.
      activation: one of `MLP_ACTIVATIONS` (relu, gelu, gelu_tanh; swiglu, geglu,
        geglu_tanh gated).
      use_bias: biases on both projections.
      activation_dropout: dropout after the activation (fused with it).
      deterministic, dtype, param_dtype, kernel_init: as the layers'.
      fp8: None or a `jax_ls2.fp8.DelayedScaling` (widths multiples of 16);
        fp8_amax_axes: the amax reduction axes inside ``shard_map``.
      tensor_axis, sequence_parallel: Megatron tensor (and sequence) parallelism.
      rngs: ``nnx.Rngs`` (params; dropout keys from ``dropout``).

    ``__call__(x, *, deterministic=None, rngs=None)``: x (..., hidden) -> (..., hidden).
    """

    _owner = "MLP"

    def __init__(self, hidden_size: int, ffn_size: int, *, activation: str = "gelu", use_bias: bool = True,
                 activation_dropout: float = 0.0, deterministic: bool | None = None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=nnx.initializers.lecun_normal(), fp8=None, fp8_amax_axes=(),
                 tensor_axis: str | None = None, sequence_parallel: bool = False, rngs: nnx.Rngs):
        o = self._owner
        check_positive_int(o, "hidden_size", hidden_size)
        check_positive_int(o, "ffn_size", ffn_size)
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"{o}: activation must be one of {MLP_ACTIVATIONS}, got {activation!r}")
        if tensor_axis is not None and fp8 is not None:
            raise ValueError(f"{o}: fp8 with tensor_axis is not supported; leave one of them unset")
        if sequence_parallel and tensor_axis is None:
            raise ValueError(f"{o}: sequence_parallel needs tensor_axis")
        self.hidden_size, self.ffn_size, self.activation = hidden_size, ffn_size, activation
        self.activation_dropout = check_rate(o, "activation_dropout", activation_dropout)
        self.deterministic, self.dtype = deterministic, dtype
        self.tensor_axis, self.sequence_parallel = tensor_axis, sequence_parallel
        parts = 2 if is_gated(activation) else 1
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        if tensor_axis is None:
            self.fc1 = nnx.Linear(hidden_size, parts * ffn_size, **kw)
            self.fc2 = nnx.Linear(ffn_size, hidden_size, **kw)
        else:
            tp = dict(kw, tensor_axis=tensor_axis, sequence_dim=1 if sequence_parallel else None)
            self.fc1 = ColumnParallelLinear(hidden_size, (parts, ffn_size) if parts > 1 else ffn_size, **tp)
            self.fc2 = RowParallelLinear(ffn_size, hidden_size, **tp)
        self.fp8 = fp8
        self.fp8_amax_axes = check_fp8(o, fp8, fp8_amax_axes, {"hidden_size": hidden_size, "ffn_size": ffn_size})
        if fp8 is not None:
            check_fp8_device(o)
            self.fc1_fp8, self.fc2_fp8 = FP8DotMeta(fp8), FP8DotMeta(fp8)
        self.rngs = rng_stream(rngs)

    def __call__(self, x, *, deterministic: bool | None = None, rngs=None):
        o = self._owner
        check_hidden(o, x, self.hidden_size)
        det = resolve_deterministic(o, deterministic, self.deterministic)
        key = None if det or not self.activation_dropout else draw_key(o, self.rngs, rngs)
        if self.tensor_axis is not None:
            require_tensor_axis(o, self.tensor_axis, {"ffn_size": self.ffn_size})
        fp8 = (None, None) if self.fp8 is None else tuple(
            FP8Gemm(m, self.fp8, self.fp8_amax_axes) for m in (self.fc1_fp8, self.fc2_fp8))
        y, b = mlp_forward(x, self.fc1, self.fc2, activation=self.activation, rate=self.activation_dropout, key=key,
                           deterministic=det or key is None, dtype=self.dtype, fp8=fp8, tensor_axis=self.tensor_axis,
                           sequence_dim=1 if self.sequence_parallel else None)
        return y if b is None else y + b
