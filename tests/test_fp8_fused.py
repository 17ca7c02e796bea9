"""jax_ls2.fp8.fused: LayerNorm -> FP8 GEMM and the FP8 MLP against the same math
composed from fp8_dot (equal up to the rounding of the intermediates), the meta update
(each GEMM's input, weight and output-gradient amaxes), vmap with a shared meta, the
errors, and one FP8 cast per tensor in the lowered program."""
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ls2 import fp8, ops
from jax_ls2.fp8 import fused
from numerics import cuda_lowering_text, rel_err

RECIPE = fp8.DelayedScaling(amax_history_len=4)
H, F, N = 32, 64, 48


def _meta(*tensors):
    """A meta whose scales come from the amaxes of `tensors` (input, weight, gradient)."""
    meta = fp8.DotMeta.create(RECIPE)
    amaxes = jnp.stack([jnp.max(jnp.abs(t)).astype(jnp.float32) for t in tensors])
    return fp8.update_meta(meta, fp8.DotMeta.observation(amaxes, meta), RECIPE)


def _data(seed=0, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(seed), 8)
    x = (jax.random.normal(k[0], (2, 8, H)) * 2 + 0.5).astype(dtype)
    gamma, beta = 1 + 0.1 * jax.random.normal(k[1], (H,)), 0.1 * jax.random.normal(k[2], (H,))
    w1, b1 = jax.random.normal(k[3], (H, F)) * 0.2, 0.1 * jax.random.normal(k[4], (F,))
    w2 = jax.random.normal(k[5], (F, N)) * 0.1
    c = jax.random.normal(k[6], (2, 8, N)).astype(dtype)
    return x, gamma, beta, w1, b1, w2, c


def _ln(x, gamma, beta):
    return ops.layer_norm(x, gamma.astype(x.dtype), beta.astype(x.dtype))


def _close(name, a, b, tol):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert rel_err(u, v) <= tol, (name, rel_err(u, v))


def test_layernorm_fp8_dot_matches_layer_norm_then_fp8_dot():
    x, gamma, beta, w1, _, _, _ = _data()
    c = jax.random.normal(jax.random.key(9), (2, 8, F)).astype(x.dtype)
    meta = _meta(_ln(x, gamma, beta), w1, c)

    def fused_loss(x, gamma, beta, w, m):
        y, x_res = fused.layernorm_fp8_dot(x, gamma, beta, w, m, RECIPE, return_input=True)
        return jnp.sum((y * c).astype(jnp.float32)) + jnp.sum(x_res.astype(jnp.float32) ** 2)

    def composed_loss(x, gamma, beta, w, m):
        y = fp8.fp8_dot(_ln(x, gamma, beta), w, m, RECIPE)
        return jnp.sum((y * c).astype(jnp.float32)) + jnp.sum(x.astype(jnp.float32) ** 2)

    args = (x, gamma, beta, w1, meta)
    got = jax.jit(jax.value_and_grad(fused_loss, argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.jit(jax.value_and_grad(composed_loss, argnums=(0, 1, 2, 3, 4)))(*args)
    _close("value", got[0], want[0], 2e-2)
    for name, a, b in zip(("dx", "dgamma", "dbeta", "dw"), got[1][:4], want[1][:4]):
        _close(name, a, b, 3e-2)
    # The meta update: amaxes of LN(x), w and the output gradient (bf16 LN output here,
    # float32 in the fused kernel: equal to bf16 rounding).
    np.testing.assert_allclose(got[1][4].observed_amax(), want[1][4].observed_amax(), rtol=1e-2)
    assert np.all(np.asarray(got[1][4].observed_amax()) > 0)


@pytest.mark.parametrize("with_ln, activation", [(True, "gelu"), (False, "gelu_tanh"), (True, "relu")])
def test_fp8_mlp_matches_fp8_dot_bias_act_fp8_dot(with_ln, activation):
    x, gamma, beta, w1, b1, w2, c = _data(1)
    h = _ln(x, gamma, beta) if with_ln else x
    pre = h.astype(jnp.float32) @ w1 + b1
    act = ops.bias_act_dropout(pre.astype(x.dtype), jnp.zeros((F,), x.dtype), activation=activation, rate=0.0,
                               deterministic=True)
    m1, m2 = _meta(h, w1, pre * 0.05), _meta(act, w2, c)

    def fused_loss(x, gamma, beta, w1, b1, w2, m1, m2):
        y = fused.fp8_mlp(x, w1, b1, w2, m1, m2, RECIPE, activation=activation,
                          ln=(gamma, beta) if with_ln else None)
        return jnp.sum((y * c).astype(jnp.float32)), y

    def composed_loss(x, gamma, beta, w1, b1, w2, m1, m2):
        h = _ln(x, gamma, beta) if with_ln else x
        y1 = fp8.fp8_dot(h, w1, m1, RECIPE)
        a = ops.bias_act_dropout(y1, b1.astype(y1.dtype), activation=activation, rate=0.0, deterministic=True)
        y = fp8.fp8_dot(a, w2, m2, RECIPE)
        return jnp.sum((y * c).astype(jnp.float32)), y

    args = (x, gamma, beta, w1, b1, w2, m1, m2)
    got = jax.jit(jax.value_and_grad(fused_loss, argnums=tuple(range(8)), has_aux=True))(*args)
    want = jax.jit(jax.value_and_grad(composed_loss, argnums=tuple(range(8)), has_aux=True))(*args)
    # The bias is added to the bf16 GEMM result (fused) or in float32 (composed), so a
    # few FP8 roundings of the activation differ.
    _close("y", got[0][1], want[0][1], 3e-2)
    names = ("dx", "dgamma", "dbeta", "dw1", "db1", "dw2")
    for i, name in enumerate(names):
        if with_ln or i not in (1, 2):
            _close(name, got[1][i], want[1][i], 5e-2)
    for i in (6, 7):
        amax_got, amax_want = got[1][i].observed_amax(), want[1][i].observed_amax()
        assert np.all(np.asarray(amax_got) > 0)
        np.testing.assert_allclose(amax_got, amax_want, rtol=2e-2)


def test_vmap_with_a_shared_meta_records_one_observation_over_the_batch():
    x, gamma, beta, w1, b1, w2, c = _data(2)
    m1, m2 = _meta(x, w1, x), _meta(x, w2, c)
    xs = jnp.stack([x, 3.0 * x])

    def loss(ms):
        y = jax.vmap(lambda xi: fused.fp8_mlp(xi, w1, b1, w2, ms[0], ms[1], RECIPE))(xs)
        return jnp.sum(y.astype(jnp.float32))
    d1, _ = jax.grad(loss)((m1, m2))
    np.testing.assert_allclose(d1.observed_amax()[fp8.INPUT], 3.0 * jnp.abs(x.astype(jnp.float32)).max(), rtol=1e-2)


def test_bad_input_names_the_op():
    x, gamma, beta, w1, b1, w2, _ = _data()
    m = fp8.DotMeta.create(RECIPE)
    with pytest.raises(ValueError, match="fp8_mlp: activation must be one of"):
        fused.fp8_mlp(x, w1, b1, w2, m, m, RECIPE, activation="swish")
    with pytest.raises(ValueError, match=r"fp8_mlp: w2 must have shape \(64, N\)"):
        fused.fp8_mlp(x, w1, b1, w2.T, m, m, RECIPE)
    with pytest.raises(ValueError, match=r"fp8_mlp: b1 must have shape \(64,\)"):
        fused.fp8_mlp(x, w1, b1[:3], w2, m, m, RECIPE)
    with pytest.raises(ValueError, match=r"layernorm_fp8_dot: gamma must have shape \(32,\)"):
        fused.layernorm_fp8_dot(x, gamma[:4], beta, w1, m, RECIPE)
    with pytest.raises(ValueError, match="layernorm_fp8_dot: x's last dim"):
        fused.layernorm_fp8_dot(x, gamma, beta, w1.T, m, RECIPE)
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"layernorm_fp8_dot: epsilon must be a positive finite Python float, "
                                             f"got {bad}"):
            fused.layernorm_fp8_dot(x, gamma, beta, w1, m, RECIPE, epsilon=bad)


# A quantization: a convert to FP8 (XLA's casts and the references of the fused casts) or
# a fused cast kernel's custom call with FP8 results (its two layouts are one cast).
_TO_FP8 = re.compile(r"= (?:stablehlo\.convert [^\n]*-> tensor<[^>]*f8E[^>]*>"
                     r"|stablehlo\.custom_call @jax_ls2_[^\n]*-> \([^\n]*f8E[^\n]*)$", re.M)
_F8_DOT = re.compile(r"stablehlo\.dot_general [^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")


_FUSED_CASTS = ("layer_norm_fp8", "bias_gelu_fp8", "cast_transpose", "dgelu_cast_transpose_dbias")


@pytest.mark.parametrize("pre_layer_norm, param_dtype, fused_casts", [
    # LayerNorm -> q|k|v and LayerNorm -> fc1 write FP8; GELU writes FP8; the backward
    # casts fc2's output gradient with its transpose, and dGELU's (q, k and v's gradients
    # are concatenated into XLA's cast).
    (True, jnp.float32, {"layer_norm_fp8": 2, "bias_gelu_fp8": 1, "cast_transpose": 1,
                         "dgelu_cast_transpose_dbias": 1}),
    (True, jnp.bfloat16, {"layer_norm_fp8": 2, "bias_gelu_fp8": 1, "cast_transpose": 1,
                          "dgelu_cast_transpose_dbias": 1}),
    # Post-LN: fc1's input (the LayerNorm's bf16 output, kept for the residual) is cast
    # with its transpose.
    (False, jnp.float32, {"layer_norm_fp8": 0, "bias_gelu_fp8": 1, "cast_transpose": 2,
                          "dgelu_cast_transpose_dbias": 1}),
])
def test_train_step_quantizes_each_gemm_operand_once_and_writes_no_float32_activations(
        monkeypatch, pre_layer_norm, param_dtype, fused_casts):
    from flax import nnx

    from jax_ls2 import nn as ls2
    from test_fp8_dot import _scaled_gemm_forms
    layer = ls2.TransformerEncoderLayer(H, F, 4, fp8=RECIPE, dtype=jnp.bfloat16, param_dtype=param_dtype,
                                        pre_layer_norm=pre_layer_norm, deterministic=True, rngs=nnx.Rngs(0))
    graphdef, variables, rest = nnx.split(layer, nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    x = jax.random.normal(jax.random.key(0), (2, 16, H), jnp.bfloat16)

    def loss(variables, x):
        return jnp.sum(nnx.merge(graphdef, variables, rest)(x).astype(jnp.float32) ** 2)
    calls = collections.Counter({name: 0 for name in _FUSED_CASTS})

    def spy(name, op):
        def counted(*args, **kw):
            calls[name] += 1
            return op(*args, **kw)
        return counted
    for name in _FUSED_CASTS:
        monkeypatch.setattr(ops, name, spy(name, getattr(ops, name)))
    text = cuda_lowering_text(jax.value_and_grad(loss, argnums=(0, 1)), variables, x)
    assert dict(calls) == fused_casts
    gemms = 4  # q|k|v, attention output, fc1, fc2
    qkv_parts = 2  # q, k and v: one weight and meta, three forward GEMMs
    dots = [d for d in _F8_DOT.findall(text) if "f8E" in d[0] + d[1]]
    assert len(dots) == 3 * gemms + qkv_parts, dots
    # One quantization per GEMM operand per step: the input and the weight in the forward,
    # the output gradient in the backward -- not one per consumer (q, k, v) or per use
    # (forward and wgrad), and no re-quantization of a tensor already in FP8.
    assert len(_TO_FP8.findall(text)) == 3 * gemms, _TO_FP8.findall(text)
    # Forward and dgrad results are bf16 activations written by the GEMM itself; only a
    # float32 weight's gradient is float32. Each result goes straight to its scale
    # multiply, which XLA folds into the cuBLASLt FP8 call.
    forms = _scaled_gemm_forms(text)
    w_out = "f32" if param_dtype == jnp.float32 else "bf16"
    outs = collections.Counter(out.split("x")[-1].rstrip(">") for _, _, out, _ in forms)
    bf16 = 2 * gemms + qkv_parts
    assert outs == ({"bf16": bf16, "f32": gemms} if w_out == "f32" else {"bf16": bf16 + gemms}), outs
    assert all(scaled for *_, scaled in forms), forms


# ---------------------------------------------------------------- float64 truth, 2x rule
@jax.custom_vjp
def _qdq_operand(t, scale, fp8_dtype_code):
    """t quantized to FP8 and back (float32); the gradient passes straight through."""
    dtype = (jnp.float8_e4m3fn, jnp.float8_e5m2)[fp8_dtype_code]
    limit = fp8.fp8_max(dtype)
    return jnp.clip(t.astype(jnp.float32) * scale, -limit, limit).astype(dtype).astype(jnp.float32) / scale


_qdq_operand.defvjp(lambda t, s, c: (_qdq_operand(t, s, c), None), lambda _, g: (g, None, None))


@jax.custom_vjp
def _qdq_gradient(t, scale, fp8_dtype_code):
    """t unchanged; its cotangent quantized to FP8 and back (an output gradient's cast)."""
    return t


_qdq_gradient.defvjp(lambda t, s, c: (t, (s, c)), lambda res, g: (_qdq_operand(g, *res), None, None))


def _mlp_reference(x, gamma, beta, w1, b1, w2, m1, m2, activation, quantized):
    """LayerNorm -> fc1 -> act -> fc2 in x's dtype (float32 or float64); with
    `quantized`, XLA's unfused FP8 math: operands quantize-dequantized with the metas'
    scales, output gradients too (E5M2)."""
    e4, e5 = 0, 1
    op = (lambda t, m, row: _qdq_operand(t, m.scale[row], e4)) if quantized else (lambda t, m, row: t)
    grad = (lambda t, m: _qdq_gradient(t, m.scale[fp8.GRAD_OUTPUT], e5)) if quantized else (lambda t, m: t)
    mean = jnp.mean(x, -1, keepdims=True)
    h = (x - mean) / jnp.sqrt(jnp.mean((x - mean) ** 2, -1, keepdims=True) + 1e-5) * gamma + beta
    hi = jax.lax.Precision.HIGHEST
    pre = grad(jnp.dot(op(h, m1, 0).astype(x.dtype), op(w1, m1, 1).astype(x.dtype), precision=hi), m1) + b1
    act = {"gelu": lambda v: jax.nn.gelu(v, approximate=False), "gelu_tanh": jax.nn.gelu,
           "relu": jax.nn.relu}[activation]
    return grad(jnp.dot(op(act(pre), m2, 0).astype(x.dtype), op(w2, m2, 1).astype(x.dtype), precision=hi), m2)


def _check_fp8_mlp_within_2x(activation):
    from numerics import assert_within_2x, f64
    x, gamma, beta, w1, b1, w2, c = _data(3)
    args = (x, gamma, beta, w1, b1, w2)
    fresh = fp8.DotMeta.create(RECIPE)

    def loss(x, gamma, beta, w1, b1, w2, m1, m2):
        y = fused.fp8_mlp(x, w1, b1, w2, m1, m2, RECIPE, activation=activation, ln=(gamma, beta))
        return jnp.sum((y * c).astype(jnp.float32)), y
    step = jax.jit(jax.grad(loss, argnums=tuple(range(8)), has_aux=True))
    # Delayed scaling: the scales come from a first step's observations.
    d, _ = step(*args, fresh, fresh)
    m1, m2 = (fp8.update_meta(fresh, u, RECIPE) for u in d[6:])
    grads, y = step(*args, m1, m2)
    cpu = jax.devices("cpu")[0]

    def reference(dtype, quantized):
        # On the CPU, with every array it reads (the GPU run computes only the fused op there).
        m1_cpu, m2_cpu, c_cpu = jax.device_put((m1, m2, c), cpu)

        def f(*a):
            y = _mlp_reference(*a, m1_cpu, m2_cpu, activation, quantized)
            return jnp.sum(y * c_cpu.astype(dtype)), y
        a = jax.device_put([t.astype(dtype) for t in args], cpu)
        return jax.grad(f, argnums=tuple(range(6)), has_aux=True)(*a)
    with jax.enable_x64(True):
        truth_grads, truth_y = reference(jnp.float64, False)
        truth = [f64(t) for t in (truth_y, *truth_grads)]
    ref_grads, ref_y = reference(jnp.float32, True)
    for name, got, ref, t in zip(("y", "dx", "dgamma", "dbeta", "dw1", "db1", "dw2"), (y, *grads[:6]),
                                 (ref_y, *ref_grads), truth):
        assert_within_2x(name, got, ref, t)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_fp8_mlp_within_2x_of_unfused_quantize_dot_dequantize(activation):
    _check_fp8_mlp_within_2x(activation)


@pytest.mark.gpu
def test_gpu_fp8_mlp_within_2x_of_unfused_quantize_dot_dequantize():
    # On the GPU: the fused cast kernels and the cuBLASLt FP8 GEMMs (truth and reference on the CPU).
    _check_fp8_mlp_within_2x("gelu_tanh")
