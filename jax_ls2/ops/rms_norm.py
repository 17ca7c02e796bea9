"""Fused RMSNorm (LLaMA, Mistral, Gemma), optionally with the residual add of a pre-norm
block folded in, and with the multi-consumer forms of `jax_ls2.ops.layer_norm`."""
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
# The default epsilon: Hugging Face LlamaConfig's rms_norm_eps default (Gemma's too); LLaMA 2
# and 3 checkpoints and Mistral's set 1e-5, which a converted config carries.
RMS_EPSILON = 1e-6


# ---------------------------------------------------------------- reference math
def _weight(gamma, unit_offset):
    g = gamma.astype(F32)
    return g + np.float32(1) if unit_offset else g


def _rstd(s, eps):
    sf = s.astype(F32)
    return jax.lax.rsqrt(jnp.mean(jnp.square(sf), axis=-1) + np.float32(eps))


def _fwd_ref(x, gamma, *, eps, unit_offset):
    rstd = _rstd(x, eps)
    y = x.astype(F32) * rstd[..., None] * _weight(gamma, unit_offset)
    return y.astype(x.dtype), rstd


def _add_fwd_ref(x, residual, gamma, *, eps, unit_offset):
    s = (x.astype(F32) + residual.astype(F32)).astype(x.dtype)
    y, rstd = _fwd_ref(s, gamma, eps=eps, unit_offset=unit_offset)
    return y, s, rstd


def _bwd_ref(x, gamma, rstd, *cts, has_dsum, unit_offset):
    # cts = dy_0 .. dy_{n-1} [, dsum]: the cotangents of y summed in float32 in this
    # order (as the kernel adds them while loading), then that of the input's other use.
    dy, dsum = _normalization.sum_cotangents(cts, has_dsum)
    xhat = x.astype(F32) * rstd[..., None]
    g = dy * _weight(gamma, unit_offset)
    dot = jnp.mean(g * xhat, axis=-1, keepdims=True)
    dx = rstd[..., None] * (g - xhat * dot)
    if has_dsum:
        dx = dx + dsum.astype(F32)
    return dx.astype(x.dtype), jnp.sum(dy * xhat, axis=tuple(range(x.ndim - 1)))


# ---------------------------------------------------------------- CUDA calls
def _fwd_types(x, gamma, *, eps, unit_offset):
    return result_type(x), result_type(x, x.shape[:-1], F32)


def _add_fwd_types(x, residual, gamma, *, eps, unit_offset):
    return result_type(x), result_type(x), result_type(x, x.shape[:-1], F32)


def _bwd_types(x, gamma, rstd, *cts, has_dsum, unit_offset):
    # dx, dgamma, then the workspace of partial dgamma rows.
    h = x.shape[-1]
    return result_type(x), result_type(x, (h,), F32), result_type(x, (MAX_PARTS, h), F32)


def _fwd_attrs(*arrays, eps, unit_offset):
    return dict(eps=np.float32(eps), unit_offset=bool(unit_offset))


def _bwd_attrs(*arrays, has_dsum, unit_offset):
    return dict(has_dsum=bool(has_dsum), unit_offset=bool(unit_offset))


_R1, _R0, _P = Role(ROWS, 1), Role(ROWS, 0), Role(PARAM)
_FWD = FusedKernel("jax_ls2_rms_norm_fwd", _fwd_ref, operands=(_R1, _P), results=(_R1, _R0),
                   result_types=_fwd_types, attrs=_fwd_attrs, vmap_method="broadcast_all")
_ADD_FWD = FusedKernel("jax_ls2_add_rms_norm_fwd", _add_fwd_ref, operands=(_R1, _R1, _P), results=(_R1, _R1, _R0),
                       result_types=_add_fwd_types, attrs=_fwd_attrs, vmap_method="broadcast_all")


@functools.lru_cache(maxsize=None)
def _bwd_kernel(n_cts: int) -> FusedKernel:
    """The backward for n_cts cotangents (x, gamma, rstd, then the cotangents): one
    target serves every count and whether the last one is the input's (has_dsum)."""
    return FusedKernel("jax_ls2_rms_norm_bwd", _bwd_ref, operands=(_R1, _P, _R0) + (_R1,) * n_cts,
                       results=(_R1, Role(SUM)), result_types=_bwd_types, attrs=_bwd_attrs,
                       vmap_method="sequential")


def _backward(x, gamma, rstd, cts, has_dsum, unit_offset):
    dx, dg = _bwd_kernel(len(cts))(x, gamma, rstd, *cts, has_dsum=has_dsum, unit_offset=unit_offset)
    return dx, dg.astype(gamma.dtype)


# ---------------------------------------------------------------- custom_vjp
@functools.partial(fused_vjp, nondiff_argnums=(2, 3, 4, 5), op="rms_norm",
                   plain='x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + epsilon) * gamma')
def _rms_norm(x, gamma, eps, unit_offset, copies, keep_input):
    y = _FWD(x, gamma, eps=eps, unit_offset=unit_offset)[0]
    return _normalization.distinct_copies(y, copies) + ((x,) if keep_input else ())


def _rms_norm_fwd(x, gamma, eps, unit_offset, copies, keep_input):
    y, rstd = _FWD(x, gamma, eps=eps, unit_offset=unit_offset)
    return _normalization.distinct_copies(y, copies) + ((x,) if keep_input else ()), (x, gamma, rstd)


def _rms_norm_bwd(eps, unit_offset, copies, keep_input, res, cts):
    # Each copy of y has its own consumers; their cotangents (and, with keep_input, that
    # of x's other uses) are added inside the kernel instead of by separate passes.
    x, gamma, rstd = res
    return _backward(x, gamma, rstd, tuple(cts), keep_input, unit_offset)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd, optimize_remat=True)


@functools.partial(fused_vjp, nondiff_argnums=(3, 4), op="rms_norm",
                   plain='x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + epsilon) * gamma')
def _add_rms_norm(x, residual, gamma, eps, unit_offset):
    y, s, _ = _ADD_FWD(x, residual, gamma, eps=eps, unit_offset=unit_offset)
    return y, s


def _add_rms_norm_fwd(x, residual, gamma, eps, unit_offset):
    y, s, rstd = _ADD_FWD(x, residual, gamma, eps=eps, unit_offset=unit_offset)
    return (y, s), (s, gamma, rstd)


def _add_rms_norm_bwd(eps, unit_offset, res, cts):
    s, gamma, rstd = res
    dx, dg = _backward(s, gamma, rstd, tuple(cts), True, unit_offset)
    return dx, dx, dg


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public API
@renamed_keywords("rms_norm", eps="epsilon")  # eps= until 53d525f
def rms_norm(x, gamma, *, epsilon: float = RMS_EPSILON, residual=None, copies: int = 1, return_input: bool = False,
             unit_offset: bool = False):
    """RMSNorm over the last axis: ``s * rsqrt(mean(s**2) + epsilon) * w``.

    Args:
      x: ``(..., hidden)`` float32, float16 or bfloat16; any hidden size >= 1.
      gamma: ``(hidden,)`` floating; cast to ``x.dtype`` (as Flax does with ``dtype=``),
        its gradient comes back in its own dtype.
      epsilon: added to the mean square; default `RMS_EPSILON` (1e-6, the default of
        Hugging Face's LlamaConfig and Gemma's value; LLaMA 2 and 3 and Mistral
        checkpoints set 1e-5).
      residual: optional ``(..., hidden)`` in ``x.dtype``; then ``s = x + residual``
        (rounded to ``x.dtype``) is normalised instead of ``x``.
      copies: without ``residual``, return ``y`` this many times (2 to 4) as a tuple, one
        per consumer (say the q, k and v projections): the backward kernel adds their
        gradients in float32 as it reads them, where JAX would otherwise sum them in a
        separate pass first.
      return_input: without ``residual``, also return ``x``: a pre-norm block that feeds
        it to its residual branch gets that branch's gradient added to ``dx`` inside the
        backward kernel.
      unit_offset: the weight is ``1 + gamma`` (Gemma, whose ``gamma`` starts at zero)
        instead of ``gamma``; the sum is formed in float32.

    Returns:
      ``y`` of ``x``'s shape and dtype; with ``residual``, ``(y, s)`` so the sum can feed
      the next residual branch; with ``copies=k``, ``(y, ..., y)`` (k of them), followed
      by ``x`` with ``return_input``; with ``return_input`` alone, ``(y, x)``.

    The statistic (rstd) and every accumulation are float32. The backward keeps ``x``
    (or ``s``), ``gamma`` and the float32 rstd per row.
    """
    op = "rms_norm"
    _checks.check_array(op, "x", x, min_ndim=1)
    _checks.check_array(op, "gamma", gamma, ndim=1)
    h = x.shape[-1]
    _checks.check_shape(op, "gamma", gamma, (h,))
    if h == 0:
        raise ValueError(f"{op}: x must have a non-empty last axis, got shape {tuple(x.shape)}")
    _normalization.check_options(op, epsilon=epsilon, copies=copies, return_input=return_input, residual=residual)
    if not isinstance(unit_offset, bool):
        raise TypeError(f"{op}: unit_offset must be a Python bool, got {type(unit_offset).__name__}")
    gamma = gamma.astype(x.dtype)
    if residual is None:
        x, gamma = match_varying(x, gamma)
        out = _rms_norm(x, gamma, float(epsilon), unit_offset, copies, return_input)
        return out[0] if len(out) == 1 else out
    _checks.check_array(op, "residual", residual)
    _checks.check_shape(op, "residual", residual, x.shape)
    _checks.check_same_dtype(op, "residual", residual, x.dtype)
    x, residual, gamma = match_varying(x, residual, gamma)
    return _add_rms_norm(x, residual, gamma, float(epsilon), unit_offset)
