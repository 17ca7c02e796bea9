"""jax_ls2.optim's inputs: values that cannot work are refused with a message naming
the optimizer, the argument, what was expected and what came (at construction for
numbers; a bad traced learning rate or weight decay zeroes its step and flags it in the
state); leaves optax takes (float64 under x64, complex, int, bool) go through optax's
per-leaf math."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_ls2 import optim

INF, NAN = float("inf"), float("nan")


# ---------------------------------------------------------------- loss-scaling parameters
@pytest.mark.parametrize("argument,value,expected", [
    ("initial_loss_scale", 0.0, "a finite number > 0"),
    ("initial_loss_scale", -4.0, "a finite number > 0"),
    ("initial_loss_scale", INF, "a finite number > 0"),
    ("initial_loss_scale", NAN, "a finite number > 0"),
    ("growth_factor", 0.0, "a finite number > 1"),
    ("growth_factor", 1.0, "a finite number > 1"),
    ("growth_factor", INF, "a finite number > 1"),
    ("backoff_factor", 0.0, r"a number in \(0, 1\)"),
    ("backoff_factor", 1.0, r"a number in \(0, 1\)"),
    ("backoff_factor", 2.0, r"a number in \(0, 1\)"),
    ("backoff_factor", NAN, r"a number in \(0, 1\)"),
    ("growth_interval", 0, "an integer >= 1"),
    ("growth_interval", -3, "an integer >= 1"),
    ("growth_interval", 2.5, "an integer >= 1"),
    ("min_loss_scale", 0.0, "a finite number > 0"),
    ("min_loss_scale", -1.0, "a finite number > 0"),
    ("min_loss_scale", INF, "a finite number > 0"),
    ("min_loss_scale", 2.0 ** 20, r"a number <= initial_loss_scale \(32768.0\)"),
])
@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_dynamic_loss_scale_parameters_that_cannot_work_are_refused(name, argument, value, expected):
    with pytest.raises(ValueError, match=rf"{name}: {argument} must be {expected}, got {value}"):
        getattr(optim, name)(1e-3, loss_scale="dynamic", **{argument: value})


@pytest.mark.parametrize("value", [INF, NAN, 0.0, -2.0])
def test_static_loss_scale_must_be_finite_and_positive(value):
    with pytest.raises(ValueError, match=rf"adamw: loss_scale must be a finite number > 0, got {value}"):
        optim.adamw(1e-3, loss_scale=value)


@pytest.mark.parametrize("value", [0.0, -1.0, INF, NAN])
def test_max_grad_norm_must_be_finite_and_positive(value):
    with pytest.raises(ValueError, match=rf"sgd: max_grad_norm must be a finite number > 0, got {value}"):
        optim.sgd(1e-3, max_grad_norm=value)


def test_sound_loss_scale_parameters_are_taken():
    tx = optim.adam(1e-3, loss_scale="dynamic", initial_loss_scale=8.0, growth_factor=1.5,
                    backoff_factor=0.25, growth_interval=1, min_loss_scale=8.0)
    assert float(tx.init({"a": jnp.ones(3)}).loss_scale) == 8.0


# ---------------------------------------------------------------- constant learning rate and weight decay
@pytest.mark.parametrize("make,argument,value", [
    (lambda v: optim.adamw(v), "learning_rate", INF),
    (lambda v: optim.adamw(v), "learning_rate", NAN),
    (lambda v: optim.adamw(v), "learning_rate", -1e-3),
    (lambda v: optim.adam(v), "learning_rate", -INF),
    (lambda v: optim.sgd(v), "learning_rate", INF),
    (lambda v: optim.adamw(v), "learning_rate", np.float32(INF)),
    (lambda v: optim.adamw(v), "learning_rate", jnp.float32(-1.0)),
    (lambda v: optim.adamw(1e-3, weight_decay=v), "weight_decay", INF),
    (lambda v: optim.adamw(1e-3, weight_decay=v), "weight_decay", NAN),
    (lambda v: optim.adamw(1e-3, weight_decay=v), "weight_decay", -0.1),
    (lambda v: optim.sgd(1e-3, weight_decay=v), "weight_decay", INF),
])
def test_constant_learning_rate_and_weight_decay_must_be_finite_and_non_negative(make, argument, value):
    with pytest.raises(ValueError, match=rf"\w+: {argument} must be a finite number >= 0, got "):
        make(value)


@pytest.mark.parametrize("make,argument,value", [
    (lambda v: optim.adamw(v), "learning_rate", "1e-3"),
    (lambda v: optim.adam(v), "learning_rate", None),
    (lambda v: optim.sgd(v), "learning_rate", [1e-3]),
    (lambda v: optim.adamw(1e-3, b1=v), "b1", "0.9"),
    (lambda v: optim.adamw(1e-3, eps=v), "eps", True),
    (lambda v: optim.sgd(1e-3, momentum=v), "b1", "0.9"),
    (lambda v: optim.adamw(1e-3, weight_decay=v), "weight_decay", jnp.array([1 + 1j])),
])
def test_hyper_parameters_of_another_type_are_named_at_construction(make, argument, value):
    with pytest.raises(TypeError, match=rf"^\w+: {argument} must be a (real )?number"):
        make(value)


@pytest.mark.parametrize("factory", [optim.adam, optim.adamw])
@pytest.mark.parametrize("argument,value", [("b1", 1.0), ("b2", 1.0), ("b1", NAN), ("b2", -0.1)])
def test_adam_betas_outside_zero_to_one_are_refused(factory, argument, value):
    with pytest.raises(ValueError, match=rf"^{factory.__name__}: {argument} must be a number in \[0, 1\), got "):
        factory(1e-3, **{argument: value})


@pytest.mark.parametrize("kw,exc,match", [
    (dict(seed=2 ** 40), ValueError, r"adamw: seed must be an int in \[0, 2\*\*32\) or an integer scalar array, got "
                                     r"1099511627776"),
    (dict(seed=-1), ValueError, r"adamw: seed must be an int in \[0, 2\*\*32\)"),
    (dict(seed="abc"), TypeError, r"adamw: seed must be .*, got str 'abc'"),
    (dict(seed=1.5), TypeError, r"adamw: seed must be .*, got float 1.5"),
    (dict(seed=jnp.zeros((2,), jnp.uint32)), TypeError, r"adamw: seed must be .*, got an array of uint32\(2,\)"),
    (dict(moment_dtype="foo"), TypeError, r"adamw: moment_dtype must be float32 or bfloat16 \(or None\), got str 'foo'"),
    (dict(mu_dtype="foo"), TypeError, r"adamw: mu_dtype must be None, float32 or bfloat16, got str 'foo'"),
])
def test_seed_and_moment_dtype_are_checked_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        optim.adamw(1e-3, **kw)


def test_sound_seeds_are_taken():
    for seed in (0, 2 ** 32 - 1, np.uint32(7), jnp.asarray(3, jnp.int32)):
        optim.adamw(1e-3, stochastic_rounding=True, seed=seed).init({"a": jnp.ones((2,), jnp.bfloat16)})


def test_sound_hyper_parameters_of_every_kind_are_taken():
    optim.adamw(optax.linear_schedule(1e-3, 0.0, 10), b1=0.0, b2=np.float32(0.99), eps=jnp.float32(1e-6))
    optim.adam(jnp.asarray(1e-3))
    optim.sgd(1, momentum=0.9)


# ---------------------------------------------------------------- traced learning rate, checked on the device
def _jitted_step(tx, params):
    @jax.jit
    def step(p, s):
        u, s = tx.update(p, s, p)
        return optax.apply_updates(p, u), s
    return step, tx.init(params)


@pytest.mark.parametrize("bad", [-1e-3, INF, NAN])
@pytest.mark.parametrize("factory", [optim.adamw, functools.partial(optim.adamw, skip_nonfinite=True)])
def test_schedule_giving_a_bad_learning_rate_leaves_params_and_flags_the_step(bad, factory):
    params = {"a": jnp.ones((4,))}
    schedule = lambda count: jnp.where(count >= 2, bad, 1e-3)  # good for two steps, then bad
    step, state = _jitted_step(factory(schedule), params)
    for _ in range(2):
        params, state = step(params, state)
        assert bool(state.finite)
    before = np.asarray(params["a"])
    assert not np.allclose(before, 1.0)  # the good steps moved them
    params, state = step(params, state)
    np.testing.assert_array_equal(np.asarray(params["a"]), before)
    assert not bool(state.finite)


def test_injected_negative_learning_rate_leaves_params_and_flags_the_step():
    params = {"a": jnp.ones((4,))}
    tx = optax.inject_hyperparams(optim.sgd)(learning_rate=1e-2, momentum=0.9)
    step, state = _jitted_step(tx, params)
    params, state = step(params, state)
    assert bool(state.inner_state.finite)
    state.hyperparams["learning_rate"] = jnp.asarray(-0.5)
    new, state = step(params, state)
    np.testing.assert_array_equal(np.asarray(new["a"]), np.asarray(params["a"]))
    assert not bool(state.inner_state.finite)


@pytest.mark.parametrize("params", [{"a": jnp.ones((4,))},
                                    {"a": jnp.ones((4,)), "steps": jnp.zeros((), jnp.int32)}],
                         ids=["fused", "per_leaf"])
def test_traced_weight_decay_checked_too(params):
    step = jax.jit(lambda p, wd: optim.adamw(1e-3, weight_decay=wd).update(p, optim.adamw(1e-3).init(p), p))
    updates, state = step(params, 0.1)
    assert bool(state.finite) and np.all(np.asarray(updates["a"]) != 0)
    updates, state = step(params, -0.1)
    np.testing.assert_array_equal(np.asarray(updates["a"]), 0.0)
    assert not bool(state.finite)


def test_bad_rate_under_vmap_flags_only_its_element():
    params = {"a": jnp.ones((4,))}
    tx = optim.sgd(1e-3)
    state = tx.init(params)
    sweep = jax.jit(jax.vmap(lambda lr: optim.sgd(lr).update(params, state, params)))
    updates, states = sweep(jnp.asarray([0.1, -0.2, NAN]))
    np.testing.assert_allclose(np.asarray(updates["a"]), [[-0.1] * 4, [0.0] * 4, [0.0] * 4], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(states.finite), [True, False, False])


def test_rate_check_adds_no_host_callback_or_conditional():
    """A traced rate is checked by a few scalar operations on the device: no host
    callback and no conditional, which would stall the stream every step. (With the
    kernels built, platform_dependent adds conditionals of its own to both programs.)"""
    params = {"a": jnp.ones((4,))}
    state = optim.adam(1e-3).init(params)
    text = lambda tx: jax.jit(lambda p, s: tx.update(p, s, p)).lower(params, state).as_text()
    scheduled = text(optim.adam(lambda c: 1e-3 / (1.0 + c)))
    constant = text(optim.adam(1e-3))
    assert "callback" not in scheduled and "callback" not in constant
    assert scheduled.count("stablehlo.case") == constant.count("stablehlo.case")
    assert scheduled.count("stablehlo.is_finite") == constant.count("stablehlo.is_finite") + 1


# ---------------------------------------------------------------- leaves the kernel does not take: optax's math
PAIRS = {
    "adamw": (lambda: optim.adamw(1e-2, weight_decay=0.1), lambda: optax.adamw(1e-2, weight_decay=0.1)),
    "adam_schedule": (lambda: optim.adam(lambda c: 1e-2 / (1.0 + c)), lambda: optax.adam(lambda c: 1e-2 / (1.0 + c))),
    "sgd_nesterov": (lambda: optim.sgd(1e-2, 0.9, True), lambda: optax.sgd(1e-2, 0.9, True)),
    "sgd": (lambda: optim.sgd(1e-2), lambda: optax.sgd(1e-2)),
}


def _tree(dtype, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *s: rng.normal(size=s) + (1j * rng.normal(size=s) if jnp.issubdtype(dtype, jnp.complexfloating)
                                             else 0)
    return {"w": jnp.asarray(draw(7, 5), dtype), "b": jnp.asarray(draw(5), dtype),
            "f32": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}


def _steps(tx, params, n=4, jit=True, fused_apply=False):
    """`n` steps on fresh gradients; returns the params and the update of every step."""
    state = tx.init(params)

    def step(p, s, g):
        if fused_apply:
            return optim.apply_updates(tx, g, s, p) + (None,)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u
    step = jax.jit(step) if jit else step
    updates = []
    for t in range(n):
        g = jax.tree.map(lambda x: x * 0.5 + _tree(x.dtype, seed=t + 1)["b"][0], params)
        params, state, u = step(params, state, g)
        updates.append(u)
    return params, state, updates


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("dtype", ["float64", "complex64", "complex128"])
def test_float64_and_complex_leaves_follow_optax_exactly(dtype, pair, jit):
    """Under x64 (float64, complex128) and with complex64 leaves the whole tree goes
    through optax's per-leaf math: the same updates, params and moments, in the same dtypes."""
    ours, theirs = (make() for make in PAIRS[pair])
    with jax.enable_x64(dtype != "complex64"):
        params = _tree(jnp.dtype(dtype))
        p_ours, s_ours, u_ours = _steps(ours, params, jit=jit)
        p_theirs, s_theirs, u_theirs = _steps(theirs, params, jit=jit)
        _assert_same(u_ours, u_theirs)
        _assert_same(p_ours, p_theirs)
        for name in ("mu", "nu", "trace"):
            theirs_m = optax.tree.get(s_theirs, name, None)
            if theirs_m is not None:
                _assert_same(getattr(s_ours, "nu" if name == "nu" else "mu"), theirs_m)
                _assert_same(getattr(optim.moments(s_ours, params), "nu" if name == "nu" else "mu"), theirs_m)


def test_fused_apply_on_the_per_leaf_path_is_optax_apply_updates():
    with jax.enable_x64(True):
        params = _tree(jnp.float64)
        p_fused, _, _ = _steps(optim.adamw(1e-2), params, fused_apply=True)
        p_optax, _, _ = _steps(optax.adamw(1e-2, weight_decay=1e-4), params)
        _assert_same(p_fused, p_optax)


def test_float64_leaf_without_x64_is_float32_as_jax_makes_it():
    """Without x64 JAX itself makes a float64 NumPy array float32: the kernel's path."""
    params = {"w": np.ones((3,), np.float64)}
    state = optim.adam(1e-2).init(params)
    assert state.mu.shape == (16,) and state.mu.dtype == jnp.float32


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_int_and_bool_leaves_pass_through_as_optax_does(pair):
    """optax runs its float math on integer and bool leaves too (float updates; its
    apply_updates casts the new params back): the same numbers and dtypes here."""
    ours, theirs = (make() for make in PAIRS[pair])
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32),
              "count": jnp.asarray([1, 2, 3], jnp.int32), "flag": jnp.asarray([True, False])}
    grads = {"w": jnp.full((4, 3), 0.5, jnp.float32), "count": jnp.asarray([1, 1, 1], jnp.int32),
             "flag": jnp.asarray([True, True])}
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for _ in range(2):
        u_ours, s_ours = ours.update(grads, s_ours, params)
        u_theirs, s_theirs = theirs.update(grads, s_theirs, params)
        _assert_same(u_ours, u_theirs)
        _assert_same(optax.apply_updates(params, u_ours), optax.apply_updates(params, u_theirs))


FLOAT_PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.ones(())}


@pytest.mark.parametrize("leaf", [jnp.ones((3, 2), jnp.int32), jnp.ones((3, 2), bool), jnp.ones((3, 2), jnp.complex64)],
                         ids=["int32", "bool", "complex64"])
@pytest.mark.parametrize("with_params", [True, False])
def test_a_gradient_leaf_off_the_float_params_path_is_named(leaf, with_params):
    tx = optim.adam(1e-3)
    state = tx.init(FLOAT_PARAMS)
    grads = {"w": leaf, "b": jnp.ones(())}
    with pytest.raises(TypeError, match=rf"adam: grads leaf \['w'\] has dtype {jnp.dtype(leaf.dtype)}, but the params "
                                        r"are all float32, float16 or bfloat16"):
        tx.update(grads, state, FLOAT_PARAMS if with_params else None)


def test_float64_gradient_under_x64_on_float_params_is_named():
    with jax.enable_x64(True):
        params = {"w": jnp.ones((3,), jnp.float32)}
        tx = optim.adamw(1e-3)
        with pytest.raises(TypeError, match=r"adamw: grads leaf \['w'\] has dtype float64"):
            tx.update({"w": np.ones((3,))}, tx.init(params), params)


def test_python_float_and_float64_numpy_gradients_are_float32_as_optax_makes_them():
    """Without x64, JAX makes a Python float or a float64 NumPy array float32: the updates
    are optax's, in float32."""
    grads = {"w": np.full((3, 2), 0.25), "b": 0.5}
    for ours, theirs in ((optim.adamw(1e-2), optax.adamw(1e-2)), (optim.sgd(1e-2, 0.9), optax.sgd(1e-2, 0.9))):
        u, _ = ours.update(grads, ours.init(FLOAT_PARAMS), FLOAT_PARAMS)
        v, _ = theirs.update(grads, theirs.init(FLOAT_PARAMS), FLOAT_PARAMS)
        for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
            assert x.dtype == y.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


@pytest.mark.parametrize("made_by,used_by,field", [
    (lambda: optim.sgd(1e-3), lambda: optim.adamw(1e-3), "mu"),
    (lambda: optim.sgd(1e-3, momentum=0.9), lambda: optim.adamw(1e-3), "nu"),
    (lambda: optim.adamw(1e-3), lambda: optim.sgd(1e-3), "mu"),
    (lambda: optim.adamw(1e-3), lambda: optim.sgd(1e-3, momentum=0.9), "nu"),
    (lambda: optim.adamw(1e-3), lambda: optim.adamw(1e-3, master_weights=True), "master"),
])
def test_a_state_made_by_another_optimizer_is_refused(made_by, used_by, field):
    state = made_by().init(FLOAT_PARAMS)
    tx = used_by()
    with pytest.raises(ValueError, match=rf"^\w+: state.{field} is (None|set), but this \w+ keeps .*made by another "
                                         r"optimizer's init"):
        tx.update(FLOAT_PARAMS, state, FLOAT_PARAMS)


def test_python_int_params_as_optax_extra_args_uses_them():
    tx = optim.adam(1e-3)
    params = {"a": 1, "b": 2}
    u, _ = tx.update(params, tx.init(params))
    v, _ = optax.adam(1e-3).update(params, optax.adam(1e-3).init(params))
    _assert_same(u, v)


def test_per_leaf_path_keeps_loss_scaling_and_the_finite_check():
    tx = optim.adam(1e-2, loss_scale="dynamic", initial_loss_scale=4.0)
    with jax.enable_x64(True):
        params = _tree(jnp.float64)
        state = tx.init(params)
        grads = jax.tree.map(lambda x: x * 4.0, params)  # scaled by the loss scale
        u, state = jax.jit(tx.update)(grads, state, params)
        v, _ = jax.jit(optax.adam(1e-2).update)(params, optax.adam(1e-2).init(params))
        _assert_same(u, v)  # the scale is a power of two: unscaling is exact
        bad = {**grads, "b": grads["b"].at[0].set(jnp.inf)}
        u, after = jax.jit(tx.update)(bad, state, params)
        assert not bool(after.finite) and int(after.count) == 1 and float(after.loss_scale) == 2.0
        assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u))
        _assert_same(after.mu, state.mu)


def test_per_leaf_path_refuses_what_only_the_kernel_does():
    with jax.enable_x64(True):
        params = {"h": jnp.ones((3,), jnp.bfloat16), "d": jnp.ones((2,), jnp.float64)}
        with pytest.raises(ValueError, match="adamw: master_weights=True needs params of dtype float32, float16 or "
                                             "bfloat16 .*; params leaf 0 is float64"):
            optim.adamw(1e-2, master_weights=True).init(params)
        with pytest.raises(ValueError, match="sgd: stochastic_rounding=True needs params"):
            optim.sgd(1e-2, stochastic_rounding=True).init(params)
        tx = optim.adam(1e-2)
        state = tx.init({"h": params["h"], "d": params["h"]})  # a kernel-path state for another tree
        with pytest.raises(ValueError, match="adam: state.mu must be a tree like params for params with float64"):
            tx.update(params, state, params)
