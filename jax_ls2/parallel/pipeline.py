"""GPipe pipeline parallelism inside ``shard_map``: stages over a mesh axis, micro-batches
passed from stage to stage with ``ppermute``.

Device ``s`` of the pipeline axis (of ``S``) holds stage ``s``: for a stack of ``L``
layers whose parameters have a leading layer dim partitioned over the axis
(``P("pipe", ...)``), layers ``[s * L / S, (s + 1) * L / S)``, so any ``S`` dividing ``L``
works. With ``M`` micro-batches the schedule takes ``M + S - 1`` steps: at step ``t``
stage 0 reads micro-batch ``t``, every other stage the activation its predecessor sent
at step ``t - 1``; each stage runs, then passes its output on. The last stage's
output at step ``t`` is micro-batch ``t - S + 1``'s result. The idle slots (the bubble,
``(S - 1) / (M + S - 1)`` of the steps) run the stage on zeros whose results are dropped.
Gradients come from differentiating the schedule: the backward pass runs it in reverse,
with each ``ppermute`` transposed into the opposite shift.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jax_ls2.parallel.mesh import PIPE
from jax_ls2.parallel.tensor import bound_axis_size

_OP = "pipeline"


def pipeline(stage_fn: Callable, stage_params, microbatches: jax.Array, *, axis_name: str = PIPE,
             indexed: bool = False) -> jax.Array:
    """Runs ``stage_fn`` as a GPipe pipeline over ``axis_name``; call inside ``shard_map``.

    Args:
      stage_fn: ``stage_fn(stage_params, x) -> y`` for one micro-batch ``x``, with ``y`` of
        ``x``'s shape and dtype (every stage maps activations of one shape; embed before
        and project after the pipeline). It sees this device's ``stage_params``. In the
        bubble it runs on zeros (results dropped), so it must stay finite there, its
        gradient included.
      stage_params: this device's stage parameters (any pytree), e.g. its
        ``(L / S, ...)`` block of a layer stack partitioned ``P(axis_name, ...)``.
      microbatches: ``(M, ...)``: ``M`` micro-batches, the same on every device of
        ``axis_name`` (replicated over it; other mesh axes may split the trailing dims).
      axis_name: the pipeline axis (default ``"pipe"``).
      indexed: call ``stage_fn(stage_params, x, index)`` instead, ``index`` the int32
        number of the micro-batch ``x`` is (outside ``[0, M)`` in the bubble), for
        stages that read per-micro-batch inputs of their own or number dropout masks.

    Returns:
      ``(M, ...)``: the last stage's outputs, the same on every device of ``axis_name``
      (one ``psum`` over it at the end). Per step one ``ppermute`` of a micro-batch
      activation to the next stage; the backward pass sends gradients the other way.

    Raises:
      ValueError: outside ``shard_map`` over ``axis_name``, microbatches without a
        micro-batch dim, or a ``stage_fn`` that changes the activation's shape or dtype.
    """
    stages = bound_axis_size(axis_name)
    if stages is None:
        raise ValueError(f"{_OP}: must run inside shard_map with {axis_name!r} a manual mesh axis")
    if microbatches.ndim < 1 or microbatches.shape[0] < 1:
        raise ValueError(f"{_OP}: microbatches must be (num_microbatches >= 1, ...), got shape "
                         f"{tuple(microbatches.shape)}")
    x0 = jax.lax.pcast(jnp.zeros_like(microbatches[0]), axis_name, to="varying")  # as each stage sees it
    run = stage_fn if indexed else (lambda params, x, index: stage_fn(params, x))
    out = jax.eval_shape(run, stage_params, x0, jnp.zeros((), jnp.int32))
    if out.shape != x0.shape or out.dtype != x0.dtype:
        raise ValueError(f"{_OP}: stage_fn must map a micro-batch {x0.dtype}{list(x0.shape)} to the same shape "
                         f"and dtype, got {out.dtype}{list(out.shape)}")
    count = microbatches.shape[0]
    stage = jax.lax.axis_index(axis_name)
    forward = [(s, (s + 1) % stages) for s in range(stages)]

    def step(carry, t):
        received, outputs = carry
        fresh = jax.lax.dynamic_index_in_dim(microbatches, jnp.minimum(t, count - 1), keepdims=False)
        fresh = jnp.where(t < count, fresh, jnp.zeros_like(fresh))
        y = run(stage_params, jnp.where(stage == 0, fresh, received), (t - stage).astype(jnp.int32))
        done = t - (stages - 1)  # the micro-batch the last stage finishes now
        keep = (stage == stages - 1) & (done >= 0)
        slot = jnp.clip(done, 0, count - 1)
        current = jax.lax.dynamic_index_in_dim(outputs, slot, keepdims=False)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, jnp.where(keep, y, current), slot, 0)
        return (jax.lax.ppermute(y, axis_name, forward), outputs), None

    # the carry varies over the axis (each stage holds its own activation)
    init = (x0, jax.lax.pcast(jnp.zeros_like(microbatches), axis_name, to="varying"))
    (_, outputs), _ = jax.lax.scan(step, init, jnp.arange(count + stages - 1))
    return jax.lax.psum(outputs, axis_name)  # only the last stage's are nonzero
