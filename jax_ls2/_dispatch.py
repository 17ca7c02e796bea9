"""Plumbing shared by every op: one `FusedKernel` is a pure-JAX reference and a CUDA
FFI call of the same math, composed as

    custom_jvp( custom_vmap( custom_partitioning( platform_dependent(cuda=..., default=reference) ) ) )

so that a single jitted function runs on any backend, batches under ``vmap``, and
partitions along batch-like dimensions under ``jit`` with sharded inputs without
gathering them. The ops put ``jax.custom_vjp`` outside, with the forward and the
backward each a `FusedKernel`; the ``custom_jvp`` layer only turns a second
derivative (differentiating the backward) into a clear NotImplementedError.

Operands and results are described by `Role`s:

* ``ROWS``: shape ``(*lead, *tail)``; the ``lead`` dims are batch-like (shardable,
  foldable under vmap), the last ``tail`` dims are processed whole. All ROWS
  operands and results of a kernel share the same ``lead`` dims.
* ``BCAST``: like ROWS but each lead dim is either the full size or 1 (broadcast).
* ``PARAM``: replicated (weights such as LayerNorm's gamma).
* ``SEED``: the uint32[3] dropout seed (replicated; under partitioning its offset
  word is advanced by the shard's position so shards draw different masks).
* ``OFFSETS``: uint32[ndim] of the first ROWS operand: the global coordinate of its first
  element along each dim (`jax_ls2._random`'s numbering; zeros for a whole array).
  Under partitioning a sharded dim's entry is advanced by the shard's index times its
  local extent. A seeded kernel with OFFSETS numbers its mask by global coordinates,
  so every lead dim may stay sharded (without it, only the first one may).
* ``SUM`` (results only): reduced over all lead dims (parameter gradients); summed
  across shards with ``psum``.
* ``BCAST_SUM`` (results only): shaped like a BCAST operand, reduced over the lead dims
  where it has size 1 (a bias gradient ``(1, ..., 1, hidden)`` with hidden sharded);
  summed across the shards of those dims.
* ``MAX`` (results only): a maximum over all lead dims (an FP8 amax); max-reduced
  across shards with ``pmax``.
* ``COLS`` (results only): shape ``(*tail, *lead)``, a ROWS array transposed (the
  transposed FP8 copies); sharded like the rows along its last dims.

Environment: ``JAX_LS2_IMPL=auto|cuda|reference``. Default auto: the kernels where the
platform is CUDA and the extension is built, the reference elsewhere, with a warning
(once) when a CUDA backend is present but the kernels are not. ``cuda`` demands the
kernels: an op raises when they cannot run here, on a CPU-only machine too.
``reference`` always runs the reference. The variable is read the first time an op is
traced with a given set of static options; set it before the first call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ls2 import _ffi

ROWS, BCAST, PARAM, SEED, SUM = "rows", "bcast", "param", "seed", "sum"
MAX, COLS = "max", "cols"
OFFSETS, BCAST_SUM = "offsets", "bcast_sum"


@dataclasses.dataclass(frozen=True)
class Role:
    kind: str
    tail: int = 0  # ROWS/BCAST: number of trailing dims that are not batch-like


def _impl_mode() -> str:
    mode = os.environ.get("JAX_LS2_IMPL", "auto").lower()
    if mode not in ("auto", "cuda", "reference"):
        raise ValueError(f"JAX_LS2_IMPL must be 'auto', 'cuda' or 'reference', got {mode!r}")
    return mode


class KernelsUnavailableWarning(RuntimeWarning):
    """An op runs its pure-JAX reference on a CUDA backend because its kernel is missing."""


_warned_causes: set = set()  # one warning per cause and process


def _warn_reference_on_cuda(target: str) -> None:
    if _ffi.kernels_built():
        cause = f"the built extension has no FFI target {target} (a stale build?)"
    else:
        cause = f"the extension jax_ls2._C is not available ({_ffi._load()[1]})"
    if cause in _warned_causes:
        return
    _warned_causes.add(cause)
    warnings.warn(f"{target}: running the pure-JAX reference on a CUDA backend because {cause}. "
                  f"{_ffi.REBUILD_HINT} Set JAX_LS2_IMPL=reference to choose the reference "
                  f"knowingly, or JAX_LS2_IMPL=cuda to make this an error.",
                  KernelsUnavailableWarning, stacklevel=2)


def select_impl(target: str, reference: Callable, cuda: Callable) -> Callable:
    """The one dispatch path of every op and of the optimizer.

    ``JAX_LS2_IMPL=reference``: ``reference``. Otherwise, when the FFI ``target`` is
    registered, a ``platform_dependent`` choice: ``cuda`` in programs compiled for
    CUDA, ``reference`` in programs compiled for another platform (a computation
    placed on a CPU device of a GPU process). ``JAX_LS2_IMPL=cuda`` raises a
    RuntimeError naming ``target`` unless its kernel runs here (built, and a CUDA
    backend present), so no GPU program ever runs the reference. Default (auto)
    without the target: ``reference``, with a `KernelsUnavailableWarning` (once) when
    JAX has a CUDA backend, where the kernels were expected.
    """
    mode = _impl_mode()
    if mode == "reference":
        return reference
    if mode == "cuda":
        _ffi.require_cuda(target)
        if not _ffi.has_target(target):
            raise RuntimeError(f"{target}: this FFI target is missing from the built extension. "
                               f"{_ffi.REBUILD_HINT}")
    elif not _ffi.has_target(target):
        if _ffi.cuda_backend():
            _warn_reference_on_cuda(target)
        return reference
    return lambda *a: jax.lax.platform_dependent(*a, cuda=_varying_as_inputs(cuda),
                                                 default=_varying_as_inputs(reference))


def _varying_as_inputs(fn: Callable) -> Callable:
    """``fn`` whose outputs vary over every manual mesh axis its inputs vary over (inside
    ``shard_map``), so the two branches of ``platform_dependent`` agree: an FFI result
    takes its input's varying axes, while a reference output computed only from
    replicated values (or a constant) varies over none."""
    def wrapped(*args):
        axes = frozenset().union(*(_varying_axes(a) for a in jax.tree.leaves(args)))
        outs = fn(*args)
        if not axes:
            return outs

        def vary(o):
            missing = tuple(sorted(axes - _varying_axes(o)))
            return jax.lax.pcast(o, missing, to="varying") if missing else o
        return jax.tree.map(vary, outs)
    return wrapped


def implementation() -> str:
    """``"cuda"`` or ``"reference"``: what the ops run on JAX's default backend, as
    chosen by ``JAX_LS2_IMPL`` (see the module docstring). Under
    ``JAX_LS2_IMPL=cuda`` it raises, as the ops do, when the kernels cannot run here."""
    mode = _impl_mode()
    if mode == "reference":
        return "reference"
    if mode == "cuda":
        _ffi.require_cuda("jax_ls2.implementation")
        return "cuda"
    on_cuda = jax.default_backend() == "gpu" and _ffi.cuda_backend()
    return "cuda" if on_cuda and _ffi.kernels_built() else "reference"


class FusedKernel:
    """A reference/CUDA pair with vmap and partitioning rules.

    The CUDA side is one ``jax.ffi.ffi_call`` to the target ``name``, built here from
    a description, so each target's name is written once.

    Args:
      name: FFI target name of the CUDA kernel (its presence in the extension gates use).
      reference: ``reference(*arrays, **static) -> tuple of arrays`` in pure JAX.
      operands, results: one `Role` per array of ``reference``.
      result_types: ``result_types(*arrays, **static) -> tuple`` of the FFI call's
        result types (build them with `result_type`): one per entry of ``results``,
        then any workspace buffers, which are dropped from what the kernel returns.
      vmap_method: the FFI call's ``vmap_method``.
      attrs: ``attrs(*arrays, **static) -> dict`` of the FFI call's static attributes
        (numpy scalars or bools); default none.
      ffi_operands: ``ffi_operands(*arrays, **static) -> tuple`` of the FFI call's
        operands, when they differ from the arrays (say, with extra index buffers the
        reference does not need); default the arrays themselves.
      input_output_aliases: passed to ``ffi_call``.
      per_example: ``per_example(static) -> bool``; when True under ``vmap``, the
        examples run one by one (``lax.map``) instead of folding the mapped axis into
        the rows, so that each example draws the dropout mask it would draw alone.
    """

    def __init__(self, name: str, reference: Callable, *, operands: Sequence[Role], results: Sequence[Role],
                 result_types: Callable, vmap_method: str, attrs: Callable | None = None,
                 ffi_operands: Callable | None = None, input_output_aliases: dict | None = None,
                 per_example: Callable[[dict], bool] | None = None):
        self.name = name
        self.reference = reference
        self.operands = tuple(operands)
        self.results = tuple(results)
        self.result_types = result_types
        self.vmap_method = vmap_method
        self.attrs = attrs
        self.ffi_operands = ffi_operands
        self.input_output_aliases = input_output_aliases
        self.per_example = per_example
        rows = [i for i, r in enumerate(self.operands) if r.kind == ROWS]
        if not rows:
            raise ValueError(f"{name}: a FusedKernel needs at least one ROWS operand")
        self._rows_index = rows[0]
        self._seed_index = next((i for i, r in enumerate(self.operands) if r.kind == SEED), None)
        self._offsets_index = next((i for i, r in enumerate(self.operands) if r.kind == OFFSETS), None)

    def cuda(self, *arrays, **static):
        """The FFI call of target ``name`` on ``arrays``; its workspace results dropped."""
        operands = self.ffi_operands(*arrays, **static) if self.ffi_operands else arrays
        attrs = self.attrs(*arrays, **static) if self.attrs else {}
        call = jax.ffi.ffi_call(self.name, tuple(self.result_types(*arrays, **static)),
                                vmap_method=self.vmap_method, input_output_aliases=self.input_output_aliases)
        return tuple(call(*operands, **attrs))[:len(self.results)]

    def __call__(self, *args, **static):
        return self._vmappable(tuple(sorted(static.items())))(*args)

    # ------------------------------------------------------------------ dispatch
    def _impl(self, static: dict):
        return select_impl(self.name, lambda *a: tuple(self.reference(*a, **static)),
                           lambda *a: tuple(self.cuda(*a, **static)))

    def _lead(self, shapes) -> int:
        return len(shapes[self._rows_index]) - self.operands[self._rows_index].tail

    # ------------------------------------------------------------------ partitioning
    @functools.lru_cache(maxsize=None)
    def _partitioned(self, static_items: tuple):
        static = dict(static_items)
        impl = self._impl(static)
        kernel = self

        @custom_partitioning
        def fn(*args):
            return impl(*args)

        # A seeded kernel numbers its elements by their flat index, which a shard knows
        # only when its rows are one contiguous block: only the first leading dim may stay
        # sharded (the others are gathered), so masks match the unsharded ones. A kernel
        # with an OFFSETS operand numbers by global coordinates: no such limit.
        seeded = kernel._seed_index is not None and kernel._offsets_index is None

        def lead_spec_of(arg_shapes):
            rows = arg_shapes[kernel._rows_index]
            lead = kernel._lead([a.shape for a in arg_shapes])
            spec = tuple(rows.sharding.spec) + (None,) * (len(rows.shape) - len(rows.sharding.spec))
            spec = spec[:lead]
            if seeded:
                spec = tuple(e if i == 0 else None for i, e in enumerate(spec))
            return spec, rows.shape[:lead]

        def spec_for(role, shape, lead_spec, lead_shape):
            if role.kind == ROWS:
                return P(*lead_spec, *([None] * role.tail))
            if role.kind in (BCAST, BCAST_SUM):
                dims = [lead_spec[i] if shape[i] == lead_shape[i] and shape[i] > 1 else None
                        for i in range(len(lead_spec))]
                return P(*dims, *([None] * role.tail))
            if role.kind == COLS:
                return P(*([None] * role.tail), *lead_spec)
            return P()

        def partition(mesh, arg_shapes, result_shape):
            lead_spec, lead_shape = lead_spec_of(arg_shapes)
            arg_shardings = tuple(
                NamedSharding(mesh, spec_for(r, a.shape, lead_spec, lead_shape))
                for r, a in zip(kernel.operands, arg_shapes))
            result_shapes = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
            result_shardings = tuple(
                NamedSharding(mesh, spec_for(r, s.shape, lead_spec, lead_shape))
                for r, s in zip(kernel.results, result_shapes))
            axes = []
            for entry in lead_spec:
                if entry is None:
                    continue
                axes += list(entry) if isinstance(entry, tuple) else [entry]

            def shard_index(entry):
                names = () if entry is None else (tuple(entry) if isinstance(entry, tuple) else (entry,))
                index = jnp.zeros((), jnp.uint32)
                for name in names:
                    index = index * mesh.shape[name] + jax.lax.axis_index(name).astype(jnp.uint32)
                return index, names

            def lower_fn(*args):
                args = list(args)
                if kernel._offsets_index is not None:
                    local = args[kernel._rows_index].shape
                    offsets = args[kernel._offsets_index]
                    for d, entry in enumerate(lead_spec):
                        index, names = shard_index(entry)
                        if names:
                            offsets = offsets.at[d].add(index * jnp.uint32(local[d]))
                    args[kernel._offsets_index] = offsets
                elif axes and kernel._seed_index is not None:
                    shard = 0
                    for name in axes:
                        shard = shard * mesh.shape[name] + jax.lax.axis_index(name)
                    local = math.prod(args[kernel._rows_index].shape)
                    seed = args[kernel._seed_index]
                    args[kernel._seed_index] = seed.at[2].add(
                        (shard * local).astype(jnp.uint32))
                outs = impl(*args)
                outs = tuple(jax.lax.psum(o, tuple(axes)) if r.kind == SUM and axes else
                             jax.lax.pmax(o, tuple(axes)) if r.kind == MAX and axes else
                             psum_bcast(o, lead_spec) if r.kind == BCAST_SUM else o
                             for r, o in zip(kernel.results, outs))
                return outs

            def psum_bcast(o, lead_spec):
                names = tuple(n for d, entry in enumerate(lead_spec) if o.shape[d] == 1
                              for n in shard_index(entry)[1])
                return jax.lax.psum(o, names) if names else o

            return mesh, lower_fn, result_shardings, arg_shardings

        def sharding_rule(mesh, arg_types, result_types):
            shapes = [a.shape for a in arg_types]
            lead = kernel._lead(shapes)
            lead_shape = shapes[kernel._rows_index][:lead]
            counter = iter(range(10_000))
            replicated = []

            def fresh():
                name = f"r{next(counter)}"
                replicated.append(name)
                return name

            shared = lambda i: i == 0 or not seeded  # see lead_spec_of

            def mapping(role, shape):
                if role.kind == ROWS:
                    return tuple(f"b{i}" if shared(i) else fresh() for i in range(lead)) + \
                        tuple(fresh() for _ in range(role.tail))
                if role.kind in (BCAST, BCAST_SUM):
                    dims = tuple(f"b{i}" if shared(i) and shape[i] == lead_shape[i] and shape[i] > 1 else fresh()
                                 for i in range(lead))
                    return dims + tuple(fresh() for _ in range(role.tail))
                if role.kind == COLS:
                    return tuple(fresh() for _ in range(role.tail)) + \
                        tuple(f"b{i}" if shared(i) else fresh() for i in range(lead))
                return tuple(fresh() for _ in shape)

            results = result_types if isinstance(result_types, (tuple, list)) else (result_types,)
            ops = tuple(mapping(r, a.shape) for r, a in zip(kernel.operands, arg_types))
            res = tuple(mapping(r, a.shape) for r, a in zip(kernel.results, results))
            return SdyShardingRule(ops, res, need_replication_factors=tuple(replicated))

        fn.def_partition(partition=partition, sharding_rule=sharding_rule)
        return fn

    # ------------------------------------------------------------------ batching
    @functools.lru_cache(maxsize=None)
    def _vmappable(self, static_items: tuple):
        partitioned = self._partitioned(static_items)
        kernel = self

        @jax.custom_batching.custom_vmap
        def fn(*args):
            return partitioned(*args)

        one_by_one = bool(kernel.per_example and kernel.per_example(dict(static_items)))

        @fn.def_vmap
        def rule(axis_size, in_batched, *args):
            foldable = not one_by_one and all(not b or r.kind in (ROWS, BCAST)
                                              for b, r in zip(in_batched, kernel.operands))
            foldable = foldable and all(r.kind not in (SUM, MAX, COLS, BCAST_SUM) for r in kernel.results)
            if foldable:
                folded = []
                for a, b, r in zip(args, in_batched, kernel.operands):
                    if r.kind == ROWS and not b:
                        a = jnp.broadcast_to(a, (axis_size,) + a.shape)
                    elif r.kind == BCAST and not b:
                        a = a[None]
                    folded.append(a)
                outs = fn(*folded)
            else:
                batched = [a for a, b in zip(args, in_batched) if b]

                def one(xs):
                    it = iter(xs)
                    return fn(*[next(it) if b else a for a, b in zip(args, in_batched)])

                outs = jax.lax.map(one, batched)
            return outs, tuple(True for _ in outs)

        # The ops differentiate once, through their custom_vjp; differentiating the
        # backward pass itself would reach custom_partitioning, which has no JVP rule.
        @jax.custom_jvp
        def once(*args):
            return fn(*args)

        @once.defjvp
        def no_second_derivative(primals, tangents):
            raise NotImplementedError(
                f"{kernel.name}: second derivatives (differentiating a gradient: jax.grad of jax.grad, "
                f"jax.hessian, jax.jvp of a gradient) are not supported by jax_ls2's fused ops; use the "
                f"plain-JAX formula where a second derivative is needed")

        return once


def _in_forward_mode(x) -> bool:
    """Whether `x` carries a nonzero forward-mode tangent, looking through ``vmap``'s
    tracers (``jax.jacfwd`` is a vmap of jvp; a vmap inside a jvp wraps the tangent's
    tracer). A reverse-mode tracer (jax.grad's) stops the search: differentiating a
    gradient is the second-derivative case, which the kernels refuse themselves."""
    while True:
        if isinstance(x, jax.interpreters.ad.JVPTracer):
            return not isinstance(x.tangent, jax.interpreters.ad.Zero)
        if isinstance(x, jax.core.Tracer) and hasattr(x, "batch_dim") and hasattr(x, "val"):  # vmap's tracer
            x = x.val
            continue
        return False


class fused_vjp(jax.custom_vjp):
    """``jax.custom_vjp`` for a fused op, which defines reverse mode only: forward-mode
    autodiff of it (``jax.jvp``, ``jax.jacfwd``, a JVP inside ``jit``) raises a
    NotImplementedError naming the op and the plain-JAX formula to use instead of JAX's
    "can't apply forward-mode autodiff (jvp) to a custom_vjp function".

    Use as ``@functools.partial(fused_vjp, nondiff_argnums=(3,), op="layer_norm",
    plain="...")``. The check sees the arguments as they reach the op; forward mode
    applied outside a ``jit``, ``scan`` or ``checkpoint`` that holds the op reaches it
    through a jaxpr and still gives JAX's message.
    """

    def __new__(cls, fun, nondiff_argnums=(), *, op: str, plain: str):
        return super().__new__(cls, fun, nondiff_argnums)

    def __init__(self, fun, nondiff_argnums=(), *, op: str, plain: str):
        super().__init__(fun, nondiff_argnums=nondiff_argnums)
        self.op = op
        self.plain = plain

    def __call__(self, *args, **kwargs):
        if any(_in_forward_mode(x) for x in jax.tree.leaves((args, kwargs))):
            raise NotImplementedError(
                f"{self.op}: forward-mode autodiff (jax.jvp, jax.jacfwd) is not supported: jax_ls2's fused ops "
                f"define reverse mode only (jax.grad, jax.vjp, jax.jacrev work); where a JVP is needed use the "
                f"plain-JAX formula, {self.plain}")
        return super().__call__(*args, **kwargs)


def forget_choices() -> None:
    """Forgets the implementation every kernel chose when first traced, so the next
    trace reads ``JAX_LS2_IMPL`` and the extension's state again (jitted functions
    already compiled keep theirs)."""
    FusedKernel._partitioned.cache_clear()
    FusedKernel._vmappable.cache_clear()


def result_type(like, shape=None, dtype=None):
    """A result type for ``ffi_call`` built from an input's type, so shardings and
    varying manual axes survive (``jax.ShapeDtypeStruct`` would drop the latter)."""
    t = jax.typeof(like)
    kwargs = {}
    if shape is not None:
        kwargs["shape"] = tuple(shape)
    if dtype is not None:
        kwargs["dtype"] = jnp.dtype(dtype)
    if shape is not None and tuple(shape) != tuple(t.shape):
        kwargs["sharding"] = jax.sharding.NamedSharding(t.sharding.mesh, P()) \
            if hasattr(t.sharding, "mesh") else t.sharding
    return t.update(**kwargs)


def _varying_axes(a) -> frozenset:
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", frozenset()))


def match_varying(*arrays):
    """Makes every array varying over the union of the arrays' manual mesh axes
    (inside ``shard_map``), so a weight used with a per-device activation enters the
    op as per-device too. Its gradient then comes back through ``pcast``'s transpose,
    which sums it over those axes, exactly as for a plain jnp formula. ``None``
    entries (absent optional arrays) pass through."""
    vmas = [frozenset() if a is None else _varying_axes(a) for a in arrays]
    union = frozenset().union(*vmas)
    if not union:
        return arrays
    out = []
    for a, v in zip(arrays, vmas):
        missing = tuple(sorted(union - v))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing and a is not None else a)
    return tuple(out)
