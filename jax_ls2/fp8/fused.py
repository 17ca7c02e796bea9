"""FP8 GEMMs fed by fused casts: each activation is quantized once, by the kernel that
produces it, and each backward pass quantizes its gradients with the transposed copy
the weight-gradient GEMM reads.

* `layernorm_fp8_dot`: ``LayerNorm(x) @ w``, the LayerNorm writing FP8 and its amax in
  one pass (`jax_ls2.ops.layer_norm_fp8`); pre-LN attention's fused q|k|v projection.
* `fp8_mlp`: ``gelu(h @ w1 + b1) @ w2`` with ``h`` either ``LayerNorm(x)`` (pre-LN, as
  above) or ``x`` cast with its transpose (`jax_ls2.ops.cast_transpose`); the bias and
  GELU write FP8 (`jax_ls2.ops.bias_gelu_fp8`), and the backward runs dGELU, the cast,
  its transpose and dbias as one pass (`jax_ls2.ops.dgelu_cast_transpose_dbias`).

Each is one ``custom_vjp`` with the meta semantics of `jax_ls2.fp8.fp8_dot`: one meta
per GEMM, whose "gradient" is the meta update carrying this step's amaxes (input,
weight, output gradient), one observation over a ``vmap``ped batch for a shared meta,
max-reduced over ``amax_axes`` inside ``shard_map``, and the same weight caching
(`jax_ls2.fp8.cache_weights`) through its `FP8DotMeta`s. Every GEMM is `dot._scaled_dot`'s
form (one cuBLASLt FP8 call writing the final dtype). Operands the GEMMs read
K-major on Hopper are handed over that way where a fused kernel wrote them (the output
gradients' transposed copies, and each FP8 weight's transposed copy for the forward);
the LayerNorm / GELU outputs are transposed by XLA for the weight gradient (one-byte
copies).
"""
from __future__ import annotations

import importlib
from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_ls2._dispatch import match_varying
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops._normalization import check_epsilon
from jax_ls2.fp8.dot import (_backward_gemms, _check_splits, _first_order_only, _joined, _mesh_max, _prepare,
                              _quantize, _reduced_amax, _rows, _scaled_dot, _split_gemms, _weight_copies)
from jax_ls2.fp8.recipe import GRAD_OUTPUT, INPUT, WEIGHT, DelayedScaling
from jax_ls2.fp8.state import DotMeta

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


def _ops():
    # Imported when first used: jax_ls2.ops' FP8 casts import jax_ls2.fp8.
    from jax_ls2 import ops
    # The module, not the function jax_ls2.ops re-exports under the same name.
    return ops, importlib.import_module("jax_ls2.ops.layer_norm")


@custom_vmap
def _shared_amax(amax, like_scale):
    """An amax returned by a fused kernel, as one observation: ``like_scale`` (the meta's
    scale) only tells the vmap rule whether the meta is mapped."""
    del like_scale
    return amax


@_shared_amax.def_vmap
def _shared_amax_vmap(axis_size, in_batched, amax, like_scale):
    # The kernels run example by example under vmap (one amax each); a shared meta sees
    # one amax over the whole mapped batch, as `fp8_dot`'s do.
    amax_batched, meta_batched = in_batched
    if amax_batched and not meta_batched:
        return jnp.max(amax, axis=0), False
    if meta_batched and not amax_batched:
        return jnp.broadcast_to(amax, (axis_size,)), True
    return amax, amax_batched


def _observed(amax, like_scale, axes):
    """A fused kernel's amax as the meta records it: shared over a vmapped batch for an
    unmapped meta, max-reduced over the mesh axes ``axes`` (inside shard_map)."""
    return _mesh_max(_shared_amax(amax, jax.lax.stop_gradient(like_scale)), axes)


def _grad_cast(g, dm, recipe, axes, fused_cast=True):
    """The output gradient g (..., N) as FP8 rows (M, N), its transpose (N, M) and amax,
    one pass (`cast_transpose`); without ``fused_cast`` (g a concatenation XLA should
    fuse into the cast rather than write out for a kernel) XLA's cast, and no transpose."""
    if not fused_cast:
        return _rows(_quantize(g, dm.scale[GRAD_OUTPUT], recipe.backward_dtype)), None, _reduced_amax(g, dm.scale, axes)
    ops, _ = _ops()
    gq, gq_t, amax = ops.cast_transpose(g, dm.scale[GRAD_OUTPUT], fp8_dtype=recipe.backward_dtype)
    return _rows(gq), gq_t, _observed(amax, dm.scale, axes)


def _check_ln(op, x, gamma, beta, epsilon):
    for name, p in (("gamma", gamma), ("beta", beta)):
        if not hasattr(p, "shape") or tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"{op}: {name} must have shape ({x.shape[-1]},), got "
                             f"{tuple(getattr(p, 'shape', ()))}")
    check_epsilon(op, epsilon)


def _ln_backward(dh, dx_other, x, gamma, mean, rstd):
    """LayerNorm backward with the gradient of x's other use (the residual branch)
    added in the same kernel."""
    _, ln_mod = _ops()
    gamma_x = gamma.astype(x.dtype)
    if dx_other is None:
        dx, dg, db = ln_mod._multi_bwd_kernel(1)(x, gamma_x, mean, rstd, dh.astype(x.dtype), has_dsum=False)
    else:
        dx, dg, db = ln_mod._multi_bwd_kernel(2)(x, gamma_x, mean, rstd, dh.astype(x.dtype),
                                                 dx_other.astype(x.dtype), has_dsum=True)
    return dx, dg.astype(gamma.dtype), db.astype(gamma.dtype)


# ---------------------------------------------------------------- LayerNorm -> GEMM
def layernorm_fp8_dot(x, gamma, beta, w, meta, recipe: DelayedScaling, *, epsilon: float = 1e-5, dtype=None,
                      amax_axes=(), return_input: bool = False, splits: int = 1):
    """``LayerNorm(x) @ w`` with the LayerNorm writing FP8 straight away.

    Args:
      x: (..., K) float32/bfloat16/float16, rank >= 2; the LayerNorm runs in x's dtype
        (statistics float32).
      gamma, beta: (K,) floating.
      w: (K, N) float32/bfloat16/float16.
      meta, recipe, dtype, amax_axes: as for `jax_ls2.fp8.fp8_dot`; the meta's INPUT row
        is the LayerNorm output's.
      epsilon: the LayerNorm's.
      return_input: also return x, for a residual branch whose gradient the LayerNorm's
        backward kernel then adds (as `jax_ls2.ops.layer_norm`'s ``return_input``).
      splits: as for `jax_ls2.fp8.fp8_dot` (the q, k, v blocks of a fused projection,
        each GEMM writing its own result; then XLA casts the concatenated gradient).

    Returns:
      y: (..., N) in ``dtype``, or with ``splits > 1`` a tuple of (..., N / splits);
      then x with ``return_input``.

    Forward: one LayerNorm kernel writes the E4M3 output and its amax; one FP8 GEMM.
    Kept for the backward: x, gamma, the float32 mean and rstd, the FP8 LayerNorm output
    and weight. Backward: the output gradient cast with its transpose in one pass, the
    dgrad and wgrad GEMMs, the LayerNorm backward (plus the residual gradient).
    """
    op = "layernorm_fp8_dot"
    x, w, dm, dtype, axes = _prepare(op, x, w, meta, recipe, dtype, amax_axes)
    _check_ln(op, x, gamma, beta, epsilon)
    x, gamma, beta, w = match_varying(x, gamma, beta, w)
    splits = _check_splits(op, splits, w)
    wc = _weight_copies(op, w, meta, dm, recipe, axes)
    ys, *rest = _ln_dot(recipe, dtype, axes, float(epsilon), jnp.dtype(w.dtype), bool(return_input), splits,
                        x, gamma, beta, w, wc, dm)
    y = ys if splits > 1 else ys[0]
    return (y, *rest) if return_input else y


# ``keep``: x is also returned (for the residual branch); static, so that without it no
# zero cotangent of x reaches the LayerNorm backward kernel.
# w's FP8 copies ``wc`` come from `_weight_copies`, as in `jax_ls2.fp8.dot._fp8_dot`.
@partial(fused_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6), op="layernorm_fp8_dot",
         plain='jnp.dot(layer_norm(x), w) in the compute dtype')
def _ln_dot(recipe, dtype, axes, eps, w_dtype, keep, splits, x, gamma, beta, w, wc, dm):
    return _ln_dot_fwd(recipe, dtype, axes, eps, w_dtype, keep, splits, x, gamma, beta, w, wc, dm)[0]


def _ln_fp8(x, gamma, beta, dm, recipe, axes, eps):
    ops, _ = _ops()
    hq, amax_h, mean, rstd = ops.layer_norm_fp8(x, gamma, beta, dm.scale[INPUT], fp8_dtype=recipe.forward_dtype,
                                                epsilon=eps)
    return hq, _observed(amax_h, dm.scale, axes), mean, rstd


def _ln_dot_fwd(recipe, dtype, axes, eps, w_dtype, keep, splits, x, gamma, beta, w, wc, dm):
    x, gamma, beta, w, wc, dm = _first_order_only((x, gamma, beta, w, wc, dm))
    hq, amax_h, mean, rstd = _ln_fp8(x, gamma, beta, dm, recipe, axes, eps)
    ys = _split_gemms(_rows(hq), wc.wq_t, splits, dm.scale_inv[INPUT] * dm.scale_inv[WEIGHT], dtype,
                      x.shape[:-1])
    return (ys, x) if keep else (ys,), (x, gamma, mean, rstd, hq, wc.wq, dm, amax_h, wc.amax)


def _ln_dot_bwd(recipe, dtype, axes, eps, w_dtype, keep, splits, res, cts):
    cts, res = _first_order_only((cts, res))
    x, gamma, mean, rstd, hq, wq, dm, amax_h, amax_w = res
    dys, dx_other = cts if keep else (cts[0], None)
    gq, gq_t, amax_g = _grad_cast(_joined(dys), dm, recipe, axes, fused_cast=splits == 1)
    dh, dw = _backward_gemms(gq, gq_t, _rows(hq), None, wq, dm, x.dtype, w_dtype)
    dx, dgamma, dbeta = _ln_backward(dh.reshape(x.shape), dx_other, x, gamma, mean, rstd)
    d_meta = DotMeta.observation(jnp.stack([amax_h, amax_w, amax_g], axis=-1), dm)
    return dx, dgamma, dbeta, dw, None, d_meta


_ln_dot.defvjp(_ln_dot_fwd, _ln_dot_bwd, optimize_remat=True)


# ---------------------------------------------------------------- the MLP
def fp8_mlp(x, w1, b1, w2, meta1, meta2, recipe: DelayedScaling, *, activation: str = "gelu", ln=None,
            epsilon: float = 1e-5, dtype=None, amax_axes=(), return_input: bool = False):
    """``act(h @ w1 + b1) @ w2`` with FP8 GEMMs fed by fused casts; ``h = LayerNorm(x)``
    with ``ln=(gamma, beta)``, else ``h = x``. fc2's bias is left to the caller (for a
    fused bias + dropout + residual).

    Args:
      x: (..., H) float32/bfloat16/float16, rank >= 2.
      w1: (H, F), b1: (F,), w2: (F, N) floating.
      meta1, meta2: the metas of the fc1 and fc2 GEMMs (`jax_ls2.fp8.fp8_dot`'s
        ``meta``): fc1's INPUT row is h's, its GRAD_OUTPUT row the gradient of
        ``h @ w1 + b1``; fc2's INPUT row is the activation's output.
      recipe, dtype, amax_axes: as for `jax_ls2.fp8.fp8_dot` (``dtype``: of both GEMMs'
        results and the activation).
      activation: "gelu" (erf), "gelu_tanh" or "relu", as `jax_ls2.ops.bias_act_dropout`.
      ln: None or ``(gamma, beta)``, each (H,); epsilon: the LayerNorm's.
      return_input: with ``ln``, also return x (see `layernorm_fp8_dot`).

    Returns:
      (..., N) in ``dtype`` (and x with ``return_input``).

    Forward: h to E4M3 (the LayerNorm kernel, or one cast + transpose pass), fc1 with
    b1 added after the scaling (a bias XLA can fold into the cuBLASLt call), one kernel
    for act(.) to E4M3 with its amax, fc2. Kept for the backward: the fc1 result with
    its bias (the activation's input), the FP8 copies of h (and its transpose without
    ln), of the activation and of the weights, the LayerNorm's x, gamma, mean, rstd.
    Backward: fc2's output gradient cast with its transpose in one pass; fc2's dgrad;
    dact + cast + transpose + dbias in one pass; fc1's dgrad and both wgrads; the
    LayerNorm backward.
    """
    op = "fp8_mlp"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    x, w1, dm1, dtype, axes = _prepare(op, x, w1, meta1, recipe, dtype, amax_axes, w_name="w1")
    if not hasattr(w2, "shape") or w2.ndim != 2 or w2.shape[0] != w1.shape[1]:
        raise ValueError(f"{op}: w2 must have shape ({w1.shape[1]}, N) (w1's N rows), got "
                         f"{tuple(getattr(w2, 'shape', ()))}")
    if not hasattr(b1, "shape") or tuple(b1.shape) != (w1.shape[1],):
        raise ValueError(f"{op}: b1 must have shape ({w1.shape[1]},), got {tuple(getattr(b1, 'shape', ()))}")
    # fc2's weight and meta pass the same checks (its input, act(.), has w2's K columns).
    _, w2, dm2, _, _ = _prepare(op, jnp.zeros((1, w2.shape[0]), x.dtype), w2, meta2, recipe, dtype, amax_axes,
                                w_name="w2")
    x, w1, b1, w2 = match_varying(x, w1, b1, w2)
    if ln is None:
        if return_input:
            raise ValueError(f"{op}: return_input needs ln=(gamma, beta)")
        gamma = beta = eps = None
    else:
        gamma, beta = ln
        _check_ln(op, x, gamma, beta, epsilon)
        x, gamma, beta, w1, b1, w2 = match_varying(x, gamma, beta, w1, b1, w2)
        eps = float(epsilon)
    wc1 = _weight_copies(op, w1, meta1, dm1, recipe, axes)
    wc2 = _weight_copies(op, w2, meta2, dm2, recipe, axes)
    out = _mlp(recipe, dtype, axes, activation, eps, jnp.dtype(w1.dtype), jnp.dtype(w2.dtype),
               bool(return_input), x, gamma, beta, w1, b1, w2, wc1, wc2, dm1, dm2)
    return out if return_input else out[0]


# The weights' FP8 copies ``wc1``, ``wc2`` come from `_weight_copies`, as in `_fp8_dot`.
@partial(fused_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6, 7), op="fp8_mlp",
         plain='the MLP written with jnp.dot in the compute dtype')
def _mlp(recipe, dtype, axes, act, eps, w1_dtype, w2_dtype, keep, x, gamma, beta, w1, b1, w2, wc1, wc2, dm1, dm2):
    return _mlp_fwd(recipe, dtype, axes, act, eps, w1_dtype, w2_dtype, keep, x, gamma, beta, w1, b1, w2,
                    wc1, wc2, dm1, dm2)[0]


def _mlp_fwd(recipe, dtype, axes, act, eps, w1_dtype, w2_dtype, keep, x, gamma, beta, w1, b1, w2, wc1, wc2,
             dm1, dm2):
    ops, _ = _ops()
    x, gamma, beta, w1, b1, w2, wc1, wc2, dm1, dm2 = _first_order_only((x, gamma, beta, w1, b1, w2, wc1, wc2,
                                                                         dm1, dm2))
    if eps is None:
        hq, hq_t, amax_h = ops.cast_transpose(x, dm1.scale[INPUT], fp8_dtype=recipe.forward_dtype)
        amax_h, ln_res = _observed(amax_h, dm1.scale, axes), None
    else:
        hq, amax_h, mean, rstd = _ln_fp8(x, gamma, beta, dm1, recipe, axes, eps)
        hq_t, ln_res = None, (gamma, mean, rstd)
    w1q, amax_w1 = wc1.wq, wc1.amax
    pre = _scaled_dot(_rows(hq), wc1.wq_t, ((1,), (1,)), dm1.scale_inv[INPUT] * dm1.scale_inv[WEIGHT], dtype)
    pre = pre + b1.astype(dtype)
    aq, amax_a = ops.bias_gelu_fp8(pre, jnp.zeros(pre.shape[-1:], dtype), dm2.scale[INPUT],
                                   fp8_dtype=recipe.forward_dtype, activation=act)
    amax_a = _observed(amax_a, dm2.scale, axes)
    w2q, amax_w2 = wc2.wq, wc2.amax
    y = _scaled_dot(aq, wc2.wq_t, ((1,), (1,)), dm2.scale_inv[INPUT] * dm2.scale_inv[WEIGHT], dtype)
    y = y.reshape(*x.shape[:-1], w2.shape[1])
    res = (x, ln_res, _rows(hq), hq_t, w1q, pre, aq, w2q, dm1, dm2, amax_h, amax_w1, amax_a, amax_w2, b1)
    return (y, x) if keep else (y,), res


def _mlp_bwd(recipe, dtype, axes, act, eps, w1_dtype, w2_dtype, keep, res, cts):
    ops, _ = _ops()
    cts, res = _first_order_only((cts, res))
    x, ln_res, hq, hq_t, w1q, pre, aq, w2q, dm1, dm2, amax_h, amax_w1, amax_a, amax_w2, b1 = res
    dy, dx_other = cts if keep else (cts[0], None)
    g2q, g2q_t, amax_g2 = _grad_cast(dy, dm2, recipe, axes)
    da, dw2 = _backward_gemms(g2q, g2q_t, aq, None, w2q, dm2, dtype, w2_dtype)
    g1q, g1q_t, amax_g1, db1 = ops.dgelu_cast_transpose_dbias(
        da, pre, dm1.scale[GRAD_OUTPUT], fp8_dtype=recipe.backward_dtype, activation=act, dbias_dtype=b1.dtype)
    amax_g1 = _observed(amax_g1, dm1.scale, axes)
    dh, dw1 = _backward_gemms(_rows(g1q), g1q_t, hq, hq_t, w1q, dm1, x.dtype, w1_dtype)
    dh = dh.reshape(x.shape)
    if ln_res is None:
        dx, dgamma, dbeta = dh, None, None
    else:
        gamma, mean, rstd = ln_res
        dx, dgamma, dbeta = _ln_backward(dh, dx_other, x, gamma, mean, rstd)
    d_meta1 = DotMeta.observation(jnp.stack([amax_h, amax_w1, amax_g1], axis=-1), dm1)
    d_meta2 = DotMeta.observation(jnp.stack([amax_a, amax_w2, amax_g2], axis=-1), dm2)
    return dx, dgamma, dbeta, dw1, db1, dw2, None, None, d_meta1, d_meta2


_mlp.defvjp(_mlp_fwd, _mlp_bwd, optimize_remat=True)
