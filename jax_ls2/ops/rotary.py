"""Rotary position embeddings (RoPE) applied to q and k in one pass, at given positions.

Pair ``i`` (``0 <= i < rotary_dim / 2``) of a head is rotated by the angle
``positions * inv_freq[i]`` (float32 product), ``inv_freq[i] = theta ** (-2 i / rotary_dim)``
before any `RotaryScaling`. The pairs are ``(x[i], x[i + rotary_dim / 2])`` (the
GPT-NeoX / Hugging Face LLaMA layout) or, with ``interleaved=True``, ``(x[2 i], x[2 i + 1])``
(the GPT-J / original LLaMA layout); the dims from ``rotary_dim`` on pass through.
Positions are given per token, so packed sequences (positions restarting inside a row)
and sequence-sharded inputs (each shard its own positions) need nothing more. Under
``jit`` with sharded inputs the batch and sequence dims stay sharded; heads sharded over a
mesh axis are gathered, so tensor-parallel heads call it inside ``shard_map``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from jax_ls2._dispatch import PARAM, ROWS, FusedKernel, Role, match_varying, result_type
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks

F32 = jnp.float32
SCALING_KINDS = ("linear", "ntk", "llama3")


@dataclasses.dataclass(frozen=True)
class RotaryScaling:
    """Context-extension scaling of the rotary frequencies.

    Fields:
      kind: ``"linear"`` (position interpolation: every frequency divided by
        ``factor``), ``"ntk"`` (NTK-aware: the base ``theta`` multiplied by
        ``factor ** (rotary_dim / (rotary_dim - 2))``, so the lowest frequency is divided
        by ``factor`` and the highest kept) or ``"llama3"`` (LLaMA 3.1: wavelengths
        longer than ``original_max_position / low_freq_factor`` divided by ``factor``,
        shorter than ``original_max_position / high_freq_factor`` kept, those between
        interpolated smoothly).
      factor: the context extension, > 0 (``8.0`` for LLaMA 3.1).
      low_freq_factor, high_freq_factor: ``"llama3"`` only; ``high > low > 0`` (1 and 4
        for LLaMA 3.1).
      original_max_position: ``"llama3"`` only; the pre-training context (8192 for
        LLaMA 3.1).
    """
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def _check_scaling(op: str, scaling) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, RotaryScaling):
        raise TypeError(f"{op}: scaling must be a RotaryScaling or None, got {type(scaling).__name__}")
    if scaling.kind not in SCALING_KINDS:
        raise ValueError(f"{op}: scaling.kind must be one of {SCALING_KINDS}, got {scaling.kind!r}")
    if not isinstance(scaling.factor, (int, float)) or not scaling.factor > 0:
        raise ValueError(f"{op}: scaling.factor must be a positive number, got {scaling.factor!r}")
    if scaling.kind == "llama3":
        lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
        if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and 0 < lo < hi):
            raise ValueError(f"{op}: scaling needs 0 < low_freq_factor < high_freq_factor, got {lo!r} and {hi!r}")
        if not isinstance(scaling.original_max_position, int) or scaling.original_max_position < 1:
            raise ValueError(f"{op}: scaling.original_max_position must be a positive int, "
                             f"got {scaling.original_max_position!r}")


def rotary_frequencies(rotary_dim: int, *, theta: float = 10000.0, scaling: RotaryScaling | None = None):
    """The ``(rotary_dim // 2,)`` float32 inverse frequencies `rotary` uses (computed in
    float64, rounded once)."""
    half = rotary_dim // 2
    base = float(theta)
    if scaling is not None and scaling.kind == "ntk" and rotary_dim > 2:
        base *= float(scaling.factor) ** (rotary_dim / (rotary_dim - 2))
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
    if scaling is not None and scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        old = float(scaling.original_max_position)
        lo, hi = float(scaling.low_freq_factor), float(scaling.high_freq_factor)
        wavelen = 2.0 * math.pi / inv
        smooth = np.clip((old / wavelen - lo) / (hi - lo), 0.0, 1.0)
        inv = (1.0 - smooth) * inv / scaling.factor + smooth * inv
    return inv.astype(np.float32)


# ---------------------------------------------------------------- reference math
def _angles(positions, inv_freq):
    ang = positions.astype(F32)[..., None] * inv_freq  # (tokens..., half)
    return jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]


def _rotate(x, cos, sin, interleaved):
    half = cos.shape[-1]
    r = 2 * half
    xf = x[..., :r].astype(F32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleaved:
        rot = jnp.stack([o1, o2], axis=-1).reshape(xf.shape)
    else:
        rot = jnp.concatenate([o1, o2], axis=-1)
    return jnp.concatenate([rot.astype(x.dtype), x[..., r:]], axis=-1)


def _rotate_both(q, k, positions, inv_freq, interleaved, inverse):
    cos, sin = _angles(positions, inv_freq)
    sin = -sin if inverse else sin
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)


def _fwd_ref(q, k, positions, inv_freq, *, interleaved):
    return _rotate_both(q, k, positions, inv_freq, interleaved, inverse=False)


def _bwd_ref(dq, dk, positions, inv_freq, *, interleaved):
    return _rotate_both(dq, dk, positions, inv_freq, interleaved, inverse=True)


# ---------------------------------------------------------------- CUDA calls
def _types(q, k, positions, inv_freq, **static):
    return result_type(q), result_type(k)


def _attrs(*arrays, interleaved):
    return dict(interleaved=bool(interleaved))


# q and k are (batch, seq | heads, head_dim): the token dims are batch-like.
_T2 = Role(ROWS, 2)
_KERNEL_OPTIONS = dict(operands=(_T2, _T2, Role(ROWS, 0), Role(PARAM)), results=(_T2, _T2), result_types=_types,
                       attrs=_attrs, vmap_method="broadcast_all")
_FWD = FusedKernel("jax_ls2_rotary_fwd", _fwd_ref, **_KERNEL_OPTIONS)
# The backward is the inverse rotation of the cotangents (the same kernel, sin negated).
_BWD = FusedKernel("jax_ls2_rotary_bwd", _bwd_ref, **_KERNEL_OPTIONS)


# ---------------------------------------------------------------- custom_vjp
@functools.partial(fused_vjp, nondiff_argnums=(4,), op="rotary",
                   plain='x * cos + rotate_half(x) * sin in jnp')
def _rotary(q, k, positions, inv_freq, interleaved):
    return _FWD(q, k, positions, inv_freq, interleaved=interleaved)


def _rotary_fwd(q, k, positions, inv_freq, interleaved):
    out = _FWD(q, k, positions, inv_freq, interleaved=interleaved)
    return out, (positions, inv_freq)


def _rotary_bwd(interleaved, res, cts):
    positions, inv_freq = res
    dq, dk = _BWD(*cts, positions, inv_freq, interleaved=interleaved)
    return dq, dk, None, None


_rotary.defvjp(_rotary_fwd, _rotary_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public API
def rotary(q, k, positions, *, theta: float = 10000.0, rotary_dim: int | None = None, interleaved: bool = False,
           scaling: RotaryScaling | None = None):
    """Rotary position embeddings of q and k (one kernel for both).

    Args:
      q: ``(batch, seq, heads, head_dim)`` float32, float16 or bfloat16.
      k: ``(batch, seq, kv_heads, head_dim)`` in ``q.dtype``; ``kv_heads`` divides
        ``heads`` (grouped-query attention).
      positions: ``(batch, seq)`` integer (int32; wider ones are clamped to int32's
        range): each token's position, so packed and sequence-sharded inputs work.
      theta: the frequency base, > 0 (10000 for LLaMA 2, 500000 for LLaMA 3).
      rotary_dim: the leading dims of each head that rotate (even, <= head_dim; default
        head_dim); the rest pass through unchanged.
      interleaved: pairs ``(2 i, 2 i + 1)`` instead of ``(i, i + rotary_dim / 2)``.
      scaling: a `RotaryScaling` (LLaMA 3.1, NTK-aware or linear), or None.

    Returns:
      ``(q_rotated, k_rotated)``, shapes and dtypes of q and k; the angle
      ``position * inv_freq`` and the rotation in float32, rounded once. The backward
      keeps only the positions: it rotates the cotangents back (angle negated).
    """
    op = "rotary"
    _checks.check_array(op, "q", q, ndim=4)
    _checks.check_array(op, "k", k, ndim=4)
    _checks.check_same_dtype(op, "k", k, q.dtype)
    b, s, h, d = q.shape
    if k.shape[:2] != (b, s) or k.shape[3] != d:
        raise ValueError(f"{op}: k must have shape ({b}, {s}, kv_heads, {d}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    kvh = k.shape[2]
    if kvh == 0 or h % kvh != 0:
        raise ValueError(f"{op}: k's kv_heads ({kvh}) must divide q's heads ({h})")
    _checks.check_array(op, "positions", positions, dtypes=None, ndim=2)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"{op}: positions must have an integer dtype (int32), got {positions.dtype}")
    _checks.check_shape(op, "positions", positions, (b, s))
    rd = d if rotary_dim is None else rotary_dim
    if isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2 or rd > d:
        raise ValueError(f"{op}: rotary_dim must be an even Python int from 2 to head_dim ({d}), got {rotary_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"{op}: theta must be a positive Python float, got {theta!r}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"{op}: interleaved must be a Python bool, got {type(interleaved).__name__}")
    _check_scaling(op, scaling)
    positions = _checks.clamp_to_int32(positions)
    inv_freq = jnp.asarray(rotary_frequencies(rd, theta=theta, scaling=scaling))
    q, k, positions, inv_freq = match_varying(q, k, positions, inv_freq)
    return _rotary(q, k, positions, inv_freq, interleaved)
