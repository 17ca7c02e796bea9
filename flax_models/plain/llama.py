"""Plain-Flax twins of jax_ls2.nn.RMSNorm and jax_ls2.nn.DecoderLayer (no jax_ls2 ops):
the same constructors and parameter trees, the math written with jnp and
``jax.nn.dot_product_attention``. The decode cache is Flax's own ``nnx.Cache``, written
and masked by `flax_models.plain.kv_cache` (a copy of `jax_ls2.nn.kv_cache`'s rules),
and the defaults are copies of jax_ls2's constants (`flax_models.plain.constants`), so
both forms decode and initialise alike."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_models.plain import kv_cache
from flax_models.plain.constants import EPSILON, INIT_STDDEV, RMS_EPSILON
from flax_models.plain.layers import LayerNorm, attention_implementation

F32 = jnp.float32


def _ct(dtype):
    """The math dtype for ``dtype``: float32, or float64 for float64 (a test's truth)."""
    return jnp.promote_types(dtype, F32)
_GATED = {"swiglu": jax.nn.silu, "geglu": lambda v: jax.nn.gelu(v, approximate=False),
          "geglu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x**2) + epsilon) * w`` in float32, the result in x's dtype; ``w``
    is ``scale`` or, with ``unit_offset`` (Gemma), ``1 + scale``. Param ``scale``
    (num_features,), ones (zeros with unit_offset)."""

    def __init__(self, num_features, *, epsilon=RMS_EPSILON, unit_offset=False, dtype=None,
                 param_dtype=jnp.float32, rngs=None):
        del rngs
        self.num_features, self.epsilon, self.unit_offset, self.dtype = num_features, epsilon, unit_offset, dtype
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = nnx.Param(init((num_features,), param_dtype))

    def __call__(self, x, residual=None):
        dtype = self.dtype or jnp.promote_types(x.dtype, self.scale.dtype)
        x = x.astype(dtype)
        if residual is not None:
            x = (x.astype(_ct(dtype)) + residual.astype(_ct(dtype))).astype(dtype)
        xf = x.astype(_ct(dtype))
        w = self.scale[...].astype(dtype).astype(_ct(dtype))
        w = w + 1.0 if self.unit_offset else w
        y = (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.epsilon) * w).astype(dtype)
        return y if residual is None else (y, x)


def rotary_frequencies(rotary_dim, theta, scaling):
    """``(rotary_dim // 2,)`` float32 inverse frequencies; ``scaling`` is None or has the
    fields ``kind`` ("linear", "ntk", "llama3"), ``factor``, ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position``."""
    half = rotary_dim // 2
    base = float(theta)
    kind = None if scaling is None else scaling.kind
    if kind == "ntk" and rotary_dim > 2:
        base *= float(scaling.factor) ** (rotary_dim / (rotary_dim - 2))
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
    if kind == "linear":
        inv = inv / scaling.factor
    elif kind == "llama3":
        wavelen = 2.0 * math.pi / inv
        lo, hi = float(scaling.low_freq_factor), float(scaling.high_freq_factor)
        smooth = np.clip((scaling.original_max_position / wavelen - lo) / (hi - lo), 0.0, 1.0)
        inv = (1.0 - smooth) * inv / scaling.factor + smooth * inv
    return inv.astype(np.float32)


def apply_rotary(x, positions, inv_freq, interleaved):
    """x (batch, seq, heads, head_dim) rotated at positions (batch, seq); float32 math."""
    half = inv_freq.shape[0]
    ang = positions.astype(_ct(x.dtype))[..., None] * inv_freq
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xf = x[..., :2 * half].astype(_ct(x.dtype))
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :half], xf[..., half:])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot = jnp.stack([o1, o2], -1).reshape(xf.shape) if interleaved else jnp.concatenate([o1, o2], -1)
    return jnp.concatenate([rot.astype(x.dtype), x[..., 2 * half:]], axis=-1)


class DecoderLayer(nnx.Module):
    """Twin of jax_ls2.nn.DecoderLayer (see there for the arguments and the parameters)."""

    def __init__(self, hidden_size, ffn_size, num_heads, *, num_kv_heads=None, head_dim=None,
                 norm="rms", activation="swiglu", epsilon=None, unit_offset=False,
                 rope_theta=10000.0, rotary_dim=None, rope_scaling=None, interleaved=False,
                 attn_dropout=0.0, activation_dropout=0.0, hidden_dropout=0.0,
                 deterministic=None, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.normal(INIT_STDDEV), rngs):
        self.hidden_size, self.ffn_size, self.num_heads = hidden_size, ffn_size, num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.norm, self.activation, self.interleaved = norm, activation, interleaved
        self.rope = (rotary_dim or self.head_dim, rope_theta, rope_scaling)
        self.attn_dropout, self.deterministic, self.dtype = attn_dropout, deterministic, dtype
        lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        if epsilon is None:
            epsilon = RMS_EPSILON if norm == "rms" else EPSILON
        if norm == "rms":
            make_norm = lambda: RMSNorm(hidden_size, epsilon=epsilon, unit_offset=unit_offset, dtype=dtype,
                                        param_dtype=param_dtype)
        else:
            make_norm = lambda: LayerNorm(hidden_size, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                                          rngs=rngs)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.attn_norm = make_norm()
        self.qkv = nnx.Linear(hidden_size, q_size + 2 * kv_size, **lin)
        self.out = nnx.Linear(q_size, hidden_size, **lin)
        self.mlp_norm = make_norm()
        self.gate_up = nnx.Linear(hidden_size, 2 * ffn_size, **lin)
        self.down = nnx.Linear(ffn_size, hidden_size, **lin)
        self.attn_drop = nnx.Dropout(attn_dropout, deterministic=deterministic, rngs=rngs)
        self.act_drop = nnx.Dropout(activation_dropout, deterministic=deterministic, rngs=rngs)
        self.hidden_drop = nnx.Dropout(hidden_dropout, deterministic=deterministic, rngs=rngs)
        self.cache_k = self.cache_v = self.cache_index = nnx.data(None)

    def init_cache(self, batch, max_len, dtype=None):
        dtype = dtype or self.dtype or self.qkv.kernel.dtype
        self.cache_k, self.cache_v, self.cache_index = kv_cache.new_cache(
            batch, max_len, self.num_kv_heads, self.head_dim, dtype, "DecoderLayer")

    def _attend(self, q, k, v, mask, causal, det):
        if (not det) and self.attn_dropout > 0:
            groups = self.num_heads // self.num_kv_heads
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
            s = jnp.einsum("btnh,bsnh->bnts", q, k).astype(_ct(q.dtype)) / math.sqrt(self.head_dim)
            if mask is not None:
                s = jnp.where(mask, s, -1e30)
            if causal:
                s = jnp.where(jnp.arange(s.shape[-2])[:, None] >= jnp.arange(s.shape[-1]), s, -1e30)
            p = self.attn_drop(jax.nn.softmax(s, axis=-1), deterministic=det).astype(v.dtype)
            return jnp.einsum("bnts,bsnh->btnh", p, v)
        # cuDNN's fused attention where it applies (as the other twins pick it), else XLA's.
        impl = (attention_implementation("auto", False, q.shape[1], k.shape[1], self.head_dim, q.dtype)
                if mask is None else "xla")
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=impl)

    def __call__(self, x, *, positions=None, segment_ids=None, deterministic=None, decode=False):
        det = deterministic if deterministic is not None else self.deterministic
        b, t, _ = x.shape
        h = self.attn_norm(x)
        qkv = self.qkv(h)
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[..., :nq * d].reshape(b, t, nq, d)
        k = qkv[..., nq * d:(nq + nkv) * d].reshape(b, t, nkv, d)
        v = qkv[..., (nq + nkv) * d:].reshape(b, t, nkv, d)
        start = self.cache_index[...] if decode else 0
        if positions is None:
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        inv_freq = jnp.asarray(rotary_frequencies(*self.rope))
        q, k = apply_rotary(q, positions, inv_freq, self.interleaved), apply_rotary(k, positions, inv_freq,
                                                                                    self.interleaved)
        mask, causal = None, True
        if segment_ids is not None:
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        if decode:
            k_all, v_all = kv_cache.write(self.cache_k, self.cache_v, start, k, v, "DecoderLayer")
            self.cache_index[...] = start + t
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
            mask, causal = kv_cache.visible(start, t, k.shape[1])[None, None], False
        ctx = self._attend(q, k, v, mask, causal, det)
        if decode:
            ctx = kv_cache.nan_past_end(ctx, start, k.shape[1])
        ctx = ctx.reshape(b, t, nq * d)
        a = self.hidden_drop(self.out(ctx), deterministic=det)
        h, x = self.mlp_norm(a, residual=x) if self.norm == "rms" else self._ln_residual(a, x)
        gate, up = jnp.split(self.gate_up(h), 2, axis=-1)
        y = (_GATED[self.activation](gate.astype(_ct(up.dtype))) * up.astype(_ct(up.dtype))).astype(up.dtype)
        y = self.down(self.act_drop(y, deterministic=det))
        return x.astype(y.dtype) + self.hidden_drop(y, deterministic=det)

    def _ln_residual(self, a, x):
        s = x.astype(a.dtype) + a
        return self.mlp_norm(s), s
