"""jax_ls2.fp8 recipe and meta state: validation, the scale/history update against a
hand computation of the recipe, and the split/merge/update/join helpers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ls2 import fp8

F32_MAX = float(np.finfo(np.float32).max)


def test_fp8_max_values():
    assert fp8.fp8_max(fp8.E4M3) == 448.0 and fp8.fp8_max(fp8.E5M2) == 57344.0


def test_recipe_is_frozen_hashable_and_picks_formats():
    r = fp8.DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == \
        (0, "hybrid", 1024, "max", True)
    assert hash(r) == hash(fp8.DelayedScaling()) and r != fp8.DelayedScaling(margin=1)
    with pytest.raises(Exception):
        r.margin = 3
    assert r.operand_dtypes() == (fp8.E4M3, fp8.E4M3, fp8.E5M2)
    assert fp8.DelayedScaling(fp8_format="e4m3").operand_dtypes() == (fp8.E4M3,) * 3
    np.testing.assert_array_equal(r.operand_fp8_max(), [448.0, 448.0, 57344.0])


@pytest.mark.parametrize("kwargs, arg", [
    ({"fp8_format": "e5m2"}, "fp8_format"), ({"fp8_format": "HYBRID "}, "fp8_format"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"), ({"amax_history_len": 0}, "amax_history_len"),
    ({"amax_history_len": 2.0}, "amax_history_len"), ({"margin": -1}, "margin"), ({"margin": 0.5}, "margin"),
    ({"margin": 127}, "margin"), ({"margin": 200}, "margin"), ({"margin": float("inf")}, "margin"),
    ({"reduce_amax": 1}, "reduce_amax"),
])
def test_recipe_rejects_bad_arguments(kwargs, arg):
    (value,) = kwargs.values()
    with pytest.raises(ValueError, match=rf"DelayedScaling: {arg} must be .*got {value!r}".replace("(", r"\(")):
        fp8.DelayedScaling(**kwargs)


def test_largest_margin_keeps_finite_nonzero_scales():
    """margin=MAX_MARGIN (126) is accepted and its 2**margin divides to non-zero
    scales, in eager code and under jit."""
    r = fp8.DelayedScaling(margin=fp8.recipe.MAX_MARGIN)
    assert r.margin == 126
    args = (jnp.ones((3,)), jnp.ones((3,)), r.operand_fp8_max())
    for scale in (r.compute_scale(*args), jax.jit(r.compute_scale)(*args)):
        assert bool(jnp.all(jnp.isfinite(scale) & (scale > 0)))


def _hand_step(history, scale, observed, *, algo, margin, maxes):
    """The recipe by hand in float64 numpy, one operand row at a time."""
    history = np.concatenate([[observed], history[:-1]])
    amax = history.max() if algo == "max" else history[0]
    if amax > 0 and np.isfinite(amax):
        new = maxes / amax / 2.0 ** margin
        scale = F32_MAX if new > F32_MAX else new
    return history, scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_update_meta_equals_hand_computation(algo, margin):
    recipe = fp8.DelayedScaling(margin=margin, amax_history_len=3, amax_compute_algo=algo)
    maxes = [448.0, 448.0, 57344.0]
    rng = np.random.default_rng(margin)
    # Rows: input, weight, output gradient; steps include a zero amax, a tiny one whose
    # scale overflows float32, and non-finite ones (the previous scale is kept).
    steps = [rng.uniform(0.5, 8.0, 3), np.array([0.0, 3.0, 1e-3]), rng.uniform(0.5, 8.0, 3),
             np.array([2.0, 1e-39, np.inf]), np.array([np.nan, 0.25, 5.0]), rng.uniform(0.5, 8.0, 3)]
    meta = fp8.DotMeta.create(recipe)
    hand = [(np.zeros(3), 1.0) for _ in range(3)]
    for observed in steps:
        meta = jax.jit(fp8.update_meta, static_argnums=2)(
            meta, fp8.DotMeta.observation(jnp.asarray(observed, jnp.float32), meta), recipe)
        hand = [_hand_step(h, s, np.float32(o), algo=algo, margin=margin, maxes=m)
                for (h, s), o, m in zip(hand, observed, maxes)]
        np.testing.assert_array_equal(meta.amax_history, np.float32([h for h, _ in hand]))
        np.testing.assert_allclose(meta.scale, [s for _, s in hand], rtol=1e-6)
        # 1 / float32-max is subnormal; XLA flushes it to zero.
        np.testing.assert_allclose(meta.scale_inv, 1.0 / np.float64(meta.scale), rtol=1e-6,
                                   atol=np.finfo(np.float32).tiny)
        assert meta.scale.dtype == meta.scale_inv.dtype == meta.amax_history.dtype == jnp.float32


def test_zero_and_nonfinite_amax_keep_the_previous_scale():
    recipe = fp8.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
    meta = fp8.update_meta(fp8.DotMeta.create(recipe), fp8.DotMeta.observation(jnp.float32([4.0, 8.0, 2.0]),
                                                                                 fp8.DotMeta.create(recipe)), recipe)
    np.testing.assert_array_equal(meta.scale, [112.0, 56.0, 28672.0])
    later = fp8.update_meta(meta, fp8.DotMeta.observation(jnp.float32([0.0, np.nan, np.inf]), meta), recipe)
    np.testing.assert_array_equal(later.scale, meta.scale)


def _tree(recipe):
    k = jax.random.split(jax.random.key(0), 2)
    return {"a": {"kernel": jax.random.normal(k[0], (4, 3)), "fp8": fp8.DotMeta.create(recipe)},
            "b": {"kernel": jax.random.normal(k[1], (3, 2)), "fp8": fp8.DotMeta.create(recipe)}}


def test_split_merge_update_join_on_a_pytree():
    recipe = fp8.DelayedScaling(amax_history_len=2)
    tree = _tree(recipe)
    params, meta = fp8.split_meta(tree)
    assert params["a"]["fp8"] is None and meta["a"]["kernel"] is None
    assert isinstance(meta["b"]["fp8"], fp8.DotMeta)
    assert jax.tree.all(jax.tree.map(lambda x, y: x is y, fp8.join_meta(params, meta), tree))

    def obs(vals):
        return {k: {"kernel": None, "fp8": fp8.DotMeta.observation(jnp.float32(v), tree[k]["fp8"])}
                for k, v in vals.items()}
    u1, u2 = obs({"a": [1, 5, 2], "b": [3, 1, 1]}), obs({"a": [2, 4, 2], "b": [1, 1, 7]})
    merged = fp8.merge_meta_updates(fp8.merge_meta_updates(None, u1), u2)
    np.testing.assert_array_equal(merged["a"]["fp8"].observed_amax(), [2, 5, 2])
    np.testing.assert_array_equal(merged["b"]["fp8"].observed_amax(), [3, 1, 7])
    new = fp8.update_meta(tree, merged, recipe)
    assert new["a"]["kernel"] is tree["a"]["kernel"]
    np.testing.assert_allclose(new["b"]["fp8"].scale, [448 / 3, 448.0, 57344 / 7], rtol=1e-6)
    with pytest.raises(ValueError, match="update_meta: both trees must have one structure"):
        fp8.update_meta(tree, {"a": merged["a"]}, recipe)


class _TwoDots(nnx.Module):
    def __init__(self, recipe):
        self.w = nnx.Param(jnp.ones((4, 4)))
        self.dot1 = fp8.FP8DotMeta.create(recipe)
        self.dot2 = fp8.FP8DotMeta(recipe)


def test_fp8_meta_is_its_own_variable_and_the_helpers_take_nnx_state():
    recipe = fp8.DelayedScaling(amax_history_len=5)
    model = _TwoDots(recipe)
    assert isinstance(model.dot1.meta, fp8.FP8Meta) and not isinstance(model.dot1.meta, nnx.Param)
    assert {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))} == {("w",)}
    meta_state = nnx.state(model, fp8.FP8Meta)
    assert model.dot2.value().amax_history.shape == (3, 5)
    updates = jax.tree.map(lambda v: v.replace(fp8.DotMeta.observation(jnp.float32([1.0, 2.0, 4.0]), v.get_value())),
                           meta_state, is_leaf=fp8.is_meta)
    grads = nnx.merge_state(nnx.state(model, nnx.Param), updates)
    param_grads, meta_updates = fp8.split_meta(grads)
    assert {p for p, _ in nnx.to_flat_state(param_grads)} == {("w",)}
    nnx.update(model, fp8.update_meta(meta_state, meta_updates, recipe))
    np.testing.assert_allclose(model.dot1.value().scale, [448.0, 224.0, 14336.0])
    np.testing.assert_array_equal(model.dot2.value().amax_history[:, :2], [[1, 0], [2, 0], [4, 0]])
