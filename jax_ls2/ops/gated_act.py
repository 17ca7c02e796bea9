"""Fused gated activation + dropout of a gated MLP (SwiGLU, GEGLU), on the concatenated
``[gate | up]`` projection, without bias.

``y = dropout(act(gate) * up)`` with ``gate = x[..., :ffn]``, ``up = x[..., ffn:]``.
Dropout masks come from the counter-based generator of :mod:`jax_ls2._random` (bit for
bit the same in CUDA and in the reference), numbered as every dropout mask is: an output
element by its global coordinates, ``g`` = its flat row-major index in the whole
``(..., ffn)`` output (64-bit, see `jax_ls2._random.keep_mask_at`), kept iff its 16-bit
draw is ``>= round(rate * 65536)``; kept elements are scaled by ``keep_scale(rate)``. A
shard knows its place in the whole array, so under ``jit`` any leading dim of ``x`` may be
sharded (the last, ``[gate | up]``, stays whole) and draws the unsharded mask; inside
``shard_map`` pass ``shard_spec``. The backward regenerates the mask from the seed; nothing
per element is stored.

Under ``vmap`` with dropout active, every example draws the mask it would draw on its
own, as with ``jax.random``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random
from jax_ls2._dispatch import OFFSETS, ROWS, SEED, FusedKernel, Role, match_varying, result_type
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks
from jax_ls2.ops._activations import C_TANH, INV_SQRT_2PI, K_TANH, SQRT_HALF

F32 = jnp.float32
# "geglu" takes the exact (erf) GELU, "geglu_tanh" its tanh approximation (Gemma's).
ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


# ---------------------------------------------------------------- reference math
def _act_and_grad(v, activation):
    """act(v) and act'(v) in float32; at v = +-inf their limits (act(-inf) = 0, act(inf) =
    inf, act' 0 and 1), where the formulas would give inf * 0 = NaN."""
    act, grad = _act_and_grad_finite(v, activation)
    inf = jnp.isinf(v)
    pos = v > 0
    act = jnp.where(inf, jnp.where(pos, v, jnp.zeros((), v.dtype)), act)
    grad = jnp.where(inf, pos.astype(v.dtype), grad)
    return act, grad


def _act_and_grad_finite(v, activation):
    one, half = np.float32(1), np.float32(0.5)
    if activation == "swiglu":
        sig = jax.nn.sigmoid(v)
        return v * sig, sig * (one + v * (one - sig))
    if activation == "geglu":
        cdf = half * (one + jax.lax.erf(v * SQRT_HALF))
        return v * cdf, cdf + v * INV_SQRT_2PI * jnp.exp(-half * v * v)
    t = jnp.tanh(K_TANH * (v + C_TANH * v * v * v))
    dt = (one - t * t) * K_TANH * (one + np.float32(3) * C_TANH * v * v)
    return half * v * (one + t), half * (one + t) + half * v * dt


def _out_shape(x):
    return x.shape[:-1] + (x.shape[-1] // 2,)


def _split(x):
    f = x.shape[-1] // 2
    return x[..., :f].astype(F32), x[..., f:].astype(F32)


def _fwd_ref(x, seed, offsets, *, activation, threshold, scale, strides):
    gate, up = _split(x)
    a, _ = _act_and_grad(gate, activation)
    return (_random.apply_mask(a * up, seed, offsets, threshold, scale, strides).astype(x.dtype),)


def _bwd_ref(x, dy, seed, offsets, *, activation, threshold, scale, strides):
    gate, up = _split(x)
    a, da = _act_and_grad(gate, activation)
    g = _random.apply_mask(dy.astype(F32), seed, offsets, threshold, scale, strides)
    return (jnp.concatenate([g * up * da, g * a], axis=-1).astype(x.dtype),)


# ---------------------------------------------------------------- CUDA calls
def _attrs(x, *arrays, activation, threshold, scale, strides):
    # x is the first operand of both kernels; the mask numbers the output's rows.
    return dict(activation=np.int32(_ACT_CODE[activation]), threshold=np.int32(threshold), scale=np.float32(scale),
                **_random.kernel_row_attrs(_out_shape(x), threshold, strides))


def _fwd_types(x, *arrays, **static):
    return (result_type(x, _out_shape(x)),)


def _bwd_types(x, *arrays, **static):
    return (result_type(x),)


_R1, _S, _O = Role(ROWS, 1), Role(SEED), Role(OFFSETS)
# x is the first operand of both, so the partitioner's offsets are those of its leading
# dims (the output's too; the last dim is never split). The seed and offsets reach the
# kernels as one uint32[4] (k0, k1, 64-bit base).
_KERNEL_OPTIONS = _random.kernel_options(_attrs)
_FWD = FusedKernel("jax_ls2_gated_act_dropout_fwd", _fwd_ref, operands=(_R1, _S, _O), results=(_R1,),
                   result_types=_fwd_types, vmap_method="broadcast_all", **_KERNEL_OPTIONS)
_BWD = FusedKernel("jax_ls2_gated_act_dropout_bwd", _bwd_ref, operands=(_R1, _R1, _S, _O), results=(_R1,),
                   result_types=_bwd_types, vmap_method="broadcast_all", **_KERNEL_OPTIONS)


# ---------------------------------------------------------------- custom_vjp
# ``num`` = (activation, threshold, scale, strides), static.
def _static(num):
    activation, threshold, scale, strides = num
    return dict(activation=activation, threshold=threshold, scale=scale, strides=strides)


@functools.partial(fused_vjp, nondiff_argnums=(3,), op="gated_act_dropout",
                   plain='jax.nn.silu(x[..., :f]) * x[..., f:] (jax.nn.gelu for GEGLU)')
def _gated(x, seed, offsets, num):
    return _FWD(x, seed, offsets, **_static(num))[0]


def _gated_fwd(x, seed, offsets, num):
    return _FWD(x, seed, offsets, **_static(num))[0], (x, seed, offsets)


def _gated_bwd(num, res, dy):
    x, seed, offsets = res
    return _BWD(x, dy, seed, offsets, **_static(num))[0], None, None


_gated.defvjp(_gated_fwd, _gated_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public API
def gated_act_dropout(x, *, activation: str = "swiglu", rate: float = 0.0, key=None, deterministic: bool = False,
                      shard_spec=None):
    """``dropout(act(gate) * up)`` of a gated MLP, ``[gate | up] = x``.

    Args:
      x: ``(..., 2 * ffn)`` float32, float16 or bfloat16: the gate projection then the up
        projection, concatenated (one GEMM with a ``(hidden, 2 * ffn)`` kernel).
      activation: ``"swiglu"`` (``silu(gate) * up``: LLaMA, Mistral), ``"geglu"``
        (exact erf GELU) or ``"geglu_tanh"`` (tanh-approximated GELU: Gemma).
      rate: static Python float in [0, 1), quantised to 1/65536.
      key: a JAX PRNG key (required when ``rate > 0`` and not ``deterministic``).
      deterministic: no dropout.
      shard_spec: inside ``shard_map`` only: how ``x`` is split over the manual mesh
        axes, its ``in_specs`` entry (per dim None, an axis name or a tuple of names; the
        last dim whole), so this device draws its block of the whole output's mask.
        Default: ``x`` is the whole array. Under plain ``jit`` leave it out.

    Returns:
      ``(..., ffn)`` in ``x.dtype``; float32 math in registers, rounded once. The
      backward keeps ``x``, the seed and the offsets: ``dgate = mask * scale * dy * up *
      act'(gate)``, ``dup = mask * scale * dy * act(gate)``, returned concatenated as ``dx``.
      At ``gate = +-inf`` act and act' take their limits (``act(-inf) = 0``, so a
      ``-inf`` gate gives 0 and zero gradients, not ``-inf * 0 = NaN``).
    """
    op = "gated_act_dropout"
    _checks.check_array(op, "x", x, min_ndim=1)
    n = x.shape[-1]
    if n == 0 or n % 2:
        raise ValueError(f"{op}: x's last axis must be 2 * ffn (gate then up; even, > 0), got shape {tuple(x.shape)}")
    if not isinstance(activation, str) or activation not in _ACT_CODE:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    seed, threshold, scale = _checks.check_dropout(op, rate, key, deterministic)
    if shard_spec is not None and len(tuple(shard_spec)) == x.ndim and tuple(shard_spec)[-1] is not None:
        raise ValueError(f"{op}: x's last axis ([gate | up]) cannot be split, got shard_spec {shard_spec!r}")
    offsets, strides = _random.numbering(op, _out_shape(x), shard_spec, threshold)
    (x,) = match_varying(x)
    return _gated(x, seed, offsets, (activation, threshold, scale, strides))
