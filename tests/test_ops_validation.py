"""Inputs found by fuzzing that once slipped through or ended in JAX internals: each
gets the op's own clear error or the right result. And the ops as per-device code
inside shard_map with replicated weights."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_ls2.ops import (bias_act_dropout, bias_dropout_residual, cross_entropy, embedding, layer_norm,
                         linear_cross_entropy, softmax_dropout)

KEY = jax.random.key(0)


def _normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    return Mesh(np.array(jax.devices()[:8]), ("data",))


# ---------------------------------------------------------------- dropout keys and flags
def _dropout_ops():
    x, b = _normal((4, 8)), _normal((8,), 1)
    return {
        "bias_dropout_residual": lambda **kw: bias_dropout_residual(x, b, x, rate=0.1, **kw),
        "bias_act_dropout": lambda **kw: bias_act_dropout(x, b, activation="relu", rate=0.1, **kw),
        "softmax_dropout": lambda **kw: softmax_dropout(x, rate=0.1, **kw),
        "embedding": lambda **kw: embedding(jnp.arange(4) % 3, x, rate=0.1, **kw),
    }


@pytest.mark.parametrize("op", sorted(_dropout_ops()))
def test_a_batch_of_keys_is_refused(op):
    with pytest.raises(ValueError, match=rf"{op}: key must be a single PRNG key \(shape \(\)\), "
                                         r"got a batch of keys of shape \(3,\)"):
        _dropout_ops()[op](key=jax.random.split(KEY, 3))


@pytest.mark.parametrize("op", sorted(_dropout_ops()))
def test_a_non_key_is_refused(op):
    with pytest.raises(TypeError, match=rf"{op}: key must be a JAX PRNG key \(jax.random.key\) or uint32\[2\], "
                                        r"got int"):
        _dropout_ops()[op](key=0)


@pytest.mark.parametrize("op", sorted(_dropout_ops()))
def test_a_traced_deterministic_is_refused(op):
    with pytest.raises(TypeError, match=rf"{op}: deterministic must be a Python bool \(static\).*got a traced"):
        jax.jit(lambda d: _dropout_ops()[op](key=KEY, deterministic=d))(True)


def test_activation_that_is_not_a_string_is_refused():
    with pytest.raises(ValueError, match=r"bias_act_dropout: activation must be one of \('relu', 'gelu', "
                                         r"'gelu_tanh'\), got \['relu'\]"):
        bias_act_dropout(_normal((4, 8)), _normal((8,)), activation=["relu"], rate=0.0)


def test_embedding_dtype_that_is_not_a_dtype_is_refused():
    with pytest.raises(TypeError, match="embedding: dtype must be one of float32, float16, bfloat16, got 'foo'"):
        embedding(jnp.arange(4), _normal((5, 8)), dtype="foo")


# ---------------------------------------------------------------- positions and labels
def test_default_positions_beyond_the_pos_table_are_refused():
    table, pos_table = _normal((5, 8)), _normal((6, 8), 1)
    with pytest.raises(ValueError, match=r"embedding: the default positions 0 .. 6 need a pos_table of at least "
                                         r"7 rows, got 6"):
        embedding(jnp.zeros((2, 7), jnp.int32), table, pos_table=pos_table)
    embedding(jnp.zeros((2, 6), jnp.int32), table, pos_table=pos_table)  # fits exactly


def test_linear_cross_entropy_without_ignore_index_ignores_no_label():
    """ignore_index=None: a traced label of -1 is out of range (NaN, as in cross_entropy),
    not silently ignored while still counted; padding the chunks still works."""
    h, w = _normal((5, 8)), _normal((7, 8), 1)
    labels = jnp.array([1, -1, 3, 0, 6])
    f = jax.jit(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=2))
    loss, count = f(h, w, labels)
    assert int(count) == 5 and np.isnan(float(loss))
    good = jnp.array([1, 2, 3, 0, 6])
    loss, count = f(h, w, good)
    want = optax.softmax_cross_entropy_with_integer_labels(h @ w.T, good).mean()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"linear_cross_entropy: labels must be in \[0, 7\)"):
        linear_cross_entropy(h, w, labels)


def test_int64_labels_and_ids_do_not_wrap():
    big = 2**32 + 1  # int32 would read it as 1
    with jax.enable_x64(True):
        logits = _normal((3, 7))
        labels = jnp.array([0, big, 2], jnp.int64)
        loss = jax.jit(lambda x, y: cross_entropy(x, y)[0])(logits, labels)
        assert np.isfinite(loss[0]) and np.isnan(loss[1]) and np.isfinite(loss[2])
        lce = jax.jit(lambda h, w, y: linear_cross_entropy(h, w, y)[0])
        assert np.isnan(float(lce(_normal((3, 8)), _normal((7, 8), 1), labels)))
        table = _normal((5, 8))
        out = jax.jit(lambda i: embedding(i, table))(jnp.array([big, 1], jnp.int64))
        np.testing.assert_array_equal(out[0], table[4])  # clamped into the table, as documented
        np.testing.assert_array_equal(out[1], table[1])
        with pytest.raises(ValueError, match=r"cross_entropy: labels must be in \[0, 7\).*got 4294967297"):
            cross_entropy(logits, labels)


# ---------------------------------------------------------------- second derivatives
SECOND_ORDER = {
    "layer_norm": lambda x: jnp.sum(layer_norm(x, jnp.ones(8), jnp.zeros(8)) ** 3),
    "bias_act_dropout": lambda x: jnp.sum(bias_act_dropout(x, jnp.ones(8), activation="gelu", rate=0.0) ** 3),
    "softmax_dropout": lambda x: jnp.sum(softmax_dropout(x) ** 3),
    "cross_entropy": lambda x: cross_entropy(x, jnp.arange(4), reduction="mean")[0],
    "linear_cross_entropy": lambda x: linear_cross_entropy(x, x * 2, jnp.arange(4))[0],
}


@pytest.mark.parametrize("op", sorted(SECOND_ORDER))
@pytest.mark.parametrize("how", ["grad_of_grad", "hessian"])
def test_second_derivatives_say_they_are_not_supported(op, how):
    f = SECOND_ORDER[op]
    x = _normal((4, 8))
    jax.grad(f)(x)  # first order works
    second = (jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2)) if how == "grad_of_grad" else jax.hessian(f))
    with pytest.raises(NotImplementedError, match=r"jax_ls2_\w+: second derivatives .* are not supported"):
        second(x)


# ---------------------------------------------------------------- forward mode
def _forward_mode_ops():
    from jax_ls2 import ops
    kv = _normal((2, 6, 1, 8), 3)
    return {
        "layer_norm": lambda x: layer_norm(x, jnp.ones(8), jnp.zeros(8)),
        "layer_norm (residual)": lambda x: layer_norm(x, jnp.ones(8), jnp.zeros(8), residual=x)[0],
        "rms_norm": lambda x: ops.rms_norm(x, jnp.ones(8)),
        "bias_act_dropout": lambda x: bias_act_dropout(x, jnp.ones(8), activation="gelu", rate=0.0),
        "bias_dropout_residual": lambda x: bias_dropout_residual(x, jnp.ones(8), x, rate=0.0),
        "dropout": lambda x: ops.dropout(x, rate=0.1, key=KEY),
        "gated_act_dropout": lambda x: ops.gated_act_dropout(x),
        "softmax_dropout": lambda x: softmax_dropout(x),
        "cross_entropy": lambda x: cross_entropy(x, jnp.arange(4), reduction="mean")[0],
        "linear_cross_entropy": lambda x: linear_cross_entropy(x, x * 2, jnp.arange(4))[0],
        "embedding": lambda x: embedding(jnp.arange(4) % 3, x),
        "flash_attention": lambda x: ops.flash_attention(x.reshape(2, 2, 1, 8), kv, kv),
        "rotary": lambda x: ops.rotary(x.reshape(2, 2, 1, 8), x.reshape(2, 2, 1, 8), jnp.tile(jnp.arange(2), (2, 1)))[0],
    }


@pytest.mark.parametrize("how", ["jvp", "jit_jvp", "jacfwd"])
@pytest.mark.parametrize("name", sorted(_forward_mode_ops()))
def test_forward_mode_autodiff_names_the_op(name, how):
    f = _forward_mode_ops()[name]
    x = _normal((4, 8))
    run = {"jvp": lambda: jax.jvp(f, (x,), (x,)), "jit_jvp": lambda: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
           "jacfwd": lambda: jax.jacfwd(f)(x)}[how]
    op = name.split(" ")[0]
    with pytest.raises(NotImplementedError, match=rf"^{op}: forward-mode autodiff \(jax.jvp, jax.jacfwd\) is not "
                                                  r"supported.*plain-JAX formula, \S"):
        run()
    jax.grad(lambda x: jnp.sum(f(x)))(x)  # reverse mode works


def test_forward_mode_through_fp8_and_the_parallel_ops_names_the_op():
    from jax_ls2 import fp8
    from jax_ls2.parallel import vocab_parallel_cross_entropy
    recipe = fp8.DelayedScaling()
    x, w = _normal((4, 16)), _normal((16, 16), 1)
    meta = fp8.DotMeta.create(recipe)
    with pytest.raises(NotImplementedError, match=r"^fp8_dot: forward-mode autodiff"):
        jax.jvp(lambda x: fp8.fp8_dot(x, w, meta, recipe), (x,), (x,))
    ring = jax.vmap(lambda z: vocab_parallel_cross_entropy(z, jnp.arange(4) % 8, "t")[0], axis_name="t")
    logits = _normal((2, 4, 8))
    with pytest.raises(NotImplementedError, match=r"^vocab_parallel_cross_entropy: forward-mode autodiff"):
        jax.jvp(ring, (logits,), (logits,))


# ---------------------------------------------------------------- shard_map, replicated weights
def _per_device(loss, argnums, mesh, in_specs, out_specs):
    """jit(shard_map) of the gradient of ``loss`` as per-device code, the loss summed
    over the devices (so gradients of replicated weights are the global ones)."""
    def per_device(*args):
        return jax.grad(lambda *a: jax.lax.psum(loss(*a), "data"), argnums)(*args)

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def test_shard_map_softmax_bias_gradient():
    mesh = _mesh()
    s, bias = _normal((8, 2, 4, 16)), _normal((1, 2, 4, 16), 1)
    loss = lambda s, b: jnp.sum(softmax_dropout(s, bias=b, scale=0.5) ** 2)
    plain = lambda s, b: jnp.sum(jax.nn.softmax(0.5 * s + b, axis=-1) ** 2)
    f = _per_device(loss, (0, 1), mesh, (P("data"), P()), (P("data"), P()))
    for got, want in zip(f(s, bias), jax.grad(plain, (0, 1))(s, bias)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_shard_map_embedding_table_gradient():
    mesh = _mesh()
    ids = jax.random.randint(jax.random.key(3), (8, 6), 0, 11)
    table = _normal((11, 8))
    f = _per_device(lambda i, t: jnp.sum(embedding(i, t) ** 2), 1, mesh, (P("data"), P()), P())
    got = f(ids, table)
    want = jax.grad(lambda t: jnp.sum(t[ids] ** 2))(table)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shard_map_linear_cross_entropy_weight_gradient():
    mesh = _mesh()
    h, w = _normal((16, 8)), _normal((7, 8), 1)
    labels = jnp.arange(16) % 7
    plain = lambda h, w: optax.softmax_cross_entropy_with_integer_labels(h @ w.T, labels).sum()
    f = _per_device(lambda h, w, y: linear_cross_entropy(h, w, y, reduction="sum")[0], (0, 1), mesh,
                    (P("data"), P(), P("data")), (P("data"), P()))
    for got, want in zip(f(h, w, labels), jax.grad(plain, (0, 1))(h, w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
