"""fp8_dot: numerics against a float64 truth (2x the error of XLA's unfused
quantize-dot-dequantize), FP8 dot_generals in the program lowered for CUDA, the meta
update (amax observation) under grad, vmap and gradient accumulation, and bad input."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ls2 import fp8
from numerics import assert_within_2x, cuda_lowering_text, f64


def _delayed_meta(recipe, *tensors):
    """The meta after one step that observed the amaxes of `tensors` (input, weight,
    output gradient) -- from other draws than the ones multiplied, as delayed scaling is."""
    meta = fp8.DotMeta.create(recipe)
    amaxes = jnp.stack([jnp.max(jnp.abs(t)).astype(jnp.float32) for t in tensors])
    return fp8.update_meta(meta, fp8.DotMeta.observation(amaxes, meta), recipe)


def _unfused_reference(x, w, g, meta, recipe):
    """XLA's unfused quantize -> dequantize (float32) -> dot, forward and both grads."""
    def qdq(t, row, dtype):
        limit = fp8.fp8_max(dtype)
        q = jnp.clip(t.astype(jnp.float32) * meta.scale[row], -limit, limit).astype(dtype)
        return q.astype(jnp.float32) * meta.scale_inv[row]
    hi = jax.lax.Precision.HIGHEST
    xd, wd = qdq(x, fp8.INPUT, recipe.forward_dtype), qdq(w, fp8.WEIGHT, recipe.forward_dtype)
    gd = qdq(g, fp8.GRAD_OUTPUT, recipe.backward_dtype)
    y = jnp.einsum("...k,kn->...n", xd, wd, precision=hi)
    dx = jnp.einsum("...n,kn->...k", gd, wd, precision=hi)
    dw = jnp.matmul(xd.reshape(-1, xd.shape[-1]).T, gd.reshape(-1, gd.shape[-1]), precision=hi)
    return y, dx, dw


@pytest.mark.parametrize("shape, n, dtype, fmt", [
    ((3, 7, 123), 96, jnp.bfloat16, "hybrid"),
    ((37, 64), 33, jnp.float32, "hybrid"),
    ((2, 5, 48), 80, jnp.float32, "e4m3"),
])
def test_fp8_dot_within_2x_of_unfused_quantize_dot_dequantize(shape, n, dtype, fmt):
    recipe = fp8.DelayedScaling(fp8_format=fmt, amax_history_len=4)
    k = jax.random.split(jax.random.key(sum(shape) + n), 6)
    x = (jax.random.normal(k[0], shape) * 3.0).astype(dtype)
    w = (jax.random.normal(k[1], (shape[-1], n)) * 0.05).astype(dtype)
    g = (jax.random.normal(k[2], shape[:-1] + (n,)) * 1e-3).astype(dtype)
    meta = _delayed_meta(recipe, jax.random.normal(k[3], shape) * 3.0,
                         jax.random.normal(k[4], w.shape) * 0.05, jax.random.normal(k[5], g.shape) * 1e-3)

    y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot(x, w, meta, recipe), x, w)
    dx, dw = vjp(g)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert y.shape == shape[:-1] + (n,) and dx.shape == shape and dw.shape == w.shape
    truth_y = np.einsum("...k,kn->...n", f64(x), f64(w))
    truth_dx = np.einsum("...n,kn->...k", f64(g), f64(w))
    truth_dw = f64(x).reshape(-1, shape[-1]).T @ f64(g).reshape(-1, n)
    ref_y, ref_dx, ref_dw = _unfused_reference(x, w, g, meta, recipe)
    assert_within_2x("y", y, ref_y, truth_y)
    assert_within_2x("dx", dx, ref_dx, truth_dx)
    assert_within_2x("dw", dw, ref_dw, truth_dw)


def test_meta_gradient_is_the_observed_amaxes():
    recipe = fp8.DelayedScaling(amax_history_len=3)
    k = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(k[0], (4, 6, 32)), jax.random.normal(k[1], (32, 16))
    c = jax.random.normal(k[2], (4, 6, 16))
    meta = _delayed_meta(recipe, x, w, c)
    d_meta = jax.jit(jax.grad(lambda m: jnp.sum(fp8.fp8_dot(x, w, m, recipe) * c)))(meta)
    expected = np.zeros((3, 3), np.float32)
    expected[:, 0] = [jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(c).max()]
    np.testing.assert_array_equal(d_meta.amax_history, expected)
    np.testing.assert_array_equal(d_meta.scale, 0.0)
    np.testing.assert_array_equal(d_meta.scale_inv, 0.0)

    # vmap over x with a shared meta: one observation over the whole mapped batch, and
    # the same outputs as the unmapped call over the stacked batch.
    f_vmapped = lambda m: jnp.sum(jax.vmap(lambda xi, ci: fp8.fp8_dot(xi, w, m, recipe) * ci)(x, c))
    np.testing.assert_array_equal(jax.grad(f_vmapped)(meta).amax_history, expected)
    np.testing.assert_array_equal(jax.vmap(lambda xi: fp8.fp8_dot(xi, w, meta, recipe))(x),
                                  fp8.fp8_dot(x, w, meta, recipe))
    # vmap over stacked metas (one per layer): one observation each.
    metas = jax.tree.map(lambda a: jnp.stack([a, a]), meta)
    xs = jnp.stack([x, 2.0 * x])
    per_layer = jax.grad(lambda ms: jnp.sum(jax.vmap(lambda xi, m: fp8.fp8_dot(xi, w, m, recipe) * c)(xs, ms)))(metas)
    np.testing.assert_allclose(per_layer.amax_history[:, 0, 0], [jnp.abs(x).max(), 2.0 * jnp.abs(x).max()])


def test_cuda_lowering_has_fp8_dot_generals_and_no_upcast_before_them():
    recipe = fp8.DelayedScaling(amax_history_len=8)
    x = jnp.ones((2, 16, 64), jnp.bfloat16)
    w = jnp.ones((64, 32), jnp.bfloat16)
    meta = fp8.DotMeta.create(recipe)
    loss = lambda x, w, m: jnp.sum(fp8.fp8_dot(x, w, m, recipe).astype(jnp.float32) ** 2)
    text = cuda_lowering_text(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, w, meta)
    dots = re.findall(r"stablehlo\.dot_general.*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    kinds = sorted((a.split("x")[-1].rstrip(">"), b.split("x")[-1].rstrip(">")) for a, b in dots)
    # forward e4m3 x e4m3; dgrad e5m2 x e4m3; wgrad e4m3 x e5m2.
    assert kinds == [("f8E4M3FN", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2"), ("f8E5M2", "f8E4M3FN")], text
    upcasts = re.findall(r"stablehlo\.convert .*: \(tensor<[^>]*f8E[^>]*>\) -> tensor<[^>]*(?:bf16|f16|f32)>", text)
    assert not upcasts, upcasts


_F8_DOT = re.compile(r"(%\S+) = stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")


def _scaled_gemm_forms(text):
    """(operand types, result type, whether its only use is a multiply by a broadcast
    scalar of the result dtype) of each FP8 dot_general in a lowered program."""
    forms = []
    for name, a, b, out in _F8_DOT.findall(text):
        if "f8E" not in a + b:
            continue
        uses = re.findall(rf"= (\S+) [^\n]*{re.escape(name)}\b[^\n]*", text)
        scaled = uses == ["stablehlo.multiply"] and re.search(
            rf"stablehlo\.multiply {re.escape(name)}, (%\S+) : {re.escape(out)}", text) is not None
        forms.append((a, b, out, scaled))
    return forms


@pytest.mark.parametrize("x_dtype, w_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
def test_gemms_have_the_form_xla_folds_into_one_cublaslt_fp8_call(x_dtype, w_dtype):
    # XLA's gemm rewriter takes a 2-D dot_general of FP8 operands with a bf16/f32 result,
    # and folds a following multiply by a broadcast scalar into the call's scale
    # (F8ScaleD): the GEMM writes its final dtype, no float32 round trip.
    recipe = fp8.DelayedScaling(amax_history_len=8)
    x = jnp.ones((2, 16, 64), x_dtype)
    w = jnp.ones((64, 32), w_dtype)
    loss = lambda x, w, m: jnp.sum(fp8.fp8_dot(x, w, m, recipe, dtype=jnp.bfloat16).astype(jnp.float32) ** 2)
    text = cuda_lowering_text(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, w, fp8.DotMeta.create(recipe))
    forms = _scaled_gemm_forms(text)
    assert len(forms) == 3, text
    w_out = "f32" if w_dtype == jnp.float32 else "bf16"
    # forward (32, 64) x (64, 32) -> bf16; dgrad (32, 32) x (64, 32) -> x's bf16; wgrad -> w's dtype.
    assert sorted(out for _, _, out, _ in forms) == sorted(["tensor<32x32xbf16>", "tensor<32x64xbf16>",
                                                            f"tensor<64x32x{w_out}>"]), forms
    for a, b, out, scaled in forms:
        assert a.count("x") == 2 and b.count("x") == 2, (a, b)  # 2-D operands
        assert scaled, (a, b, out)


def test_splits_share_one_quantization_and_equal_the_whole_gemm():
    recipe = fp8.DelayedScaling(amax_history_len=4)
    k = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(k[0], (2, 8, 32), jnp.bfloat16)
    w = jax.random.normal(k[1], (32, 48)) * 0.1
    c = jax.random.normal(k[2], (2, 8, 48), jnp.bfloat16)
    meta = _delayed_meta(recipe, x, w, c)

    def loss(x, w, m, splits):
        ys = fp8.fp8_dot(x, w, m, recipe, dtype=jnp.bfloat16, splits=splits)
        y = jnp.concatenate(ys, -1) if splits > 1 else ys
        return jnp.sum((y * c).astype(jnp.float32)), y
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (dx3, dw3, dm3), y3 = grad(x, w, meta, 3)
    (dx1, dw1, dm1), y1 = grad(x, w, meta, 1)
    for a, b in ((y3, y1), (dx3, dx1), (dw3, dw1)):
        np.testing.assert_allclose(f64(a), f64(b), rtol=1e-2, atol=1e-2 * float(jnp.abs(f64(b)).max()))
    np.testing.assert_array_equal(dm3.amax_history, dm1.amax_history)
    # Three forward GEMMs on one quantized x and w; one dgrad and one wgrad.
    text = cuda_lowering_text(lambda x, w, m: grad(x, w, m, 3), x, w, meta)
    forms = _scaled_gemm_forms(text)
    assert sorted(out for *_, out, _ in forms) == sorted(["tensor<16x16xbf16>"] * 3 + ["tensor<16x32xbf16>",
                                                                                     "tensor<32x48xf32>"]), forms
    assert len(re.findall(r"stablehlo\.convert [^\n]*-> tensor<[^>]*f8E", text)) == 3
    with pytest.raises(ValueError, match="fp8_dot: splits must be a positive int dividing w's N=48 columns, got 5"):
        fp8.fp8_dot(x, w, meta, recipe, splits=5)


def test_second_order_raises():
    recipe = fp8.DelayedScaling(amax_history_len=2)
    x, w, meta = jnp.ones((2, 8)), jnp.ones((8, 4)), fp8.DotMeta.create(recipe)
    inner = jax.grad(lambda x: jnp.sum(fp8.fp8_dot(x, w, meta, recipe) ** 2))
    with pytest.raises(NotImplementedError, match="fp8_dot: second-order derivatives are not supported"):
        jax.grad(lambda x: jnp.sum(inner(x)))(x)


@pytest.mark.parametrize("x_shape, w_shape, x_dtype, kwargs, error, match", [
    ((8,), (8, 4), jnp.float32, {}, ValueError, r"x must have shape \(\.\.\., K\) with rank >= 2, got \(8,\)"),
    ((2, 8), (8, 4, 1), jnp.float32, {}, ValueError, r"w must have shape \(K, N\) \(rank 2\), got \(8, 4, 1\)"),
    ((2, 8), (7, 4), jnp.float32, {}, ValueError, r"x's last dim \(K=8\) must equal w's first dim"),
    ((2, 8), (8, 4), jnp.int32, {}, TypeError, r"x must have dtype in .*got int32"),
    ((2, 8), (8, 4), jnp.float32, {"dtype": jnp.int8}, TypeError, r"dtype must be one of .*got int8"),
    ((2, 8), (8, 4), jnp.float32, {"amax_axes": ("data", 1)}, TypeError, r"amax_axes must be a tuple"),
])
def test_bad_input_is_rejected(x_shape, w_shape, x_dtype, kwargs, error, match):
    recipe = fp8.DelayedScaling(amax_history_len=2)
    with pytest.raises(error, match="fp8_dot: " + match):
        fp8.fp8_dot(jnp.ones(x_shape, x_dtype), jnp.ones(w_shape), fp8.DotMeta.create(recipe), recipe, **kwargs)


def test_bad_meta_or_recipe_is_rejected():
    recipe = fp8.DelayedScaling(amax_history_len=2)
    x, w = jnp.ones((2, 8)), jnp.ones((8, 4))
    with pytest.raises(ValueError, match=r"fp8_dot: meta.amax_history must be float32 of shape \(3, 2\)"):
        fp8.fp8_dot(x, w, fp8.DotMeta.create(fp8.DelayedScaling(amax_history_len=3)), recipe)
    with pytest.raises(TypeError, match="fp8_dot: meta must be a DotMeta, FP8Meta or FP8DotMeta, got dict"):
        fp8.fp8_dot(x, w, {}, recipe)
    with pytest.raises(TypeError, match="fp8_dot: recipe must be a jax_ls2.fp8.DelayedScaling, got str"):
        fp8.fp8_dot(x, w, fp8.DotMeta.create(recipe), "hybrid")
    with pytest.raises(ValueError, match="DelayedScaling: fp8_format must be one of"):
        fp8.DelayedScaling(fp8_format="e5m2")


# --- gradient accumulation: 4 micro-batches give the state of the max over them ---

RECIPE = fp8.DelayedScaling(amax_history_len=4)
MICRO = 4


def _variables():
    k = jax.random.split(jax.random.key(7), 2)
    return {"dense": {"kernel": jax.random.normal(k[0], (24, 8)) * 0.1, "fp8": _delayed_meta(
        RECIPE, jnp.full((1,), 2.0), jnp.full((1,), 0.3), jnp.full((1,), 1.0))}}


def _micro_batches():
    k = jax.random.split(jax.random.key(8), 2 * MICRO)
    # Different magnitudes per micro-batch, so the max is not any one of them in every row.
    xs = [jax.random.normal(k[i], (5, 24)) * s for i, s in enumerate([1.0, 4.0, 2.0, 0.5])]
    cs = [jax.random.normal(k[MICRO + i], (5, 8)) * s for i, s in enumerate([0.5, 1.0, 3.0, 2.0])]
    return xs, cs


def _loss(variables, x, c):
    return jnp.sum(fp8.fp8_dot(x, variables["dense"]["kernel"], variables["dense"]["fp8"], RECIPE) * c)


def _expected_meta(variables, xs, cs):
    """By hand: the recipe stepped once with the max over the micro-batches of the
    amaxes of x, the kernel and the output gradient (which is c for this loss)."""
    amax = jnp.float32([max(float(jnp.abs(x).max()) for x in xs), float(jnp.abs(variables["dense"]["kernel"]).max()),
                        max(float(jnp.abs(c).max()) for c in cs)])
    meta = variables["dense"]["fp8"]
    return fp8.update_dot_meta(meta, fp8.DotMeta.observation(amax, meta), RECIPE)


def _assert_meta_equal(meta, expected):
    for name, a, b in zip(fp8.DotMeta._fields, meta, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_accumulation_loop_gives_the_max_over_micro_batches():
    variables, (xs, cs) = _variables(), _micro_batches()
    grad = jax.jit(jax.grad(_loss))
    param_sum, meta_acc = None, None
    for x, c in zip(xs, cs):
        param_grads, meta_updates = fp8.split_meta(grad(variables, x, c))
        param_sum = param_grads if param_sum is None else jax.tree.map(jnp.add, param_sum, param_grads)
        meta_acc = fp8.merge_meta_updates(meta_acc, meta_updates)
    new = fp8.update_meta(variables, meta_acc, RECIPE)
    _assert_meta_equal(new["dense"]["fp8"], _expected_meta(variables, xs, cs))
    assert new["dense"]["kernel"] is variables["dense"]["kernel"]
    assert param_sum["dense"]["fp8"] is None and param_sum["dense"]["kernel"].shape == (24, 8)


def test_optax_multisteps_through_split_and_merge_gives_the_max_over_micro_batches():
    variables, (xs, cs) = _variables(), _micro_batches()
    tx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), every_k_schedule=MICRO)
    params, meta = fp8.split_meta(variables)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, meta, opt_state, meta_acc, x, c):
        param_grads, meta_updates = fp8.split_meta(jax.grad(_loss)(fp8.join_meta(params, meta), x, c))
        updates, opt_state = tx.update(param_grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        meta_acc = fp8.merge_meta_updates(meta_acc, meta_updates)
        emitted = tx.has_updated(opt_state)
        meta = jax.tree.map(lambda new, old: jnp.where(emitted, new, old),
                            fp8.update_meta(meta, meta_acc, RECIPE), meta)
        # Start a new accumulation after each optimizer step.
        meta_acc = jax.tree.map(lambda a: jnp.where(emitted, 0.0, a), meta_acc)
        return params, meta, opt_state, meta_acc

    meta_acc = jax.tree.map(jnp.zeros_like, meta)
    for i, (x, c) in enumerate(zip(xs, cs)):
        params, meta, opt_state, meta_acc = step(params, meta, opt_state, meta_acc, x, c)
        if i < MICRO - 1:
            _assert_meta_equal(meta["dense"]["fp8"], variables["dense"]["fp8"])
    _assert_meta_equal(meta["dense"]["fp8"], _expected_meta(variables, xs, cs))
    assert not np.array_equal(params["dense"]["kernel"], variables["dense"]["kernel"])


class _FP8Dense(nnx.Module):
    def __init__(self, k, n, recipe, *, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (k, n)) * 0.1)
        self.fp8 = fp8.FP8DotMeta.create(recipe)
        self.recipe = recipe

    def __call__(self, x):
        return fp8.fp8_dot(x, self.kernel[...], self.fp8, self.recipe)


def test_nnx_module_step_updates_meta_and_params_separately():
    model = _FP8Dense(24, 8, RECIPE, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    xs, cs = _micro_batches()
    before = model.fp8.value()
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta))

    @nnx.jit
    def train_step(model, optimizer, x, c):
        grads = nnx.grad(lambda m: jnp.sum(m(x) * c), argnums=wrt)(model)
        param_grads, meta_updates = fp8.split_meta(grads)
        optimizer.update(model, param_grads)
        nnx.update(model, fp8.update_meta(nnx.state(model, fp8.FP8Meta), meta_updates, RECIPE))

    kernel_before = np.asarray(model.kernel[...])
    train_step(model, optimizer, xs[1], cs[1])
    observed = jnp.float32([jnp.abs(xs[1]).max(), jnp.abs(jnp.asarray(kernel_before)).max(), jnp.abs(cs[1]).max()])
    _assert_meta_equal(model.fp8.value(), fp8.update_dot_meta(before, fp8.DotMeta.observation(observed, before), RECIPE))
    assert not np.array_equal(model.kernel[...], kernel_before)


@pytest.mark.parametrize("remat", [False, True])
def test_scan_over_layers_with_stacked_metas(remat):
    """Layers scanned with one meta each: every layer's update holds its own input amax,
    with and without jax.checkpoint around the layer."""
    recipe, layers = fp8.DelayedScaling(amax_history_len=4), 3
    ws = jax.random.normal(jax.random.key(0), (layers, 16, 16)) * 0.2
    metas = jax.tree.map(lambda a: jnp.stack([a] * layers), fp8.DotMeta.create(recipe))
    x = jax.random.normal(jax.random.key(1), (4, 16)) * 3.0

    def layer(h, w_and_meta):
        w, m = w_and_meta
        return jnp.tanh(fp8.fp8_dot(h, w, m, recipe)), None

    def loss(ws, metas):
        h, _ = jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, (ws, metas))
        return jnp.sum(h ** 2)

    d_metas = jax.jit(jax.grad(loss, argnums=1))(ws, metas)
    h, input_amaxes = x, []
    for i in range(layers):
        input_amaxes.append(float(jnp.abs(h).max()))
        h = layer(h, (ws[i], jax.tree.map(lambda a: a[i], metas)))[0]
    np.testing.assert_array_equal(d_metas.amax_history[:, fp8.INPUT, 0], np.float32(input_amaxes))
    np.testing.assert_array_equal(d_metas.amax_history[:, fp8.WEIGHT, 0], jnp.abs(ws).max(axis=(1, 2)))
