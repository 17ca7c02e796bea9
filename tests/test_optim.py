"""jax_ls2.optim against optax (CPU: the pure-JAX reference; GPU tests at the end)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ls2
from jax_ls2 import optim
from jax_ls2.optim import _reference

SHAPES = [(), (1,), (7,), (3, 5), (129,), (33, 17), (1, 1), (2, 3, 4), (1031,), (0,), (64, 9)]


def make_params(seed=0, dtypes=(jnp.float32,)):
    rng = np.random.default_rng(seed)
    params = {}
    for i, s in enumerate(SHAPES):
        dt = dtypes[i % len(dtypes)]
        params[f"w{i}"] = jnp.asarray(rng.normal(size=s), jnp.float32).astype(dt)
    params["nested"] = {"bias": jnp.asarray(rng.normal(size=(5,)), jnp.float32).astype(dtypes[0]),
                        "scale": jnp.asarray(rng.normal(size=()), jnp.float32).astype(dtypes[-1])}
    return params


def grads_at(params, step, seed=1):
    """Fresh, deterministic pseudo-gradients (a quadratic pull plus noise) per step."""
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed * 1000 + step)
    out = [(x.astype(jnp.float32) * 0.5 + jnp.asarray(rng.normal(size=x.shape), jnp.float32)).astype(x.dtype)
           for x in leaves]
    return jax.tree.unflatten(treedef, out)


def run(tx, params, steps, fused=False, grads_fn=grads_at):
    state = tx.init(params)

    @jax.jit
    def step(p, s, g):
        if fused:
            return optim.apply_updates(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for t in range(steps):
        params, state = step(params, state, grads_fn(params, t))
    return params, state


def assert_tree_close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- parity with optax, float32
@pytest.mark.parametrize("fused", [False, True])
def test_adamw_matches_optax_100_steps(fused):
    params = make_params()
    mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, 100, 1e-3)
    ours, _ = run(optim.adamw(sched, weight_decay=0.1, mask=mask), params, 100, fused=fused)
    ref, _ = run(optax.adamw(sched, weight_decay=0.1, mask=mask), params, 100)
    assert_tree_close(ours, ref, rtol=2e-6, atol=2e-6)
    # the run moved the params far from where they started
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(ref), jax.tree.leaves(params)) if a.size) > 0.1


def test_adam_matches_optax_100_steps():
    params = make_params(3)
    ours, _ = run(optim.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6), params, 100)
    ref, _ = run(optax.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6), params, 100)
    assert_tree_close(ours, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("momentum,nesterov", [(None, False), (0.9, False), (0.9, True)])
def test_sgd_matches_optax_100_steps(momentum, nesterov):
    params = make_params(4)
    ours, _ = run(optim.sgd(1e-2, momentum=momentum, nesterov=nesterov), params, 100, fused=True)
    ref, _ = run(optax.sgd(1e-2, momentum=momentum, nesterov=nesterov), params, 100)
    assert_tree_close(ours, ref, rtol=2e-6, atol=2e-6)


def test_mixed_dtypes_master_weights_follow_float32_optax():
    """bf16/f16/f32 leaves with an f32 master: the master follows optax run in f32 on the
    same gradients, and each low-precision param is its master rounded to nearest."""
    params = make_params(5, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    tx = optim.adamw(1e-2, weight_decay=0.05, master_weights=True)
    ref_tx = optax.adamw(1e-2, weight_decay=0.05)
    state, ref_state = tx.init(params), ref_tx.init(jax.tree.map(lambda x: x.astype(jnp.float32), params))
    p, ref_p = params, jax.tree.map(lambda x: x.astype(jnp.float32), params)
    step = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p))
    ref_step = jax.jit(ref_tx.update)
    for t in range(100):
        g = grads_at(p, t)  # grads in each leaf's dtype
        p, state = step(g, state, p)
        u, ref_state = ref_step(jax.tree.map(lambda x: x.astype(jnp.float32), g), ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    leaves, treedef = jax.tree.flatten(p)
    from jax_ls2.optim._layout import layout_of, unflatten
    master = jax.tree.unflatten(treedef, unflatten(state.master, layout_of(leaves)))
    assert_tree_close(master, ref_p, rtol=2e-6, atol=2e-6)
    assert_tree_close(p, jax.tree.map(lambda m, x: m.astype(x.dtype), master, p), rtol=0, atol=0)


# ---------------------------------------------------------------- composition with optax
def test_chain_after_clip_and_builtin_clip():
    params = make_params(6)
    big = lambda p, t: jax.tree.map(lambda g: g * 50, grads_at(p, t))
    ref, _ = run(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), params, 30, grads_fn=big)
    chained, _ = run(optax.chain(optax.clip_by_global_norm(1.0), optim.adamw(1e-2)), params, 30, grads_fn=big)
    builtin, st = run(optim.adamw(1e-2, max_grad_norm=1.0), params, 30, fused=True, grads_fn=big)
    assert_tree_close(chained, ref, rtol=2e-6, atol=2e-6)
    assert_tree_close(builtin, ref, rtol=2e-6, atol=2e-6)
    assert float(st.grad_norm) > 1.0


def test_inject_hyperparams_changes_learning_rate():
    params = make_params(7)
    tx = optax.inject_hyperparams(optim.adamw)(learning_rate=1e-2, weight_decay=0.1)
    ref_tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
    s, rs, p, rp = tx.init(params), ref_tx.init(params), params, params
    for t in range(20):
        if t == 10:
            s.hyperparams["learning_rate"] = jnp.asarray(3e-3)
            rs.hyperparams["learning_rate"] = jnp.asarray(3e-3)
        g = grads_at(p, t)
        u, s = jax.jit(tx.update)(g, s, p)
        p = optax.apply_updates(p, u)
        ru, rs = jax.jit(ref_tx.update)(g, rs, rp)
        rp = optax.apply_updates(rp, ru)
    assert_tree_close(p, rp, rtol=2e-6, atol=2e-6)


def test_multisteps_matches_optax():
    params = make_params(8)
    ours, _ = run(optax.MultiSteps(optim.adamw(1e-2), every_k_schedule=3), params, 12)
    ref, _ = run(optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=3), params, 12)
    assert_tree_close(ours, ref, rtol=2e-6, atol=2e-6)


def with_inf_at(step_with_inf):
    def fn(p, t):
        g = grads_at(p, t)
        if t == step_with_inf:
            g = dict(g, w3=g["w3"].at[1, 2].set(jnp.inf))
        return g
    return fn


def test_apply_if_finite_skips_inf_step():
    params = make_params(9)
    ours, _ = run(optax.apply_if_finite(optim.adamw(1e-2), 3), params, 10, grads_fn=with_inf_at(4))
    ref, _ = run(optax.apply_if_finite(optax.adamw(1e-2), 3), params, 10, grads_fn=with_inf_at(4))
    assert_tree_close(ours, ref, rtol=2e-6, atol=2e-6)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(ours))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("make_tx", [lambda: optim.adamw(1e-2), lambda: optim.sgd(1e-2, momentum=0.9),
                                     lambda: optim.adamw(1e-2, max_grad_norm=1.0)],
                         ids=["adamw", "sgd_momentum", "adamw_clip"])
def test_unchecked_step_still_reports_nonfinite_gradients(make_tx, fused):
    """Without skip_nonfinite or loss scaling the step is applied (as in optax), and
    state.finite says so: False exactly at the step whose gradients hold an inf."""
    params = make_params(12)
    tx = make_tx()
    state = tx.init(params)
    step = jax.jit((lambda g, s, p: optim.apply_updates(tx, g, s, p)) if fused else
                   (lambda g, s, p: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p))))
    grads_fn = with_inf_at(2)
    seen = []
    for t in range(4):
        params, state = step(grads_fn(params, t), state, params)
        seen.append(bool(state.finite))
    # step 3's pseudo-gradients derive from the now non-finite params, so they are too
    assert seen == [True, True, False, False], seen
    # the inf reached the params (nothing skipped it), and the flag is what tells
    assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


# ---------------------------------------------------------------- loss scaling and overflow
@pytest.mark.parametrize("fused", [False, True])
def test_dynamic_loss_scale_skips_overflow(fused):
    params = make_params(10, dtypes=(jnp.float16, jnp.float32))
    tx = optim.adamw(1e-2, loss_scale="dynamic", initial_loss_scale=1024.0, growth_interval=3,
                     master_weights=True)
    state = tx.init(params)
    step = jax.jit((lambda g, s, p: optim.apply_updates(tx, g, s, p)) if fused else
                   (lambda g, s, p: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p))))
    scaled = lambda p, t, s: jax.tree.map(lambda g: (g.astype(jnp.float32) * s).astype(g.dtype), grads_at(p, t))
    p = params
    p, state = step(scaled(p, 0, 1024.0), state, p)
    assert int(state.count) == 1 and bool(state.finite)
    before_p, before_s = p, state
    bad = scaled(p, 1, 1024.0)
    bad = dict(bad, w5=bad["w5"].at[3, 4].set(jnp.nan))
    p, state = step(bad, state, p)
    assert not bool(state.finite)
    assert int(state.count) == 1
    assert float(state.loss_scale) == 512.0
    assert_tree_close(p, before_p, rtol=0, atol=0)
    for name in ("mu", "nu", "master"):
        np.testing.assert_array_equal(np.asarray(getattr(state, name)), np.asarray(getattr(before_s, name)))
    for t in range(2, 5):  # three good steps in a row grow the scale back
        p, state = step(scaled(p, t, float(state.loss_scale)), state, p)
    assert int(state.count) == 4 and float(state.loss_scale) == 1024.0 and int(state.good_steps) == 0
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))


def test_static_loss_scale_unscales():
    params = make_params(11)
    ref, _ = run(optax.adamw(1e-2), params, 10)
    scaled = lambda p, t: jax.tree.map(lambda g: g * 256.0, grads_at(p, t))
    ours, st = run(optim.adamw(1e-2, loss_scale=256.0), params, 10, fused=True, grads_fn=scaled)
    assert_tree_close(ours, ref, rtol=2e-6, atol=2e-6)
    assert float(optim.scale_loss(jnp.float32(2.0), (st,))) == 512.0


# ---------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_rounding_is_unbiased(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-3, 3, size=(257,)), jnp.float32)
    n = 2000
    seeds = jnp.stack([jnp.asarray([k, 7, 3, 0], jnp.uint32) for k in range(n)])
    idx = jnp.arange(x.size, dtype=jnp.uint32)
    rounded = jax.vmap(lambda s: _reference.round_stochastic(x, dtype, _reference.sr_bits(idx, s)))(seeds)
    r = np.asarray(rounded.astype(jnp.float32), np.float64)
    lo = np.minimum.reduce(r, axis=0)
    hi = np.maximum.reduce(r, axis=0)
    xs = np.asarray(x, np.float64)
    # every draw is one of the two neighbours
    assert np.all((lo <= xs) & (xs <= hi))
    p = np.clip((xs - lo) / np.maximum(hi - lo, 1e-30), 0, 1)
    sd = (hi - lo) * np.sqrt(p * (1 - p) / n)
    err = np.abs(r.mean(axis=0) - xs)
    assert np.all(err <= 5 * sd + 1e-12), float(np.max(err / np.maximum(sd, 1e-30)))
    # round-to-nearest is biased on the same inputs
    near = np.asarray(x.astype(dtype).astype(jnp.float32), np.float64)
    assert np.mean(np.abs(near - xs)) > 10 * np.mean(err)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_rounding_edges(dtype):
    finfo = jnp.finfo(dtype)
    big = float(finfo.max)
    x = jnp.asarray([big, -big, big * (1 + 2.0 ** -12), 1.0, -0.5, 0.0, np.inf, -np.inf, np.nan],
                    jnp.float32)
    for k in range(64):
        bits = _reference.sr_bits(jnp.arange(x.size, dtype=jnp.uint32), jnp.asarray([k, 1, 2, 0], jnp.uint32))
        r = np.asarray(_reference.round_stochastic(x, dtype, bits).astype(jnp.float32))
        # finite values stay finite, exactly representable ones stay exact
        assert np.all(np.isfinite(r[:6])), r
        np.testing.assert_array_equal(r[[0, 1, 3, 4, 5]], np.asarray(x)[[0, 1, 3, 4, 5]])
        assert r[6] == np.inf and r[7] == -np.inf and np.isnan(r[8])


def test_stochastic_rounding_keeps_small_updates():
    """bf16 params without master: updates far below half an ulp vanish with rounding
    to nearest, while stochastic rounding moves the params by the right amount on average."""
    params = {"w": jnp.ones((4096,), jnp.bfloat16)}
    grads = lambda p, t: {"w": jnp.ones((4096,), jnp.bfloat16)}
    sgd = lambda sr: optim.sgd(1e-4, stochastic_rounding=sr, seed=3)
    near, _ = run(sgd(False), params, 50, fused=True, grads_fn=grads)
    sto, _ = run(sgd(True), params, 50, fused=True, grads_fn=grads)
    assert float(jnp.max(jnp.abs(near["w"].astype(jnp.float32) - 1.0))) == 0.0
    mean = float(jnp.mean(sto["w"].astype(jnp.float32)))
    assert abs(mean - (1.0 - 50 * 1e-4)) < 5e-4, mean


# ---------------------------------------------------------------- accumulation, memory, lowering
def test_accumulate_then_update_equals_mean_gradient():
    params = make_params(12, dtypes=(jnp.float32, jnp.bfloat16))
    tx = optim.adamw(1e-2, master_weights=True)
    micro = [grads_at(params, t) for t in range(4)]
    acc = optim.init_accumulator(params)
    add = jax.jit(optim.accumulate, donate_argnums=0)
    for g in micro:
        acc = add(acc, g, 0.25)
    mean = jax.tree.map(lambda *gs: sum(g.astype(jnp.float32) for g in gs) * 0.25, *micro)
    assert_tree_close(optim.unflatten_grads(acc, params), mean, rtol=1e-6, atol=1e-6)
    state = tx.init(params)
    p1, _ = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p))(acc, state, params)
    p2, _ = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p))(optim.unflatten_grads(acc, params),
                                                                      state, params)
    assert_tree_close(p1, p2, rtol=0, atol=0)


def test_no_master_bf16_holds_at_most_12_bytes_per_param():
    params = {f"w{i}": jnp.zeros((1000 + i, 64), jnp.bfloat16) for i in range(8)}
    tx = optim.adamw(1e-3, stochastic_rounding=True)
    state = tx.init(params)
    n = sum(x.size for x in jax.tree.leaves(params))
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
    total = 2 * nbytes(params) + nbytes(state)  # params + grads (same dtype) + state
    assert total / n <= 12.0 + 1e-3, total / n
    half = optim.adamw(1e-3, moment_dtype=jnp.bfloat16).init(params)
    assert (2 * nbytes(params) + nbytes(half)) / n <= 8.0 + 1e-3


def _custom_calls(tx, params, fused=True):
    g = jax.tree.map(jnp.ones_like, params)
    fn = (lambda g, s, p: optim.apply_updates(tx, g, s, p)) if fused else tx.update
    text = jax.jit(fn).trace(g, tx.init(params), params).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("stablehlo.custom_call @jax_ls2_optim_update"), text


@pytest.mark.skipif(not jax_ls2._ffi.has_target("jax_ls2_optim_update"), reason="extension not built")
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_lowering_one_custom_call_whatever_the_leaves(fused):
    small = {f"w{i}": jnp.zeros((3, i + 1)) for i in range(5)}
    large = {f"w{i}": jnp.zeros((i % 7 + 1, 5)) for i in range(600)}
    tx = optim.adamw(1e-3, max_grad_norm=1.0, loss_scale="dynamic")
    n_small, _ = _custom_calls(tx, small, fused)
    n_large, text = _custom_calls(tx, large, fused)
    assert n_small == n_large == 1
    assert text.count("output_operand_alias") >= 600 + 2


@pytest.mark.skipif(not jax_ls2._ffi.has_target("jax_ls2_optim_accumulate"), reason="extension not built")
def test_cuda_lowering_accumulate_one_custom_call():
    params = {f"w{i}": jnp.zeros((i + 1,)) for i in range(300)}
    acc = optim.init_accumulator(params)
    text = jax.jit(optim.accumulate).trace(acc, params).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @jax_ls2_optim_accumulate") == 1


# ---------------------------------------------------------------- Flax nnx.Optimizer
def _nnx_model(param_dtype):
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 16, rngs=rngs, param_dtype=param_dtype)
            self.b = nnx.Linear(16, 4, rngs=rngs, param_dtype=param_dtype)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    return Mlp(nnx.Rngs(0))


def _nnx_train(tx, param_dtype, fused, steps=3):
    from flax import nnx
    model = _nnx_model(param_dtype)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (32, 8))

    @nnx.jit
    def step(model, opt):
        g = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
        if fused:
            optim.update_nnx(opt, model, g)
        else:
            opt.update(model, g)

    for _ in range(steps):
        step(model, opt)
    return model, opt


def _params_of(model):
    from flax import nnx
    return jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("make_tx", [lambda: optim.adamw(1e-2, weight_decay=0.1), lambda: optax.adamw(1e-2)],
                         ids=["fused", "optax"])
def test_update_nnx_matches_optimizer_update_fp32(make_tx):
    from flax import nnx
    a, oa = _nnx_train(make_tx(), jnp.float32, fused=True)
    b, ob = _nnx_train(make_tx(), jnp.float32, fused=False)
    for u, v in zip(_params_of(a), _params_of(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    for u, v in zip(jax.tree.leaves(nnx.as_pure(oa.opt_state)), jax.tree.leaves(nnx.as_pure(ob.opt_state))):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert int(oa.step[...]) == int(ob.step[...]) == 3


def test_update_nnx_writes_bf16_params_from_the_master_and_rounds_stochastically():
    from flax import nnx
    # fp32 master: the bf16 params are the master rounded to nearest.
    model, opt = _nnx_train(optim.adamw(1e-2, weight_decay=0.1, master_weights=True), jnp.bfloat16, fused=True)
    master = optim.find_state(nnx.as_pure(opt.opt_state)).master
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    master = optim.unflatten_grads(optim.FlatGrads(master), params)  # per leaf, float32
    for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(master)):
        assert m.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p.astype(jnp.float32)),
                                      np.asarray(m.astype(jnp.bfloat16).astype(jnp.float32)))
    # No master, stochastic rounding: one update_nnx step equals apply_updates on the arrays.
    tx = optim.adamw(1e-2, stochastic_rounding=True)
    model = _nnx_model(jnp.bfloat16)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    x = jax.random.normal(jax.random.key(2), (32, 8))
    grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    want, _ = optim.apply_updates(tx, nnx.as_pure(nnx.state(grads, nnx.Param)), nnx.as_pure(opt.opt_state), params)
    finite = optim.update_nnx(opt, model, grads)
    for u, v in zip(_params_of(model), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)), np.asarray(v.astype(jnp.float32)))
    assert int(opt.step[...]) == 1 and bool(finite)
    grads.a.kernel[...] = grads.a.kernel[...].at[0, 0].set(jnp.nan)
    assert not bool(optim.update_nnx(opt, model, grads))
    assert optim.update_nnx(nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param), model, grads) is None


# ---------------------------------------------------------------- validation
def test_validation_messages():
    params = {"a": jnp.zeros((3,))}
    tx = optim.adamw(1e-3)
    state = tx.init(params)
    with pytest.raises(ValueError, match="adamw: grads leaf 0 must have shape"):
        tx.update({"a": jnp.zeros((4,))}, state, params)
    with pytest.raises(TypeError, match="adamw: params leaf 0 must have dtype"):
        tx.init({"a": jnp.zeros((3,), jnp.float8_e4m3fn)})  # int leaves are optax's (test_optim_inputs.py)
    with pytest.raises(ValueError, match="adamw: params are required"):
        tx.update(params, state, None)
    with pytest.raises(ValueError, match="loss_scale must be None, a number or 'dynamic'"):
        optim.adam(1e-3, loss_scale="auto")
    with pytest.raises(TypeError, match="moment_dtype must be float32 or bfloat16"):
        optim.adam(1e-3, moment_dtype=jnp.float16)
    with pytest.raises(TypeError, match="apply_updates: tx must be a transformation made by jax_ls2.optim"):
        optim.apply_updates(optax.adam(1e-3), params, state, params)


def test_precision_options_are_one_group_and_unknown_keywords_say_so():
    assert optim.adamw(1e-3, master_weights=True, loss_scale="dynamic").update.config.options == \
        optim.PrecisionOptions(master_weights=True, loss_scale="dynamic")
    with pytest.raises(TypeError, match="sgd: unexpected keyword argument.*master_weight;"):
        optim.sgd(1e-3, master_weight=True)


def test_fused_capability_is_the_transformation_type():
    tx = optim.adam(1e-3)
    assert isinstance(tx, optim.FusedGradientTransformation)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    chained = optax.chain(optax.identity(), tx)
    with pytest.raises(TypeError, match="apply_updates: tx must be a transformation made by jax_ls2.optim"):
        optim.apply_updates(chained, {"a": jnp.ones(2)}, chained.init({"a": jnp.ones(2)}), {"a": jnp.ones(2)})


def test_optax_signatures_and_positional_order():
    import inspect
    for name in ("adamw", "adam", "sgd"):
        ours = list(inspect.signature(getattr(optim, name)).parameters.values())
        theirs = list(inspect.signature(getattr(optax, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
            [(p.name, p.kind, p.default) for p in theirs], name


def test_update_without_params_where_optax_allows_it():
    params = make_params()
    grads = grads_at(params, 0)
    for ours, theirs in [(optim.adam(1e-2), optax.adam(1e-2)), (optim.sgd(1e-2, 0.9, True), optax.sgd(1e-2, 0.9, True)),
                         (optim.adamw(1e-2, weight_decay=0.0), optax.adam(1e-2))]:
        u, _ = ours.update(grads, ours.init(params))
        v, _ = theirs.update(grads, theirs.init(params))
        assert_tree_close(u, v, rtol=1e-6, atol=1e-7)
    for tx, what in [(optim.adamw(1e-2), "with weight decay"), (optim.adam(1e-2, master_weights=True),
                                                                 "with master_weights=True")]:
        with pytest.raises(ValueError, match=f"params are required {what}"):
            tx.update(grads, tx.init(params))


def test_moment_dtype_arguments_of_optax():
    params = {"a": jnp.ones((3,))}
    assert optim.sgd(1e-2, 0.9, accumulator_dtype=jnp.bfloat16).init(params).mu.dtype == jnp.bfloat16
    assert optim.adam(1e-2, mu_dtype=jnp.float32).init(params).nu.dtype == jnp.float32
    with pytest.raises(ValueError, match="adam: mu_dtype=bfloat16 alone is not supported"):
        optim.adam(1e-2, mu_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="adamw: mu_dtype=float32 contradicts moment_dtype=bfloat16"):
        optim.adamw(1e-2, mu_dtype=jnp.float32, moment_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="adam: nesterov=True is not supported"):
        optim.adam(1e-2, nesterov=True)


def test_prefix_mask_as_optax():
    params = make_params()
    prefix = {k: (k != "nested") for k in params}  # one bool for the whole "nested" subtree
    for mask in (prefix, lambda p: prefix):
        ours, _ = run(optim.adamw(1e-2, weight_decay=0.5, mask=mask), params, 3)
        theirs, _ = run(optax.adamw(1e-2, weight_decay=0.5, mask=mask), params, 3)
        assert_tree_close(ours, theirs, rtol=2e-6, atol=2e-6)
    tx = optim.adamw(1e-2, mask={"w0": True})
    with pytest.raises(ValueError, match="adamw: mask must be a prefix of the params tree"):
        tx.update(params, tx.init(params), params)


def test_numpy_and_python_float_leaves_as_optax_takes_them():
    rng = np.random.default_rng(3)
    params = {"np64": rng.normal(size=(4, 3)), "np32": rng.normal(size=(5,)).astype(np.float32), "py": 0.5}
    grads = {"np64": rng.normal(size=(4, 3)), "np32": rng.normal(size=(5,)).astype(np.float32), "py": -1.5}
    for ours, theirs in [(optim.adamw(1e-2), optax.adamw(1e-2)), (optim.sgd(1e-2, 0.9), optax.sgd(1e-2, 0.9))]:
        u, _ = ours.update(grads, ours.init(params), params)
        v, _ = theirs.update(grads, theirs.init(params), params)
        assert_tree_close(u, v, rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="adam: params leaf 0 must have dtype float32, float16 or bfloat16 .*, "
                                        "got float8_e5m2"):
        optim.adam(1e-2).init({"step": np.zeros((2,), jnp.float8_e5m2)})


def test_explicit_sharding_mesh_says_what_it_needs():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        params = {"b": jnp.ones((6,)), "w": jax.device_put(jnp.ones((4, 6)), NamedSharding(mesh, P("x", None)))}
        with pytest.raises(ValueError, match=r"adamw: params leaf 1 is sharded over the explicit mesh axes "
                                             r"\('x',\).*AxisType.Auto"):
            optim.adamw(1e-2).init(params)
        replicated = {"b": params["b"]}  # leaves no explicit axis shards still work
        tx = optim.adamw(1e-2)
        u, _ = jax.jit(lambda p, s: tx.update(p, s, p))(replicated, tx.init(replicated))
        assert u["b"].shape == (6,)


def test_outside_jit_adam_steps_are_optax_steps_within_a_few_ulps():
    """Op by op, as a user's first try runs: the bias correction is compiled as optax's
    is, so the updates are optax's within float32 rounding (the kernel's math multiplies
    by the correction's reciprocals where optax divides: a few ulps; computed
    op by op the correction used to drift by about a hundred)."""
    params = make_params(4)
    ours, theirs = optim.adam(1e-2), optax.adam(1e-2)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for t in range(5):
        g = grads_at(params, t)
        u, s_ours = ours.update(g, s_ours)
        v, s_theirs = theirs.update(g, s_theirs)
        assert_tree_close(u, v, rtol=6e-7, atol=0)


def test_state_shardings_derived_from_params_specs_with_map_params():
    """The optax recipe: optax.tree.map_params maps the params-shaped parts of the
    state to the params' shardings and the rest to `transform_non_params`. The flat
    buffers are not params-shaped, so they take the latter (replicated here), and a
    jitted step with those shardings gives optax's numbers on a sharded mesh."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)), jnp.float32), "b": jnp.ones((6,))}
    shardings = {"w": NamedSharding(mesh, P("x", None)), "b": NamedSharding(mesh, P())}
    params = jax.device_put(params, shardings)
    tx = optim.adamw(1e-2)
    state_shardings = optax.tree.map_params(tx.init, lambda p: p, jax.eval_shape(tx.init, params),
                                            transform_non_params=lambda _: NamedSharding(mesh, P()))
    assert optim.find_state(state_shardings).mu.spec == P()
    state = jax.device_put(tx.init(params), state_shardings)
    step = jax.jit(lambda p, s: tx.update(p, s, p), out_shardings=(shardings, state_shardings))
    u, _ = step(params, state)
    v, _ = optax.adamw(1e-2).update(params, optax.adamw(1e-2).init(params), params)
    assert u["w"].sharding.spec == P("x", None)
    assert_tree_close(u, v, rtol=1e-6, atol=1e-7)


def test_moments_view_is_params_shaped_and_matches_optax():
    params = make_params()
    ours, s_ours = run(optim.adam(1e-2), params, 3)
    theirs, s_theirs = run(optax.adam(1e-2), params, 3)
    view = optim.moments(s_ours, ours)
    assert view.master is None
    for name in ("mu", "nu"):
        assert_tree_close(getattr(view, name), optax.tree.get(s_theirs, name), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"moments: state.mu has shape \(\d+,\), but these params need \(16,\)"):
        optim.moments(s_ours, {"a": jnp.ones((3,))})


# ---------------------------------------------------------------- GPU: kernels against the reference
GPU_CONFIGS = {
    "adamw_fp32": (lambda: optim.adamw(1e-2, weight_decay=0.1), (jnp.float32,)),
    "adamw_master_mixed": (lambda: optim.adamw(1e-2, master_weights=True, max_grad_norm=5.0),
                           (jnp.float32, jnp.bfloat16, jnp.float16)),
    "adamw_bf16_sr": (lambda: optim.adamw(1e-2, stochastic_rounding=True, seed=5), (jnp.bfloat16,)),
    "adam_bf16_moments": (lambda: optim.adam(1e-2, moment_dtype=jnp.bfloat16), (jnp.bfloat16, jnp.float32)),
    "sgd_nesterov_fp16_scaled": (lambda: optim.sgd(1e-2, momentum=0.9, nesterov=True, loss_scale="dynamic",
                                                   initial_loss_scale=8.0), (jnp.float16,)),
    "sgd_plain": (lambda: optim.sgd(1e-2, skip_nonfinite=True), (jnp.float32, jnp.bfloat16)),
}


def _run_impl(monkeypatch, impl, make_tx, params, steps, fused, grads_fn=grads_at):
    monkeypatch.setenv("JAX_LS2_IMPL", impl)
    tx = make_tx()
    state = tx.init(params)
    if fused:
        step = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p))
    else:
        step = jax.jit(lambda g, s, p: (lambda u, s2: (u, s2))(*tx.update(g, s, p)))
    outs, finite = [], []
    p = params
    for t in range(steps):
        out, state = step(grads_fn(params, t), state, p)
        outs.append(out)
        finite.append(bool(state.finite))
        if fused:
            p = out
    return outs, state, finite


def _assert_bits_close(a, b, rtol, max_flip_fraction=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        xf, yf = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if jnp.dtype(x.dtype) == jnp.float32:
            np.testing.assert_allclose(xf, yf, rtol=rtol, atol=rtol)
        else:  # low precision: equal, or (stochastic rounding near a tie) one ulp apart, rarely
            np.testing.assert_array_equal(np.isnan(xf), np.isnan(yf))
            xf, yf = np.nan_to_num(xf), np.nan_to_num(yf)
            ulp = np.abs(yf) * (2.0 ** -7 if x.dtype == jnp.bfloat16 else 2.0 ** -10) + 1e-30
            far = np.abs(xf - yf) > 1.01 * ulp
            assert not far.any(), np.abs(xf - yf).max()
            if xf.size:
                assert np.mean(xf != yf) <= max_flip_fraction + 1e-12, np.mean(xf != yf)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_kernel_matches_reference(monkeypatch, name, fused):
    make_tx, dtypes = GPU_CONFIGS[name]
    params = make_params(20, dtypes=dtypes)
    params["big"] = jnp.asarray(np.random.default_rng(1).normal(size=(4099, 3)), dtypes[0])

    def grads(p, t):  # step 3 carries a NaN: checked configs skip it, the others propagate it
        g = grads_at(p, t)
        return dict(g, w5=g["w5"].at[0, 0].set(jnp.nan)) if t == 3 else g

    ours, s1, finite1 = _run_impl(monkeypatch, "cuda", make_tx, params, 5, fused, grads)
    ref, s2, finite2 = _run_impl(monkeypatch, "reference", make_tx, params, 5, fused, grads)
    assert finite1 == finite2 == [True, True, True, False, True], (finite1, finite2)
    flips = 1e-3 if name == "adamw_bf16_sr" else 0.0
    for a, b in zip(ours, ref):
        _assert_bits_close(a, b, rtol=2e-6, max_flip_fraction=flips)
    for field in ("mu", "nu", "master", "loss_scale", "count"):
        x, y = getattr(s1, field), getattr(s2, field)
        if x is not None:
            np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
def test_gpu_many_leaves_several_launches(monkeypatch):
    """260 leaves: 2 kernel launches per pass; every leaf updated like the reference."""
    rng = np.random.default_rng(2)
    params = {f"w{i:03d}": jnp.asarray(rng.normal(size=(i % 13 + 1, i % 5 + 1)), jnp.float32) for i in range(260)}
    make_tx = lambda: optim.adamw(1e-2, max_grad_norm=1.0, skip_nonfinite=True)
    ours, _, _ = _run_impl(monkeypatch, "cuda", make_tx, params, 2, True)
    ref, _, _ = _run_impl(monkeypatch, "reference", make_tx, params, 2, True)
    for a, b in zip(ours, ref):
        _assert_bits_close(a, b, rtol=2e-6)
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ours[-1]), jax.tree.leaves(params))]
    assert min(moved) > 0


@pytest.mark.gpu
def test_gpu_accumulate_matches_reference(monkeypatch):
    params = make_params(21, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    outs = {}
    for impl in ("cuda", "reference"):
        monkeypatch.setenv("JAX_LS2_IMPL", impl)
        acc = optim.init_accumulator(params)
        add = jax.jit(lambda a, g, s: optim.accumulate(a, g, s), donate_argnums=0)
        for t in range(3):
            acc = add(acc, grads_at(params, t), 0.5)
        outs[impl] = np.asarray(acc.buffer)
    np.testing.assert_allclose(outs["cuda"], outs["reference"], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_compiled_program_calls_the_kernel():
    params = make_params(22)
    tx = optim.adamw(1e-3)
    fn = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p), donate_argnums=(1, 2))
    hlo = fn.lower(params, tx.init(params), params).compile().as_text()
    assert hlo.count("jax_ls2_optim_update") >= 1


# ---------------------------------------------------------------- convergence
def _mlp_loss(params, x, y):
    h = x.astype(params["w1"].dtype)
    h = jnp.tanh(h @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    logits = (h @ params["w3"] + params["b3"]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _train_mlp(tx, dtype, steps=300):
    """A small classifier (16 -> 64 -> 64 -> 8) on a fixed teacher with 10% label noise,
    so the loss stays O(1) as in language-model training; returns the final loss in fp32."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1024, 16)), jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    y = jnp.argmax(jnp.sin(x @ teacher), axis=1)
    y = jnp.where(jnp.asarray(rng.random(1024) < 0.1), jnp.asarray(rng.integers(0, 8, 1024)), y)
    init = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
    params = {"w1": init(16, 64), "b1": jnp.zeros((64,)), "w2": init(64, 64), "b2": jnp.zeros((64,)),
              "w3": init(64, 8), "b3": jnp.zeros((8,))}
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        g = jax.grad(_mlp_loss)(p, x, y)
        return optim.apply_updates(tx, g, s, p)

    for _ in range(steps):
        params, state = step(params, state)
    return float(_mlp_loss(jax.tree.map(lambda p: p.astype(jnp.float32), params), x, y))


@pytest.mark.slow
def test_no_master_bf16_stochastic_rounding_converges_like_fp32_master():
    """300 AdamW steps: bf16 params without master weights (fp32 moments, stochastic
    rounding) end within 3% of the loss of bf16 params with fp32 master weights (measured:
    2.5%; the 1% goal is not met on this task), while rounding to nearest ends far worse."""
    lr = optax.cosine_decay_schedule(3e-3, 300, 0.1)
    master = _train_mlp(optim.adamw(lr, weight_decay=1e-4, master_weights=True), jnp.bfloat16)
    bf16_sr = _train_mlp(optim.adamw(lr, weight_decay=1e-4, stochastic_rounding=True, seed=1), jnp.bfloat16)
    bf16_rn = _train_mlp(optim.adamw(lr, weight_decay=1e-4), jnp.bfloat16)
    first = _train_mlp(optim.adamw(lr), jnp.float32, steps=1)
    assert master < 0.7 * first  # the model learned something
    assert abs(bf16_sr - master) <= 0.03 * master, (bf16_sr, master)
    assert abs(bf16_rn - master) > 10 * abs(bf16_sr - master), (bf16_rn, bf16_sr, master)


@functools.lru_cache(maxsize=None)
def _tiny_gpt(param_dtype):
    """The zoo's tiny GPT (plain-Flax twin, bf16 compute): its initial params and ONE
    jitted gradient and evaluation shared by every optimizer trained on it, so the
    model's backward pass compiles once per dtype rather than once per optimizer."""
    from flax import nnx

    import flax_models as fm
    from flax_models.data import make_batch

    cfg = fm.get_config("gpt", "tiny")
    batch = lambda seed, s: {k: jnp.asarray(v) for k, v in make_batch(cfg, seed, s, 8, 64).items()}
    model = fm.build(cfg, impl="plain", dtype=jnp.bfloat16, param_dtype=param_dtype, seed=0)
    model.eval()
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = lambda p, b: nnx.merge(graph, p, rest).loss(b)[0]
    return params, batch, jax.jit(jax.grad(loss_fn)), jax.jit(loss_fn)


def _train_tiny_gpt(tx, param_dtype, steps=300):
    """The tiny GPT trained on the standard library's source text; returns the mean
    loss on 8 held-out batches."""
    params, batch, grad_fn, evaluate = _tiny_gpt(param_dtype)
    state = tx.init(params)
    update = jax.jit(lambda p, s, g: optim.apply_updates(tx, g, s, p))
    for s in range(steps):
        params, state = update(params, state, grad_fn(params, batch(0, s)))
    return float(np.mean([evaluate(params, batch(1, s)) for s in range(8)]))


@pytest.mark.slow
@pytest.mark.optimized_cpu_code
def test_tiny_gpt_no_master_bf16_with_stochastic_rounding_ends_within_1pct_of_master():
    """300 AdamW steps of a small real model (measured on the CPU reference: fp32-master
    2.6319, no-master bf16 + stochastic rounding 2.6362 (+0.17%), round-to-nearest 2.6611
    (+1.11%))."""
    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 300, 3e-4)
    master = _train_tiny_gpt(optim.adamw(lr, weight_decay=0.01, master_weights=True), jnp.bfloat16)
    sr = _train_tiny_gpt(optim.adamw(lr, weight_decay=0.01, stochastic_rounding=True, seed=1), jnp.bfloat16)
    rn = _train_tiny_gpt(optim.adamw(lr, weight_decay=0.01), jnp.bfloat16)
    assert master < 0.6 * np.log(256)  # learned well past a uniform byte model
    assert abs(sr - master) <= 0.01 * master, (sr, master)
    assert abs(rn - master) > abs(sr - master), (rn, sr, master)
