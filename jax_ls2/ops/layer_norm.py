"""Fused LayerNorm, optionally with the residual add of a pre-LN block folded in."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2._dispatch import PARAM, ROWS, SUM, FusedKernel, Role, match_varying, result_type
from jax_ls2._deprecation import renamed_keywords
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks, _normalization
from jax_ls2.ops._limits import MAX_PARTS

F32 = jnp.float32


# ---------------------------------------------------------------- reference math
def _stats(s, eps):
    sf = s.astype(F32)
    mean = jnp.mean(sf, axis=-1)
    var = jnp.mean(jnp.square(sf - mean[..., None]), axis=-1)
    return mean, jax.lax.rsqrt(var + eps)


def _normalize(s, gamma, beta, mean, rstd):
    xhat = (s.astype(F32) - mean[..., None]) * rstd[..., None]
    return (xhat * gamma.astype(F32) + beta.astype(F32)).astype(s.dtype)


def _fwd_reference(x, gamma, beta, *, eps):
    mean, rstd = _stats(x, eps)
    return _normalize(x, gamma, beta, mean, rstd), mean, rstd


def _add_fwd_reference(x, residual, gamma, beta, *, eps):
    s = (x.astype(F32) + residual.astype(F32)).astype(x.dtype)
    y, mean, rstd = _fwd_reference(s, gamma, beta, eps=eps)
    return y, s, mean, rstd


def _bwd_reference(dy, x, gamma, mean, rstd):
    h = x.shape[-1]
    xhat = (x.astype(F32) - mean[..., None]) * rstd[..., None]
    dyf = dy.astype(F32)
    g = dyf * gamma.astype(F32)
    s1 = jnp.sum(g, axis=-1, keepdims=True) / h
    s2 = jnp.sum(g * xhat, axis=-1, keepdims=True) / h
    dx = rstd[..., None] * (g - s1 - xhat * s2)
    lead = tuple(range(x.ndim - 1))
    return dx, jnp.sum(dyf * xhat, axis=lead), jnp.sum(dyf, axis=lead)


def _bwd_ref(dy, x, gamma, mean, rstd):
    dx, dg, db = _bwd_reference(dy, x, gamma, mean, rstd)
    return dx.astype(x.dtype), dg, db


def _add_bwd_ref(dy, dsum, x, gamma, mean, rstd):
    dx, dg, db = _bwd_reference(dy, x, gamma, mean, rstd)
    return (dx + dsum.astype(F32)).astype(x.dtype), dg, db


# ---------------------------------------------------------------- CUDA calls
def _stats_types(x):
    lead = x.shape[:-1]
    return result_type(x, lead, F32), result_type(x, lead, F32)


def _fwd_types(x, gamma, beta, *, eps):
    return (result_type(x),) + _stats_types(x)


def _add_fwd_types(x, residual, gamma, beta, *, eps):
    return (result_type(x), result_type(x)) + _stats_types(x)


def _eps_attr(*arrays, eps):
    return dict(eps=np.float32(eps))


def _bwd_types(*arrays):
    # dx, dgamma, dbeta, then the workspace of partial dgamma/dbeta rows. x is the
    # last operand but three in every backward variant.
    x = arrays[-4]
    h = x.shape[-1]
    return (result_type(x), result_type(x, (h,), F32), result_type(x, (h,), F32),
            result_type(x, (MAX_PARTS, 2, h), F32))


def _multi_bwd_ref(x, gamma, mean, rstd, *cts, has_dsum):
    # cts = dy_0 .. dy_{n-1} [, dsum]: the cotangents of y summed in float32 in this
    # order (as the kernel adds them while loading).
    dy, dsum = _normalization.sum_cotangents(cts, has_dsum)
    dx, dg, db = _bwd_reference(dy, x, gamma, mean, rstd)
    if has_dsum:
        dx = dx + dsum.astype(F32)
    return dx.astype(x.dtype), dg, db


def _multi_bwd_types(x, gamma, mean, rstd, *cts, has_dsum):
    return _bwd_types(x, gamma, mean, rstd)


def _has_dsum_attr(*arrays, has_dsum):
    return dict(has_dsum=np.int32(has_dsum))


_R1, _R0, _P = Role(ROWS, 1), Role(ROWS, 0), Role(PARAM)
_GRADS = (_R1, Role(SUM), Role(SUM))
_FWD = FusedKernel("jax_ls2_layer_norm_fwd", _fwd_reference, operands=(_R1, _P, _P), results=(_R1, _R0, _R0),
                   result_types=_fwd_types, attrs=_eps_attr, vmap_method="broadcast_all")
_ADD_FWD = FusedKernel("jax_ls2_add_layer_norm_fwd", _add_fwd_reference, operands=(_R1, _R1, _P, _P),
                       results=(_R1, _R1, _R0, _R0), result_types=_add_fwd_types, attrs=_eps_attr,
                       vmap_method="broadcast_all")
_BWD = FusedKernel("jax_ls2_layer_norm_bwd", _bwd_ref, operands=(_R1, _R1, _P, _R0, _R0), results=_GRADS,
                   result_types=_bwd_types, vmap_method="sequential")
_ADD_BWD = FusedKernel("jax_ls2_add_layer_norm_bwd", _add_bwd_ref, operands=(_R1, _R1, _R1, _P, _R0, _R0),
                       results=_GRADS, result_types=_bwd_types, vmap_method="sequential")
# x, gamma, mean, rstd, then the cotangents; the number of cotangents and has_dsum are
# static options, so one kernel object serves every count.
_MULTI_BWD_OPERANDS = (_R1, _P, _R0, _R0)


# ---------------------------------------------------------------- custom_vjp
@functools.partial(fused_vjp, nondiff_argnums=(3,), op="layer_norm",
                   plain='(x - mean) * jax.lax.rsqrt(var + epsilon) * gamma + beta (flax.nnx.LayerNorm)')
def _layer_norm(x, gamma, beta, eps):
    return _FWD(x, gamma, beta, eps=eps)[0]


def _layer_norm_fwd(x, gamma, beta, eps):
    y, mean, rstd = _FWD(x, gamma, beta, eps=eps)
    return y, (x, gamma, mean, rstd)


def _layer_norm_bwd(eps, res, dy):
    x, gamma, mean, rstd = res
    dx, dg, db = _BWD(dy, x, gamma, mean, rstd)
    return dx, dg.astype(gamma.dtype), db.astype(gamma.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd, optimize_remat=True)


@functools.partial(fused_vjp, nondiff_argnums=(4,), op="layer_norm",
                   plain='(x - mean) * jax.lax.rsqrt(var + epsilon) * gamma + beta (flax.nnx.LayerNorm)')
def _add_layer_norm(x, residual, gamma, beta, eps):
    y, s, _, _ = _ADD_FWD(x, residual, gamma, beta, eps=eps)
    return y, s


def _add_layer_norm_fwd(x, residual, gamma, beta, eps):
    y, s, mean, rstd = _ADD_FWD(x, residual, gamma, beta, eps=eps)
    return (y, s), (s, gamma, mean, rstd)


def _add_layer_norm_bwd(eps, res, cts):
    s, gamma, mean, rstd = res
    dy, ds = cts
    dx, dg, db = _ADD_BWD(dy, ds, s, gamma, mean, rstd)
    return dx, dx, dg.astype(gamma.dtype), db.astype(gamma.dtype)


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd, optimize_remat=True)


@functools.partial(fused_vjp, nondiff_argnums=(3,), op="layer_norm",
                   plain='(x - mean) * jax.lax.rsqrt(var + epsilon) * gamma + beta (flax.nnx.LayerNorm)')
def _layer_norm_keep_input(x, gamma, beta, eps):
    return _FWD(x, gamma, beta, eps=eps)[0], x


def _layer_norm_keep_input_fwd(x, gamma, beta, eps):
    y, mean, rstd = _FWD(x, gamma, beta, eps=eps)
    return (y, x), (x, gamma, mean, rstd)


def _layer_norm_keep_input_bwd(eps, res, cts):
    # The gradient reaching x through its other uses is added inside the kernel.
    x, gamma, mean, rstd = res
    dy, dx_other = cts
    dx, dg, db = _ADD_BWD(dy, dx_other, x, gamma, mean, rstd)
    return dx, dg.astype(gamma.dtype), db.astype(gamma.dtype)


_layer_norm_keep_input.defvjp(_layer_norm_keep_input_fwd, _layer_norm_keep_input_bwd, optimize_remat=True)


@functools.lru_cache(maxsize=None)
def _multi_bwd_kernel(n_cts: int) -> FusedKernel:
    return FusedKernel("jax_ls2_layer_norm_bwd_multi", _multi_bwd_ref,
                       operands=_MULTI_BWD_OPERANDS + (_R1,) * n_cts, results=_GRADS,
                       result_types=_multi_bwd_types, attrs=_has_dsum_attr, vmap_method="sequential")


@functools.partial(fused_vjp, nondiff_argnums=(3, 4, 5), op="layer_norm",
                   plain='(x - mean) * jax.lax.rsqrt(var + epsilon) * gamma + beta (flax.nnx.LayerNorm)')
def _layer_norm_copies(x, gamma, beta, eps, copies, keep_input):
    y = _FWD(x, gamma, beta, eps=eps)[0]
    return _normalization.distinct_copies(y, copies) + ((x,) if keep_input else ())


def _layer_norm_copies_fwd(x, gamma, beta, eps, copies, keep_input):
    y, mean, rstd = _FWD(x, gamma, beta, eps=eps)
    return _normalization.distinct_copies(y, copies) + ((x,) if keep_input else ()), (x, gamma, mean, rstd)


def _layer_norm_copies_bwd(eps, copies, keep_input, res, cts):
    # Each copy of y has its own consumers; their cotangents (and, with keep_input, that
    # of x's other uses) are added inside the kernel instead of by separate passes.
    x, gamma, mean, rstd = res
    dx, dg, db = _multi_bwd_kernel(len(cts))(x, gamma, mean, rstd, *cts, has_dsum=keep_input)
    return dx, dg.astype(gamma.dtype), db.astype(gamma.dtype)


_layer_norm_copies.defvjp(_layer_norm_copies_fwd, _layer_norm_copies_bwd, optimize_remat=True)


@renamed_keywords("layer_norm", eps="epsilon")  # eps= until 2e8e4ee
def layer_norm(x, gamma, beta, *, epsilon: float = 1e-5, residual=None, return_input: bool = False,
               copies: int = 1):
    """LayerNorm over the last axis: ``(s - mean) / sqrt(var + epsilon) * gamma + beta``.

    Args:
      x: ``(..., hidden)`` float32, float16 or bfloat16; any hidden size >= 1.
      gamma, beta: ``(hidden,)`` floating; cast to ``x.dtype`` (as Flax does with
        ``dtype=``), their gradients come back in their own dtype.
      epsilon: added to the variance; jax_ls2's default is 1e-5 (PyTorch's, LightSeq2's
        and Transformer Engine's), where ``flax.nnx.LayerNorm``'s is 1e-6.
      residual: optional ``(..., hidden)`` in ``x.dtype``; then ``s = x + residual``
        (rounded to ``x.dtype``) is normalised instead of ``x``.

      return_input: without ``residual``, return ``(y, x)``: a pre-LN block that feeds
        the returned ``x`` to its residual branch gets the gradient of that branch added
        to ``dx`` inside the backward kernel instead of by a separate elementwise add.
      copies: without ``residual``, return ``y`` this many times (2 to 4) as a tuple,
        one per consumer (say the q, k and v projections): the backward kernel adds
        their gradients as it reads them, where JAX would otherwise sum them in a
        separate pass first. The gradients are summed in float32, not rounded to
        ``x.dtype`` in between.

    Returns:
      ``y`` of ``x``'s shape and dtype; with ``residual``, the pair ``(y, s)`` so the
      sum can feed the next residual branch; with ``return_input``, ``(y, x)``; with
      ``copies=k``, ``(y, ..., y)`` (k of them), followed by ``x`` with ``return_input``.

    Statistics (mean, rstd) and every accumulation are float32. The backward pass
    keeps ``x`` (or ``s``), ``gamma`` and the float32 mean and rstd per row.
    """
    op = "layer_norm"
    _checks.check_array(op, "x", x, min_ndim=1)
    _checks.check_array(op, "gamma", gamma, ndim=1)
    _checks.check_array(op, "beta", beta, ndim=1)
    h = x.shape[-1]
    _checks.check_shape(op, "gamma", gamma, (h,))
    _checks.check_shape(op, "beta", beta, (h,))
    if h == 0:
        raise ValueError(f"{op}: x must have a non-empty last axis, got shape {tuple(x.shape)}")
    _normalization.check_options(op, epsilon=epsilon, copies=copies, return_input=return_input, residual=residual)
    gamma = gamma.astype(x.dtype)
    beta = beta.astype(x.dtype)
    if residual is None:
        x, gamma, beta = match_varying(x, gamma, beta)
        if copies > 1:
            return _layer_norm_copies(x, gamma, beta, float(epsilon), copies, return_input)
        if return_input:
            return _layer_norm_keep_input(x, gamma, beta, float(epsilon))
        return _layer_norm(x, gamma, beta, float(epsilon))
    _checks.check_array(op, "residual", residual)
    _checks.check_shape(op, "residual", residual, x.shape)
    _checks.check_same_dtype(op, "residual", residual, x.dtype)
    x, residual, gamma, beta = match_varying(x, residual, gamma, beta)
    return _add_layer_norm(x, residual, gamma, beta, float(epsilon))
