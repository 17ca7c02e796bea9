"""Megatron tensor parallelism: column- and row-parallel linear layers (Flax NNX) and functions.

A Megatron MLP is ``row(act(column(x)))``: the column-parallel layer splits its
``(in, out)`` kernel by output columns over the tensor axis, so each device computes a
slice of the features, and the activation runs on that slice; the row-parallel layer
splits its kernel by input rows, so each device's product is a partial sum of the full
output, and one all-reduce over the tensor axis completes it. Forward: one all-reduce;
backward: one all-reduce of the column layer's input gradient.

Two ways to run them:

- Under ``jit`` with the parameters placed by their partition specs
  (``nnx.get_partition_spec(nnx.state(model))``, mesh axes ``AxisType.Auto``): the
  partitioner keeps the column output sharded on its feature dim and inserts the
  all-reduce after the row-parallel product.
- Inside ``jax.shard_map`` with the tensor axis manual (parameters passed with those
  same specs, so each device holds its shard): the row-parallel product is reduced by
  an explicit ``psum`` over the tensor axis; the column layer's input gradient is summed
  by the transpose of ``shard_map``'s replicated-to-varying cast (keep ``check_vma=True``,
  the default, for that).

Megatron sequence parallelism (``sequence_dim`` set): outside the tensor-parallel region
activations are split along the sequence over the same tensor axis. The column-parallel
layer all-gathers its input along the sequence first, and the row-parallel layer
reduce-scatters its output along the sequence instead of all-reducing it, so a
column -> row pair costs one all-gather and one reduce-scatter each way. Inside
``shard_map`` these are ``all_gather`` / ``psum_scatter``; under ``jit`` they are sharding
constraints (a mesh must be set with ``jax.set_mesh``), and the partitioner chooses the
collectives (on the CPU it makes the reduce-scatter an all-reduce and a slice).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax.sharding import PartitionSpec as P

from jax_ls2.parallel.mesh import TENSOR

_default_kernel_init = nnx.initializers.lecun_normal()
_default_bias_init = nnx.initializers.zeros_init()


def bound_axis_size(axis_name: str) -> int | None:
    """The size of ``axis_name`` inside ``shard_map`` (a manual axis), None outside it."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        return None


def _sequence_dim(op: str, x, sequence_dim: int | None) -> int | None:
    if sequence_dim is None:
        return None
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
        raise TypeError(f"{op}: sequence_dim must be an int or None, got {sequence_dim!r}")
    if not -x.ndim <= sequence_dim < x.ndim or sequence_dim % x.ndim == x.ndim - 1:
        raise ValueError(f"{op}: sequence_dim must name a dim of x other than the last (features), x has shape "
                         f"{tuple(x.shape)}, got {sequence_dim}")
    return sequence_dim % x.ndim


def constrain_sequence(op: str, x, seq: int, axis_name: str | None):
    """``x`` with dim ``seq`` split over ``axis_name`` (None: whole), the features whole and
    every other dim left to the partitioner, under ``jit``; needs a mesh set with
    ``jax.set_mesh`` (``op`` names the caller in the error)."""
    if jax.sharding.get_abstract_mesh().empty:
        raise ValueError(f"{op}: sequence parallelism under jit needs the mesh set with jax.set_mesh(mesh) "
                         f"(or run inside shard_map)")
    spec = [P.UNCONSTRAINED] * x.ndim
    spec[seq], spec[-1] = axis_name, None
    return jax.lax.with_sharding_constraint(x, P(*spec))


def _check_operands(op: str, x, kernel, bias, kernel_ndim: str):
    if kernel.ndim < 2 or (kernel_ndim == "2" and kernel.ndim != 2):
        raise ValueError(f"{op}: kernel must be {'(in, out)' if kernel_ndim == '2' else '(in, *out)'}, "
                         f"got shape {tuple(kernel.shape)}")
    if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(f"{op}: x must have shape (..., {kernel.shape[0]}) to match kernel {tuple(kernel.shape)}, "
                         f"got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != tuple(kernel.shape[1:]):
        raise ValueError(f"{op}: bias must have shape {tuple(kernel.shape[1:])} to match kernel "
                         f"{tuple(kernel.shape)}, got {tuple(bias.shape)}")


def _linear(x, kernel, bias, dtype):
    x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=dtype)
    y = jnp.tensordot(x, kernel, axes=1)
    return y, bias


def column_parallel_linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                           axis_name: str = TENSOR, sequence_dim: int | None = None, dtype=None) -> jax.Array:
    """``x @ kernel + bias`` with the kernel split by output columns over the tensor axis.

    Args:
      x: ``(..., in)``, replicated over the tensor axis; with ``sequence_dim``, split
        along that dim over it instead (inside ``shard_map``: this device's
        ``seq / tensor`` positions).
      kernel: ``(in, out)`` sharded ``P(None, tensor)`` under ``jit``; inside
        ``shard_map`` this device's ``(in, out / tensor)`` shard. ``(in, *out)`` with
        several output dims (e.g. ``(in, 3, heads * head_dim)`` for a fused QKV
        projection, so each device holds whole heads of q, k and v) is split on its last.
      bias: ``out`` shaped, split like the kernel's last dim, or None.
      axis_name: the tensor axis.
      sequence_dim: the sequence dim of x for Megatron sequence parallelism (e.g. 1
        for ``(batch, seq, in)``), or None. x is then all-gathered along it first.
      dtype: the compute dtype (None: promote x, kernel and bias, as ``nnx.Linear``).

    Returns:
      ``(..., *out)`` with every position, sharded on the last dim over the tensor axis
      (inside ``shard_map``: this device's ``(..., out / tensor)`` slice). No collective
      in the forward pass (with ``sequence_dim``, the all-gather of x); in the backward
      pass one all-reduce of x's gradient (with ``sequence_dim``, a reduce-scatter).
    """
    op = "column_parallel_linear"
    _check_operands(op, x, kernel, bias, "n")
    seq = _sequence_dim(op, x, sequence_dim)
    if seq is not None:
        if bound_axis_size(axis_name) is not None:
            x = jax.lax.all_gather(x, axis_name, axis=seq, tiled=True)
        else:
            x = constrain_sequence(op, x, seq, None)
    y, bias = _linear(x, kernel, bias, dtype)
    return y if bias is None else y + bias


def row_parallel_linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                        axis_name: str = TENSOR, sequence_dim: int | None = None, dtype=None) -> jax.Array:
    """``x @ kernel + bias`` with the kernel split by input rows over the tensor axis.

    Args:
      x: ``(..., in)`` sharded on the last dim over ``axis_name`` (a column-parallel
        output); inside ``shard_map`` this device's ``(..., in / tensor)`` slice.
      kernel: ``(in, out)`` sharded ``P(tensor, None)``; inside ``shard_map`` this
        device's ``(in / tensor, out)`` shard.
      bias: ``(out,)`` replicated, added once after the reduction, or None.
      axis_name: the tensor axis. Inside ``shard_map`` (where it is a manual axis) the
        partial products are summed with ``psum`` over it; under ``jit`` the
        partitioner inserts the same all-reduce.
      sequence_dim: for Megatron sequence parallelism, the sequence dim of x (and of the
        output), or None. The partial products are then reduce-scattered along it
        (``psum_scatter`` inside ``shard_map``) instead of all-reduced.
      dtype: the compute dtype (None: promote x, kernel and bias).

    Returns:
      ``(..., out)``, replicated over the tensor axis (one all-reduce of ``(..., out)``
      in the forward pass, none in the backward pass); with ``sequence_dim``, split
      along it over the tensor axis (one reduce-scatter forward, one all-gather backward).
    """
    op = "row_parallel_linear"
    _check_operands(op, x, kernel, bias, "2")
    seq = _sequence_dim(op, x, sequence_dim)
    y, bias = _linear(x, kernel, bias, dtype)
    if bound_axis_size(axis_name) is not None:
        y = (jax.lax.psum(y, axis_name) if seq is None
             else jax.lax.psum_scatter(y, axis_name, scatter_dimension=seq, tiled=True))
    elif seq is not None:
        y = constrain_sequence(op, y, seq, axis_name)
    return y if bias is None else y + bias


def _param(value, spec, mesh):
    """A Param annotated with its partition spec; placed on ``mesh`` when one is given
    or set (``jax.set_mesh``), else left where it was made."""
    if mesh is not None:
        return nnx.Param(value, out_sharding=spec, mesh=mesh)
    if not jax.sharding.get_abstract_mesh().empty:
        return nnx.Param(value, out_sharding=spec)
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


def _check_features(owner: str, name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


def _check_input(owner: str, x, width: int, what: str):
    if x.ndim < 1 or x.shape[-1] != width:
        raise ValueError(f"{owner}: x must have shape (..., {width}) ({what}), got {tuple(x.shape)}")


def _local_width(owner: str, axis_name: str, full: int, local: int, param: str, dim: str) -> int:
    """The tensor-axis size when ``local`` is ``full`` split over it inside ``shard_map``, 1 otherwise."""
    size = bound_axis_size(axis_name)
    if size is None:
        if local != full:
            raise ValueError(f"{owner}: {param} has {dim} {local}, expected {full} outside shard_map")
        return 1
    if full % size or local * size != full:
        raise ValueError(f"{owner}: inside shard_map over {axis_name!r} (size {size}) {param} must be this "
                         f"device's shard with {dim} {full} / {size}, got {local}; pass the parameters with "
                         f"the specs of nnx.get_partition_spec(nnx.state(module)), and make {dim} "
                         f"{full} a multiple of the axis size")
    return size


class ColumnParallelLinear(nnx.Module):
    """A linear layer whose ``(in_features, out_features)`` kernel is split by columns over the tensor axis.

    Params: ``kernel`` ``(in_features, out_features)`` partitioned ``(None, tensor_axis)``;
    ``bias`` ``(out_features,)`` partitioned ``(tensor_axis,)`` (when ``use_bias``). Made
    as ``nnx.Linear`` makes them (same initialisers, same values for the same key), so a
    model with these layers matches its unsplit twin.

    ``out_features`` may be a tuple, e.g. ``(3, hidden)`` for a fused QKV projection:
    the kernel is then ``(in_features, *out_features)``, split on its last dim (each
    device holds whole heads of q, k and v), with the values of
    ``nnx.Linear(in_features, prod(out_features))``'s kernel reshaped (whose columns are
    ``[q | k | v]``), and the output is ``(..., *out_features)``.

    ``__call__(x)``: x ``(..., in_features)`` replicated over the tensor axis; returns
    ``(..., out_features)`` sharded on the last dim over the tensor axis (inside
    ``shard_map``: the local ``(..., out_features / tensor)`` slice). See
    `column_parallel_linear`. With ``sequence_dim`` (Megatron sequence parallelism), x
    comes split along that dim over the tensor axis and is all-gathered first.

    Args:
      mesh: when given, the parameters are created sharded on it; otherwise on the mesh
        set by ``jax.set_mesh`` if any, else unplaced (the annotation is kept, so
        ``jax.device_put(state, shardings)`` places them later).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 tensor_axis: str = TENSOR, dtype=None, param_dtype=jnp.float32,
                 kernel_init=_default_kernel_init, bias_init=_default_bias_init,
                 sequence_dim: int | None = None, mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        owner = "ColumnParallelLinear"
        self.in_features = _check_features(owner, "in_features", in_features)
        out = tuple(out_features) if isinstance(out_features, (tuple, list)) else (out_features,)
        if not out:
            raise ValueError(f"{owner}: out_features must be an int or a non-empty tuple of ints, got {out_features!r}")
        self.out_features = out if isinstance(out_features, (tuple, list)) else out_features
        for size in out:
            _check_features(owner, "out_features", size)
        self.tensor_axis, self.dtype, self.use_bias = tensor_axis, dtype, bool(use_bias)
        self.sequence_dim = sequence_dim
        split = (None,) * (len(out) - 1) + (tensor_axis,)
        # made 2-D and reshaped, so the initialiser sees nnx.Linear's fan-in and fan-out
        width = math.prod(out)
        kernel = kernel_init(rngs.params(), (in_features, width), param_dtype).reshape(in_features, *out)
        self.kernel = _param(kernel, (None, *split), mesh)
        self.bias = (_param(bias_init(rngs.params(), (width,), param_dtype).reshape(out), split, mesh)
                     if self.use_bias else nnx.data(None))

    @property
    def _out_shape(self) -> tuple[int, ...]:
        return tuple(self.out_features) if isinstance(self.out_features, tuple) else (self.out_features,)

    def __call__(self, x: jax.Array) -> jax.Array:
        owner = "ColumnParallelLinear"
        kernel = self.kernel[...]
        _check_input(owner, x, self.in_features, "in_features")
        full = kernel.shape[:-1] + (self._out_shape[-1],)
        if full[1:] != self._out_shape:
            raise ValueError(f"{owner}: kernel must have shape ({self.in_features}, *{self._out_shape}) (the last dim "
                             f"split over {self.tensor_axis!r}), got {tuple(kernel.shape)}")
        _local_width(owner, self.tensor_axis, self._out_shape[-1], kernel.shape[-1], "kernel",
                     "out_features[-1]" if isinstance(self.out_features, tuple) else "out_features")
        bias = None if self.bias is None else self.bias[...]
        return column_parallel_linear(x, kernel, bias, axis_name=self.tensor_axis, sequence_dim=self.sequence_dim,
                                      dtype=self.dtype)


class RowParallelLinear(nnx.Module):
    """A linear layer whose ``(in_features, out_features)`` kernel is split by rows over the tensor axis.

    Params: ``kernel`` ``(in_features, out_features)`` partitioned ``(tensor_axis, None)``;
    ``bias`` ``(out_features,)`` replicated (partition spec ``(None,)``), added once
    after the reduction. Made as ``nnx.Linear`` makes them.

    ``__call__(x)``: x ``(..., in_features)`` sharded on the last dim over the tensor axis
    (a `ColumnParallelLinear` output; inside ``shard_map`` the local
    ``(..., in_features / tensor)`` slice); returns ``(..., out_features)`` replicated
    over the tensor axis, after one all-reduce (``psum`` inside ``shard_map``); with
    ``sequence_dim``, split along that dim over the tensor axis after one reduce-scatter.
    See `row_parallel_linear`. ``mesh`` as for `ColumnParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 tensor_axis: str = TENSOR, dtype=None, param_dtype=jnp.float32,
                 kernel_init=_default_kernel_init, bias_init=_default_bias_init,
                 sequence_dim: int | None = None, mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        owner = "RowParallelLinear"
        self.in_features = _check_features(owner, "in_features", in_features)
        self.out_features = _check_features(owner, "out_features", out_features)
        self.tensor_axis, self.dtype, self.use_bias = tensor_axis, dtype, bool(use_bias)
        self.sequence_dim = sequence_dim
        key = rngs.params()
        self.kernel = _param(kernel_init(key, (in_features, out_features), param_dtype), (tensor_axis, None), mesh)
        self.bias = (_param(bias_init(rngs.params(), (out_features,), param_dtype), (None,), mesh)
                     if self.use_bias else nnx.data(None))

    def __call__(self, x: jax.Array) -> jax.Array:
        owner = "RowParallelLinear"
        kernel = self.kernel[...]
        split = _local_width(owner, self.tensor_axis, self.in_features, kernel.shape[0], "kernel", "in_features")
        _check_input(owner, x, self.in_features // split, "in_features, or its shard inside shard_map")
        bias = None if self.bias is None else self.bias[...]
        return row_parallel_linear(x, kernel, bias, axis_name=self.tensor_axis, sequence_dim=self.sequence_dim,
                                   dtype=self.dtype)
