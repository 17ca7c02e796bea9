"""The fused optimizer on params sharded over 8 simulated CPU devices (`shard_optimizer`):
the same steps as unsharded, nothing gathered to form its flat buffers (read from the
compiled HLO), with ZeRO-1 per-device state bytes falling as 1 / data, and clipping,
skipped steps and dynamic loss scaling decided on all shards together."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ls2
from jax_ls2 import optim, parallel
from jax_ls2.optim import _abi

# leaf sizes: the matrices' shards are multiples of 8 * PAD elements, so ZeRO pieces need
# no padding there; the 13-element vector needs some everywhere
SHAPES = {"w1": (32, 64), "b1": (64,), "w2": (64, 32), "ln": (13,)}
TENSOR_SPECS = {"w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None), "ln": P()}
CASES = {  # name: (mesh spec, param specs, zero axis)
    "data8": ("data=8", None, None),
    "data8-zero": ("data=8", None, "data"),
    "data2-tensor4": ("data=2,tensor=4", TENSOR_SPECS, None),
    "data2-tensor4-zero": ("data=2,tensor=4", TENSOR_SPECS, "data"),
}
STEPS = 3


def _tree(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def _decay_matrices(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


def _tx():
    # a callable mask reading the leaves' ranks: under ZeRO the step sees flat pieces,
    # so the mask must be taken from the params as given
    return optim.adamw(1e-2, weight_decay=0.1, mask=_decay_matrices)


def _placed(tree, mesh, specs):
    specs = specs or jax.tree.map(lambda _: P(), tree)
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                             is_leaf=lambda s: isinstance(s, P)))


class Run:
    def __init__(self, case):
        spec, param_specs, zero = CASES[case]
        self.mesh = parallel.make_mesh(spec)
        self.zero = zero
        self.tx = optim.shard_optimizer(_tx(), self.mesh, param_specs, zero_axis=zero)
        self.params = _placed(_tree(0), self.mesh, param_specs)
        self.grads = [_placed(_tree(10 + i), self.mesh, param_specs) for i in range(STEPS)]
        self.step = jax.jit(lambda g, s, p: optim.apply_updates(self.tx, g, s, p))
        self.state0 = self.tx.init(self.params)
        p, s = self.params, self.state0
        for g in self.grads:
            p, s = self.step(g, s, p)
        self.final = p, s
        self.hlo = self.step.lower(self.grads[0], self.state0, self.params).compile().as_text()


@pytest.fixture(scope="module", params=list(CASES))
def run(request):
    return Run(request.param)


@pytest.fixture(scope="module")
def unsharded():
    tx = _tx()
    p = _tree(0)
    s = tx.init(p)
    step = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p))
    for i in range(STEPS):
        p, s = step(_tree(10 + i), s, p)
    return p, s


def test_steps_match_unsharded(run, unsharded):
    want_p, want_s = unsharded
    got_p, got_s = run.final
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(got_p[k]), np.asarray(want_p[k]), rtol=1e-6, atol=1e-7, err_msg=k)
        assert got_p[k].sharding.is_equivalent_to(run.params[k].sharding, len(SHAPES[k]))
    std = optim.gather_state(run.tx, got_s, got_p)
    # moments of unit-scale gradients: fp32 rounding of terms of size 1
    np.testing.assert_allclose(np.asarray(std.mu), np.asarray(want_s.mu), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(std.nu), np.asarray(want_s.nu), rtol=1e-6, atol=1e-7)
    assert int(got_s.count) == STEPS and bool(got_s.finite)


def test_updates_contract_matches_apply(run):
    updates, _ = jax.jit(run.tx.update)(run.grads[0], run.state0, run.params)
    new_p, _ = run.step(run.grads[0], run.state0, run.params)
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(run.params[k] + updates[k]), np.asarray(new_p[k]), rtol=1e-6,
                                   atol=1e-7)


def _collectives(hlo, op):
    """(result shape text, replica groups text) of each `op` instruction in `hlo`."""
    return re.findall(rf"= (\w+\[[\d,]*\])\S* {op}\(.*?replica_groups=(\S+ \{{[^}}]*\}})", hlo)


def test_nothing_gathered_to_form_the_buffers(run):
    reduces = _collectives(run.hlo, "all-reduce")
    # the only all-reduce is the finite flag combined over the devices
    assert [shape for shape, _ in reduces] == ["s32[]"], reduces
    gathers = _collectives(run.hlo, "all-gather")
    if run.zero is None:
        assert gathers == []
        return
    # ZeRO-1: one all-gather per leaf, of its updated pieces, over the data axis
    plan = run.tx.update.plan(run.params)[2]
    assert sorted(gathers) == sorted((f"f32[{plan.zero * n}]", gathers[0][1]) for n in plan.piece_sizes)
    assert all("{'data'}" in groups for _, groups in gathers), gathers


def test_state_bytes_per_device(run):
    mu = run.final[1].mu
    shard = mu.addressable_shards[0].data.shape[0]
    local = [math.prod(s) for s in run.tx.update.plan(run.params)[2].local_shapes]
    padded = sum(-(-n // _abi.PAD) * _abi.PAD for n in local)
    if run.zero is None:
        assert shard == padded
        assert mu.shape[0] == padded * (4 if "tensor" in str(mu.sharding.spec) else 1)
    else:
        data = dict(run.mesh.shape)["data"]
        # the matrices' pieces split exactly; the small vectors add at most a PAD each
        assert padded // data <= shard <= padded // data + 2 * _abi.PAD
        assert shard < padded / data * 1.15


def test_scatter_inverts_gather(run):
    _, state = run.final
    std = optim.gather_state(run.tx, state, run.params)
    back = optim.scatter_state(run.tx, std, run.params)
    np.testing.assert_array_equal(np.asarray(back.mu), np.asarray(state.mu))
    assert back.mu.sharding.is_equivalent_to(state.mu.sharding, 1)


def test_bf16_master_weights_with_zero_match_unsharded():
    mesh = parallel.make_mesh("data=8")
    tx = optim.adamw(1e-2, weight_decay=0.1, master_weights=True)
    stx = optim.shard_optimizer(tx, mesh, zero_axis="data")
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), _tree(1))
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), _tree(2))
    want, want_s = optim.apply_updates(tx, g, tx.init(p), p)
    got, got_s = jax.jit(lambda g, s, p: optim.apply_updates(stx, g, s, p))(g, stx.init(p), p)
    assert got_s.master.addressable_shards[0].data.size < want_s.master.size / 7
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32))


@pytest.mark.parametrize("make, words", [
    (lambda m: optim.shard_optimizer(optax_adamw(), m), "tx must be a transformation made by jax_ls2.optim"),
    (lambda m: optim.shard_optimizer(optim.adamw(1e-3), "data"), "mesh must be a jax.sharding.Mesh"),
    (lambda m: optim.shard_optimizer(optim.adamw(1e-3), m, zero_axis="batch"), "zero_axis 'batch' is not"),
    (lambda m: optim.shard_optimizer(optim.adamw(1e-3), m, {"w1": P(), "b1": P(), "w2": P(), "ln": P("tensor")})
     .init(_tree(0)), "params leaf 1 (['ln']) has 13 elements along dim 0"),
    (lambda m: optim.shard_optimizer(optim.adamw(1e-3), m, P("model")).init(_tree(0)),
     "split over 'model', which is not an axis"),
    (lambda m: optim.shard_optimizer(optim.adamw(1e-3), m, TENSOR_SPECS, zero_axis="tensor").init(_tree(0)),
     "zero_axis 'tensor' already splits params"),
])
def test_bad_input(make, words):
    mesh = parallel.make_mesh("data=2,tensor=4")
    with pytest.raises((TypeError, ValueError), match="shard_optimizer") as info:
        make(mesh)
    assert words in str(info.value)


@pytest.mark.parametrize("case", ["data2-tensor4", "data2-tensor4-zero"])
def test_clipping_and_dynamic_loss_scale_use_all_shards(case):
    """The global norm counts each replicated shard once (a norm of the local shards, or
    of every device's, would clip otherwise); a non-finite gradient on one device skips
    the step on all of them and halves the loss scale."""
    spec, param_specs, zero = CASES[case]
    mesh = parallel.make_mesh(spec)
    # unit-scale gradients of ~4200 elements: norm ~65, so max_grad_norm=1 clips
    tx = optim.adamw(1e-2, weight_decay=0.1, max_grad_norm=1.0, loss_scale="dynamic", initial_loss_scale=4.0)
    stx = optim.shard_optimizer(tx, mesh, param_specs, zero_axis=zero)
    bad = _tree(11)
    bad["w1"][3, 50] = np.inf  # on one tensor shard only
    grads = [_tree(10), bad, _tree(12)]
    want_step = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p))
    got_step = jax.jit(lambda g, s, p: optim.apply_updates(stx, g, s, p))
    want_p, got_p = _tree(0), _placed(_tree(0), mesh, param_specs)
    want_s, got_s = tx.init(want_p), stx.init(got_p)
    for i, g in enumerate(grads):
        before = jax.tree.map(np.asarray, got_p)
        want_p, want_s = want_step(g, want_s, want_p)
        got_p, got_s = got_step(_placed(g, mesh, param_specs), got_s, got_p)
        np.testing.assert_allclose(float(got_s.grad_norm), float(want_s.grad_norm), rtol=1e-6)
        assert float(got_s.loss_scale) == float(want_s.loss_scale)
        assert bool(got_s.finite) == bool(want_s.finite) == (i != 1)
        assert int(got_s.count) == int(want_s.count)
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(got_p[k]), np.asarray(want_p[k]), rtol=1e-6, atol=1e-7)
            if i == 1:  # skipped: untouched
                np.testing.assert_array_equal(np.asarray(got_p[k]), before[k])
    assert float(got_s.loss_scale) == 2.0 and float(want_s.grad_norm) > 10


def test_bad_scheduled_rate_is_flagged_with_global_stats():
    """With clipping on, finiteness is decided on all shards; the step's own check of a
    traced learning rate must survive that: a NaN rate leaves the params and reads
    finite=False, as unsharded."""
    spec, param_specs, zero = CASES["data2-tensor4-zero"]
    mesh = parallel.make_mesh(spec)
    tx = optim.adamw(lambda count: jnp.where(count >= 1, jnp.nan, 1e-2), max_grad_norm=1.0)
    stx = optim.shard_optimizer(tx, mesh, param_specs, zero_axis=zero)
    step = jax.jit(lambda g, s, p: optim.apply_updates(stx, g, s, p))
    p = _placed(_tree(0), mesh, param_specs)
    s = stx.init(p)
    for i in range(2):
        before = jax.tree.map(np.asarray, p)
        p, s = step(_placed(_tree(10 + i), mesh, param_specs), s, p)
        assert bool(s.finite) == (i == 0)
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(p[k]), before[k])


def optax_adamw():
    import optax
    return optax.adamw(1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [False, True])
def test_gpt_train_step_gathers_nothing_but_updated_pieces(zero):
    """The whole data-parallel train step of flax_models.training (GPT tiny, dropout on,
    data=8): without ZeRO no all-gather at all; with ZeRO-1 one per parameter, of its
    updated pieces, over the data axis."""
    import flax_models as fm
    from flax import nnx
    from flax_models import data, training
    cfg = fm.get_config("gpt", "tiny", hidden_dropout=0.1, attn_dropout=0.1, activation_dropout=0.1)
    tx, _ = training.make_optimizer(1e-3, 3, 1)
    mesh = parallel.make_mesh("data=8")
    graphdef, state = training.create(cfg, impl="ls2", dtype=None, seed=0, tx=tx, mesh=mesh, zero=zero)
    batch = training.shard_batch(data.make_batch(cfg, 0, 0, 8, 16), mesh)
    hlo = training.make_step(graphdef).lower(state, batch).compile().as_text()
    gathers = _collectives(hlo, "all-gather")
    for op in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert f" {op}(" not in hlo and f" {op}-start(" not in hlo, op
    if not zero:
        assert gathers == []
        return
    model, opt = nnx.merge(graphdef, state)
    params = nnx.state(model, nnx.Param)
    plan = opt.tx.update.plan(params)[2]
    assert sorted(shape for shape, _ in gathers) == sorted(f"f32[{8 * n}]" for n in plan.piece_sizes)
    assert all("{'data'}" in groups for _, groups in gathers)


@pytest.mark.skipif(not jax_ls2._ffi.has_target("jax_ls2_optim_update"), reason="extension not built")
@pytest.mark.parametrize("zero", [None, "data"])
def test_sharded_step_lowers_to_one_kernel_call_for_cuda(zero):
    """Inside shard_map the step still reaches the fused kernel: one custom call per
    device program when lowered for CUDA (needs the built extension, no GPU)."""
    mesh = parallel.make_mesh("data=2,tensor=4")
    stx = optim.shard_optimizer(_tx(), mesh, TENSOR_SPECS, zero_axis=zero)
    params = _tree(0)
    text = (jax.jit(lambda g, s, p: optim.apply_updates(stx, g, s, p)).trace(params, stx.init(params), params)
            .lower(lowering_platforms=("cuda",)).as_text())
    assert text.count("stablehlo.custom_call @jax_ls2_optim_update") == 1
