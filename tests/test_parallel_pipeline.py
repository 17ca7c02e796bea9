"""jax_ls2.parallel.pipeline (GPipe over the "pipe" axis, inside shard_map) on the 8 simulated
CPU devices: a stack of 8 layers split into 2, 4 and 8 stages (with data parallelism over
the remaining devices) gives the sequential stack's outputs and gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ls2 import parallel

LAYERS, MICRO, BATCH, WIDTH = 8, 3, 4, 16


def _layer(params, x):
    w, b = params
    return jnp.tanh(x @ w + b) + x


def _stack(params, x):
    """The stage: this device's layers, in order (all of them on one device)."""
    return jax.lax.scan(lambda h, p: (_layer(p, h), None), x, params)[0]


@pytest.fixture(scope="module")
def inputs():
    kw, kb, kx, kc = jax.random.split(jax.random.key(9), 4)
    params = (jax.random.normal(kw, (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
              0.1 * jax.random.normal(kb, (LAYERS, WIDTH)))
    x = jax.random.normal(kx, (MICRO, BATCH, WIDTH))
    cot = jax.random.normal(kc, (MICRO, BATCH, WIDTH))
    return params, x, cot


def _loss(apply, cot, params, x):
    return jnp.sum(apply(params, x) ** 2 * cot)


def _piped(mesh):
    fn = functools.partial(parallel.pipeline, _stack)
    return jax.shard_map(fn, mesh=mesh, in_specs=(P("pipe"), P(None, "data")), out_specs=P(None, "data"))


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_pipeline_matches_the_sequential_stack(inputs, stages):
    params, x, cot = inputs
    mesh = parallel.make_mesh(f"pipe={stages},data={8 // stages}")
    piped = _piped(mesh)
    sequential = jax.vmap(_stack, in_axes=(None, 0))
    np.testing.assert_allclose(jax.jit(piped)(params, x), sequential(params, x), rtol=2e-5, atol=2e-5)
    got = jax.jit(jax.grad(functools.partial(_loss, piped, cot), argnums=(0, 1)))(params, x)
    want = jax.grad(functools.partial(_loss, sequential, cot), argnums=(0, 1))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_stages_pass_activations_not_parameters(inputs):
    params, x, _ = inputs
    mesh = parallel.make_mesh("pipe=4,data=2")
    hlo = jax.jit(_piped(mesh)).lower(params, x).compile().as_text()
    permutes = [ln for ln in hlo.splitlines() if " collective-permute(" in ln or " collective-permute-start(" in ln]
    assert permutes and all(f"f32[{BATCH // 2},{WIDTH}]" in ln.split("collective-permute")[0] for ln in permutes)
    assert " all-gather(" not in hlo
    # the one all-reduce shares the finished micro-batches, not any parameter
    reduces = [ln.split(" all-reduce")[0] for ln in hlo.splitlines() if " all-reduce(" in ln]
    assert reduces == [r for r in reduces if f"f32[{MICRO},{BATCH // 2},{WIDTH}]" in r] and len(reduces) == 1


def test_bad_inputs(inputs):
    params, x, _ = inputs
    with pytest.raises(ValueError, match="pipeline: must run inside shard_map with 'pipe'"):
        parallel.pipeline(_stack, params, x)
    mesh = parallel.make_mesh("pipe=2,data=4")
    widen = lambda p, h: jnp.concatenate([h, h], axis=-1)
    bad = jax.shard_map(functools.partial(parallel.pipeline, widen), mesh=mesh, in_specs=(P("pipe"), P()),
                        out_specs=P())
    with pytest.raises(ValueError, match=r"pipeline: stage_fn must map a micro-batch float32\[4, 16\] to the same"):
        jax.jit(bad)(params, x)
