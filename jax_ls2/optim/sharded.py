"""The fused optimizer on parameters sharded over a device mesh, and ZeRO-1.

``shard_optimizer(tx, mesh, param_specs)`` runs `tx`'s fused step inside
``jax.shard_map``: every device flattens its own shards of the params and gradients
into its own flat buffers and updates them where they lie, so nothing is gathered to
form the buffers (a tensor-sharded kernel stays split; replicated params are updated by
every device alike, as data parallelism needs). The state's flat buffers (moments,
master weights) are then per-device: the global (n,) buffer is the devices' local
buffers one after another, sharded over the mesh axes that shard any parameter.

``zero_axis="data"`` (ZeRO-1) also splits the state over that axis: each local leaf is
cut (zero-padded) into ``size(zero_axis)`` equal pieces, the device at index ``d`` of the
axis keeps the state of the pieces ``d`` of every leaf and updates only them, and the
new pieces are all-gathered over the axis into whole params. Per-device optimizer bytes
fall as ``1 / size(zero_axis)``; the step's collectives are that all-gather of the
updated params (the gradients arrive already reduced over the data axis) and a scalar
all-reduce of the finite flag.

The state's layout therefore depends on the mesh and the specs: a checkpoint of it
restores onto the same mesh shape; `gather_state` turns it into the standard layout of
``tx.init(params)`` (mesh-independent) and `scatter_state` back, for moving it to
another mesh.

Options that need all gradients (``max_grad_norm``, ``skip_nonfinite``,
``loss_scale="dynamic"``) take the global norm and finiteness from every device's
shards, each replicated shard counted once; clipping then scales the gradients by
``max_norm / norm`` before the fused pass (the unsharded kernel divides by the norm and
multiplies by max_norm, the same to fp32 rounding), and a skipped step keeps params and
state by a select. The state's ``finite`` flag is combined over all devices.

Limits: float32, float16 and bfloat16 params (the fused kernel's path) and grads as
trees (no ``FlatGrads``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_ls2.optim import _per_leaf
from jax_ls2.optim._layout import flatten, layout_of, unflatten
from jax_ls2.optim._transformation import (Config, FlatGrads, FusedGradientTransformation, FusedState,
                                           FusedUpdate, _decay_mask, _next_scale, init_state, step)

_OP = "shard_optimizer"


class Plan(NamedTuple):
    """Static description of the per-device buffers of one params tree on one mesh.

    specs:        per leaf, its PartitionSpec padded to the leaf's rank.
    local_shapes: per leaf, the shape of one device's shard.
    state_axes:   mesh axes the flat state buffers are split over, in mesh order.
    zero:         size of the ZeRO axis (1 without ZeRO).
    piece_sizes:  per leaf, the elements of one ZeRO piece (the whole shard without ZeRO).
    """
    specs: tuple
    local_shapes: tuple
    state_axes: tuple
    zero: int
    piece_sizes: tuple


def _spec_axes(spec) -> list:
    return [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]


def _is_spec(x) -> bool:
    return isinstance(x, P) or x is None


def _leaf_specs(param_specs, leaves: list, treedef) -> list:
    """One PartitionSpec per params leaf from `param_specs`: None (every leaf
    replicated), one PartitionSpec for all, a callable ``params -> specs``, or a tree
    whose PartitionSpec leaves line up with the params leaves (``nnx.get_partition_spec``)."""
    if callable(param_specs) and not isinstance(param_specs, P):
        param_specs = param_specs(jax.tree.unflatten(treedef, leaves))
    if param_specs is None or isinstance(param_specs, P):
        return [param_specs or P()] * len(leaves)
    specs = jax.tree.leaves(param_specs, is_leaf=_is_spec)
    if len(specs) != len(leaves):
        raise ValueError(f"{_OP}: param_specs must give one PartitionSpec per params leaf ({len(leaves)}), got "
                         f"{len(specs)}")
    return [P() if s is None else s for s in specs]


def make_plan(mesh: Mesh, param_specs, zero_axis: Optional[str], leaves: list, treedef, paths=None) -> Plan:
    """The `Plan` of `leaves` (params leaves, global shapes; `paths` their key paths for
    messages) on `mesh`; raises on specs naming unknown axes, dims their axes do not
    divide, and a ZeRO axis that shards params."""
    sizes = dict(mesh.shape)
    specs, local_shapes, used = [], [], set()
    for i, (x, spec) in enumerate(zip(leaves, _leaf_specs(param_specs, leaves, treedef))):
        name = f"params leaf {i}" + (f" ({paths[i]})" if paths else "")
        if not isinstance(spec, P):
            raise TypeError(f"{_OP}: the PartitionSpec of {name} must be a PartitionSpec, got {type(spec).__name__}")
        shape = tuple(x.shape)
        if len(spec) > len(shape):
            raise ValueError(f"{_OP}: {name} of shape {shape} has the longer PartitionSpec {spec}")
        spec = P(*spec, *([None] * (len(shape) - len(spec))))
        local = []
        for dim, (n, entry) in enumerate(zip(shape, spec)):
            names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
            for a in names:
                if a not in sizes:
                    raise ValueError(f"{_OP}: {name} is split over {a!r}, which is not an axis of the mesh "
                                     f"{tuple(mesh.axis_names)}")
            k = math.prod(sizes[a] for a in names)
            if n % k:
                raise ValueError(f"{_OP}: {name} has {n} elements along dim {dim}, which its mesh axes "
                                 f"{names} (sizes {[sizes[a] for a in names]}) do not divide into equal shards; "
                                 "change the mesh or the leaf's PartitionSpec")
            local.append(n // k)
            used.update(names)
        specs.append(spec)
        local_shapes.append(tuple(local))
    zero = 1
    if zero_axis is not None:
        if zero_axis not in sizes:
            raise ValueError(f"{_OP}: zero_axis {zero_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
        if zero_axis in used:
            raise ValueError(f"{_OP}: zero_axis {zero_axis!r} already splits params (its state is split with "
                             "them); give an axis over which the params are replicated")
        zero = sizes[zero_axis]
        used.add(zero_axis)
    state_axes = tuple(a for a in mesh.axis_names if a in used and sizes[a] > 1)
    pieces = tuple(-(-math.prod(s) // zero) for s in local_shapes)
    return Plan(tuple(specs), tuple(local_shapes), state_axes, zero, pieces)


def _pieces(plan: Plan, zero_axis, local: list) -> list:
    """This device's ZeRO pieces of its local leaves: (piece,) vectors, the leaf
    flattened, zero-padded to ``zero * piece`` and cut at the axis index. Without ZeRO
    the leaves themselves."""
    if plan.zero == 1:
        return list(local)
    d = jax.lax.axis_index(zero_axis)
    out = []
    for x, n in zip(local, plan.piece_sizes):
        flat = jnp.ravel(x)
        flat = jnp.pad(flat, (0, plan.zero * n - flat.size))
        out.append(jax.lax.dynamic_slice_in_dim(flat, d * n, n))
    return out


def _whole(plan: Plan, zero_axis, pieces: list) -> list:
    """The local leaves from every device's pieces (all-gathered over the ZeRO axis)."""
    if plan.zero == 1:
        return list(pieces)
    out = []
    for x, shape in zip(pieces, plan.local_shapes):
        flat = jax.lax.all_gather(x, zero_axis, tiled=True)
        out.append(flat[:math.prod(shape)].reshape(shape))
    return out


def _all_true(flag, mesh: Mesh):
    """`flag` (() bool, per device) and-ed over every device of the mesh."""
    axes = tuple(a for a, n in mesh.shape.items() if n > 1)
    return jax.lax.pmin(flag.astype(jnp.int32), axes) > 0 if axes else flag


def _global_stats(plan: Plan, zero_axis, mesh: Mesh, grads: list, inv_scale):
    """(norm, finite) of the unscaled gradients over every device's shards (or ZeRO
    pieces): each device sums the squares of its shards, a shard replicated over an
    axis is counted only at index 0 of that axis, and the sums are added over the mesh."""
    sizes = dict(mesh.shape)
    axes = tuple(a for a, n in sizes.items() if n > 1)
    total, finite = jnp.float32(0), jnp.bool_(True)
    for g, spec in zip(grads, plan.specs):
        split = set(_spec_axes(spec)) | ({zero_axis} if plan.zero > 1 else set())
        s = g.astype(jnp.float32) * inv_scale
        part = jnp.sum(s * s)
        for a in axes:
            if a not in split:
                part = jnp.where(jax.lax.axis_index(a) == 0, part, 0)
        total = total + part
        finite = finite & jnp.all(jnp.isfinite(g))
    if axes:
        total = jax.lax.psum(total, axes)
    return jnp.sqrt(total), _all_true(finite, mesh)


class ShardedUpdate(FusedUpdate):
    """`FusedUpdate` whose step runs inside ``shard_map`` over the mesh (see the module)."""

    def __init__(self, cfg: Config, mesh: Mesh, param_specs, zero_axis: Optional[str]):
        super().__init__(cfg)
        self.mesh, self.param_specs, self.zero_axis = mesh, param_specs, zero_axis

    def plan(self, params) -> tuple:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
        leaves = _per_leaf.as_arrays([x for _, x in with_paths])
        if _per_leaf.takes_per_leaf(leaves):
            raise TypeError(f"{self.config.name}: sharded params must be float32, float16 or bfloat16 (the fused "
                            "kernel's path); float64, complex, integer and bool leaves are not supported")
        return leaves, treedef, make_plan(self.mesh, self.param_specs, self.zero_axis, leaves, treedef, paths)

    def state_specs(self, plan: Plan, state_like: FusedState) -> FusedState:
        flat = P(plan.state_axes) if plan.state_axes else P()
        return FusedState(*(None if getattr(state_like, f) is None else (flat if f in ("mu", "nu", "master") else P())
                            for f in FusedState._fields))

    def state_shardings(self, params) -> FusedState:
        """NamedShardings of the state `init` makes for `params` (for ``jit`` out_shardings
        or a checkpoint's restore target)."""
        _, _, plan = self.plan(params)
        specs = self.state_specs(plan, self._state_like())
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda s: isinstance(s, P))

    def _state_like(self) -> FusedState:
        o, cfg = self.config.options, self.config
        return FusedState(0, 0 if cfg.has_mu else None, 0 if cfg.has_nu else None,
                          0 if o.master_weights else None, 0, 0, 0, 0, 0)

    def init(self, params) -> FusedState:
        leaves, treedef, plan = self.plan(params)
        cfg, zero_axis = self.config, self.zero_axis

        def body(*local):
            return init_state(cfg, _pieces(plan, zero_axis, local))

        out_specs = self.state_specs(plan, self._state_like())
        run = jax.shard_map(body, mesh=self.mesh, in_specs=plan.specs, out_specs=out_specs)
        return jax.jit(run)(*leaves)

    def _step(self, grads, state, params, *, apply: bool):
        cfg = self.config
        if isinstance(grads, FlatGrads):
            raise TypeError(f"{cfg.name}: a sharded optimizer takes grads as a tree like params, not FlatGrads")
        if not isinstance(state, FusedState):
            raise TypeError(f"{cfg.name}: state must be a FusedState from this optimizer's init, got "
                            f"{type(state).__name__}")
        if params is None:
            raise ValueError(f"{cfg.name}: a sharded optimizer needs params (they give the shards' shapes)")
        leaves, treedef, plan = self.plan(params)
        g_leaves, g_def = jax.tree.flatten(grads)
        if g_def != treedef:
            raise ValueError(f"{cfg.name}: grads must have the structure of params; got {g_def}, expected {treedef}")
        n = len(leaves)
        zero_axis, mesh = self.zero_axis, self.mesh
        state_specs = self.state_specs(plan, state)

        o = cfg.options
        global_stats = o.max_grad_norm is not None or o.checks_finite
        # the per-device step runs without the options that need all gradients; they
        # act here on the global norm and finiteness
        local_opts = dataclasses.replace(o, max_grad_norm=None, skip_nonfinite=False, loss_scale=None)

        def body(local_g, local_p, st):
            # the decay mask is read from the params as the caller shaped them, then
            # given to the step as an explicit per-piece tree
            decay = _decay_mask(cfg, jax.tree.unflatten(treedef, local_p), n)
            local_cfg = cfg._replace(options=local_opts)
            if cfg.weight_decay is not None:
                local_cfg = local_cfg._replace(mask=jax.tree.unflatten(treedef, [bool(d) for d in decay]))
            g = _pieces(plan, zero_axis, local_g)
            p = _pieces(plan, zero_axis, local_p)
            if global_stats:
                norm, finite = _global_stats(plan, zero_axis, mesh, g, 1 / st.loss_scale)
                if o.max_grad_norm is not None:
                    factor = jnp.where(norm < o.max_grad_norm, jnp.float32(1), o.max_grad_norm / norm)
                    g = [x.astype(jnp.float32) * factor for x in g]
            outs, new = step(local_cfg, jax.tree.unflatten(treedef, g), st, jax.tree.unflatten(treedef, p),
                             apply=apply)
            outs = jax.tree.leaves(outs)
            if not global_stats:
                return _whole(plan, zero_axis, outs), new._replace(finite=_all_true(new.finite, mesh))
            if o.checks_finite:
                outs = [jnp.where(finite, x, old if apply else jnp.zeros((), x.dtype)) for x, old in zip(outs, p)]
                keep = lambda old, x: None if x is None else jnp.where(finite, x, old)
                new = new._replace(mu=keep(st.mu, new.mu), nu=keep(st.nu, new.nu), master=keep(st.master, new.master),
                                   count=jnp.where(finite, new.count, st.count))
            scale, good = _next_scale(o, st, finite)
            # new.finite also holds the step's check of a traced learning rate / weight decay
            new = new._replace(grad_norm=norm, finite=finite & new.finite, loss_scale=scale, good_steps=good)
            return _whole(plan, zero_axis, outs), new

        # One pass over all of a device's leaves makes every output vary as its most
        # split input does; a replicated leaf's new value is still the same on every
        # device (same grads, same state, same math), so the replication is asserted.
        run = jax.shard_map(body, mesh=mesh, in_specs=(list(plan.specs), list(plan.specs), state_specs),
                            out_specs=(list(plan.specs), state_specs), check_vma=False)
        outs, new_state = run(list(g_leaves), list(leaves), state)
        return jax.tree.unflatten(treedef, outs), new_state

    def __call__(self, updates, state, params=None, **extra_args):
        del extra_args
        return self._step(updates, state, params, apply=False)

    def apply(self, grads, state, params):
        return self._step(grads, state, params, apply=True)


def shard_optimizer(tx: FusedGradientTransformation, mesh: Mesh, param_specs: Any = None, *,
                    zero_axis: Optional[str] = None) -> FusedGradientTransformation:
    """`tx` (from ``jax_ls2.optim.adamw/adam/sgd``) updating params sharded over `mesh`
    where they lie, optionally with its state split over `zero_axis` (ZeRO-1).

    Args:
      tx: a fused transformation, not already sharded.
      mesh: the ``jax.sharding.Mesh`` (``AxisType.Auto`` axes, as ``jax_ls2.parallel.make_mesh``
        builds) the params and gradients are sharded over.
      param_specs: how params are split: None (replicated, plain data parallelism), one
        ``PartitionSpec`` for every leaf, a tree of them lining up with the params
        leaves (``nnx.get_partition_spec(params)``), or a callable ``params -> specs``.
        Each dim must be divisible by the product of its axes' sizes.
      zero_axis: None, or a mesh axis over which the params are replicated (``"data"``)
        to split the optimizer's flat state over.

    Returns:
      A `FusedGradientTransformation`; ``init(params)`` returns a `FusedState` whose
      (n,) flat buffers are sharded over the mesh (see the module docstring), and
      ``update``/``apply`` take grads and params (required) sharded as `param_specs` say.

    Raises:
      TypeError: `tx` not from ``jax_ls2.optim`` or already sharded, or `mesh` not a Mesh;
      ValueError: a `zero_axis` not in the mesh. The specs are checked against params at
      ``init`` and at each step.
    """
    update = getattr(tx, "update", None)
    if not isinstance(tx, FusedGradientTransformation) or type(update) is not FusedUpdate:
        raise TypeError(f"{_OP}: tx must be a transformation made by jax_ls2.optim (adamw, adam or sgd) and not "
                        f"already sharded, got {type(tx).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{_OP}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    cfg = update.config
    if zero_axis is not None and zero_axis not in mesh.axis_names:
        raise ValueError(f"{_OP}: zero_axis {zero_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    sharded = ShardedUpdate(cfg, mesh, param_specs, zero_axis)
    return FusedGradientTransformation(sharded.init, sharded)


def _sharded_update(fn: str, tx) -> ShardedUpdate:
    update = getattr(tx, "update", None)
    if not isinstance(update, ShardedUpdate):
        raise TypeError(f"{fn}: tx must come from shard_optimizer, got {type(tx).__name__}")
    return update


def gather_state(tx, state: FusedState, params) -> FusedState:
    """`state` of the sharded `tx` in the standard layout of the unsharded optimizer's
    state for `params` (flat buffers over whole leaves, replicated): mesh-independent,
    for saving or for `scatter_state` onto another mesh. Gathers every buffer."""
    update = _sharded_update("gather_state", tx)
    leaves, treedef, plan = update.plan(params)
    return _convert(update, plan, leaves, state, to_standard=True)


def scatter_state(tx, state: FusedState, params) -> FusedState:
    """The inverse of `gather_state`: a standard-layout state (``tx.init`` of the
    unsharded optimizer, or `gather_state`'s result) in the sharded `tx`'s layout for
    `params` on its mesh."""
    update = _sharded_update("scatter_state", tx)
    leaves, treedef, plan = update.plan(params)
    return _convert(update, plan, leaves, state, to_standard=False)


def _convert(update: ShardedUpdate, plan: Plan, leaves, state: FusedState, *, to_standard: bool) -> FusedState:
    mesh, zero_axis = update.mesh, update.zero_axis
    std = layout_of(leaves)
    local_pieces = [jax.ShapeDtypeStruct((n,), x.dtype) if plan.zero > 1 else jax.ShapeDtypeStruct(s, x.dtype)
                    for x, n, s in zip(leaves, plan.piece_sizes, plan.local_shapes)]
    local = layout_of(local_pieces)
    specs = update.state_specs(plan, state)
    buffers = ("mu", "nu", "master")

    def to_std(*bufs):
        # per device: its flat buffers -> its pieces -> whole local leaves; then the
        # leaves are put back into global arrays by shard_map's out_specs
        out = []
        for buf in bufs:
            parts = unflatten(buf, local)
            out.append(_whole(plan, zero_axis, [p.reshape(-1) if plan.zero > 1 else p for p in parts]))
        return out

    def from_std(*trees):
        out = []
        for tree in trees:
            out.append(flatten(_pieces(plan, zero_axis, tree), local, tree[0].dtype if tree else jnp.float32))
        return out

    present = [f for f in buffers if getattr(state, f) is not None]
    leaf_specs = list(plan.specs)
    if to_standard:
        run = jax.shard_map(to_std, mesh=mesh, in_specs=tuple(getattr(specs, f) for f in present),
                            out_specs=[leaf_specs] * len(present), check_vma=False)
        trees = jax.jit(run)(*(getattr(state, f) for f in present))
        new = {f: flatten(t, std, getattr(state, f).dtype) for f, t in zip(present, trees)}
        replicated = NamedSharding(mesh, P())
        new = {f: jax.device_put(b, replicated) for f, b in new.items()}
    else:
        trees = [unflatten(getattr(state, f), std) for f in present]
        run = jax.shard_map(from_std, mesh=mesh, in_specs=tuple([leaf_specs] * len(present)),
                            out_specs=[getattr(specs, f) for f in present], check_vma=False)
        new = dict(zip(present, jax.jit(run)(*trees)))
    return state._replace(**new)


def state_layout(tx, params) -> str:
    """How `tx`'s flat state for `params` is split: ``""`` for the standard layout (an
    unsharded optimizer's, or a sharded one's whose params are all replicated, without
    ZeRO), else the axes with their sizes, e.g. ``"data=2 (ZeRO-1), tensor=4"``. States
    of equal layouts are interchangeable; others go through `gather_state` /
    `scatter_state`."""
    update = getattr(tx, "update", None)
    if not isinstance(update, ShardedUpdate):
        return ""
    _, _, plan = update.plan(params)
    sizes = dict(update.mesh.shape)
    return ", ".join(f"{a}={sizes[a]}" + (" (ZeRO-1)" if a == update.zero_axis else "") for a in plan.state_axes)
