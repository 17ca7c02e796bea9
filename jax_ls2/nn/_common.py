"""Helpers shared by the jax_ls2 Flax NNX layers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_ls2.fp8 import DelayedScaling, fp8_dot
from jax_ls2.ops._checks import check_rate_in_range as check_rate  # noqa: F401 (the layers' spelling)
from jax_ls2.ops.dropout import ACTIVATIONS
from jax_ls2.parallel.tensor import bound_axis_size, constrain_sequence

# The oldest CUDA compute capability with FP8 GEMMs (Ada, sm_89).
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
# cuBLASLt's FP8 GEMMs take K and N (the contracted and the output dims) in multiples of 16.
FP8_DIM_MULTIPLE = 16


def check_positive_int(owner: str, name: str, value, allow_none: bool = False):
    """Raises unless ``value`` is a positive Python int (or None with ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def check_activation(owner: str, activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def check_heads(owner: str, hidden_size: int, num_heads: int) -> int:
    if hidden_size <= 0 or num_heads <= 0 or hidden_size % num_heads:
        raise ValueError(f"{owner}: hidden_size ({hidden_size}) must be a positive multiple of "
                         f"num_heads ({num_heads})")
    return hidden_size // num_heads


def check_hidden(owner: str, x, hidden_size: int, name: str = "x"):
    if x.ndim < 2 or x.shape[-1] != hidden_size:
        raise ValueError(f"{owner}: {name} must have shape (..., {hidden_size}), got {tuple(x.shape)}")


def matmul(x: jax.Array, linear: nnx.Linear, dtype, fp8=None):
    """``x @ linear.kernel`` without the bias, and the bias, both in the promoted dtype.

    x: (..., in); returns y: (..., out) and bias: (out,) -- the bias is left for a fused
    epilogue op (bias + dropout + residual, bias + activation + dropout).
    fp8: None, or an `FP8Gemm`: the GEMM then runs through `jax_ls2.fp8.fp8_dot` (x and
    the kernel quantized from their own dtypes, the result in the promoted dtype).
    """
    kernel = linear.kernel[...]
    bias = linear.bias[...]
    if fp8 is not None:
        return fp8(x, kernel, dtype), bias.astype(promoted_dtype(dtype, x, kernel, bias))
    x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=dtype)
    return jnp.dot(x, kernel), bias


def promoted_dtype(dtype, *arrays):
    """The compute dtype `dtypes.promote_dtype` gives ``arrays`` for ``dtype``."""
    return jnp.dtype(dtype) if dtype is not None else jnp.result_type(*arrays)


class FP8Gemm:
    """One weight GEMM's FP8 setting: its meta (an `FP8DotMeta`), the recipe and the mesh
    axes of the amax reduction. ``gemm(x, kernel, dtype)``: ``x @ kernel`` through
    `jax_ls2.fp8.fp8_dot`, x: (..., K), kernel: (K, N) -> (..., N) in the promoted dtype;
    ``splits=k``: a tuple of k GEMM results over kernel's column blocks (see fp8_dot)."""

    def __init__(self, meta, recipe, amax_axes=()):
        self.meta, self.recipe, self.amax_axes = meta, recipe, amax_axes

    def __call__(self, x, kernel, dtype, splits: int = 1):
        return fp8_dot(x, kernel, self.meta, self.recipe, dtype=promoted_dtype(dtype, x, kernel),
                       amax_axes=self.amax_axes, splits=splits)


def check_fp8(owner: str, recipe, amax_axes, dims: dict) -> tuple:
    """Checks a layer's ``fp8`` (None or a DelayedScaling) and ``fp8_amax_axes``, and with
    fp8 that each of ``dims`` ({name: size}, the K and N dims of the layer's GEMMs) is a
    multiple of `FP8_DIM_MULTIPLE`. Returns the axes as a tuple."""
    if isinstance(amax_axes, str):
        amax_axes = (amax_axes,)
    if not isinstance(amax_axes, (tuple, list)) or not all(isinstance(a, str) for a in amax_axes):
        raise TypeError(f"{owner}: fp8_amax_axes must be a tuple of mesh axis names, got {amax_axes!r}")
    if recipe is None:
        return tuple(amax_axes)
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"{owner}: fp8 must be None or a jax_ls2.fp8.DelayedScaling, got {type(recipe).__name__}")
    for name, size in dims.items():
        if size % FP8_DIM_MULTIPLE:
            raise ValueError(f"{owner}: fp8 needs {name} to be a multiple of {FP8_DIM_MULTIPLE} (the K and N "
                             f"dims of its FP8 GEMMs, as cuBLASLt takes them), got {size}")
    return tuple(amax_axes)


def check_fp8_device(owner: str) -> None:
    """Raises where FP8 GEMMs cannot run: a CUDA GPU below compute capability 8.9. Other
    backends (the CPU) run the reference FP8 math."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return
    try:
        version = tuple(int(p) for p in str(capability).split(".")[:2])
    except ValueError:  # not a CUDA "major.minor" (another GPU vendor's naming)
        return
    if version < FP8_MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_COMPUTE_CAPABILITY))
        raise ValueError(f"{owner}: fp8 needs a GPU with FP8 GEMMs (CUDA compute capability {need} or newer: "
                         f"Ada, Hopper, Blackwell), got {device.device_kind} with compute capability "
                         f"{capability}; leave fp8=None on this GPU")


def tensor_axis_size(axis: str) -> int | None:
    """The size of mesh axis ``axis``: inside ``shard_map`` where it is manual, else in the
    mesh set by ``jax.set_mesh``; None where neither has it."""
    size = bound_axis_size(axis)
    if size is not None:
        return size
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return None
    return mesh.shape[axis]


def check_divisible(owner: str, axis: str, sizes: dict) -> None:
    """Raises unless each of ``sizes`` ({name: size}) is a multiple of the size of mesh axis
    ``axis`` (when a mesh or ``shard_map`` gives that size)."""
    n = tensor_axis_size(axis)
    if n is None:
        return
    for name, size in sizes.items():
        if size % n:
            raise ValueError(f"{owner}: {name} ({size}) must be a multiple of the size ({n}) of mesh axis "
                             f"{axis!r}, which tensor parallelism splits it over; change {name} or the mesh")


def check_tensor_parallel(owner: str, tensor_axis, sequence_parallel, sizes: dict) -> None:
    """Checks ``tensor_axis`` (None or a mesh axis name) and ``sequence_parallel`` (a bool,
    True only with a tensor axis), and ``sizes`` against the axis (see `check_divisible`)."""
    if tensor_axis is not None and (not isinstance(tensor_axis, str) or not tensor_axis):
        raise TypeError(f"{owner}: tensor_axis must be None or a mesh axis name (a str such as 'tensor'), "
                        f"got {tensor_axis!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{owner}: sequence_parallel must be a Python bool, got {type(sequence_parallel).__name__}")
    if sequence_parallel and tensor_axis is None:
        raise ValueError(f"{owner}: sequence_parallel=True splits activations over the tensor axis; "
                         f"set tensor_axis (e.g. 'tensor') too")
    if tensor_axis is not None:
        check_divisible(owner, tensor_axis, sizes)


def check_sequence_axis(owner: str, sequence_axis, attention_backend: str, fp8=None,
                        sequence_parallel: bool = False) -> None:
    """Checks ``sequence_axis`` (None or a mesh axis name) against the options it cannot
    go with: attention other than "flash" / "auto" (the ring runs flash attention),
    ``fp8`` and Megatron ``sequence_parallel`` (a second split of the sequence).
    ``tensor_axis`` goes with it: the heads split over the tensor axis, the sequence
    over ``sequence_axis``."""
    if sequence_axis is None:
        return
    if not isinstance(sequence_axis, str) or not sequence_axis:
        raise TypeError(f"{owner}: sequence_axis must be None or a mesh axis name (a str such as 'seq'), "
                        f"got {sequence_axis!r}")
    if attention_backend not in ("auto", "flash"):
        raise ValueError(f"{owner}: sequence_axis runs attention as ring attention over flash blocks; "
                         f"attention_backend must be 'flash' or 'auto', got {attention_backend!r}")
    if fp8 is not None:
        raise ValueError(f"{owner}: sequence_axis with fp8 is not supported yet; leave one of them unset")
    if sequence_parallel:
        raise ValueError(f"{owner}: sequence_axis with sequence_parallel (Megatron's split of the sequence over "
                         f"the tensor axis) is not supported; the sequence is already split over "
                         f"{sequence_axis!r}, leave sequence_parallel off")


SEQUENCE_BALANCES = ("none", "zigzag")


def check_sequence_balance(owner: str, balance) -> str:
    if balance not in SEQUENCE_BALANCES:
        raise ValueError(f"{owner}: sequence_balance must be one of {SEQUENCE_BALANCES}, got {balance!r}")
    return balance


def require_tensor_axis(owner: str, axis: str, sizes: dict) -> None:
    """At call time with tensor parallelism: the axis must be known (inside ``shard_map``
    or in the mesh set by ``jax.set_mesh``) and divide ``sizes``."""
    if tensor_axis_size(axis) is None:
        raise ValueError(f"{owner}: tensor_axis={axis!r} needs a mesh with that axis: call it under "
                         f"`with jax.set_mesh(mesh):` (the state placed by nnx.get_partition_spec) or inside "
                         f"shard_map over it")
    check_divisible(owner, axis, sizes)


def split_sequence(x, axis: str, seq_dim: int = 1):
    """x with dim ``seq_dim`` split over ``axis`` under ``jit`` (Megatron sequence
    parallelism's layout); unchanged inside ``shard_map``, where x is already a shard."""
    if bound_axis_size(axis) is not None:
        return x
    n = tensor_axis_size(axis)
    if n is not None and x.shape[seq_dim] % n:
        raise ValueError(f"sequence_parallel: the sequence length ({x.shape[seq_dim]}) must be a multiple of the "
                         f"size ({n}) of mesh axis {axis!r}; pad the sequence or change the mesh")
    return constrain_sequence("sequence_parallel", x, seq_dim, axis)


def rng_stream(rngs, collection: str = "dropout"):
    """A forked stream of ``rngs[collection]`` to keep on a module (or None)."""
    if rngs is None:
        return nnx.data(None)
    if isinstance(rngs, nnx.Rngs):
        return rngs[collection].fork()
    if isinstance(rngs, nnx.RngStream):
        return rngs.fork()
    raise TypeError(f"rngs must be nnx.Rngs, nnx.RngStream or None, got {type(rngs).__name__}")


def draw_key(owner: str, stored, rngs, collection: str = "dropout"):
    """One PRNG key from the call's ``rngs`` (Rngs, RngStream or key) or the stored stream."""
    src = rngs if rngs is not None else stored
    if src is None:
        raise ValueError(f"{owner}: dropout is active (deterministic=False, rate > 0) but no rngs "
                         f"were given; pass rngs=nnx.Rngs(dropout=...) at construction or call time")
    if isinstance(src, nnx.Rngs):
        return src[collection]()
    if isinstance(src, nnx.RngStream):
        return src()
    return src


def resolve_deterministic(owner: str, call_value, attr_value) -> bool:
    value = call_value if call_value is not None else attr_value
    if value is None:
        raise ValueError(f"{owner}: deterministic is not set; pass deterministic=True/False or "
                         f"call model.train() / model.eval()")
    return bool(value)
