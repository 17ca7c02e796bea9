"""The FP8 meta in training steps: jax_ls2.fp8.update_nnx / accumulate_flat / apply_updates
and jax_ls2.fp8.apply_meta_updates / accumulate_meta_updates take the meta updates out
of the gradients before any optimizer, clipping, MultiSteps or apply_if_finite sees
them, step the metas once per optimizer step, and merge micro-batches by max."""
import warnings
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ls2 import fp8, optim
from jax_ls2.nn import TransformerEncoderLayer

RECIPE = fp8.DelayedScaling(amax_history_len=4)
MICRO = 4
HIDDEN, FFN, HEADS = 32, 64, 4


def _layer(recipe=RECIPE):
    return TransformerEncoderLayer(HIDDEN, FFN, HEADS, fp8=recipe, deterministic=True, rngs=nnx.Rngs(0))


def _micro_batches(n=MICRO):
    k = jax.random.split(jax.random.key(5), 2 * n)
    # Other magnitudes per micro-batch, so that no single one holds every row's max.
    scales = [1.0, 4.0, 2.0, 0.5, 3.0, 0.7, 1.5, 2.5][:n]
    xs = [jax.random.normal(k[i], (2, 8, HIDDEN)) * s for i, s in enumerate(scales)]
    cs = [jax.random.normal(k[n + i], (2, 8, HIDDEN)) * s for i, s in enumerate(reversed(scales))]
    return xs, cs


def _split(model):
    """graphdef, params and metas (nnx.States), the rest of the model's state."""
    graphdef, params, metas, rest = nnx.split(model, nnx.Param, fp8.FP8Meta, ...)
    return graphdef, params, metas, rest


def _grad_fn(graphdef, rest):
    """jit(grad) of a loss of the layer w.r.t. a State holding its params and metas."""
    def loss(variables, x, c):
        return jnp.sum(nnx.merge(graphdef, variables, rest)(x) * c)
    return jax.jit(jax.grad(loss))


def _max_observations(updates_list):
    """The meta updates of several micro-batches merged by hand with numpy's maximum."""
    arrays = [jax.tree.leaves(u) for u in updates_list]
    merged = [np.maximum.reduce([np.asarray(a[i]) for a in arrays]) for i in range(len(arrays[0]))]
    return jax.tree.unflatten(jax.tree.structure(updates_list[0]), [jnp.asarray(m) for m in merged])


def _assert_tree_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


class _Spy:
    """An optax transformation recording, at trace time, how many FP8 meta nodes and
    leaves the updates it is given hold."""

    def __init__(self):
        self.seen = []

    def transformation(self):
        def update(updates, state, params=None):
            self.seen.append((fp8.count_metas(updates), len(jax.tree.leaves(updates))))
            return updates, state
        return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_accumulate_and_apply_updates_step_the_meta_by_the_max_over_micro_batches():
    model = _layer()
    graphdef, params, metas, rest = _split(model)
    variables = nnx.merge_state(params, metas)
    grad = _grad_fn(graphdef, rest)
    xs, cs = _micro_batches()
    tx = optim.adamw(1e-2)
    state = tx.init(params)

    acc = fp8.init_flat_accumulator(variables)
    plain_acc = optim.init_accumulator(params)
    add, add_flat = jax.jit(optim.accumulate), jax.jit(fp8.accumulate_flat)
    observed = []
    for x, c in zip(xs, cs):
        g = grad(variables, x, c)
        param_grads, meta_updates = fp8.split_meta(g)
        observed.append(meta_updates)
        acc = add_flat(acc, g, 1.0 / MICRO)
        plain_acc = add(plain_acc, param_grads, 1.0 / MICRO)
    new_vars, new_state = jax.jit(lambda g, s, v: fp8.apply_updates(tx, g, s, v, fp8=RECIPE))(acc, state, variables)

    expected_metas = fp8.update_meta(metas, _max_observations(observed), RECIPE)
    new_params, new_metas = fp8.split_meta(new_vars)
    _assert_tree_equal(new_metas, expected_metas)
    # The params take the step they take without any FP8 meta around.
    ref_params, ref_state = jax.jit(lambda g, s, p: optim.apply_updates(tx, g, s, p))(plain_acc, state, params)
    _assert_tree_equal(new_params, ref_params)
    _assert_tree_equal(new_state, ref_state)
    # unflatten_grads puts the merged meta updates where the metas are.
    _, unflattened_meta = fp8.split_meta(fp8.unflatten_flat_grads(acc, variables))
    _assert_tree_equal(unflattened_meta, _max_observations(observed))


def test_optax_multisteps_with_accumulate_meta_updates_steps_the_meta_by_the_max():
    model = _layer()
    graphdef, params, metas, rest = _split(model)
    grad = _grad_fn(graphdef, rest)
    xs, cs = _micro_batches(2 * MICRO)
    spy = _Spy()
    inner = optax.chain(spy.transformation(), optax.clip_by_global_norm(1.0),
                        optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=2))
    tx = optax.MultiSteps(inner, every_k_schedule=MICRO)
    opt_state = tx.init(params)

    @jax.jit
    def micro_step(params, metas, opt_state, pending, x, c):
        grads = grad(fp8.join_meta(params, metas), x, c)
        param_grads, pending = fp8.accumulate_meta_updates(pending, grads, reset=opt_state.mini_step == 0)
        updates, opt_state = tx.update(param_grads, opt_state, params)
        _, metas = fp8.apply_meta_updates(metas, pending, RECIPE, when=tx.has_updated(opt_state))
        return optax.apply_updates(params, updates), metas, opt_state, pending

    pending = fp8.meta_updates_like(metas)
    expected = metas
    for start in (0, MICRO):  # two optimizer steps of MICRO micro-batches each
        observed = [fp8.split_meta(grad(fp8.join_meta(params, expected), xs[i], cs[i]))[1]
                    for i in range(start, start + MICRO)]
        before = expected
        expected = fp8.update_meta(expected, _max_observations(observed), RECIPE)
        for i in range(start, start + MICRO):
            params, metas, opt_state, pending = micro_step(params, metas, opt_state, pending, xs[i], cs[i])
            _assert_tree_equal(metas, expected if i == start + MICRO - 1 else before)
    n_params = len(jax.tree.leaves(params))
    assert spy.seen and all(seen == (0, n_params) for seen in spy.seen), spy.seen
    assert fp8.count_metas(opt_state.acc_grads) == 0 and len(jax.tree.leaves(opt_state.acc_grads)) == n_params


def test_update_nnx_steps_params_and_meta_separately():
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta))
    xs, cs = _micro_batches(1)
    loss = lambda m: jnp.sum(m(xs[0]) * cs[0])
    for tx in (optim.adamw(1e-2), optax.adamw(1e-2)):
        model, twin = _layer(), _layer()
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        twin_opt = nnx.Optimizer(twin, tx, wrt=nnx.Param)
        grads = nnx.grad(loss, argnums=wrt)(model)
        param_grads, meta_updates = fp8.split_meta(grads)
        expected_meta = fp8.update_meta(nnx.state(model, fp8.FP8Meta), meta_updates, RECIPE)

        fp8.update_nnx(opt, model, grads, fp8=RECIPE)
        optim.update_nnx(twin_opt, twin, param_grads)
        _assert_tree_equal(nnx.state(model, fp8.FP8Meta), expected_meta)
        _assert_tree_equal(nnx.state(model, nnx.Param), nnx.state(twin, nnx.Param))
        assert not np.array_equal(model.fc1.kernel[...], _layer().fc1.kernel[...])


def test_apply_meta_updates_on_a_module_updates_it_in_place():
    model = _layer()
    xs, cs = _micro_batches(1)
    grads = nnx.grad(lambda m: jnp.sum(m(xs[0]) * cs[0]), argnums=nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta)))(model)
    expected = fp8.update_meta(nnx.state(model, fp8.FP8Meta), fp8.split_meta(grads)[1], RECIPE)
    param_grads, new = fp8.apply_meta_updates(model, grads, RECIPE)
    _assert_tree_equal(new, expected)
    _assert_tree_equal(nnx.state(model, fp8.FP8Meta), expected)
    assert fp8.count_metas(param_grads) == 0
    assert jax.tree.structure(param_grads) == jax.tree.structure(nnx.state(model, nnx.Param))
    # A step whose `when` is False leaves the metas as they are.
    _, same = fp8.apply_meta_updates(model, grads, RECIPE, when=jnp.asarray(False))
    _assert_tree_equal(same, expected)


def test_meta_updates_are_refused_where_they_would_reach_an_optimizer():
    model = _layer()
    xs, cs = _micro_batches(1)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta))
    grads = nnx.grad(lambda m: jnp.sum(m(xs[0]) * cs[0]), argnums=wrt)(model)
    param_only = nnx.grad(lambda m: jnp.sum(m(xs[0]) * cs[0]))(model)
    opt = nnx.Optimizer(model, optim.adamw(1e-2), wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"update_nnx: grads hold FP8 meta updates .*pass fp8="):
        optim.update_nnx(opt, model, grads)
    with pytest.raises(ValueError, match=r"apply_meta_updates: model_or_state holds FP8 metas but grads carry no "
                                         r"meta update"):
        fp8.update_nnx(opt, model, param_only, fp8=RECIPE)
    with pytest.raises(TypeError, match=r"update_nnx: fp8 must be None or a jax_ls2.fp8.DelayedScaling, got str"):
        fp8.update_nnx(opt, model, grads, fp8="hybrid")
    with pytest.raises(TypeError, match=r"update_nnx: optimizer.wrt selects FP8Meta variables"):
        fp8.update_nnx(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Any(nnx.Param, fp8.FP8Meta)), model, grads,
                         fp8=RECIPE)
    with pytest.raises(ValueError, match=r"update_nnx: optimizer.tx is an optax.MultiSteps"):
        fp8.update_nnx(nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), 2), wrt=nnx.Param), model, grads,
                         fp8=RECIPE)
    with pytest.raises(ValueError, match=r"update_nnx: fp8 is set but the model holds no FP8Meta"):
        plain = TransformerEncoderLayer(HIDDEN, FFN, HEADS, deterministic=True, rngs=nnx.Rngs(0))
        fp8.update_nnx(nnx.Optimizer(plain, optax.sgd(0.1), wrt=nnx.Param), plain,
                         nnx.grad(lambda m: jnp.sum(m(xs[0])))(plain), fp8=RECIPE)
    tx = optim.adamw(1e-2)
    state = tx.init(nnx.state(model, nnx.Param))
    with pytest.raises(TypeError, match=r"adamw: grads hold FP8 meta updates"):
        tx.update(nnx.state(grads), state, nnx.state(model, nnx.Any(nnx.Param, fp8.FP8Meta)))
    _, params, metas, _ = _split(model)
    acc = fp8.accumulate_flat(fp8.init_flat_accumulator(nnx.merge_state(params, metas)), grads)
    with pytest.raises(TypeError, match=r"adamw: the FlatGrads carry FP8 meta updates"):
        optim.apply_updates(tx, acc, state, params)
    with pytest.raises(ValueError, match=r"accumulate: grads hold FP8 meta updates but acc has no meta"):
        optim.accumulate(optim.init_accumulator(params), grads)


def test_a_state_holding_params_and_metas_steps_its_metas_and_keeps_its_params():
    """`apply_meta_updates` / `update_meta` on an nnx.State with params beside the metas
    (what `nnx.split(model, nnx.Any(nnx.Param, FP8Meta), ...)` gives): the metas step as
    they do alone, the params come back unchanged."""
    model = _layer()
    graphdef, variables, rest = nnx.split(model, nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    xs, cs = _micro_batches(1)
    grads = jax.grad(lambda v: jnp.sum(nnx.merge(graphdef, v, rest)(xs[0]) * cs[0]))(variables)
    param_grads, new = fp8.apply_meta_updates(variables, grads, RECIPE)
    params, metas = nnx.split_state(variables, nnx.Param, fp8.FP8Meta)
    new_params, new_metas = nnx.split_state(new, nnx.Param, fp8.FP8Meta)
    _assert_tree_equal(new_metas, fp8.update_meta(metas, fp8.split_meta(grads)[1], RECIPE))
    _assert_tree_equal(new_params, params)
    assert fp8.count_metas(param_grads) == 0
    assert not np.array_equal(np.asarray(jax.tree.leaves(new_metas)[1]), np.asarray(jax.tree.leaves(metas)[1]))


def test_optims_old_fp8_keyword_warns_once_and_runs_the_fp8_step():
    from jax_ls2.optim import apply as optim_apply
    optim_apply._warned_moved.clear()
    xs, cs = _micro_batches(1)
    loss = lambda m: jnp.sum(m(xs[0]) * cs[0])
    grad = lambda m: nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta)))(m)
    results = []
    for old in (True, False, True):
        model = _layer()
        opt = nnx.Optimizer(model, optim.adamw(1e-2), wrt=nnx.Param)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step = optim.update_nnx if old else fp8.update_nnx
            step(opt, model, grad(model), fp8=RECIPE)
        moved = [w for w in seen if issubclass(w.category, DeprecationWarning) and "update_nnx" in str(w.message)]
        assert len(moved) == (1 if old and not results else 0), [str(w.message) for w in seen]
        results.append(nnx.state(model, nnx.Any(nnx.Param, fp8.FP8Meta)))
    _assert_tree_equal(results[0], results[1])
    model = _layer()
    tx = optim.adamw(1e-2)
    _, params, _, _ = _split(model)
    variables = nnx.state(model, nnx.Any(nnx.Param, fp8.FP8Meta))
    grads = grad(model)
    with pytest.warns(DeprecationWarning, match=r"optim.apply_updates\(\.\.\., fp8=recipe\) is deprecated: call "
                                                 r"jax_ls2.fp8.apply_updates"):
        got = optim.apply_updates(tx, grads, tx.init(params), variables, fp8=RECIPE)
    _assert_tree_equal(got, fp8.apply_updates(tx, grads, tx.init(params), variables, fp8=RECIPE))
    with pytest.raises(TypeError, match=r"update_nnx: fp8 must be None or a jax_ls2.fp8.DelayedScaling, got str"):
        optim.update_nnx(nnx.Optimizer(model, optim.adamw(1e-2), wrt=nnx.Param), model, grads, fp8="hybrid")
    model = _layer()
    with pytest.raises(ValueError, match=r"init_accumulator: params hold FP8 metas; .*fp8.init_flat_accumulator"):
        optim.init_accumulator(nnx.state(model, nnx.Any(nnx.Param, fp8.FP8Meta)))
