"""What a Flax port needed from the ops: bias=None in the dropout ops, a functional
dropout with the kernels' mask, and per-token weights in the cross entropies."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ls2.ops as ops
from jax_ls2 import _random
from jax_ls2.ops import bias_act_dropout, bias_dropout_residual, cross_entropy, dropout, linear_cross_entropy

KEY = jax.random.key(5)
RATE = 0.3


def _normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# ---------------------------------------------------------------- bias=None
@pytest.mark.parametrize("rate", [0.0, RATE])
def test_bias_dropout_residual_without_bias(rate):
    x, r, dy = _normal((3, 5, 24)), _normal((3, 5, 24), 1), _normal((3, 5, 24), 2)
    zero = jnp.zeros((24,))
    no_bias = lambda x, r: bias_dropout_residual(x, None, r, rate=rate, key=KEY)
    zero_bias = lambda x, r: bias_dropout_residual(x, zero, r, rate=rate, key=KEY)
    np.testing.assert_array_equal(jax.jit(no_bias)(x, r), zero_bias(x, r))
    got = jax.grad(lambda p: jnp.sum(no_bias(**p) * dy))({"x": x, "r": r})
    assert sorted(got) == ["r", "x"]
    want = jax.grad(lambda x, r: jnp.sum(zero_bias(x, r) * dy), (0, 1))(x, r)
    np.testing.assert_array_equal(got["x"], want[0])
    np.testing.assert_array_equal(got["r"], want[1])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_bias_act_dropout_without_bias(activation):
    x, dy = _normal((4, 40)), _normal((4, 40), 2)
    no_bias = lambda x: bias_act_dropout(x, None, activation=activation, rate=RATE, key=KEY)
    zero_bias = lambda x: bias_act_dropout(x, jnp.zeros((40,)), activation=activation, rate=RATE, key=KEY)
    np.testing.assert_array_equal(jax.jit(no_bias)(x), zero_bias(x))
    np.testing.assert_array_equal(jax.vmap(no_bias)(x[:, None]), jax.vmap(zero_bias)(x[:, None]))
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(no_bias(x) * dy))(x),
                                  jax.grad(lambda x: jnp.sum(zero_bias(x) * dy))(x))


# ---------------------------------------------------------------- functional dropout
def test_dropout_is_exported_and_draws_the_kernels_mask():
    assert ops.dropout is dropout and "dropout" in ops.__all__
    x = _normal((6, 7, 33), dtype=jnp.bfloat16)
    y = dropout(x, rate=RATE, key=KEY)
    assert y.dtype == x.dtype and y.shape == x.shape
    # The same mask and the same float32 arithmetic as the fused op with nothing around it.
    np.testing.assert_array_equal(y, bias_dropout_residual(x, None, jnp.zeros_like(x), rate=RATE, key=KEY))
    keep = _random.keep_mask(_random.seed_words(KEY), x.shape, _random.dropout_threshold(RATE))
    want = jnp.where(keep, x.astype(jnp.float32) * _random.keep_scale(RATE), 0).astype(x.dtype)
    np.testing.assert_array_equal(y, want)


def test_dropout_gradient_regenerates_the_mask():
    x, dy = _normal((5, 64)), _normal((5, 64), 1)
    y, pull = jax.vjp(lambda x: dropout(x, rate=RATE, key=KEY), x)
    (dx,) = pull(dy)
    np.testing.assert_array_equal(dx, dropout(dy, rate=RATE, key=KEY))
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda x: jnp.sum(dropout(x, rate=RATE, key=KEY) * dy)))(x), dx)
    kept = float(jnp.mean(y != 0))
    assert abs(kept - (1 - RATE)) < 0.05


def test_dropout_off_and_under_vmap():
    x = _normal((3, 4, 16))
    np.testing.assert_array_equal(dropout(x, rate=0.0, key=None), x)
    np.testing.assert_array_equal(dropout(x, rate=RATE, key=KEY, deterministic=True), x)
    # Each example draws the mask it draws alone, as the fused ops do.
    yv = jax.vmap(lambda x: dropout(x, rate=RATE, key=KEY))(x)
    for i in range(3):
        np.testing.assert_array_equal(yv[i], dropout(x[i], rate=RATE, key=KEY))
    keys = jax.random.split(KEY, 3)
    yk = jax.vmap(lambda x, k: dropout(x, rate=RATE, key=k))(x, keys)
    for i in range(3):
        np.testing.assert_array_equal(yk[i], dropout(x[i], rate=RATE, key=keys[i]))


def test_dropout_bad_inputs():
    x = _normal((2, 8))
    with pytest.raises(ValueError, match=r"dropout: rate must be in \[0, 1\), got 1.0"):
        dropout(x, rate=1.0, key=KEY)
    with pytest.raises(ValueError, match="dropout: key is required when rate > 0"):
        dropout(x, rate=0.1, key=None)
    with pytest.raises(TypeError, match="dropout: x must have a floating dtype, got int32"):
        dropout(jnp.ones((2, 8), jnp.int32), rate=0.1, key=KEY)
    with pytest.raises(ValueError, match="dropout: key must be a single PRNG key"):
        dropout(x, rate=0.1, key=jax.random.split(KEY, 2))


# ---------------------------------------------------------------- per-token weights
def _plain_ce(logits, labels, weights, ignore_index, reduction):
    valid = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
    per = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    per = jnp.where(valid, per * weights, 0.0)
    if reduction == "none":
        return per
    total = jnp.sum(per)
    if reduction == "sum":
        return total
    denom = jnp.sum(jnp.where(valid, weights, 0.0))
    return total / jnp.where(denom != 0, denom, 1.0)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_cross_entropy_weights(reduction, ignore_index):
    logits = _normal((2, 5, 11))
    labels = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    if ignore_index is not None:
        labels = labels.at[0, 1].set(ignore_index).at[1, 4].set(ignore_index)
    weights = jax.random.uniform(jax.random.key(2), (2, 5), minval=0.1, maxval=2.0)

    def ours(logits, weights):
        loss, count = cross_entropy(logits, labels, weights=weights, ignore_index=ignore_index, reduction=reduction)
        return loss, count

    loss, count = jax.jit(ours)(logits, weights)
    want = _plain_ce(logits, labels, weights, ignore_index, reduction)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    counted = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
    np.testing.assert_allclose(count, jnp.sum(jnp.where(counted, weights, 0.0)), rtol=1e-6)
    dy = _normal(labels.shape, 3) if reduction == "none" else 1.0
    got = jax.grad(lambda l, w: jnp.sum(ours(l, w)[0] * dy), (0, 1))(logits, weights)
    want = jax.grad(lambda l, w: jnp.sum(_plain_ce(l, labels, w, ignore_index, reduction) * dy), (0, 1))(
        logits, weights)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("ignore_index,chunk", [(None, 3), (None, None), (-1, 4)])
@pytest.mark.parametrize("use_bias", [False, True])
def test_linear_cross_entropy_weights(reduction, ignore_index, chunk, use_bias):
    h, w, b = _normal((2, 5, 8)), _normal((13, 8), 1), _normal((13,), 2) if use_bias else None
    labels = jax.random.randint(jax.random.key(3), (2, 5), 0, 13)
    if ignore_index is not None:
        labels = labels.at[1, 2].set(ignore_index)
    weights = jax.random.uniform(jax.random.key(4), (2, 5), minval=0.1, maxval=2.0)

    def ours(h, w, b, weights):
        return linear_cross_entropy(h, w, labels, bias=b, weights=weights, ignore_index=ignore_index,
                                    chunk_size=chunk, reduction=reduction)

    def plain(h, w, b, weights):
        logits = h @ w.T + (0.0 if b is None else b)
        return _plain_ce(logits, labels, weights, ignore_index, reduction)

    loss, count = jax.jit(ours)(h, w, b, weights)
    np.testing.assert_allclose(loss, plain(h, w, b, weights), rtol=1e-5, atol=1e-6)
    counted = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
    np.testing.assert_allclose(count, jnp.sum(jnp.where(counted, weights, 0.0)), rtol=1e-6)
    argnums = (0, 1, 2, 3) if use_bias else (0, 1, 3)
    got = jax.grad(lambda *a: ours(*a)[0], argnums)(h, w, b, weights)
    want = jax.grad(plain, argnums)(h, w, b, weights)
    for a, c in zip(got, want):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)


def test_weights_bad_inputs():
    logits, labels = _normal((4, 7)), jnp.arange(4)
    with pytest.raises(ValueError, match=r"cross_entropy: weights must have shape \(4,\), got \(3,\)"):
        cross_entropy(logits, labels, weights=jnp.ones(3))
    with pytest.raises(TypeError, match="cross_entropy: weights must have a floating dtype, got int32"):
        cross_entropy(logits, labels, weights=jnp.ones(4, jnp.int32))
    with pytest.raises(ValueError, match=r"linear_cross_entropy: weights must have shape \(4,\), got \(4, 1\)"):
        linear_cross_entropy(logits, _normal((5, 7)), labels, weights=jnp.ones((4, 1)))
