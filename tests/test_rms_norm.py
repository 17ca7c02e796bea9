"""rms_norm: reference vs a plain formula (forward and autodiff gradients), the residual,
copies and return_input forms, Gemma's unit offset, transformations, sharding, bad
inputs; on the GPU, the kernels against a float64 truth (the 2x rule)."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from jax_ls2.ops import rms_norm
from numerics import assert_close, assert_within_2x, compiled_text, cuda_lowering_text, f64, mesh8, shard


def plain_rms_norm(x, gamma, eps=1e-6, unit_offset=False, compute=jnp.float32):
    """Independent formula (jnp.sqrt and a division, in `compute`)."""
    xf = x.astype(compute)
    w = gamma.astype(compute) + (1 if unit_offset else 0)
    return (xf / jnp.sqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * w).astype(x.dtype)


def inputs(shape, dtype=jnp.float32, seed=0):
    """x, gamma and a residual from NumPy (no compiled program needed to make them)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape, np.float32) * 2 + 0.3).astype(dtype)
    gamma = jnp.asarray(1 + 0.3 * rng.standard_normal(shape[-1:], np.float32)).astype(dtype)
    r = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    return x, gamma, r


@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (3, 5, 769), (2, 4097)])
def test_forward_matches_plain_formula(shape):
    x, g, _ = inputs(shape, seed=shape[-1])

    @jax.jit
    def both(x, g):
        return [(rms_norm(x, g, epsilon=eps, unit_offset=uo), plain_rms_norm(x, g, eps=eps, unit_offset=uo))
                for eps, uo in ((1e-6, False), (1e-6, True), (1e-2, False))]

    for ours, plain in both(x, g):
        assert_close(ours, plain, 2e-5)


def test_backward_matches_autodiff_of_plain_formula():
    x, g, _ = inputs((7, 123), seed=1)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(x.shape, np.float32))

    @jax.jit
    def both(x, g):
        return [(jax.grad(lambda x, g: jnp.sum(rms_norm(x, g, unit_offset=uo) * w), (0, 1))(x, g),
                 jax.grad(lambda x, g: jnp.sum(plain_rms_norm(x, g, unit_offset=uo) * w), (0, 1))(x, g))
                for uo in (False, True)]

    for ours, ref in both(x, g):
        for o, r in zip(ours, ref):
            assert_close(o, r, 1e-4)


def test_check_grads():
    x, g, r = inputs((3, 17), seed=2)
    check_grads(lambda x, g: rms_norm(x, g), (x, g), order=1, modes=("rev",), atol=3e-2, rtol=3e-2)
    check_grads(lambda x, r, g: rms_norm(x, g, residual=r, unit_offset=True)[0], (x, r, g), order=1,
                modes=("rev",), atol=3e-2, rtol=3e-2)


def test_residual_form():
    x, g, r = inputs((5, 96), seed=3)
    y, s = rms_norm(x, g, residual=r)
    assert_close(s, x + r, 1e-6)
    assert_close(y, plain_rms_norm(x + r, g), 2e-5)
    w1, w2 = inputs((5, 96), seed=13)[::2]

    def ours(x, r, g):
        y, s = rms_norm(x, g, residual=r)
        return jnp.sum(y * w1) + jnp.sum(jnp.sin(s) * w2)

    def plain(x, r, g):
        s = x + r
        return jnp.sum(plain_rms_norm(s, g) * w1) + jnp.sum(jnp.sin(s) * w2)

    grads = jax.jit(lambda *a: (jax.grad(ours, (0, 1, 2))(*a), jax.grad(plain, (0, 1, 2))(*a)))(x, r, g)
    for o, p in zip(*grads):
        assert_close(o, p, 1e-4)


@pytest.mark.parametrize("copies,return_input", [(1, True), (3, True), (4, False)])
def test_copies_and_return_input(copies, return_input):
    x, g, _ = inputs((6, 5, 96), seed=12)
    ws = jnp.asarray(np.random.default_rng(8).standard_normal((copies + 1,) + x.shape, np.float32))
    consume = lambda ys, x_other: sum(jnp.sum(jnp.sin(y * (i + 1)) * ws[i]) for i, y in enumerate(ys)) + \
        (jnp.sum(jnp.tanh(x_other) * ws[-1]) if x_other is not None else 0.0)

    def ours(x, g):
        out = rms_norm(x, g, copies=copies, return_input=return_input)
        assert len(out) == copies + return_input
        return consume(out[:copies], out[copies] if return_input else None)

    def plain(x, g):
        return consume([plain_rms_norm(x, g)] * copies, x if return_input else None)

    out, y, g_ours, g_plain = jax.jit(lambda x, g: (rms_norm(x, g, copies=copies, return_input=return_input),
                                                    plain_rms_norm(x, g), jax.grad(ours, (0, 1))(x, g),
                                                    jax.grad(plain, (0, 1))(x, g)))(x, g)
    for y_copy in out[:copies]:
        assert_close(y_copy, y, 2e-5)
    if return_input:
        np.testing.assert_array_equal(out[-1], x)
    for o, p in zip(g_ours, g_plain):
        assert_close(o, p, 1e-4)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_low_precision_dtypes_and_param_cast(dtype):
    x, g, _ = inputs((4, 64), dtype)
    y = rms_norm(x, g.astype(jnp.float32))
    assert y.dtype == dtype
    dg = jax.grad(lambda g: jnp.sum(rms_norm(x, g).astype(jnp.float32)))(g.astype(jnp.float32))
    assert dg.dtype == jnp.float32
    x64, g64 = f64(x), f64(g)
    truth = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * g64
    np.testing.assert_allclose(f64(y), truth, atol=0.05, rtol=0.02)


def test_transformations():
    x, g, _ = inputs((4, 6, 32), seed=4)
    loss = lambda x, g: jnp.sum(rms_norm(x, g) ** 2)
    plain = lambda x, g: jnp.sum(plain_rms_norm(x, g) ** 2)

    @jax.jit
    def run(x, g):
        per_ex = jax.vmap(jax.grad(loss, 1), in_axes=(0, None))(x, g)
        per_ex_plain = jax.vmap(jax.grad(plain, 1), in_axes=(0, None))(x, g)
        # vmap over the weight too (a sequential map).
        by_weight = jax.vmap(lambda g: rms_norm(x, g))(jnp.stack([g, g * 2]))[1]
        return (jax.vmap(lambda x: rms_norm(x, g))(x), plain_rms_norm(x, g)), (per_ex, per_ex_plain), \
            (by_weight, plain_rms_norm(x, g * 2))

    for (a, c), tol in zip(run(x, g), (2e-5, 1e-4, 2e-5)):
        assert_close(a, c, tol)

    def body(h, g_):
        return jax.checkpoint(lambda h: rms_norm(h, g_, residual=h, unit_offset=True)[0])(h), None

    def plain_body(h, g_):
        return plain_rms_norm(h + h, g_, unit_offset=True), None

    stack = jnp.stack([g, g * 0.5, g - 1])
    scan_loss = lambda x, st: jnp.sum(jax.lax.scan(body, x, st)[0] ** 2)
    plain_scan = lambda x, st: jnp.sum(jax.lax.scan(plain_body, x, st)[0] ** 2)
    for a, c in zip(*jax.jit(lambda *a: (jax.grad(scan_loss, (0, 1))(*a), jax.grad(plain_scan, (0, 1))(*a)))(x, stack)):
        assert_close(a, c, 2e-4)


def test_batch_sharded_jit_has_no_all_gather_and_shard_map():
    mesh = mesh8()
    x, g, _ = inputs((16, 4, 48), seed=5)
    xs = shard(x, mesh, "data")
    f = jax.jit(jax.grad(lambda x, g: sum(jnp.sum(t ** 3) for t in rms_norm(x, g, copies=2, return_input=True)),
                         (0, 1)))
    ref = jax.jit(jax.grad(lambda x, g: 2 * jnp.sum(plain_rms_norm(x, g) ** 3) + jnp.sum(x ** 3), (0, 1)))(x, g)
    out = f(xs, g)
    for a, c in zip(out, ref):
        assert_close(a, c, 2e-4)
    assert out[0].sharding.spec[0] == "data"
    text = compiled_text(f, xs, g)
    assert "all-gather" not in text and "all-reduce" in text  # dgamma summed across shards

    def per_device(x, g):
        return jax.grad(lambda x, g: jnp.sum(rms_norm(x, g, residual=x)[0] ** 2), (0, 1))(x, g)

    sm = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P())))
    ref = jax.jit(jax.grad(lambda x, g: jnp.sum(plain_rms_norm(x + x, g) ** 2), (0, 1)))(x, g)
    for a, c in zip(sm(x, g), ref):
        assert_close(a, c, 2e-4)


def test_bad_inputs():
    x, g, r = inputs((4, 8))
    with pytest.raises(ValueError, match=r"rms_norm: gamma must have shape \(8,\), got \(7,\)"):
        rms_norm(x, g[:7])
    with pytest.raises(TypeError, match="rms_norm: x must have dtype"):
        rms_norm(x.astype(jnp.int32), g)
    with pytest.raises(ValueError, match="rms_norm: x must have rank >= 1"):
        rms_norm(jnp.float32(1.0), g)
    with pytest.raises(ValueError, match="rms_norm: residual must have shape"):
        rms_norm(x, g, residual=r[:2])
    with pytest.raises(TypeError, match="rms_norm: residual must have dtype float32"):
        rms_norm(x, g, residual=r.astype(jnp.bfloat16))
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match="rms_norm: epsilon must be a positive"):
            rms_norm(x, g, epsilon=bad)
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match=f"rms_norm: epsilon must be a positive finite Python float, got {bad}"):
            rms_norm(x, g, epsilon=bad)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="rms_norm: copies must be a Python int from 1 to 4"):
            rms_norm(x, g, copies=bad)
    with pytest.raises(ValueError, match="rms_norm: copies applies without residual"):
        rms_norm(x, g, residual=r, copies=2)
    with pytest.raises(ValueError, match="rms_norm: return_input applies without residual"):
        rms_norm(x, g, residual=r, return_input=True)
    with pytest.raises(TypeError, match="rms_norm: unit_offset must be a Python bool"):
        rms_norm(x, g, unit_offset=1)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(rms_norm(x, g) ** 3))(x)))(x)


# ---------------------------------------------------------------- GPU
GPU_SHAPES = [(7, 123), (1025, 769), (64, 4097), (2048, 4096), (33, 16384), (3, 40000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("form", ["plain", "residual", "gemma"])
def test_gpu_against_float64_truth(dtype, shape, form):
    x, g, r = inputs(shape, dtype, seed=shape[-1])
    if form == "gemma":
        g = (g.astype(jnp.float32) - 1).astype(dtype)
    w = inputs(shape, dtype, seed=3)[2]
    uo = form == "gemma"

    def ours(x, g, r):
        return rms_norm(x, g, residual=r, unit_offset=uo)[0] if form == "residual" else rms_norm(x, g, unit_offset=uo)

    def xla(x, g, r, compute=jnp.float32):
        s = (x.astype(compute) + r.astype(compute)).astype(x.dtype) if form == "residual" else x
        return plain_rms_norm(s, g, unit_offset=uo, compute=compute)

    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w.astype(jnp.float32)))
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (x, g, r)]
        w64 = jax.device_put(jnp.asarray(f64(w)), cpu)
        truth_y = xla(*args64, compute=jnp.float64)
        truth_g = jax.grad(lambda *a: jnp.sum(xla(*a, compute=jnp.float64) * w64), (0, 1, 2))(*args64)
    assert_within_2x("y", jax.jit(ours)(x, g, r), jax.jit(xla)(x, g, r), truth_y)
    gk = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(x, g, r)
    gx = jax.jit(jax.grad(loss(xla), (0, 1, 2)))(x, g, r)
    for i, name in enumerate(["dx", "dgamma", "dresidual"][:3 if form == "residual" else 2]):
        assert_within_2x(name, gk[i], gx[i], truth_g[i])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1025, 769), (4096, 768), (64, 20000)])
@pytest.mark.parametrize("copies,return_input", [(1, True), (3, True), (4, False)])
def test_gpu_copies_against_float64_truth(dtype, shape, copies, return_input):
    """Cotangents given in the dtype (as consumers' backward passes deliver them); the
    XLA reference adds them in the dtype as autodiff of several uses does."""
    x, g, _ = inputs(shape, dtype, seed=6)
    n = copies + return_input
    cts = tuple(inputs(shape, dtype, seed=20 + i)[2] for i in range(n))

    def ours(x, g, cts):
        out_cts = cts if n > 1 else cts[0]
        return jax.vjp(lambda x, g: rms_norm(x, g, copies=copies, return_input=return_input), x, g)[1](out_cts)

    def xla(x, g, cts, compute=jnp.float32):
        _, vjp = jax.vjp(lambda x, g: plain_rms_norm(x, g, compute=compute), x, g)
        dx, dg = vjp(functools.reduce(jax.lax.add, cts[:copies]))
        return (dx + cts[copies] if return_input else dx), dg

    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (x, g)]
        truth = xla(*args64, tuple(jax.device_put(jnp.asarray(f64(c)), cpu) for c in cts), compute=jnp.float64)
    assert cuda_lowering_text(ours, x, g, cts).count("custom_call @jax_ls2_rms_norm_bwd") == 1
    for name, k, r, t in zip(["dx", "dgamma"], jax.jit(ours)(x, g, cts), jax.jit(xla)(x, g, cts), truth):
        assert_within_2x(name, k, r, t)


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_every_output_element_written_and_kernels_called():
    assert os.environ.get("JAX_LS2_POISON_OUTPUTS") == "1"
    x, g, r = inputs((4099, 777), jnp.bfloat16, seed=11)
    y, s = jax.jit(lambda x, g, r: rms_norm(x, g, residual=r))(x, g, r)
    grad = jax.grad(lambda x, g: jnp.sum(rms_norm(x, g).astype(jnp.float32)), (0, 1))
    dx, dg = jax.jit(grad)(x, g)
    for arr in (y, s, dx, dg):
        assert bool(jnp.all(jnp.isfinite(arr)))
    text = compiled_text(grad, x, g)
    assert "jax_ls2_rms_norm_fwd" in text and "jax_ls2_rms_norm_bwd" in text


def test_old_eps_keyword_warns_once_and_works():
    from numerics import assert_renamed_keyword
    x, g = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(3, 16), (16,)]))
    assert_renamed_keyword(lambda: rms_norm(x, g, eps=1e-3), lambda: rms_norm(x, g, epsilon=1e-3),
                           "rms_norm", "eps", "epsilon")
    with pytest.raises(TypeError, match="rms_norm: got both eps= .* and epsilon="):
        rms_norm(x, g, eps=1e-3, epsilon=1e-3)
