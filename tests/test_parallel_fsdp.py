"""FSDP-style training on the 8 simulated CPU devices (``training.create(..., fsdp=True)``):
every parameter and its optimizer state split over the data axis too. The tiny GPT and
BERT trained 3 steps with the fused AdamW, dropout on, equal the one-device run; the
per-device parameter and optimizer bytes fall as 1 / (data * tensor) but for the leaves
no free dim of which the data size divides; the compiled step gathers parameters one by
one (never a flat optimizer buffer or the whole parameter set) and hands the optimizer
gradients reduced onto the parameter shards."""
import collections
import contextlib
import functools
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_models as fm
from flax_models import training
from jax_ls2 import parallel
from jax_ls2.nn import tensor_parallel_state
from jax_ls2.optim import adamw, update_nnx
from jax_ls2.parallel.mesh import fsdp_spec
from flax_models import train
from tests.train_runs import printed_losses, run_main

BATCH, LEN, STEPS = 8, 16, 3
DROPOUT = dict(hidden_dropout=0.1, attn_dropout=0.1, activation_dropout=0.1)
TOL = dict(rtol=2e-5, atol=2e-6)
FAST_COMPILE = {"xla_backend_optimization_level": 0}
MESHES = ["data=8", "data=4,tensor=2"]


def _batch(family, cfg, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, cfg.vocab_size, (BATCH, LEN))
    labels = np.where(rng.random((BATCH, LEN)) < 0.3, -100, rng.integers(0, cfg.vocab_size, (BATCH, LEN)))
    batch = {"input_ids": ids.astype(np.int32), "labels": labels.astype(np.int32)}
    if family == "bert":
        batch["padding_mask"] = np.arange(LEN)[None, :] < rng.integers(LEN // 2, LEN + 1, (BATCH, 1))
    return batch


def _grad_step(graphdef, gathered, state, batch):
    """The training step of `training.make_mesh_step`, also returning the gradients."""
    model, opt = nnx.merge(graphdef, state)
    training.gather_params(model, gathered)
    (loss, _), grads = nnx.value_and_grad(lambda m: m.loss(batch), has_aux=True)(model)
    update_nnx(opt, model, grads)
    return nnx.state((model, opt)), loss, grads


def _train(cfg, family, mesh=None, fsdp=False):
    """(losses, grads per step, final params, graphdef, state, a function giving
    the compiled step's HLO text) of `STEPS`
    fused-AdamW steps from the same initial weights (seed 0), compiled once."""
    # eps as in test_parallel_zoo: Adam must not magnify gradients' last-bit rounding
    tx = adamw(1e-2, eps=1e-3, weight_decay=0.01)
    graphdef, state = training.create(cfg, impl="ls2", dtype=None, seed=0, tx=tx, mesh=mesh, fsdp=fsdp)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    gathered = training.fsdp_gathered(graphdef, state) if mesh is not None else None
    assert (gathered is not None) == fsdp
    step = jax.jit(functools.partial(_grad_step, graphdef, gathered), out_shardings=(shardings, None, None),
                   donate_argnums=0, compiler_options=FAST_COMPILE)
    batches = [_batch(family, cfg, s) for s in range(STEPS)]
    if mesh is not None:
        batches = [training.shard_batch(b, mesh) for b in batches]
    losses, grads = [], []
    for b in batches:
        state, loss, g = step(state, b)
        losses.append(float(loss))
        grads.append(g)
    model, _ = nnx.merge(graphdef, state)

    @functools.cache
    def program():
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            return step.lower(state, batches[-1]).compile().as_text()
    return losses, grads, nnx.state(model, nnx.Param), graphdef, state, program


@pytest.fixture(scope="module")
def reference():
    @functools.cache
    def run(family):
        cfg = fm.get_config(family, "tiny", **DROPOUT)
        return cfg, _train(cfg, family)
    return run


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


def _mesh(spec):
    return parallel.make_mesh(spec)


@pytest.fixture(scope="module")
def fsdp_runs(reference):
    @functools.cache
    def run(family, spec):
        cfg, _ = reference(family)
        mesh = _mesh(spec)
        split = cfg.replace(tensor_axis="tensor") if "tensor=" in spec else cfg
        with jax.set_mesh(mesh):
            return mesh, _train(split, family, mesh, fsdp=True)
    return run


@pytest.mark.parametrize("family,spec", [("gpt", s) for s in MESHES] + [("bert", "data=4,tensor=2")])
@pytest.mark.optimized_cpu_code
def test_fsdp_trains_like_one_device(reference, fsdp_runs, family, spec):
    _, (want_losses, want_grads, want_params, *_) = reference(family)
    mesh, (losses, grads, params, *_) = fsdp_runs(family, spec)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(tensor_parallel_state(g, w), w)
    _close(tensor_parallel_state(params, want_params), want_params)
    # the params stay split over data (and tensor) through the optimizer step
    data = dict(mesh.shape)["data"]
    for (path, x), (_, w) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                 jax.tree_util.tree_flatten_with_path(want_params)[0]):
        free = [n for n, e in zip(x.shape, x.sharding.spec + (None,) * x.ndim) if e in (None, "data")]
        assert ("data" in str(x.sharding.spec)) == any(n % data == 0 for n in free), (jax.tree_util.keystr(path),
                                                                                      x.sharding.spec)


def _per_device_bytes(x):
    return x.addressable_shards[0].data.nbytes


@pytest.mark.parametrize("spec", MESHES)
def test_fsdp_bytes_per_device(fsdp_runs, spec):
    """Per device, every param and the optimizer's moments take 1 / (data * tensor) of
    their bytes, but for the leaves one of the axes leaves whole: those the tensor axis
    does not split (LayerNorms, row-parallel biases, the position table) take 1 / data,
    and the QKV and FFN-in biases, whose free dims (3, or none) the data size does not
    divide, 1 / tensor."""
    mesh, (*_, graphdef, state, _) = fsdp_runs("gpt", spec)
    sizes = dict(mesh.shape)
    model, opt = nnx.merge(graphdef, state)
    params = nnx.state(model, nnx.Param)
    per_device = 0
    partly = set()
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        axes = [a for a in ("data", "tensor") if sizes[a] > 1 and a in str(x.sharding.spec)]
        assert _per_device_bytes(x) == x.nbytes // math.prod(sizes[a] for a in axes)
        per_device += _per_device_bytes(x)
        if len(axes) < sum(sizes[a] > 1 for a in ("data", "tensor")):
            partly.add(re.sub(r"\[\d+\]", "[i]", jax.tree_util.keystr(path)))
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if sizes["tensor"] == 1:
        assert per_device == total // sizes["data"] and not partly
    else:
        assert partly == {"['embed']['positions']['embedding'].value", "['decoder']['final_ln']['bias'].value",
                          "['decoder']['final_ln']['scale'].value"} | {
            f"['decoder']['layers'][i]{m}.value" for m in (
                "['attn']['out']['bias']", "['attn']['qkv']['bias']", "['attn_ln']['bias']", "['attn_ln']['scale']",
                "['fc1']['bias']", "['fc2']['bias']", "['ffn_ln']['bias']", "['ffn_ln']['scale']")}, partly
    for buf in (opt.opt_state.mu, opt.opt_state.nu):
        # this device's shards, one after another (each leaf padded a little at most)
        n = len(jax.tree.leaves(params))
        assert per_device <= _per_device_bytes(buf) <= per_device + 64 * n, (_per_device_bytes(buf), per_device)


def _all_gathers(hlo):
    """The result shapes (``f32[...]``) of the program's all-gathers; a tuple
    all-gather (XLA's combiner) is not matched, so the test's count sees it missing."""
    return re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)


def _elements(shape_text):
    return math.prod(int(d) for d in re.search(r"\[([\d,]*)\]", shape_text).group(1).split(",") if d)


@pytest.mark.parametrize("spec", MESHES)
def test_fsdp_step_gathers_params_one_by_one(fsdp_runs, spec):
    """The compiled step all-gathers each data-split param once, to its tensor-split
    shape (perhaps reshaped), and nothing else: no flat optimizer buffer, no activation.
    The gradients are reduced over data at param size and each device slices its shard
    (XLA's CPU partitioner emits all-reduce + dynamic-slice, combined into one tuple
    all-reduce, where a reduce-scatter would do; no reduce-scatter)."""
    mesh, (_, _, params, graphdef, state, program) = fsdp_runs("gpt", spec)
    hlo = program()
    _, opt = nnx.merge(graphdef, state)
    sizes = dict(mesh.shape)
    leaves = jax.tree.leaves(params)
    want = []
    for x in leaves:
        if "data" in str(x.sharding.spec):
            want.append(x.size // (sizes["tensor"] if "tensor" in str(x.sharding.spec) else 1))
    got = [_elements(g) for g in _all_gathers(hlo)]
    assert sorted(got) == sorted(want)
    flat = opt.opt_state.mu.size
    assert flat not in got and max(got) < sum(x.size for x in leaves) // 2
    assert " reduce-scatter(" not in hlo and " reduce-scatter-start(" not in hlo
    # the all-reduces: the gradients (param-sized), the tensor axis's activations, scalars
    largest = max(x.size for x in leaves)
    for line in hlo.splitlines():
        if re.search(r" all-reduce(?:-start)?\(", line):
            results = line.split("=", 1)[1].split("all-reduce", 1)[0]
            assert all(_elements(r) <= largest for r in re.findall(r"\w+\[[\d,]*\]", results)), line[:200]
    assert hlo.count(" dynamic-slice(") > 0


@pytest.mark.slow
@pytest.mark.optimized_cpu_code
def test_fsdp_with_remat_gathers_each_layer_again_in_the_backward(reference):
    """With remat the layer stack gathers a layer's params inside the layer's
    rematerialised call: the compiled step all-gathers each data-split layer weight
    matrix twice (forward, and again for the backward's recomputation), the layers'
    vectors once or twice (the backward re-gathers those it needs), the other params
    once, and trains to the one-device losses and gradients (remat changes no value)."""
    cfg, (want_losses, want_grads, *_) = reference("gpt")
    mesh = _mesh("data=8")
    with jax.set_mesh(mesh):
        losses, grads, params, _, _, program = _train(cfg.replace(remat=True), "gpt", mesh, fsdp=True)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(g, w)
    once, at_most = collections.Counter(), collections.Counter()
    for path, x in nnx.to_flat_state(params):
        value = x.get_value()
        if "data" in str(value.sharding.spec):
            once[value.size] += 1
            at_most[value.size] += 2 if "layers" in path else 1
    got = collections.Counter(_elements(g) for g in _all_gathers(program()))
    assert set(got) == set(once)
    for size in got:
        assert once[size] <= got[size] <= at_most[size], (size, got[size], once[size], at_most[size])
    # the matrices (no vector here has as many elements): every layer's twice
    matrices = [size for size in got if size > 4 * cfg.hidden_size]
    assert matrices and all(got[size] == at_most[size] for size in matrices), got


def test_fsdp_spec():
    mesh = _mesh("data=4,tensor=2")
    assert fsdp_spec((64, 3, 64), P(None, None, "tensor"), mesh) == P("data", None, "tensor")
    assert fsdp_spec((128, 64), P("tensor", None), mesh) == P("tensor", "data")
    assert fsdp_spec((3, 64), P(None, "tensor"), mesh) == P(None, "tensor")  # 3: indivisible, left whole
    assert fsdp_spec((), P(), mesh) == P()
    assert fsdp_spec((6, 64), P(), mesh) == P(None, "data")
    assert fsdp_spec((64, 64), P(), mesh) == P("data", None)  # the first of equal dims
    assert fsdp_spec((64,), P("data"), mesh) == P("data")
    assert fsdp_spec((64,), P(), _mesh("tensor=8")) == P()


def test_fsdp_bad_options():
    tx = adamw(1e-3)
    cfg = fm.get_config("gpt", "tiny")
    with pytest.raises(ValueError, match="create: fsdp needs a mesh"):
        training.create(cfg, impl="ls2", dtype=None, seed=0, tx=tx, fsdp=True)
    with pytest.raises(ValueError, match="create: fsdp needs the fused optimizer"):
        import optax  # noqa: PLC0415
        training.create(cfg, impl="ls2", dtype=None, seed=0, tx=optax.adamw(1e-3), mesh=_mesh("data=8"), fsdp=True)
    with pytest.raises(ValueError, match="drop zero"):
        training.create(cfg, impl="ls2", dtype=None, seed=0, tx=tx, mesh=_mesh("data=8"), fsdp=True, zero=True)
    with pytest.raises(ValueError, match="create: fsdp is not supported with a pipe axis above 1"):
        training.create(cfg, impl="ls2", dtype=None, seed=0, tx=tx, mesh=_mesh("data=4,pipe=2"), fsdp=True)


# ------------------------------------------------------------------ the training command
CLI_RUN = ["--model", "gpt", "--preset", "tiny", "--batch", "8", "--seq", "16", "--steps", "3",
           "--dropout", "0.1", "--eval-every", "0", "--log-every", "1"]


def test_train_command_with_fsdp_prints_the_same_losses():
    want, want_out = run_main(CLI_RUN)
    got, out = run_main(CLI_RUN + ["--mesh", "data=8", "--fsdp"])
    assert "jax_ls2.optim.adamw (state split over data=8)" in out
    assert len(printed_losses(out, 3)) == 3 and printed_losses(out, 3) == printed_losses(want_out, 3)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
    model, _ = nnx.merge(got["graphdef"], got["state"])
    table = nnx.state(model, nnx.Param)["embed"]["tokens"]["embedding"].get_value()
    assert table.sharding.spec == P("data", None)


@pytest.mark.parametrize("extra,message", [
    (["--fsdp"], "--fsdp needs --mesh"),
    (["--mesh", "data=8", "--fsdp", "--optimizer", "optax"], "--fsdp needs the fused optimizer"),
    (["--mesh", "data=8", "--fsdp", "--zero1"], "--fsdp needs the fused optimizer"),
    (["--mesh", "data=4,pipe=2", "--fsdp"], "--fsdp does not combine with --mesh pipe above 1"),
])
def test_train_command_fsdp_usage_errors(monkeypatch, capsys, extra, message):
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "gpt"] + extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_train_command_with_fsdp_resumes_bit_for_bit(tmp_path):
    """A checkpoint of the FSDP state (params and optimizer state split over data)
    saved at step 2 resumes on the same mesh to the uninterrupted run's step 3."""
    run = CLI_RUN + ["--mesh", "data=4,tensor=2", "--fsdp", "--ckpt-dir", str(tmp_path), "--save-every", "2"]
    whole, out = run_main(run)
    resumed, out_resumed = run_main(run + ["--resume"])
    assert "resumed from step 2" in out_resumed
    assert len(printed_losses(out_resumed, 3)) == 1
    assert printed_losses(out_resumed, 3) == printed_losses(out, 3)[-1:]
    assert resumed["losses"][-1] == whole["losses"][-1]
