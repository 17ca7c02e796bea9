"""The device mesh for parallel training: four named axes over all devices of all processes.

Axes, outermost to innermost (their canonical names, then the aliases accepted in a spec):

==========  ==========================  ================================================
axis        aliases                     what is split over it
==========  ==========================  ================================================
``pipe``    ``pipeline``, ``pp``        layers, in pipeline stages
``data``    ``dp``                      the batch (and, optionally, optimizer state)
``seq``     ``sequence``, ``sp``        the sequence (context parallelism)
``tensor``  ``tp``, ``model``           heads and feature dims (Megatron tensor parallelism)
==========  ==========================  ================================================

Every mesh made here has all four axes, in this order; an axis left out of the spec has
size 1, so layers may name any of them whatever the spec. The order puts the axis with
the most traffic (``tensor``: an all-reduce per layer in the forward and the backward
pass) innermost, so its groups are runs of consecutive device ids, which on a GPU host
are the devices of one NVLink domain; ``pipe`` (one activation transfer per
micro-batch) is outermost, the axis that may cross the slowest links. It is the order of
Megatron-LM (tensor fastest, then context, then data, then pipeline).

All axes are ``AxisType.Auto``: under ``jit`` the partitioner propagates shardings from
the arguments (as the fused ops were built and tested for), and ``shard_map`` takes the
axes as manual. ``jax.make_mesh`` defaults to ``Explicit`` axes on jax 0.11, with which
shardings become part of every array's type; the fused optimizer rejects such meshes.
"""
from __future__ import annotations

import collections
import math
from typing import Mapping

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

PIPE = "pipe"
DATA = "data"
SEQ = "seq"
TENSOR = "tensor"
AXES = (PIPE, DATA, SEQ, TENSOR)
"""The mesh's axis names, outermost to innermost."""

ALIASES = {
    PIPE: PIPE, "pipeline": PIPE, "pp": PIPE,
    DATA: DATA, "dp": DATA,
    SEQ: SEQ, "sequence": SEQ, "sp": SEQ,
    TENSOR: TENSOR, "tp": TENSOR, "model": TENSOR,
}
"""Every name a spec may use for an axis, mapped to the axis's canonical name."""


def _axis_name(op: str, name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{op}: axis names must be strings, got {name!r} ({type(name).__name__})")
    key = name.strip().lower()
    if key not in ALIASES:
        raise ValueError(f"{op}: unknown axis {name!r}; use one of {', '.join(AXES)} "
                         f"(or an alias: {', '.join(k for k in ALIASES if k not in AXES)})")
    return ALIASES[key]


def _axis_size(op: str, axis: str, size) -> int:
    if isinstance(size, str):
        text = size.strip()
        if not text.lstrip("+-").isdigit():
            raise ValueError(f"{op}: the size of axis {axis!r} must be a positive integer, got {size!r}")
        size = int(text)
    elif isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"{op}: the size of axis {axis!r} must be an int, got {size!r} ({type(size).__name__})")
    if size <= 0:
        raise ValueError(f"{op}: the size of axis {axis!r} must be a positive integer, got {size}")
    return int(size)


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """Axis sizes from a spec, with every axis present (size 1 where unspecified).

    Args:
      spec: a string of comma-separated ``axis=size`` entries (``"data=2,tensor=2,seq=2"``,
        spaces allowed, names case-insensitive), a mapping ``{axis: size}``, or ``None`` /
        ``""`` (every axis size 1). Axis names are the canonical ones or their aliases (see
        the module docstring).

    Returns:
      ``{axis: size}`` over ``AXES``, in mesh order (outermost first).

    Raises:
      ValueError: an unknown axis, a size that is not a positive integer, an entry that is
        not ``axis=size``, or the same axis named twice (also through an alias).
      TypeError: a spec of another type, or a mapping with non-integer sizes.
    """
    op = "parse_mesh_spec"
    if spec is None:
        items = []
    elif isinstance(spec, str):
        items = []
        for entry in (e.strip() for e in spec.split(",")):
            if not entry:
                continue
            name, eq, size = entry.partition("=")
            if not eq or not name.strip():
                raise ValueError(f"{op}: each entry must be axis=size (e.g. 'data=2,tensor=4'), got {entry!r} "
                                 f"in {spec!r}")
            items.append((name, size))
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        raise TypeError(f"{op}: spec must be a string like 'data=2,tensor=4', a dict or None, "
                        f"got {type(spec).__name__}")
    sizes: dict[str, int] = {}
    named_as: dict[str, str] = {}
    for name, size in items:
        axis = _axis_name(op, name)
        if axis in sizes:
            raise ValueError(f"{op}: axis {axis!r} is given twice (as {named_as[axis]!r} and {name!r}); "
                             f"give each axis once")
        sizes[axis] = _axis_size(op, axis, size)
        named_as[axis] = name
    return {axis: sizes.get(axis, 1) for axis in AXES}


def make_mesh(spec: str | Mapping[str, int] | None = None, *, devices=None) -> Mesh:
    """A ``Mesh`` with axes ``("pipe", "data", "seq", "tensor")`` over all devices.

    Args:
      spec: axis sizes, as for `parse_mesh_spec` (``"data=2,tensor=4"``,
        ``{"dp": 2, "tp": 4}``); unspecified axes have size 1. The sizes' product must
        equal the number of devices.
      devices: the devices to arrange; default ``jax.devices()``, every device of every
        process (call `initialize_distributed` first when several processes run).

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(pipe, data, seq, tensor)`` whose four axes are
      ``AxisType.Auto``. Devices are ordered by id and arranged by
      ``jax.experimental.mesh_utils.create_device_mesh`` (topology-aware on TPUs; id
      order elsewhere), so consecutive ids are neighbours along ``tensor``, then
      ``seq``, ``data`` and ``pipe``: a tensor group of size t is ``t`` consecutive ids,
      on one host whenever ``t`` divides the per-host device count.

    Raises:
      ValueError: a bad spec (see `parse_mesh_spec`), a device given more than once,
        or sizes whose product is not the number of devices (the message gives the
        product, the device count, and the size the ``data`` axis would need).
    """
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: devices is empty")
    repeated = [(d, n) for d, n in collections.Counter(devices).items() if n > 1]
    if repeated:
        listed = ", ".join(f"{d!r} ({n} times)" for d, n in repeated)
        raise ValueError(f"make_mesh: devices must be distinct, got {listed}")
    shape = tuple(sizes[a] for a in AXES)
    product, count = math.prod(shape), len(devices)
    if product != count:
        other = product // sizes[DATA]
        hint = (f"; with the other axes as given, data={count // other} would fit" if count % other == 0
                else f"; the sizes must multiply to {count}")
        given = ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "(all axes 1)"
        raise ValueError(f"make_mesh: the axis sizes {given} multiply to {product}, but there are {count} "
                         f"devices{hint}")
    devices = sorted(devices, key=lambda d: d.id)
    grid = mesh_utils.create_device_mesh(shape, devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))



def shard_module(module, mesh: Mesh):
    """Places a Flax NNX module's state on ``mesh`` by its partition specs, in place.

    Every variable goes to ``NamedSharding(mesh, spec)`` with ``spec`` from
    ``nnx.get_partition_spec(nnx.state(module))``: the annotated tensor-parallel
    parameters split over their axes, everything else (LayerNorms, unannotated params,
    dropout RNG state) replicated. Returns the module. Works for any pytree of modules,
    e.g. ``(model, optimizer)``.
    """
    from flax import nnx  # noqa: PLC0415 (the mesh helpers need no Flax)
    from jax.sharding import NamedSharding  # noqa: PLC0415

    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)
    nnx.update(module, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)))
    return module


def fsdp_spec(shape, spec, mesh: Mesh, axis: str = DATA):
    """``spec`` (a leaf's ``PartitionSpec``) with ``axis`` added, FSDP-style: on the
    largest dim of ``shape`` that no axis splits yet and that ``axis``'s size divides
    (the first of equal ones). The spec comes back as it is, replicated over ``axis``,
    where the axis has size 1 or already splits the leaf, or no free dim is divisible
    (scalars, small or odd-sized leaves such as a (3, hidden) QKV bias whose hidden
    dim the tensor axis splits)."""
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    size = dict(mesh.shape).get(axis, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    named = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
    if size == 1 or axis in named:
        return spec
    free = [d for d, (n, e) in enumerate(zip(shape, entries)) if e is None and n % size == 0]
    if not free:
        return spec
    dim = max(free, key=lambda d: (shape[d], -d))
    entries[dim] = axis
    return P(*entries)


def gather_as_annotated(owner: str, module) -> None:
    """Constrains ``module``'s params, under ``jit`` with a mesh set (``jax.set_mesh``), to
    the shardings their partition annotations give (split over the tensor axis only), in
    place: params placed split over data too (FSDP, `fsdp_spec`) are all-gathered over
    data where this is called. Called inside each layer's (rematerialised) call, a layer
    stack gathers one layer's params at a time, and again in the backward when the layer
    is rematerialised, instead of holding every layer's gathered params for the step.

    Raises ValueError (naming ``owner``) without a mesh set."""
    from flax import nnx  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    if jax.sharding.get_abstract_mesh().empty:
        raise ValueError(f"{owner}: gathering the layers' params (FSDP) needs a mesh: call it under "
                         f"jax.set_mesh(mesh)")
    params = nnx.state(module, nnx.Param)
    specs = nnx.get_partition_spec(params)
    nnx.update(module, jax.tree.map(lambda x, spec: jax.lax.with_sharding_constraint(x, P() if spec is None else spec),
                                    params, specs))
