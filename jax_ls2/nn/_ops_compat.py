"""The functional ops the layers are built on.

Each name is taken from :mod:`jax_ls2.ops` when that op exists there; otherwise a
pure-``jnp`` implementation of the same contract is used (fp32 statistics and
accumulation, dropout masks from :func:`jax_ls2._random.keep_mask`, so a mask drawn
here equals the one the fused kernels draw for the same key). Delete a fallback
once the op lands in ``jax_ls2.ops``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_ls2 import _random

try:  # pragma: no cover - depends on what jax_ls2.ops provides
    from jax_ls2 import ops as _ops
except ImportError:  # pragma: no cover
    _ops = None

_NEG = -1e30


def _real(name):
    return getattr(_ops, name, None) if _ops is not None else None


def _dropout(x, rate, key, deterministic):
    """``x`` with the shared counter-based mask of ``rate`` applied (scaled by 1/keep)."""
    if deterministic or rate == 0.0:
        return x
    if key is None:
        raise ValueError("dropout: a PRNG key is required when rate > 0 and deterministic=False")
    keep = _random.keep_mask(_random.seed_words(key), x.shape, _random.dropout_threshold(rate))
    return jnp.where(keep, x * jnp.asarray(_random.keep_scale(rate), x.dtype), jnp.zeros_like(x))


def _layer_norm(x, gamma, beta, *, eps=1e-5, residual=None):
    s = x if residual is None else x + residual
    xf = s.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    y = (y * gamma.astype(jnp.float32) + beta.astype(jnp.float32)).astype(x.dtype)
    return y if residual is None else (y, s)


def _bias_dropout_residual(x, bias, residual, *, rate, key, deterministic=False):
    y = (x + bias.astype(x.dtype)).astype(jnp.float32)
    y = _dropout(y, rate, key, deterministic)
    return (residual.astype(jnp.float32) + y).astype(residual.dtype)


_ACTS = {
    "relu": jax.nn.relu,
    "gelu": lambda v: jax.nn.gelu(v, approximate=False),
    "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True),
}


def _bias_act_dropout(x, bias, *, activation, rate, key, deterministic=False):
    if activation not in _ACTS:
        raise ValueError(f"bias_act_dropout: activation must be one of {sorted(_ACTS)}, got {activation!r}")
    y = _ACTS[activation]((x + bias.astype(x.dtype)).astype(jnp.float32))
    return _dropout(y, rate, key, deterministic).astype(x.dtype)


def _softmax_dropout(scores, *, scale=1.0, bias=None, mask=None, causal=False, rate=0.0,
                     key=None, deterministic=False):
    s = scores.astype(jnp.float32) * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    if causal:
        q, k = s.shape[-2], s.shape[-1]
        tri = jnp.arange(q)[:, None] + (k - q) >= jnp.arange(k)[None, :]
        s = jnp.where(tri, s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    return _dropout(p, rate, key, deterministic).astype(scores.dtype)


def sinusoid(positions, dim: int):
    """Sinusoidal position encodings, fp32 of shape (*positions.shape, dim):
    ``[sin(p*w_i) | cos(p*w_i)]`` with ``w_i = 10000^(-i/(dim/2-1))`` (fairseq's layout),
    zero-padded by one column when ``dim`` is odd."""
    half = dim // 2
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000.0) / max(half - 1, 1)))
    ang = positions.astype(jnp.float32)[..., None] * freq
    table = jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)
    if dim % 2:
        table = jnp.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, 1)])
    return table


def _embedding(ids, table, *, scale=1.0, positions=None, pos_table=None, sinusoidal=False,
               padding_idx=None, rate=0.0, key=None, deterministic=False):
    x = jnp.take(table, ids, axis=0).astype(jnp.float32) * scale
    if positions is None and (pos_table is not None or sinusoidal):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
    if pos_table is not None:
        x = x + jnp.take(pos_table, positions, axis=0).astype(jnp.float32)
    elif sinusoidal:
        x = x + sinusoid(positions, table.shape[-1])
    if padding_idx is not None:
        x = jnp.where((ids == padding_idx)[..., None], 0.0, x)
    return _dropout(x, rate, key, deterministic).astype(table.dtype)


def _cross_entropy(logits, labels, *, label_smoothing=0.0, ignore_index=None, z_loss=0.0):
    lf = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(lf, axis=-1)
    safe = labels if ignore_index is None else jnp.where(labels == ignore_index, 0, labels)
    picked = jnp.take_along_axis(lf, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    nll = lse - picked
    if label_smoothing:
        smooth = lse - jnp.mean(lf, axis=-1)
        nll = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    if z_loss:
        nll = nll + z_loss * jnp.square(lse)
    if ignore_index is None:
        return nll, jnp.asarray(labels.size, jnp.int32)
    keep = labels != ignore_index
    return jnp.where(keep, nll, 0.0), jnp.sum(keep).astype(jnp.int32)


layer_norm = _real("layer_norm") or _layer_norm
bias_dropout_residual = _real("bias_dropout_residual") or _bias_dropout_residual
bias_act_dropout = _real("bias_act_dropout") or _bias_act_dropout
softmax_dropout = _real("softmax_dropout") or _softmax_dropout
embedding = _real("embedding") or _embedding
cross_entropy = _real("cross_entropy") or _cross_entropy


def dropout(x, *, rate, key, deterministic=False):
    """Plain dropout with the shared counter-based mask. x: any shape, any float dtype."""
    return _dropout(x, rate, key, deterministic)


def using_fallback() -> dict:
    """{op name: True when the pure-jnp fallback of this module is in use}."""
    names = ("layer_norm", "bias_dropout_residual", "bias_act_dropout", "softmax_dropout",
             "embedding", "cross_entropy")
    return {n: _real(n) is None for n in names}
