"""Training-state plumbing for the zoo: optimizer choice, the jitted train step and
orbax checkpoints of the full state (params, optimizer state, dropout RNG counters)."""
from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_models as fm
from flax_models.pipeline import pipeline_model
from jax_ls2 import parallel
from jax_ls2 import fp8
from jax_ls2.fp8 import FP8Meta
from jax_ls2.optim import FusedGradientTransformation, shard_optimizer
from jax_ls2.optim.sharded import state_layout
from jax_ls2.parallel.mesh import fsdp_spec


def lr_schedule(lr: float, steps: int, warmup: int):
    """Linear warm-up from 0 over ``warmup`` steps, then cosine decay to lr / 10 at ``steps``."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1),
                                              end_value=lr * 0.1)


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.01,
                   fused: bool = True):
    """AdamW with `lr_schedule`: ``jax_ls2.optim.adamw`` when ``fused``, else ``optax.adamw``.
    Returns (transformation, name). An option the chosen optimizer does not take raises
    there; there is no fallback from one optimizer to the other.

    Equal schedules (the same lr, warm-up and decay length) give the same transformation
    object, so two models built alike have equal graphdefs and share `make_step`'s step."""
    if fused:
        from jax_ls2.optim import adamw as factory  # noqa: PLC0415
        name = "jax_ls2.optim.adamw"
    else:
        factory, name = optax.adamw, "optax.adamw"
    # the schedule depends on steps only through max(steps, warmup + 1)
    return _adamw(factory, float(lr), max(steps, warmup + 1), warmup, float(weight_decay)), name


@functools.lru_cache(maxsize=32)
def _adamw(factory, lr: float, steps: int, warmup: int, weight_decay: float):
    return factory(learning_rate=lr_schedule(lr, steps, warmup), weight_decay=weight_decay)


def create(cfg, *, impl: str, dtype, seed: int, tx, params_from=None, mesh=None, zero: bool = False,
           fsdp: bool = False, microbatches: int = 1):
    """(graphdef, state) of (model, optimizer). ``params_from``: a model whose params are
    copied in (so twins start from identical weights).

    mesh: None (one device), or a ``jax.sharding.Mesh`` (``jax_ls2.parallel.make_mesh``)
    the state is placed on: params as their partition specs say (replicated without
    any), a fused optimizer through ``jax_ls2.optim.shard_optimizer`` (its state split as
    the params are, and over the data axis with ``zero``, ZeRO-1), everything else
    replicated. Works with several processes: each builds the same host values. With
    ``cfg.tensor_axis`` the model starts from the weights of the same model unsplit
    (so a run on any mesh starts where the one-device run does); build and step it
    under ``jax.set_mesh(mesh)``. A mesh whose pipe axis is above 1 runs the layer stack
    as GPipe stages with ``microbatches`` micro-batches (`flax_models.pipeline`; GPT and
    BERT on jax_ls2 layers), its layer parameters stacked (L, ...) and split over pipe.

    fsdp: every parameter is also split over the data axis (``parallel.mesh.fsdp_spec``:
    its largest dim the tensor axis leaves whole and the data size divides; leaves with
    none stay replicated over data), and the fused optimizer's state with it. The
    model's layer stacks gather their params layer by layer (``gather_layer_params``,
    again in the backward with ``cfg.remat``); `make_mesh_step` all-gathers the other
    such params (`gather_params`) at the start of the step. The gradients are reduced
    over data onto the param shards, and the optimizer updates the shards where they
    lie. Needs the fused optimizer and a mesh without a pipe axis."""
    split = mesh is not None and cfg.tensor_axis is not None
    whole = cfg.replace(tensor_axis=None, sequence_parallel=False) if split else cfg
    model = fm.build(whole, impl=impl, dtype=dtype, seed=seed, train=True)
    if params_from is not None:
        nnx.update(model, jax.tree.map(jnp.copy, nnx.state(params_from, nnx.Param)))
    if split:
        from jax_ls2.nn.layers import tensor_parallel_state  # noqa: PLC0415
        graphdef, like = nnx.split(nnx.eval_shape(lambda: fm.build(cfg, impl=impl, dtype=dtype, seed=seed,
                                                                   train=True)))
        model = nnx.merge(graphdef, tensor_parallel_state(nnx.state(model), like))
    if mesh is not None and mesh.shape.get(parallel.PIPE, 1) > 1:
        model = pipeline_model(model, num_microbatches=microbatches)
    if fsdp and zero:
        raise ValueError("create: fsdp splits the optimizer state with the params over data; drop zero (ZeRO-1)")
    if fsdp and not isinstance(tx, FusedGradientTransformation):
        raise ValueError("create: fsdp needs the fused optimizer (jax_ls2.optim), not "
                         f"{type(tx).__name__}")
    if mesh is None:
        if zero or fsdp:
            raise ValueError(f"create: {'fsdp' if fsdp else 'zero (ZeRO-1)'} needs a mesh")
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        graphdef, state = nnx.split((model, opt))
        # committed to the device, as a restored checkpoint's arrays are, so a fresh and a
        # resumed run call the compiled step with the same input signature
        return graphdef, jax.device_put(state, jax.devices()[0])
    if fsdp and mesh.shape.get(parallel.PIPE, 1) > 1:
        raise ValueError("create: fsdp is not supported with a pipe axis above 1; split the params over tensor "
                         "or the optimizer state with zero (ZeRO-1)")
    model_state = nnx.state(model)
    specs = nnx.get_partition_spec(model_state)
    if fsdp:
        specs = jax.tree.map(lambda x, s: s.replace(fsdp_spec(x.shape, s.get_value(), mesh))
                             if isinstance(x, nnx.Param) else s, model_state, specs,
                             is_leaf=lambda v: isinstance(v, nnx.Variable))
        for _, stack in _layer_stacks(model):
            stack.gather_layer_params = True
    nnx.update(model, place_on_mesh(model_state, mesh, specs))
    if isinstance(tx, FusedGradientTransformation):
        # the specs the params were placed with (the fsdp ones, not their annotations)
        specs = jax.tree.map(lambda x: x.sharding.spec, nnx.state(model, nnx.Param))
        tx = shard_optimizer(tx, mesh, specs, zero_axis=parallel.DATA if zero else None)
    elif zero:
        raise ValueError("create: zero (ZeRO-1) needs the fused optimizer (jax_ls2.optim), not "
                         f"{type(tx).__name__}")
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    return graphdef, place_on_mesh(state, mesh)


def _global_array(x, sharding):
    """`x` (a host-computable array, the same value in every process) as a global array
    with `sharding`; PRNG keys through their key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_global_array(jax.random.key_data(x), sharding),
                                        impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_on_mesh(state, mesh, specs=None):
    """`state` with every array on `mesh`, as `specs` (a tree of ``PartitionSpec`` like
    ``nnx.get_partition_spec(state)``) says, replicated where there is none. Without
    `specs`, arrays already on the mesh stay as they are and the others (host values,
    arrays on one local device) are replicated."""
    leaves, treedef = jax.tree.flatten(state)
    keep = specs is None
    if keep:
        specs = [P()] * len(leaves)
    else:
        specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P) or s is None)
        specs = [P() if s is None else s for s in specs]
    out = []
    for x, spec in zip(leaves, specs):
        target = NamedSharding(mesh, spec)
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            # a global array: resharded by XLA where it is laid out otherwise
            out.append(x if keep or sharding.is_equivalent_to(target, x.ndim) else jax.device_put(x, target))
        else:
            out.append(_global_array(x, target))
    return jax.tree.unflatten(treedef, out)


def shard_batch(batch: dict, mesh):
    """A host batch (a dict of numpy arrays, the same in every process) as global arrays
    split over the mesh's data axis along their first dim."""
    data_spec = NamedSharding(mesh, P(parallel.DATA))
    return {k: _global_array(v, data_spec) for k, v in batch.items()}


def to_host(x) -> np.ndarray:
    """`x` as a numpy array in this process, gathered from the other processes' devices
    where it is split across them."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@functools.lru_cache(maxsize=32)
def make_step(graphdef):
    """jit(state, batch) -> (state, loss, aux); state donated. With a jax_ls2 optimizer,
    aux["grads_finite"] is the optimizer's () bool report on the step's gradients. Equal
    graphdefs (same model, dtypes and optimizer object) get the same jitted function, so
    repeated runs in one process compile once. A model with FP8 layers (``cfg.fp8``) is
    differentiated with respect to its FP8 metas too, and ``jax_ls2.fp8.update_nnx`` splits
    them off and steps them by the recipe after the params (the meta updates never reach the optimizer)."""
    return jax.jit(_step_fn(graphdef), donate_argnums=0)


def make_mesh_step(graphdef, state):
    """`make_step` for a `state` placed on a mesh: the new state comes out with the
    shardings it went in with (else the partitioner lays some of it out its own way and
    the next step compiles again), loss and aux replicated. With params split over data
    (``create(..., fsdp=True)``) the step gathers them first (`gather_params`). Not
    cached: one per run."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, P())
    return jax.jit(_step_fn(graphdef, fsdp_gathered(graphdef, state)), donate_argnums=0,
                   out_shardings=(shardings, replicated, replicated))


def fsdp_gathered(graphdef, state):
    """NamedShardings of the params of (model, optimizer) `state` as their partition
    annotations say (split over tensor only), where some are placed otherwise (split
    over data too, ``create(..., fsdp=True)``); None where all are placed so."""
    model, _ = nnx.merge(graphdef, state)
    params = nnx.state(model, nnx.Param)
    placed = jax.tree.leaves(params)
    if not placed:
        return None
    mesh = placed[0].sharding.mesh
    gathered = jax.tree.map(lambda s: NamedSharding(mesh, P() if s is None else s), nnx.get_partition_spec(params))
    same = all(x.sharding.is_equivalent_to(g, x.ndim) for x, g in zip(placed, jax.tree.leaves(gathered)))
    return None if same else gathered


def _layer_stacks(model):
    """(path, stack) of the jax_ls2 layer stacks in `model`."""
    from jax_ls2.nn import TransformerDecoder, TransformerEncoder  # noqa: PLC0415
    return [(path, node) for path, node in nnx.iter_graph(model)
            if isinstance(node, (TransformerEncoder, TransformerDecoder))]


def gather_params(model, gathered) -> None:
    """Puts `model`'s params (split over data, FSDP) under jit as `gathered`
    (`fsdp_gathered`) says, in place: one all-gather per param, before the forward
    pass uses it; but the layers of stacks that gather their own
    (``gather_layer_params``, one layer at a time). Without this the partitioner may
    keep a weight split and gather the activations it produces instead (the whole
    logits, for the tied embedding split over the vocabulary). The gradients, taken
    with respect to the gathered params, are reduced onto the param shards by the
    optimizer's sharded step."""
    if gathered is None:
        return
    own = [tuple(path) + ("layers",) for path, stack in _layer_stacks(model) if stack.gather_layer_params]
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    wanted = dict(nnx.to_flat_state(gathered))
    here = [(path, jax.lax.with_sharding_constraint(x, wanted[path])) for path, x in params
            if not any(path[:len(p)] == p for p in own)]
    nnx.update(model, nnx.from_flat_state(here))


def _step_fn(graphdef, gathered=None):
    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)
        gather_params(model, gathered)
        recipe = model.cfg.fp8
        if recipe is None:
            (loss, aux), grads = nnx.value_and_grad(lambda m: m.loss(batch), has_aux=True)(model)
        else:
            wrt = nnx.DiffState(0, nnx.Any(nnx.Param, FP8Meta))
            (loss, aux), grads = nnx.value_and_grad(lambda m: m.loss(batch), has_aux=True, argnums=wrt)(model)
        # jax_ls2's fused optimizers write the params in their fused pass (and round
        # stochastically when asked); any other optax transformation goes through opt.update.
        finite = fp8.update_nnx(opt, model, grads, fp8=recipe)
        if finite is not None:
            aux = dict(aux, grads_finite=finite)
        return nnx.state((model, opt)), loss, aux
    return step


@functools.lru_cache(maxsize=32)
def make_eval_step(graphdef):
    """jit(state, batch) -> () float32 loss of the model in eval mode (no dropout); the
    state is read, not changed or donated. Cached like `make_step`."""
    def evaluate(state, batch):
        model, _ = nnx.merge(graphdef, state)
        model.eval()
        loss, _ = model.loss(batch)
        return loss.astype(jnp.float32)
    return jax.jit(evaluate)


# ---------------------------------------------------------------------------- checkpoints
class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into the given state: written for another
    model (other arrays), corrupted (checksum mismatch, a step its optimizer state does
    not count, or unreadable), or without the metadata this module writes."""


def _flat(state):
    leaves, treedef = jax.tree.flatten(state)
    is_key = [jnp.issubdtype(l.dtype, jax.dtypes.prng_key) for l in leaves]
    arrays = [jax.random.key_data(l) if k else l for l, k in zip(leaves, is_key)]
    return {f"{i:06d}": a for i, a in enumerate(arrays)}, treedef, is_key


def _layout(state) -> list:
    """[path, shape, dtype] of every leaf of ``state`` (keys as their key data)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    arrays, _, _ = _flat(state)
    return [[p, list(a.shape), str(a.dtype)] for p, a in zip(paths, arrays.values())]


def checksum(arrays) -> str:
    """SHA-256 (hex) over the dtype, shape and bytes of each array, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(to_host(a))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def metadata_checksum(meta: dict) -> str:
    """SHA-256 (hex) over the checkpoint metadata's fields, all but the two checksums
    (``sha256`` is checked against the arrays), as JSON with sorted keys."""
    fields = {k: v for k, v in meta.items() if k not in ("sha256", "meta_sha256")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _optimizer_steps(state) -> list:
    """[path, count] of the update counter (the ``step`` OptState) of every
    ``nnx.Optimizer`` in ``state``: the training step a checkpoint of it is saved at."""
    found = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    return [[jax.tree_util.keystr(path), int(to_host(v.get_value()))] for path, v in found
            if isinstance(v, nnx.OptState) and getattr(path[-1], "key", None) == "step"]


def _step_mismatch(state, step: int) -> str | None:
    """Why ``step`` is not the step of ``state``'s optimizer, or None when it is (or the
    state has no ``nnx.Optimizer``)."""
    for path, count in _optimizer_steps(state):
        if count != step:
            return f"the optimizer state {path} counts {count} updates, not {step}"
    return None


def _metadata_file(directory: str, step: int) -> str:
    """Where orbax keeps the metadata of the checkpoint of ``step`` (see `_manager`)."""
    return os.path.join(os.path.abspath(directory), str(step), "meta", "metadata")


def _manager(directory: str, **kw):
    import orbax.checkpoint as ocp  # noqa: PLC0415
    return ocp.CheckpointManager(
        os.path.abspath(directory), item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                    "meta": ocp.JsonCheckpointHandler()}, **kw)


def save_checkpoint(directory: str, step: int, state, model: str = "", optimizer_layout: str = "") -> None:
    """Save the full training state at ``step`` under ``directory`` (orbax, keeps 2), with
    metadata: the step, ``model`` (a description for error messages), each array's path,
    shape and dtype, the arrays' `checksum`, ``optimizer_layout`` (`optimizer_layout`
    of the state: "" for the standard layout) and the `metadata_checksum` of these.
    Arrays sharded over a mesh are written shard by shard (every process calls this).

    Raises ValueError when the state holds an ``nnx.Optimizer`` that has not made
    ``step`` updates (a checkpoint `restore_checkpoint` would refuse)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    why = _step_mismatch(state, int(step))
    if why:
        raise ValueError(f"save_checkpoint: step is {step}, but {why}")
    arrays, _, _ = _flat(state)
    meta = {"step": int(step), "model": model, "arrays": _layout(state), "sha256": checksum(arrays.values()),
            "optimizer_layout": optimizer_layout}
    meta["meta_sha256"] = metadata_checksum(meta)
    with _manager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mngr:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()


def latest_step(directory: str):
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as mngr:
        return mngr.latest_step()


def _other_model(where: str, meta: dict, expected: list) -> str | None:
    """Why the checkpoint's arrays are not ``expected``'s, or None when they match."""
    got = meta.get("arrays")
    if got is None or "sha256" not in meta:
        return f"{where} has no array list or checksum (not written by flax_models.training)"
    whose = f" (saved from {meta['model']})" if meta.get("model") else ""
    if len(got) != len(expected):
        return (f"{where} belongs to another model{whose}: it holds {len(got)} arrays, this "
                f"model's training state has {len(expected)}")
    for (gp, gs, gd), (ep, es, ed) in zip(got, expected):
        if (gs, gd) != (es, ed):
            return (f"{where} belongs to another model{whose}: array {gp} is {tuple(gs)} {gd} "
                    f"there, this model's {ep} is {tuple(es)} {ed}")
    return None


def optimizer_layout(graphdef, state) -> str:
    """How the optimizer state of (model, optimizer) is split over its mesh (see
    ``jax_ls2.optim.sharded.state_layout``): "" for the standard layout, which restores
    onto any mesh."""
    model, opt = nnx.merge(graphdef, state)
    return state_layout(opt.tx, nnx.state(model, opt.wrt))


def _layout_text(layout: str) -> str:
    return f"[{layout}]" if layout else "[the standard layout, any mesh]"


def restore_checkpoint(directory: str, template, step: int | None = None, optimizer_layout: str = ""):
    """(state shaped like ``template``, step) from ``directory`` (latest step by default),
    onto the template's shardings (another mesh than the one saved from is fine while
    the optimizer state's layout is the same).

    Raises FileNotFoundError without a checkpoint, and `CheckpointError` when the
    checkpoint's arrays are not the template's (another model), its optimizer state is
    split otherwise than ``optimizer_layout`` says, or it is corrupted: its metadata's
    or arrays' checksum differs from the one saved with them, or the step in its
    metadata is not the one it is stored under or not its optimizer state's count of
    updates."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    arrays, treedef, is_key = _flat(template)
    # restored onto the template's shardings, so a step compiled for the template runs as is
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            arrays)
    with _manager(directory) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"restore_checkpoint: no checkpoint under {directory}")
        where = f"restore_checkpoint: the checkpoint of step {step} under {directory}"
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 (any failure to read it is reported as such)
            raise CheckpointError(f"{where} has no readable metadata (not written by "
                                  f"flax_models.training, or corrupted): {e}") from e
        meta_file = _metadata_file(directory, step)
        if "meta_sha256" not in meta:
            raise CheckpointError(f"{where} has no metadata checksum in {meta_file} (not written by "
                                  "flax_models.training, or by a version before it had one)")
        found = metadata_checksum(meta)
        if found != meta["meta_sha256"]:
            raise CheckpointError(f"{where} is corrupted: the SHA-256 of its metadata {meta_file} is {found}, "
                                  f"the one saved in it {meta['meta_sha256']}")
        if meta.get("step") != step:
            raise CheckpointError(f"{where} is corrupted: its metadata {meta_file} gives step "
                                  f"{meta.get('step')!r}")
        # the layout first: another split changes the flat buffers' padded lengths
        saved = meta.get("optimizer_layout", "")
        if saved != optimizer_layout:
            raise CheckpointError(f"{where} holds optimizer state split as {_layout_text(saved)}, this run's is "
                                  f"split as {_layout_text(optimizer_layout)}; resume with the mesh (and "
                                  "ZeRO-1 setting) it was saved with")
        why = _other_model(where, meta, _layout(template))
        if why:
            raise CheckpointError(why)
        try:
            got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{where} is corrupted: its arrays cannot be read ({e})") from e
    leaves = [got["state"][k] for k in sorted(got["state"])]
    found = checksum(leaves)
    if found != meta["sha256"]:
        raise CheckpointError(f"{where} is corrupted: the arrays' SHA-256 is {found}, the one "
                              f"saved with them {meta['sha256']}")
    leaves = [jax.random.wrap_key_data(l) if k else l for l, k in zip(leaves, is_key)]
    state = jax.tree.unflatten(treedef, leaves)
    why = _step_mismatch(state, step)
    if why:
        raise CheckpointError(f"{where} is corrupted: its metadata {meta_file} gives step {step}, but {why}")
    return state, step
