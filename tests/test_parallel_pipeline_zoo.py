"""Pipeline parallelism in the zoo (flax_models.pipeline) on the 8 simulated CPU devices: the
tiny GPT and BERT (4 heads, 2 layers) with their layers split into 2 pipe stages, 2
micro-batches, tensor parallelism inside each stage, trained 3 steps with the fused AdamW,
dropout on, against the same model on one device; the stage boundary in the compiled step;
the errors for sizes that do not fit.

As in test_parallel_zoo, every run compiles its step once, without LLVM's optimisations."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_models as fm
from flax_models.pipeline import pipeline_model, unpipelined_state
from jax_ls2 import _random, ops, parallel
from jax_ls2.nn import tensor_parallel_state
from jax_ls2.optim import adamw, shard_optimizer, update_nnx
from jax_ls2.parallel.mesh import shard_module

BATCH, LEN, STEPS, MICROBATCHES = 8, 16, 3, 2
DROPOUT = dict(hidden_dropout=0.1, attn_dropout=0.1, activation_dropout=0.1)
MESHES = ["pipe=2,data=2,tensor=2", "pipe=2,tensor=4"]
# the layers without tensor parallelism: data parallelism inside the stages only
DATA_ONLY = "pipe=2,data=4"
TOL = dict(rtol=2e-5, atol=2e-6)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _batch(family, cfg, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, cfg.vocab_size, (BATCH, LEN))
    labels = np.where(rng.random((BATCH, LEN)) < 0.3, -100, rng.integers(0, cfg.vocab_size, (BATCH, LEN)))
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "labels": jnp.asarray(labels, jnp.int32)}
    if family == "bert":
        batch["padding_mask"] = jnp.asarray(np.arange(LEN)[None, :] < rng.integers(LEN // 2, LEN + 1, (BATCH, 1)))
    return batch


def _step(graphdef, state, batch):
    model, opt = nnx.merge(graphdef, state)
    (loss, _), grads = nnx.value_and_grad(lambda m: m.loss(batch), has_aux=True)(model)
    update_nnx(opt, model, grads)
    return nnx.state((model, opt)), loss, grads


def _train(model, batches, mesh=None):
    """(losses, gradients, final params, compiled step's HLO) of `STEPS` fused-AdamW steps,
    compiled once (``eps`` as in test_parallel_zoo: it bounds how much Adam magnifies
    rounding-level gradients). On a mesh the optimizer updates each device's parameter
    shards where they lie (`shard_optimizer`), so nothing gathers the layer stack."""
    tx = adamw(1e-2, eps=1e-3, weight_decay=0.01)
    if mesh is not None:
        tx = shard_optimizer(tx, mesh, nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    state = jax.device_put(state, shardings)
    step = jax.jit(functools.partial(_step, graphdef), out_shardings=(shardings, None, None),
                   compiler_options=FAST_COMPILE)
    hlo = step.lower(state, batches[0]).compile().as_text()
    losses, grads = [], []
    for batch in batches:
        state, loss, g = step(state, batch)
        losses.append(float(loss))
        grads.append(g)
    assert step._cache_size() == 1
    model, _ = nnx.merge(graphdef, state)
    return losses, grads, nnx.state(model, nnx.Param), hlo


@functools.cache
def _one_device(family):
    cfg = fm.get_config(family, "tiny", **DROPOUT)
    model = nnx.jit(lambda: fm.build(cfg))()
    start = jax.tree.map(jnp.copy, nnx.state(model))
    batches = [_batch(family, cfg, s) for s in range(STEPS)]
    losses, grads, params, _ = _train(model, batches)
    return cfg, start, batches, (losses, grads, params)


@functools.cache
def _pipelined(family, spec):
    """The pipelined run of `family` ("gpt-remat": GPT with its layers rematerialised;
    "-sp": with Megatron sequence parallelism) on mesh `spec`, tensor-parallel where it
    has a tensor axis, from the one-device model's initial state; gradients and params
    in the unpipelined layout."""
    family, *variant = family.split("-")
    cfg, start, batches, _ = _one_device(family)
    mesh = parallel.make_mesh(spec)
    with jax.set_mesh(mesh):
        split = cfg.replace(tensor_axis="tensor" if "tensor=" in spec else None, remat="remat" in variant,
                            sequence_parallel="sp" in variant)
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: fm.build(split)))
        model = nnx.merge(graphdef, tensor_parallel_state(start, shapes))
        model = shard_module(pipeline_model(model, num_microbatches=MICROBATCHES), mesh)
        stacked = nnx.state(model, nnx.Param)
        sharded = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
        losses, grads, params, hlo = _train(model, sharded, mesh)
    shapes = nnx.state(nnx.eval_shape(lambda: fm.build(split)), nnx.Param)
    return (losses, [unpipelined_state(g, shapes) for g in grads], unpipelined_state(params, shapes), hlo,
            stacked)


def _close(got, want):
    got = tensor_parallel_state(got, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


@pytest.mark.parametrize("family,spec", [(f, m) for m in MESHES for f in ("gpt", "bert")] + [("gpt-remat", DATA_ONLY), ("bert-sp", MESHES[0])])
def test_pipelined_zoo_trains_like_one_device(family, spec):
    _, _, _, (want_losses, want_grads, want_params) = _one_device(family.split("-")[0])
    losses, grads, params, _, stacked = _pipelined(family, spec)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads, strict=True):
        _close(g, w)
    _close(params, want_params)
    # the stacked layers sit on their stages, tensor-parallel weights split inside them
    qkv = stacked["encoder" if family.startswith("bert") else "decoder"]["layers"]["attn"]["qkv"]["kernel"]
    assert qkv.get_value().sharding.spec == (P("pipe", None, None, "tensor") if "tensor=" in spec else P("pipe", None, None))


def test_stage_boundary_passes_activations_only():
    """The compiled GPT step on (pipe 2, data 2, tensor 2): the stages exchange
    micro-batch activations by collective-permute (each device's micro-batch rows, the
    whole length and width: (2, 16, 64)), and no collective carries a parameter stack
    (a leading layer dim of 2 layers or 1 stage's worth): the optimizer updates the
    stages' parameters where they lie."""
    *_, hlo, stacked = _pipelined("gpt", MESHES[0])
    permutes = [ln for ln in hlo.splitlines() if re.search(r" collective-permute(-start)?\(", ln)]
    boundary = [re.search(r"= (\w+\[[\d,]*\])", ln).group(1) for ln in permutes if "/ppermute" in ln]
    assert len(boundary) >= 2 and set(boundary) == {"f32[2,16,64]"}, boundary  # forward and backward
    stack_shapes = set()
    for leaf in jax.tree.leaves(stacked):
        trailing = leaf.sharding.shard_shape(leaf.shape)[1:]
        for layers in (1, 2):
            stack_shapes.add(",".join(map(str, (layers, *trailing))))
            stack_shapes.add(",".join(map(str, (layers, *leaf.shape[1:]))))
    moved = re.findall(r"= \w+\[([\d,]*)\]\S* (?:all-gather|collective-permute|all-to-all)(?:-start)?\(", hlo)
    assert not [m for m in moved if m in stack_shapes], moved


def test_microbatch_rows_draw_their_rows_of_the_whole_mask():
    """`batch_rows_from`: a block of rows draws those rows of the whole batch's mask, in
    the batch-first and the sequence-first numbering, nested blocks adding up."""
    x = jnp.ones((8, 6, 32))
    key = jax.random.key(3)
    whole = ops.dropout(x, rate=0.5, key=key)
    with _random.batch_rows_from(2):
        with _random.batch_rows_from(jnp.int32(2)):
            block = ops.dropout(x[4:6], rate=0.5, key=key)
    np.testing.assert_array_equal(block, whole[4:6])
    assert not np.array_equal(ops.dropout(x[4:6], rate=0.5, key=key), whole[4:6])
    res = jnp.zeros_like(x)
    whole = ops.bias_dropout_residual(x.swapaxes(0, 1), None, res.swapaxes(0, 1), rate=0.5, key=key, seq_first=True)
    with _random.batch_rows_from(6):
        block = ops.bias_dropout_residual(x[6:].swapaxes(0, 1), None, res[6:].swapaxes(0, 1), rate=0.5, key=key,
                                          seq_first=True)
    np.testing.assert_array_equal(block, whole[:, 6:])


def test_stages_see_their_microbatch_number():
    """``pipeline(indexed=True)``: each stage gets the number of the micro-batch it holds;
    two stages each adding it give micro-batch m plus 2 m."""
    mesh = parallel.make_mesh("pipe=2,data=4")
    x = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2)
    stage = functools.partial(parallel.pipeline, lambda p, h, i: h + i.astype(h.dtype) + 0 * p, indexed=True)
    piped = jax.shard_map(stage, mesh=mesh, in_specs=(P("pipe"), P(None, "data")), out_specs=P(None, "data"))
    got = jax.jit(piped)(jnp.zeros((2,)), x)
    np.testing.assert_array_equal(got, x + 2 * jnp.arange(3.0)[:, None, None])


def _pipelined_shapes(cfg, num_microbatches=MICROBATCHES):
    return nnx.eval_shape(lambda: pipeline_model(fm.build(cfg), num_microbatches=num_microbatches))


def _loss_shape(model, batch):
    graphdef, state = nnx.split(model)
    return jax.eval_shape(lambda s: nnx.merge(graphdef, s).loss(batch), state)


def test_sizes_that_do_not_fit():
    batch = {"input_ids": jnp.zeros((8, LEN), jnp.int32), "labels": jnp.zeros((8, LEN), jnp.int32)}
    with jax.set_mesh(parallel.make_mesh("pipe=2,data=4")):
        model = _pipelined_shapes(fm.get_config("gpt", "tiny", num_layers=3))
        with pytest.raises(ValueError, match=r"PipelinedEncoder: num_layers \(3\) must be a multiple of the size "
                                             r"\(2\) of mesh axis 'pipe'"):
            _loss_shape(model, batch)
        model = _pipelined_shapes(fm.get_config("gpt", "tiny"), num_microbatches=3)
        with pytest.raises(ValueError, match=r"PipelinedEncoder: x must be \(batch, len, hidden\) with the batch a "
                                             r"multiple of the 'data' size \(4\) times num_microbatches \(3\)"):
            _loss_shape(model, batch)
    model = _pipelined_shapes(fm.get_config("gpt", "tiny"))
    with pytest.raises(ValueError, match=r"PipelinedEncoder: needs a mesh with axis 'pipe'"):
        _loss_shape(model, batch)
    with pytest.raises(ValueError, match="pipeline_model: the model needs exactly one jax_ls2.nn.TransformerEncoder"):
        _pipelined_shapes(fm.get_config("transformer", "tiny"))
    with pytest.raises(ValueError, match="PipelinedEncoder: num_microbatches must be a positive int"):
        _pipelined_shapes(fm.get_config("gpt", "tiny"), num_microbatches=0)
