"""Training-state plumbing for the zoo: optimizer choice, the jitted train step and
orbax checkpoints of the full state (params, optimizer state, dropout RNG counters)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flax_models as fm
from jax_ls2.optim import update_nnx


def lr_schedule(lr: float, steps: int, warmup: int):
    """Linear warm-up from 0 over ``warmup`` steps, then cosine decay to lr / 10 at ``steps``."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1),
                                              end_value=lr * 0.1)


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.01,
                   fused: bool = True):
    """AdamW with `lr_schedule`: ``jax_ls2.optim.adamw`` when ``fused``, else ``optax.adamw``.
    Returns (transformation, name). An option the chosen optimizer does not take raises
    there; there is no fallback from one optimizer to the other."""
    sched = lr_schedule(lr, steps, warmup)
    if fused:
        from jax_ls2.optim import adamw  # noqa: PLC0415
        return adamw(learning_rate=sched, weight_decay=weight_decay), "jax_ls2.optim.adamw"
    return optax.adamw(learning_rate=sched, weight_decay=weight_decay), "optax.adamw"


def create(cfg, *, impl: str, dtype, seed: int, tx, params_from=None):
    """(graphdef, state) of (model, optimizer). ``params_from``: a model whose params are
    copied in (so twins start from identical weights)."""
    model = fm.build(cfg, impl=impl, dtype=dtype, seed=seed, train=True)
    if params_from is not None:
        nnx.update(model, jax.tree.map(jnp.copy, nnx.state(params_from, nnx.Param)))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return nnx.split((model, opt))


def make_step(graphdef):
    """jit(state, batch) -> (state, loss, aux); state donated. With a jax_ls2 optimizer,
    aux["grads_finite"] is the optimizer's () bool report on the step's gradients."""
    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)
        (loss, aux), grads = nnx.value_and_grad(lambda m: m.loss(batch), has_aux=True)(model)
        # jax_ls2's fused optimizers write the params in their fused pass (and round
        # stochastically when asked); any other optax transformation goes through opt.update.
        finite = update_nnx(opt, model, grads)
        if finite is not None:
            aux = dict(aux, grads_finite=finite)
        return nnx.state((model, opt)), loss, aux
    return jax.jit(step, donate_argnums=0)


# ---------------------------------------------------------------------------- checkpoints
def _flat(state):
    leaves, treedef = jax.tree.flatten(state)
    is_key = [jnp.issubdtype(l.dtype, jax.dtypes.prng_key) for l in leaves]
    arrays = [jax.random.key_data(l) if k else l for l, k in zip(leaves, is_key)]
    return {f"{i:06d}": a for i, a in enumerate(arrays)}, treedef, is_key


def save_checkpoint(directory: str, step: int, state) -> None:
    """Save the full training state at ``step`` under ``directory`` (orbax, keeps 2)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    arrays, _, _ = _flat(state)
    with ocp.CheckpointManager(os.path.abspath(directory),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mngr:
        mngr.save(step, args=ocp.args.StandardSave({"state": arrays, "step": np.asarray(step, np.int64)}))
        mngr.wait_until_finished()


def latest_step(directory: str):
    import orbax.checkpoint as ocp  # noqa: PLC0415
    if not os.path.isdir(directory):
        return None
    with ocp.CheckpointManager(os.path.abspath(directory)) as mngr:
        return mngr.latest_step()


def restore_checkpoint(directory: str, template, step: int | None = None):
    """(state shaped like ``template``, step) from ``directory`` (latest step by default)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    arrays, treedef, is_key = _flat(template)
    abstract = {"state": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays),
                "step": jax.ShapeDtypeStruct((), np.int64)}
    with ocp.CheckpointManager(os.path.abspath(directory)) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"restore_checkpoint: no checkpoint under {directory}")
        got = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    leaves = [got["state"][k] for k in sorted(got["state"])]
    leaves = [jax.random.wrap_key_data(l) if k else l for l, k in zip(leaves, is_key)]
    return jax.tree.unflatten(treedef, leaves), int(got["step"])
