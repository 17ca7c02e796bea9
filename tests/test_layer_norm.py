import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_ls2
from jax_ls2.ops import layer_norm
from numerics import assert_within_2x, compiled_text, cuda_lowering_text, f64, mesh8, shard


def plain_layer_norm(x, gamma, beta, eps=1e-5, compute=jnp.float32):
    """Independent formula (jnp.var, in `compute`: float32, or float64 for truths)."""
    xf = x.astype(compute)
    mu = xf.mean(-1, keepdims=True)
    y = (xf - mu) / jnp.sqrt(xf.var(-1, keepdims=True) + eps) * gamma.astype(compute) + beta.astype(compute)
    return y.astype(x.dtype)


def numpy_truth(x, gamma, beta, eps=1e-5):
    x, gamma, beta = f64(x), f64(gamma), f64(beta)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


def inputs(shape, dtype=jnp.float32, seed=0):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    h = shape[-1]
    x = (jax.random.normal(k1, shape) * 2 + 0.5).astype(dtype)
    gamma = (1 + 0.3 * jax.random.normal(k2, (h,))).astype(dtype)
    beta = (0.2 * jax.random.normal(k3, (h,))).astype(dtype)
    r = jax.random.normal(k4, shape).astype(dtype)
    return x, gamma, beta, r


@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (3, 5, 769), (2, 4097), (1, 20000)])
def test_forward_matches_plain_formula(shape):
    x, g, b, _ = inputs(shape, seed=shape[-1])
    np.testing.assert_allclose(layer_norm(x, g, b), plain_layer_norm(x, g, b), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(7, 123), (2, 3, 64)])
def test_backward_matches_autodiff_of_plain_formula(shape):
    x, g, b, _ = inputs(shape, seed=1)
    w = jax.random.normal(jax.random.key(9), shape)
    ours = jax.grad(lambda *a: jnp.sum(layer_norm(*a) * w), (0, 1, 2))(x, g, b)
    ref = jax.grad(lambda *a: jnp.sum(plain_layer_norm(*a) * w), (0, 1, 2))(x, g, b)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4)


def test_check_grads():
    x, g, b, r = inputs((3, 17), seed=2)
    check_grads(lambda x, g, b: layer_norm(x, g, b), (x, g, b), order=1, modes=("rev",), atol=3e-2, rtol=3e-2)
    check_grads(lambda x, r, g, b: layer_norm(x, g, b, residual=r)[0], (x, r, g, b), order=1, modes=("rev",),
                atol=3e-2, rtol=3e-2)


def test_residual_variant():
    x, g, b, r = inputs((5, 96), seed=3)
    y, s = layer_norm(x, g, b, residual=r)
    np.testing.assert_allclose(s, x + r, rtol=1e-6)
    np.testing.assert_allclose(y, plain_layer_norm(x + r, g, b), rtol=2e-5, atol=2e-5)
    w1, w2 = jax.random.normal(jax.random.key(1), (2, 5, 96))

    def ours(x, r, g, b):
        y, s = layer_norm(x, g, b, residual=r)
        return jnp.sum(y * w1) + jnp.sum(s * w2)

    def plain(x, r, g, b):
        s = x + r
        return jnp.sum(plain_layer_norm(s, g, b) * w1) + jnp.sum(s * w2)

    for o, p in zip(jax.grad(ours, (0, 1, 2, 3))(x, r, g, b), jax.grad(plain, (0, 1, 2, 3))(x, r, g, b)):
        np.testing.assert_allclose(o, p, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_low_precision_dtypes_and_param_cast(dtype):
    x, g, b, _ = inputs((4, 64), dtype)
    y = layer_norm(x, g.astype(jnp.float32), b.astype(jnp.float32))
    assert y.dtype == dtype
    grads = jax.grad(lambda g: jnp.sum(layer_norm(x, g, b).astype(jnp.float32)))(g.astype(jnp.float32))
    assert grads.dtype == jnp.float32
    np.testing.assert_allclose(f64(y), numpy_truth(x, g, b), atol=0.05, rtol=0.05)


def test_transformations():
    x, g, b, r = inputs((4, 6, 32), seed=4)
    loss = lambda x, g, b: jnp.sum(layer_norm(x, g, b) ** 2)
    plain = lambda x, g, b: jnp.sum(plain_layer_norm(x, g, b) ** 2)
    gd = jax.jit(jax.grad(loss, (0, 1, 2)))(x, g, b)
    gp = jax.grad(plain, (0, 1, 2))(x, g, b)
    for a, c in zip(gd, gp):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)
    # vmap over a leading axis, and per-example gradients (vmap of grad).
    v = jax.vmap(lambda x: layer_norm(x, g, b))(x)
    np.testing.assert_allclose(v, plain_layer_norm(x, g, b), rtol=2e-5, atol=2e-5)
    per_ex = jax.vmap(jax.grad(loss, 1), in_axes=(0, None, None))(x, g, b)
    per_ex_ref = jax.vmap(jax.grad(plain, 1), in_axes=(0, None, None))(x, g, b)
    np.testing.assert_allclose(per_ex, per_ex_ref, rtol=1e-4, atol=1e-4)
    # vmap over the parameters too (falls back to a sequential map).
    gs = jnp.stack([g, g * 2])
    np.testing.assert_allclose(jax.vmap(lambda g: layer_norm(x, g, b))(gs)[1], plain_layer_norm(x, g * 2, b),
                               rtol=2e-5, atol=2e-5)

    # remat inside scan over layers.
    def body(h, params):
        g_, b_ = params
        return jax.checkpoint(lambda h: layer_norm(h, g_, b_, residual=h)[0])(h), None

    stack = (jnp.stack([g, g * 0.5, g + 1]), jnp.stack([b, b, b]))
    scan_loss = lambda x, st: jnp.sum(jax.lax.scan(body, x, st)[0] ** 2)

    def plain_body(h, params):
        return plain_layer_norm(h + h, *params), None

    plain_scan = lambda x, st: jnp.sum(jax.lax.scan(plain_body, x, st)[0] ** 2)
    for a, c in zip(jax.jit(jax.grad(scan_loss, (0, 1)))(x, stack), jax.grad(plain_scan, (0, 1))(x, stack)):
        for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(c)):
            np.testing.assert_allclose(u, w, rtol=2e-4, atol=2e-4)


def test_copies_under_vmap_remat_and_scan():
    x, g, b, _ = inputs((4, 6, 32), seed=14)

    def loss(x, g, b):
        y1, y2, x_other = layer_norm(x, g, b, copies=2, return_input=True)
        return jnp.sum(y1 ** 2) + jnp.sum(jnp.sin(y2)) + jnp.sum(x_other * y1)

    def plain(x, g, b):
        y = plain_layer_norm(x, g, b)
        return jnp.sum(y ** 2) + jnp.sum(jnp.sin(y)) + jnp.sum(x * y)

    per_ex = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None, None))(x, g, b)
    per_ex_ref = jax.vmap(jax.grad(plain, (0, 1)), in_axes=(0, None, None))(x, g, b)
    for a, c in zip(per_ex, per_ex_ref):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)

    def body(h, params):
        return jax.checkpoint(lambda h: jnp.tanh(sum(layer_norm(h, *params, copies=3))))(h), None

    def plain_body(h, params):
        return jnp.tanh(3 * plain_layer_norm(h, *params)), None

    stack = (jnp.stack([g, g * 0.5]), jnp.stack([b, b + 1]))
    scan_loss = lambda x, st: jnp.sum(jax.lax.scan(body, x, st)[0] ** 2)
    plain_scan = lambda x, st: jnp.sum(jax.lax.scan(plain_body, x, st)[0] ** 2)
    for a, c in zip(jax.jit(jax.grad(scan_loss, (0, 1)))(x, stack), jax.grad(plain_scan, (0, 1))(x, stack)):
        for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(c)):
            np.testing.assert_allclose(u, w, rtol=2e-4, atol=2e-4)


def test_batch_sharded_jit_has_no_all_gather_and_psums_param_grads():
    mesh = mesh8()
    x, g, b, r = inputs((16, 4, 48), seed=5)
    xs = shard(x, mesh, "data")
    f = jax.jit(jax.grad(lambda x, g, b: jnp.sum(layer_norm(x, g, b, residual=x)[0] ** 3), (0, 1, 2)))
    out = f(xs, g, b)
    ref = jax.grad(lambda x, g, b: jnp.sum(plain_layer_norm(x + x, g, b) ** 3), (0, 1, 2))(x, g, b)
    for a, c in zip(out, ref):
        np.testing.assert_allclose(a, c, rtol=2e-4, atol=2e-4)
    assert out[0].sharding.spec[0] == "data"
    text = compiled_text(f, xs, g, b)
    assert "all-gather" not in text
    assert "all-reduce" in text  # dgamma/dbeta are summed across shards
    # The same with the copies form (three cotangents and the input's, one backward call).
    f = jax.jit(jax.grad(lambda x, g, b: sum(jnp.sum(t ** 3) for t in layer_norm(x, g, b, copies=3,
                                                                                 return_input=True)), (0, 1, 2)))
    out = f(xs, g, b)
    ref = jax.grad(lambda x, g, b: 3 * jnp.sum(plain_layer_norm(x, g, b) ** 3) + jnp.sum(x ** 3), (0, 1, 2))(x, g, b)
    for a, c in zip(out, ref):
        np.testing.assert_allclose(a, c, rtol=2e-4, atol=2e-4)
    assert out[0].sharding.spec[0] == "data"
    assert "all-gather" not in compiled_text(f, xs, g, b)


def test_shard_map():
    mesh = mesh8()
    x, g, b, _ = inputs((16, 40), seed=6)

    def per_device(x, g, b):
        # Gradients of the replicated weights arrive summed over devices, as for jnp code.
        return jax.grad(lambda x, g, b: jnp.sum(layer_norm(x, g, b) ** 2), (0, 1, 2))(x, g, b)

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P()),
                              out_specs=(P("data"), P(), P())))
    ref = jax.grad(lambda x, g, b: jnp.sum(plain_layer_norm(x, g, b) ** 2), (0, 1, 2))(x, g, b)
    for a, c in zip(f(x, g, b), ref):
        np.testing.assert_allclose(a, c, rtol=2e-4, atol=2e-4)


@pytest.mark.skipif(not jax_ls2.kernels_built(), reason="extension not built")
def test_return_input_variant_adds_the_other_gradient_of_x():
    x, g, b, _ = inputs((5, 96), seed=4)
    y, x_out = layer_norm(x, g, b, return_input=True)
    assert x_out is x or np.array_equal(x_out, x)
    np.testing.assert_allclose(y, plain_layer_norm(x, g, b), rtol=2e-5, atol=2e-5)
    w1, w2 = jax.random.normal(jax.random.key(2), (2, 5, 96))

    def ours(x, g, b):  # a pre-LN block: the residual branch uses the returned x
        y, x_out = layer_norm(x, g, b, return_input=True)
        return jnp.sum(y * w1) + jnp.sum(jnp.sin(x_out) * w2)

    def plain(x, g, b):
        return jnp.sum(plain_layer_norm(x, g, b) * w1) + jnp.sum(jnp.sin(x) * w2)

    for o, p in zip(jax.grad(ours, (0, 1, 2))(x, g, b), jax.grad(plain, (0, 1, 2))(x, g, b)):
        np.testing.assert_allclose(o, p, rtol=1e-4, atol=1e-4)
    # The other use's gradient goes into the backward kernel (no separate add).
    text = cuda_lowering_text(jax.grad(ours), x, g, b)
    assert "jax_ls2_layer_norm_fwd" in text and "jax_ls2_add_layer_norm_bwd" in text
    with pytest.raises(ValueError, match="layer_norm: return_input applies without residual"):
        layer_norm(x, g, b, residual=x, return_input=True)
    with pytest.raises(TypeError, match="layer_norm: return_input must be a Python bool"):
        layer_norm(x, g, b, return_input=1)


@pytest.mark.parametrize("copies", [2, 3, 4])
@pytest.mark.parametrize("return_input", [False, True])
def test_copies_give_each_consumer_its_own_cotangent(copies, return_input):
    """copies=k: y k times (then x); the gradient equals that of the plain formula whose
    output feeds the same k consumers (and x its other use), and the backward is one
    custom call that takes every cotangent."""
    x, g, b, _ = inputs((6, 5, 96), seed=12)
    ws = jax.random.normal(jax.random.key(8), (copies + 1, 6, 5, 96))
    consume = lambda ys, x_other: sum(jnp.sum(jnp.sin(y * (i + 1)) * ws[i]) for i, y in enumerate(ys)) + \
        (jnp.sum(jnp.tanh(x_other) * ws[-1]) if x_other is not None else 0.0)

    def ours(x, g, b):
        out = layer_norm(x, g, b, copies=copies, return_input=return_input)
        assert len(out) == copies + return_input
        return consume(out[:copies], out[copies] if return_input else None)

    def plain(x, g, b):
        y = plain_layer_norm(x, g, b)
        return consume([y] * copies, x if return_input else None)

    out = layer_norm(x, g, b, copies=copies, return_input=return_input)
    for y in out[:copies]:
        np.testing.assert_allclose(y, plain_layer_norm(x, g, b), rtol=2e-5, atol=2e-5)
    if return_input:
        np.testing.assert_array_equal(out[-1], x)
    for o, p in zip(jax.grad(ours, (0, 1, 2))(x, g, b), jax.grad(plain, (0, 1, 2))(x, g, b)):
        np.testing.assert_allclose(o, p, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not jax_ls2.kernels_built(), reason="extension not built")
def test_copies_lowering_for_cuda_is_one_backward_call_for_every_cotangent():
    x, g, b, _ = inputs((4, 64), seed=13)

    def loss(x, g, b):
        y1, y2, y3, x_other = layer_norm(x, g, b, copies=3, return_input=True)
        return jnp.sum(jnp.sin(y1)) + jnp.sum(y2 * y2) + jnp.sum(jnp.cos(y3)) + jnp.sum(x_other ** 3)

    text = cuda_lowering_text(jax.grad(loss, (0, 1, 2)), x, g, b)
    assert text.count("jax_ls2_layer_norm_bwd_multi") == 1 and "jax_ls2_layer_norm_fwd" in text
    assert "jax_ls2_layer_norm_bwd\"" not in text and "jax_ls2_add_layer_norm_bwd" not in text


def test_copies_bad_values():
    x, g, b, r = inputs((4, 8))
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="layer_norm: copies must be a Python int from 1 to 4"):
            layer_norm(x, g, b, copies=bad)
    with pytest.raises(ValueError, match="layer_norm: copies applies without residual"):
        layer_norm(x, g, b, residual=r, copies=2)


@pytest.mark.skipif(not jax_ls2.kernels_built(), reason="extension not built")
def test_lowering_for_cuda_reaches_the_kernels():
    x, g, b, r = inputs((4, 64), seed=7)
    text = cuda_lowering_text(jax.grad(lambda x, g, b: jnp.sum(layer_norm(x, g, b)), (0, 1, 2)), x, g, b)
    assert "jax_ls2_layer_norm_fwd" in text and "jax_ls2_layer_norm_bwd" in text
    text = cuda_lowering_text(jax.grad(lambda x, r: jnp.sum(layer_norm(x, g, b, residual=r)[0]), (0, 1)), x, r)
    assert "jax_ls2_add_layer_norm_fwd" in text and "jax_ls2_add_layer_norm_bwd" in text


def test_bad_inputs():
    x, g, b, r = inputs((4, 8))
    with pytest.raises(ValueError, match=r"layer_norm: gamma must have shape \(8,\), got \(7,\)"):
        layer_norm(x, g[:7], b)
    with pytest.raises(TypeError, match="layer_norm: x must have dtype"):
        layer_norm(x.astype(jnp.int32), g, b)
    with pytest.raises(ValueError, match="layer_norm: gamma must have rank 1"):
        layer_norm(x, g[None], b)
    with pytest.raises(ValueError, match="layer_norm: x must have rank >= 1"):
        layer_norm(jnp.float32(1.0), g, b)
    with pytest.raises(ValueError, match="layer_norm: residual must have shape"):
        layer_norm(x, g, b, residual=r[:2])
    with pytest.raises(TypeError, match="layer_norm: residual must have dtype float32"):
        layer_norm(x, g, b, residual=r.astype(jnp.bfloat16))
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match="layer_norm: epsilon must be a positive"):
            layer_norm(x, g, b, epsilon=bad)
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match=f"layer_norm: epsilon must be a positive finite Python float, got {bad}"):
            layer_norm(x, g, b, epsilon=bad)


# ---------------------------------------------------------------- GPU
GPU_SHAPES = [(7, 123), (1025, 769), (64, 4097), (33, 16384), (3, 40000), (4096, 768), (2048, 4096), (9999, 1024)]


def _xla_reference(x, g, b, r=None):
    s = x if r is None else (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)
    return plain_layer_norm(s, g, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("fused_residual", [False, True])
def test_gpu_against_float64_truth(dtype, shape, fused_residual):
    x, g, b, r = inputs(shape, dtype, seed=shape[-1])
    w = jax.random.normal(jax.random.key(3), shape).astype(dtype)

    def ours(x, g, b, r):
        if fused_residual:
            return layer_norm(x, g, b, residual=r)[0]
        return layer_norm(x, g, b)

    def xla(x, g, b, r):
        return _xla_reference(x, g, b, r if fused_residual else None)

    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w.astype(jnp.float32)))
    y = jax.jit(ours)(x, g, b, r)
    y_xla = jax.jit(xla)(x, g, b, r)
    s64 = f64(x) + f64(r) if fused_residual else f64(x)
    truth = numpy_truth(s64, g, b)
    assert_within_2x("y", y, y_xla, truth)
    # Gradients: truth through float64 autodiff on the CPU.
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (x, g, b, r)]
        w64 = jax.device_put(jnp.asarray(f64(w)), cpu)
        truth_grads = jax.grad(lambda x, g, b, r: jnp.sum(xla(x, g, b, r) * w64), (0, 1, 2, 3))(*args64)
    gk = jax.jit(jax.grad(loss(ours), (0, 1, 2, 3)))(x, g, b, r)
    gx = jax.jit(jax.grad(loss(xla), (0, 1, 2, 3)))(x, g, b, r)
    names = ["dx", "dgamma", "dbeta", "dresidual"]
    for i in range(4 if fused_residual else 3):
        assert_within_2x(names[i], gk[i], gx[i], truth_grads[i])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1025, 769), (4096, 768)])
def test_gpu_return_input_against_float64_truth(dtype, shape):
    """layer_norm(return_input=True) in a pre-LN pattern: dx (the LayerNorm's gradient plus
    the residual branch's, summed in the kernel) within 2x of XLA's error."""
    x, g, b, _ = inputs(shape, dtype, seed=5)
    w1, w2 = (jax.random.normal(k, shape).astype(dtype) for k in jax.random.split(jax.random.key(4)))

    def ours(x, g, b):
        y, x_res = layer_norm(x, g, b, return_input=True)
        return jnp.sum(y.astype(jnp.float32) * w1.astype(jnp.float32)) + \
            jnp.sum(jnp.tanh(x_res.astype(jnp.float32)) * w2.astype(jnp.float32))

    def xla(x, g, b):
        return jnp.sum(plain_layer_norm(x, g, b).astype(jnp.float32) * w1.astype(jnp.float32)) + \
            jnp.sum(jnp.tanh(x.astype(jnp.float32)) * w2.astype(jnp.float32))

    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (x, g, b)]
        a1, a2 = (jax.device_put(jnp.asarray(f64(a)), cpu) for a in (w1, w2))
        truth = jax.grad(lambda x, g, b: jnp.sum(plain_layer_norm(x, g, b) * a1) + jnp.sum(jnp.tanh(x) * a2),
                         (0, 1, 2))(*args64)
    gk = jax.jit(jax.grad(ours, (0, 1, 2)))(x, g, b)
    gx = jax.jit(jax.grad(xla, (0, 1, 2)))(x, g, b)
    for name, k, r, t in zip(["dx", "dgamma", "dbeta"], gk, gx, truth):
        assert_within_2x(name, k, r, t)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1025, 769), (4096, 768), (64, 20000)])
@pytest.mark.parametrize("copies,return_input", [(2, False), (3, True), (4, True)])
def test_gpu_copies_against_float64_truth(dtype, shape, copies, return_input):
    """layer_norm(copies=k): dx, dgamma, dbeta with the k cotangents of y (and that of
    x's other use) summed in the kernel, within 2x of XLA's error, at 16-byte, scalar
    (odd hidden) and one-row-per-block (hidden 20000) kernels.

    The cotangents are given in the dtype (as they arrive from consumers' backward
    passes), so the truth is exact: XLA's reference adds them the way autodiff of
    several uses of y does (`add_any`, in the dtype) before its LayerNorm backward. A
    reference that computes the cotangents inside the same jit would let XLA keep them
    in float32 (excess precision) where the kernel necessarily receives them rounded."""
    x, g, b, _ = inputs(shape, dtype, seed=6)
    n_cts = copies + (1 if return_input else 0)
    cts = tuple(jax.random.normal(k, shape).astype(dtype) for k in jax.random.split(jax.random.key(5), n_cts))

    def ours(x, g, b, cts):
        _, vjp = jax.vjp(lambda x, g, b: layer_norm(x, g, b, copies=copies, return_input=return_input), x, g, b)
        return vjp(cts)

    def xla(x, g, b, cts, compute=jnp.float32):
        _, vjp = jax.vjp(lambda x, g, b: plain_layer_norm(x, g, b, compute=compute), x, g, b)
        dy = functools.reduce(jax.lax.add, cts[:copies])
        dx, dg, db = vjp(dy)
        return (dx + cts[copies] if return_input else dx), dg, db

    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (x, g, b)]
        cts64 = [jax.device_put(jnp.asarray(f64(c)), cpu) for c in cts]
        truth = xla(*args64, tuple(cts64), compute=jnp.float64)
    text = compiled_text(ours, x, g, b, cts)
    assert "jax_ls2_layer_norm_bwd_multi" in text
    gk = jax.jit(ours)(x, g, b, cts)
    gx = jax.jit(xla)(x, g, b, cts)
    for name, k, r, t in zip(["dx", "dgamma", "dbeta"], gk, gx, truth):
        assert_within_2x(name, k, r, t)


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_every_output_element_written():
    # The handlers fill their outputs with NaN first (JAX_LS2_POISON_OUTPUTS=1, set by
    # conftest), so any element a kernel leaves unwritten stays NaN.
    assert os.environ.get("JAX_LS2_POISON_OUTPUTS") == "1"
    x, g, b, r = inputs((4099, 777), jnp.bfloat16, seed=11)
    y, s = jax.jit(lambda *a: layer_norm(a[0], a[1], a[2], residual=a[3]))(x, g, b, r)
    dx = jax.jit(jax.grad(lambda x: jnp.sum(layer_norm(x, g, b).astype(jnp.float32))))(x)
    for arr in (y, s, dx):
        assert bool(jnp.all(jnp.isfinite(arr)))


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_program_calls_the_kernel():
    x, g, b, _ = inputs((8, 64))
    text = compiled_text(jax.grad(lambda x: jnp.sum(layer_norm(x, g, b))), x)
    assert "jax_ls2_layer_norm_fwd" in text and "jax_ls2_layer_norm_bwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"layer_norm_bwd_stages": 1}, {"layer_norm_bwd_stages": 1, "layer_norm_bwd_elems": 16},
                                     {"layer_norm_bwd_elems": 32}, {"layer_norm_bwd_elems": 8},
                                     {"layer_norm_bwd_elems": 16}, {"layer_norm_bwd_stages": 2},
                                     {"layer_norm_bwd_stages": 4}],
                         ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("hidden", [768, 1280, 4096])
def test_gpu_backward_launch_options_compute_the_same(options, hidden):
    """The backward variants a benchmark may time (launch options) give the default's
    gradients within an ulp of bfloat16 (their sums add in another order), in the plain
    form and in the residual form, where both outputs get a cotangent so the residual
    branch's gradient is added. 1031 rows leave the staged kernel a partial last tile."""
    from numerics import assert_bf16_close, under_kernel_options
    x, g, b, r = inputs((1031, hidden), jnp.bfloat16, seed=5)
    k1, k2 = jax.random.split(jax.random.key(6))
    dy = jax.random.normal(k1, x.shape).astype(jnp.bfloat16)
    ds = jax.random.normal(k2, x.shape).astype(jnp.bfloat16)

    def both_forms(x, g, b, r, dy, ds):
        fused = jax.vjp(lambda x, g, b: layer_norm(x, g, b, residual=r), x, g, b)[1]((dy, ds))
        plain = jax.vjp(lambda x, g, b: layer_norm(x, g, b), x, g, b)[1](dy)
        return fused + plain

    prog = jax.jit(both_forms)
    want = jax.block_until_ready(prog(x, g, b, r, dy, ds))
    got = under_kernel_options(options, prog, x, g, b, r, dy, ds)
    assert len(got) == 6
    for a, w in zip(got, want):
        assert_bf16_close(a, w)



@pytest.mark.sanitize
@pytest.mark.gpu
@pytest.mark.parametrize("fused_residual", [False, True])
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_gpu_staged_backward_float16_against_float64_truth(hidden, fused_residual):
    """The staged backward (layer_norm_bwd_stages) on float16 rows: gradients within 2x of
    the XLA reference's error in float16, both against float64 autodiff."""
    from numerics import under_kernel_option
    shape = (517, hidden)
    x, g, b, r = inputs(shape, jnp.float16, seed=8)
    w = jax.random.normal(jax.random.key(9), shape).astype(jnp.float16)
    res = (lambda r: r) if fused_residual else (lambda r: None)

    def ours(x, g, b, r):
        y = layer_norm(x, g, b, residual=res(r))
        return y[0] if fused_residual else y

    xla = lambda x, g, b, r: _xla_reference(x, g, b, res(r))
    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w.astype(jnp.float32)))
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (x, g, b, r)]
        w64 = jax.device_put(jnp.asarray(f64(w)), cpu)
        truth = jax.grad(lambda x, g, b, r: jnp.sum(xla(x, g, b, r) * w64), (0, 1, 2, 3))(*args64)
    gk = under_kernel_option("layer_norm_bwd_stages", 3, jax.grad(loss(ours), (0, 1, 2, 3)), x, g, b, r)
    gx = jax.jit(jax.grad(loss(xla), (0, 1, 2, 3)))(x, g, b, r)
    for i, name in enumerate(["dx", "dgamma", "dbeta", "dresidual"][:4 if fused_residual else 3]):
        assert_within_2x(name, gk[i], gx[i], truth[i])


def test_old_eps_keyword_warns_once_and_works():
    from numerics import assert_renamed_keyword
    x, g, b = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(3, 16), (16,), (16,)]))
    assert_renamed_keyword(lambda: layer_norm(x, g, b, eps=1e-3), lambda: layer_norm(x, g, b, epsilon=1e-3),
                           "layer_norm", "eps", "epsilon")
    with pytest.raises(TypeError, match="layer_norm: got both eps= .* and epsilon="):
        layer_norm(x, g, b, eps=1e-3, epsilon=1e-3)
