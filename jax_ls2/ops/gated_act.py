"""Fused gated activation + dropout of a gated MLP (SwiGLU, GEGLU), on the concatenated
``[gate | up]`` projection, without bias.

``y = dropout(act(gate) * up)`` with ``gate = x[..., :ffn]``, ``up = x[..., ffn:]``.
Dropout masks come from the counter-based generator of :mod:`jax_ls2._random` (bit for
bit the same in CUDA and in the reference), as for the other dropout ops: output element
``(row, j)`` is numbered by the flat index of its gate element in ``x``,
``g = row * 2 ffn + j`` (plus the seed's offset word), and kept iff its 16-bit draw is
``>= round(rate * 65536)``; kept elements are scaled by ``keep_scale(rate)``. Numbering by
``x``'s layout makes a row-sharded ``x`` draw, shard by shard, the mask of the whole. The
backward regenerates the mask from the seed; nothing per element is stored.

Under ``vmap`` with dropout active, every example draws the mask it would draw on its
own, as with ``jax.random``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2 import _random
from jax_ls2._dispatch import ROWS, SEED, FusedKernel, Role, match_varying, result_type
from jax_ls2.ops import _checks

F32 = jnp.float32
# "geglu" takes the exact (erf) GELU, "geglu_tanh" its tanh approximation (Gemma's).
ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_SQRT_HALF = np.float32(0.7071067811865476)
_INV_SQRT_2PI = np.float32(0.3989422804014327)
_K_TANH = np.float32(0.7978845608028654)
_C_TANH = np.float32(0.044715)


# ---------------------------------------------------------------- reference math
def _act_and_grad(v, activation):
    """act(v) and act'(v) in float32."""
    one, half = np.float32(1), np.float32(0.5)
    if activation == "swiglu":
        sig = jax.nn.sigmoid(v)
        return v * sig, sig * (one + v * (one - sig))
    if activation == "geglu":
        cdf = half * (one + jax.lax.erf(v * _SQRT_HALF))
        return v * cdf, cdf + v * _INV_SQRT_2PI * jnp.exp(-half * v * v)
    t = jnp.tanh(_K_TANH * (v + _C_TANH * v * v * v))
    dt = (one - t * t) * _K_TANH * (one + np.float32(3) * _C_TANH * v * v)
    return half * v * (one + t), half * (one + t) + half * v * dt


def _keep(seed, rows_shape, ffn, threshold):
    """Keep flags of the outputs (rows..., ffn): numbered by their gate's index in x."""
    return _random.keep_mask(seed, rows_shape + (2 * ffn,), threshold)[..., :ffn]


def _split(x):
    f = x.shape[-1] // 2
    return x[..., :f].astype(F32), x[..., f:].astype(F32)


def _fwd_ref(x, seed, *, activation, threshold, scale):
    gate, up = _split(x)
    a, _ = _act_and_grad(gate, activation)
    y = a * up
    if threshold:
        y = jnp.where(_keep(seed, x.shape[:-1], gate.shape[-1], threshold), y * np.float32(scale), np.float32(0))
    return (y.astype(x.dtype),)


def _bwd_ref(x, dy, seed, *, activation, threshold, scale):
    gate, up = _split(x)
    a, da = _act_and_grad(gate, activation)
    g = dy.astype(F32)
    if threshold:
        g = jnp.where(_keep(seed, x.shape[:-1], gate.shape[-1], threshold), g * np.float32(scale), np.float32(0))
    return (jnp.concatenate([g * up * da, g * a], axis=-1).astype(x.dtype),)


# ---------------------------------------------------------------- CUDA calls
def _attrs(*arrays, activation, threshold, scale):
    return dict(activation=np.int32(_ACT_CODE[activation]), threshold=np.int32(threshold), scale=np.float32(scale))


def _fwd_types(x, seed, **static):
    return (result_type(x, x.shape[:-1] + (x.shape[-1] // 2,)),)


def _bwd_types(x, dy, seed, **static):
    return (result_type(x),)


def _dropping(static) -> bool:
    return static["threshold"] != 0


_R1, _S = Role(ROWS, 1), Role(SEED)
# x is the first operand of both, so a shard's seed offset counts x's elements (the
# numbering of the module docstring). With dropout active, vmap runs the examples one by
# one so each draws its own mask.
_FWD = FusedKernel("jax_ls2_gated_act_dropout_fwd", _fwd_ref, operands=(_R1, _S), results=(_R1,),
                   result_types=_fwd_types, attrs=_attrs, vmap_method="broadcast_all", per_example=_dropping)
_BWD = FusedKernel("jax_ls2_gated_act_dropout_bwd", _bwd_ref, operands=(_R1, _R1, _S), results=(_R1,),
                   result_types=_bwd_types, attrs=_attrs, vmap_method="broadcast_all", per_example=_dropping)


# ---------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gated(x, seed, activation, threshold, scale):
    return _FWD(x, seed, activation=activation, threshold=threshold, scale=scale)[0]


def _gated_fwd(x, seed, activation, threshold, scale):
    return _FWD(x, seed, activation=activation, threshold=threshold, scale=scale)[0], (x, seed)


def _gated_bwd(activation, threshold, scale, res, dy):
    x, seed = res
    return _BWD(x, dy, seed, activation=activation, threshold=threshold, scale=scale)[0], None


_gated.defvjp(_gated_fwd, _gated_bwd, optimize_remat=True)


# ---------------------------------------------------------------- public API
def gated_act_dropout(x, *, activation: str = "swiglu", rate: float = 0.0, key=None, deterministic: bool = False):
    """``dropout(act(gate) * up)`` of a gated MLP, ``[gate | up] = x``.

    Args:
      x: ``(..., 2 * ffn)`` float32, float16 or bfloat16: the gate projection then the up
        projection, concatenated (one GEMM with a ``(hidden, 2 * ffn)`` kernel).
      activation: ``"swiglu"`` (``silu(gate) * up``: LLaMA, Mistral), ``"geglu"``
        (exact erf GELU) or ``"geglu_tanh"`` (tanh-approximated GELU: Gemma).
      rate: static Python float in [0, 1), quantised to 1/65536.
      key: a JAX PRNG key (required when ``rate > 0`` and not ``deterministic``).
      deterministic: no dropout.

    Returns:
      ``(..., ffn)`` in ``x.dtype``; float32 math in registers, rounded once. The
      backward keeps ``x`` and the seed: ``dgate = mask * scale * dy * up * act'(gate)``,
      ``dup = mask * scale * dy * act(gate)``, returned concatenated as ``dx``.
    """
    op = "gated_act_dropout"
    _checks.check_array(op, "x", x, min_ndim=1)
    n = x.shape[-1]
    if n == 0 or n % 2:
        raise ValueError(f"{op}: x's last axis must be 2 * ffn (gate then up; even, > 0), got shape {tuple(x.shape)}")
    if not isinstance(activation, str) or activation not in _ACT_CODE:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    deterministic = _checks.check_deterministic(op, deterministic)
    rate = _checks.check_rate(op, rate, key, deterministic)
    threshold = 0 if deterministic else _random.dropout_threshold(rate)
    if threshold == 0:
        seed, scale = jnp.zeros((3,), jnp.uint32), 1.0
    else:
        seed, scale = _random.seed_words(key), _random.keep_scale(rate)
    (x,) = match_varying(x)
    return _gated(x, seed, activation, threshold, scale)
