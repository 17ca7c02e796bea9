"""Megatron tensor and sequence parallelism in the jax_ls2 layers and the zoo, on the 8
simulated CPU devices: the tiny GPT and BERT (4 heads, 2 layers) trained 3 steps with the
fused AdamW, dropout on, against the same model on one device; the collectives and the
per-device parameter bytes of a tensor-parallel encoder layer; the errors for sizes the
tensor axis does not divide.

Compiling dominates here, so each model's one-device run is made once (a module-scoped
fixture) and every run compiles its train step once: the step's state comes out with the
shardings it went in with, so the second step does not compile again. The programs are
compiled without LLVM's optimisations (`FAST_COMPILE`), the same for the one-device
reference and the mesh runs."""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_models as fm
from jax_ls2 import nn, parallel
from jax_ls2.nn import tensor_parallel_state
from jax_ls2.optim import adamw, update_nnx
from jax_ls2.parallel.mesh import shard_module

BATCH, LEN, STEPS = 8, 16, 3
DROPOUT = dict(hidden_dropout=0.1, attn_dropout=0.1, activation_dropout=0.1)
# (mesh spec, Megatron sequence parallelism)
MESHES = [("data=8", False), ("data=2,tensor=4", False), ("data=2,tensor=2", True)]
TOL = dict(rtol=2e-5, atol=2e-6)
# Halves the CPU compile time of these small programs; numerics are XLA's either way.
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


def _train(model, batches):
    """(losses, gradients, final params) of `STEPS` fused-AdamW steps, compiled once.
    ``eps`` bounds how much Adam magnifies a gradient's rounding (by at most lr / eps):
    gradients far below eps, as the key bias's (zero but for rounding: softmax ignores
    it) and those of tied-embedding rows no token uses, differ in their last bits between
    one device and a mesh (other summation orders), and a small eps would turn that into
    steps of visibly different sizes."""
    opt = nnx.Optimizer(model, adamw(1e-2, eps=1e-3, weight_decay=0.01), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    state = jax.device_put(state, shardings)  # committed, as the step's outputs are
    step = jax.jit(functools.partial(_step, graphdef), out_shardings=(shardings, None, None),
                   compiler_options=FAST_COMPILE)
    losses, grads = [], []
    for batch in batches:
        state, loss, g = step(state, batch)
        losses.append(float(loss))
        grads.append(g)
    assert step._cache_size() == 1  # one compilation for the three steps
    model, _ = nnx.merge(graphdef, state)
    _train.last_program = lambda: step.lower(state, batches[-1]).compile().as_text()
    return losses, grads, nnx.state(model, nnx.Param)


def _one_device(family):
    """One family's config, initial state, batches, and its one-device run ("gpt-flash":
    GPT with attention_backend="flash")."""
    family, *flash = family.split("-")
    cfg = fm.get_config(family, "tiny", **DROPOUT, **({"attention_backend": "flash"} if flash else {}))
    model = nnx.jit(lambda: fm.build(cfg))()  # one program, not one per initialiser
    start = jax.tree.map(jnp.copy, nnx.state(model))
    batches = [_batch(family, cfg, s) for s in range(STEPS)]
    return family, cfg, start, batches, _train(model, batches)


@pytest.fixture(scope="module")
def reference():
    """family -> `_one_device(family)`, each run once in this module."""
    return functools.cache(_one_device)


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


def _mesh(spec):
    sizes = parallel.parse_mesh_spec(spec)
    return parallel.make_mesh(spec, devices=jax.devices()[:int(np.prod(list(sizes.values())))])


# GPT on every mesh, BERT (post-LN, padding, the MLM bias split by vocabulary) on the
# tensor-parallel ones. The step leaves the gradients' layout to update_nnx.
@pytest.mark.parametrize("family,spec,sequence_parallel",
                         [("gpt", *m) for m in MESHES] + [("bert", *m) for m in MESHES[1:]])
def test_zoo_trains_like_one_device(reference, family, spec, sequence_parallel):
    _, cfg, start, batches, (want_losses, want_grads, want_params) = reference(family)
    mesh = _mesh(spec)
    with jax.set_mesh(mesh):
        # the one-device model's initial state in the split layout, without initialising again
        split = cfg.replace(tensor_axis="tensor" if "tensor=" in spec else None, sequence_parallel=sequence_parallel)
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: fm.build(split)))
        model = shard_module(nnx.merge(graphdef, tensor_parallel_state(start, shapes)), mesh)
        sharded = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
        losses, grads, params = _train(model, sharded)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(tensor_parallel_state(g, w), w)
    _close(tensor_parallel_state(params, want_params), want_params)
    if "tensor=" in spec:  # the split weights stay split through the optimizer step
        qkv = params["decoder" if family == "gpt" else "encoder"]["layers"][0]["attn"]["qkv"]["kernel"]
        assert qkv.get_value().sharding.spec == P(None, None, "tensor")


def test_gpt_on_sequence_shards_trains_like_one_device(reference):
    """Tiny GPT with its sequence split over (seq 4): embeddings, LayerNorms, dropout,
    FFN and loss on sequence parts, attention through the ring (flash blocks), against
    the one-device model with attention_backend="flash" (the ring's dropout masks are
    flash attention's); no all-gather in the compiled step."""
    _, _, start, batches, (want_losses, want_grads, want_params) = reference("gpt-flash")
    cfg = fm.get_config("gpt", "tiny", attention_backend="flash", sequence_axis="seq", **DROPOUT)
    mesh = _mesh("seq=4")
    with jax.set_mesh(mesh):
        model = shard_module(nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: fm.build(cfg))), start), mesh)
        sharded = [jax.device_put(b, NamedSharding(mesh, P(None, "seq"))) for b in batches]
        losses, grads, params = _train(model, sharded)
        hlo = _train.last_program()
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for g, w in zip(grads, want_grads):
        _close(g, w)
    _close(params, want_params)
    counts = _collectives(hlo)
    assert counts["all-gather"] == 0 and counts["collective-permute"] > 0, counts  # the ring, nothing gathered


# ------------------------------------------------------------------ one tensor-parallel layer
HIDDEN, FFN, HEADS = 64, 128, 4


def _layer(tensor_axis=None, sequence_parallel=False, **options):
    options = {"attention_backend": "xla", **options}
    return nn.TransformerEncoderLayer(HIDDEN, FFN, HEADS, deterministic=True, tensor_axis=tensor_axis,
                                      sequence_parallel=sequence_parallel, rngs=nnx.Rngs(0), **options)


def _collectives(hlo):
    names = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    return {n: hlo.count(f" {n}(") + hlo.count(f" {n}-start(") for n in names}


@pytest.fixture(scope="module")
def unsplit_layer():
    """x (4, 8, HIDDEN), the unsplit layer's state and its causal output."""
    x = jax.random.normal(jax.random.key(1), (4, 8, HIDDEN))
    graphdef, state = nnx.split(nnx.jit(_layer)())  # initialised by one program
    return x, state, jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, causal=True))(state, x)


def _split_layer(unsplit_state, mesh, sequence_parallel, **options):
    """(graphdef, state placed on mesh, specs) of the tensor-parallel layer with the
    unsplit one's values."""
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: _layer("tensor", sequence_parallel, **options)))
    specs = nnx.get_partition_spec(shapes)
    state = tensor_parallel_state(unsplit_state, shapes)
    return graphdef, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)), specs


@pytest.mark.parametrize("sequence_parallel,expected", [
    (False, {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0}),
    (True, {"all-reduce": 0, "all-gather": 2, "reduce-scatter": 2}),
])
def test_layer_forward_collectives(unsplit_layer, sequence_parallel, expected):
    x, unsplit, want = unsplit_layer
    mesh = parallel.make_mesh("data=2,tensor=4")
    graphdef, state, specs = _split_layer(unsplit, mesh, sequence_parallel)
    x_spec = P("data", "tensor") if sequence_parallel else P("data")
    fwd = jax.jit(jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x, causal=True), mesh=mesh,
                                in_specs=(specs, x_spec), out_specs=x_spec)).lower(state, x).compile(FAST_COMPILE)
    np.testing.assert_allclose(fwd(state, x), want, rtol=2e-5, atol=2e-5)
    assert _collectives(fwd.as_text()) == dict(expected, **{"all-to-all": 0, "collective-permute": 0})


# every dropout on, attention through the fused softmax
DROPPING = dict(DROPOUT, attention_backend="fused")


def _dropping_forward(graphdef):
    return lambda s, x, key: nnx.merge(graphdef, s)(x, causal=True, deterministic=False, rngs=key)


@pytest.fixture(scope="module")
def dropping_layer(unsplit_layer):
    """The key and the unsplit layer's causal output with dropout on."""
    x, state, _ = unsplit_layer
    key = jax.random.key(7)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: _layer(**DROPPING)))
    return key, jax.jit(_dropping_forward(graphdef))(state, x, key)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layer_dropout_on_shards(unsplit_layer, dropping_layer, sequence_parallel):
    """With dropout on, the fused ops run on the heads, FFN features and (with sequence
    parallelism) sequence parts of the tensor axis and draw the unsplit layer's masks:
    under jit the forward has only the Megatron collectives, and no all-gather but the
    column-parallel GEMMs' inputs; inside shard_map ``shard_spec`` gives each device its
    block of the masks."""
    x, unsplit, _ = unsplit_layer
    key, want = dropping_layer
    mesh = parallel.make_mesh("data=2,tensor=4")
    graphdef, state, specs = _split_layer(unsplit, mesh, sequence_parallel, **DROPPING)
    fwd = _dropping_forward(graphdef)
    x_spec = P(None, "tensor") if sequence_parallel else P()
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", *x_spec[1:])))
        compiled = jax.jit(fwd).lower(state, xs, key).compile(FAST_COMPILE)
        np.testing.assert_allclose(compiled(state, xs, key), want, rtol=2e-5, atol=2e-5)
    hlo = compiled.as_text()
    # The CPU partitioner writes a reduce-scatter as an all-reduce and a slice.
    assert _collectives(hlo) == {"all-reduce": 2, "all-gather": 2 if sequence_parallel else 0, "reduce-scatter": 0,
                                 "all-to-all": 0, "collective-permute": 0}
    # with sequence parallelism, the LayerNorm outputs before the q/k/v and fc1 GEMMs
    # (this data part, the whole length): nothing of FFN or heads width
    gathered = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)
    assert gathered == (["f32[2,8,64]"] * 2 if sequence_parallel else [])
    # inside shard_map the batch stays whole: the layer knows the tensor axis only
    inside = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(specs, x_spec, P()), out_specs=x_spec),
                     compiler_options=FAST_COMPILE)
    np.testing.assert_allclose(inside(state, x, key), want, rtol=2e-5, atol=2e-5)


def test_layer_parameter_bytes_per_device_fall_as_one_over_tensor():
    split, whole = {}, {}
    for t in (1, 2, 4):
        mesh = parallel.make_mesh(f"data={8 // t},tensor={t}")
        with jax.set_mesh(mesh):
            state = nnx.state(nnx.eval_shape(lambda: _layer("tensor")), nnx.Param)
        per_device = [(math.prod(NamedSharding(mesh, spec).shard_shape(leaf.shape)) * leaf.dtype.itemsize,
                       "tensor" in str(spec))
                      for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.get_partition_spec(state)))]
        split[t] = sum(b for b, s in per_device if s)
        whole[t] = sum(b for b, s in per_device if not s)
    assert split[1] == split[2] * 2 == split[4] * 4
    assert whole[1] == whole[2] == whole[4] < split[4]  # only LayerNorms and row-parallel biases stay whole


# ------------------------------------------------------------------ errors
def test_sizes_the_tensor_axis_does_not_divide():
    with jax.set_mesh(parallel.make_mesh("data=1,tensor=8")):
        with pytest.raises(ValueError, match=r"TransformerEncoderLayer: num_heads \(4\) must be a multiple of "
                                             r"the size \(8\) of mesh axis 'tensor'"):
            nn.TransformerEncoderLayer(HIDDEN, FFN, HEADS, tensor_axis="tensor", rngs=nnx.Rngs(0))
    with jax.set_mesh(parallel.make_mesh("data=2,tensor=4")):
        with pytest.raises(ValueError, match=r"ffn_size \(130\) must be a multiple of the size \(4\)"):
            nn.TransformerEncoderLayer(HIDDEN, 130, HEADS, tensor_axis="tensor", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"Embedding: vocab_size \(510\) must be a multiple of the size \(4\)"):
            nnx.eval_shape(lambda: fm.build(fm.get_config("gpt", "tiny", vocab_size=510, tensor_axis="tensor")))
        with pytest.raises(ValueError, match=r"sequence length \(6\) must be a multiple of the size \(4\)"):
            layer = nnx.eval_shape(lambda: _layer("tensor", sequence_parallel=True))
            jax.eval_shape(lambda x: layer(x), jax.ShapeDtypeStruct((2, 6, HIDDEN), jnp.float32))


def test_bad_parallel_options():
    with pytest.raises(ValueError, match="LayerConfig: sequence_parallel=True .* set tensor_axis"):
        nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_parallel=True)
    with pytest.raises(TypeError, match="LayerConfig: tensor_axis must be None or a mesh axis name"):
        nn.LayerConfig(HIDDEN, FFN, HEADS, tensor_axis=4)
    with pytest.raises(ValueError, match="LayerConfig: sequence_axis .* attention_backend must be 'flash' or 'auto'"):
        nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_axis="seq", attention_backend="fused")
    with pytest.raises(ValueError, match="LayerConfig: sequence_axis with sequence_parallel .* is not supported"):
        nn.LayerConfig(HIDDEN, FFN, HEADS, sequence_axis="seq", tensor_axis="tensor", sequence_parallel=True)
    with pytest.raises(ValueError, match="TransformerDecoderLayer: sequence_axis is not supported in layers with "
                                         "cross-attention"):
        nnx.eval_shape(lambda: nn.TransformerDecoderLayer(HIDDEN, FFN, HEADS, sequence_axis="seq", rngs=nnx.Rngs(0)))
    with jax.set_mesh(_mesh("seq=4")):
        layer = nnx.eval_shape(lambda: _layer(sequence_axis="seq", attention_backend="flash"))
        with pytest.raises(ValueError, match=r"TransformerEncoderLayer: the sequence length \(6\) must be a multiple "
                                             r"of the size \(4\) of mesh axis 'seq'"):
            jax.eval_shape(lambda x: layer(x), jax.ShapeDtypeStruct((2, 6, HIDDEN), jnp.float32))
    layer = nnx.eval_shape(lambda: _layer("tensor"))
    with pytest.raises(ValueError, match="TransformerEncoderLayer: tensor_axis='tensor' needs a mesh with that axis"):
        jax.eval_shape(lambda x: layer(x), jax.ShapeDtypeStruct((2, 8, HIDDEN), jnp.float32))
