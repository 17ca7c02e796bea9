"""Pure-JAX reference of the fused optimizer kernels, element for element the same
math as ``csrc/kernels/optimizer.cu`` (float32 in registers), run on every backend
without the CUDA kernels.

Per element, with ``gscale = inv_scale * grad_mult``::

    g  = grad * gscale;   g = g / norm * max_norm   if clipping and not norm < max_norm
    Adam: m = (1-b1) g + b1 m;  v = (1-b2) g^2 + b2 v;  u = (m * (1/bc1)) / (sqrt(v * (1/bc2) + eps_root) + eps)
    SGD:  m = g + b1 m;  u = g + b1 m (nesterov) or m;   u = g without momentum
    u += wd * p   (leaves flagged for decay);   d = u * (-lr);   p' = p + d
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2._random import mix32
from jax_ls2.optim import _abi as A
from jax_ls2.optim._layout import Layout, flatten, leaf_view, padding_index


def sr_bits(flat_index: jax.Array, seed: jax.Array) -> jax.Array:
    """uint32 random bits of flat element `flat_index` for seed (k0, k1, step, _)."""
    idx = flat_index.astype(jnp.uint32)
    salt = mix32((seed[2] * np.uint32(0x85EBCA6B)) ^ seed[1])
    return mix32(mix32((idx * np.uint32(0x9E3779B1)) ^ seed[0]) ^ salt)


def _bits_to_f32(b: jax.Array, dtype) -> jax.Array:
    """float32 value of the float16/bfloat16 `dtype` element with uint16 bits `b`,
    decoded with integer ops. A plain ``astype(float32)`` of ``x.astype(dtype)`` is a
    float32 -> dtype -> float32 convert pair, which XLA:GPU (SimplifyFPConversions,
    on with the default xla_allow_excess_precision) folds to ``x`` itself; bitcasts in
    between are folded away too, so the round trip cannot be written with converts."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        return jax.lax.bitcast_convert_type(b.astype(jnp.uint32) << np.uint32(16), jnp.float32)
    b = b.astype(jnp.uint32)
    e = (b >> np.uint32(10)) & np.uint32(0x1F)
    m = b & np.uint32(0x3FF)
    sig = jnp.where(e > 0, m | np.uint32(0x400), m).astype(jnp.float32)  # exact (< 2^11)
    scale = jax.lax.bitcast_convert_type((jnp.maximum(e, np.uint32(1)) + np.uint32(127 - 25)) << np.uint32(23),
                                         jnp.float32)  # 2^(max(e, 1) - 25), a normal float32
    mag = jnp.where(e == 0x1F, jnp.where(m == 0, jnp.float32(np.inf), jnp.float32(np.nan)), sig * scale)
    return jnp.where((b >> np.uint32(15)) != 0, -mag, mag)


def round_stochastic(x: jax.Array, dtype, bits: jax.Array) -> jax.Array:
    """float32 `x` rounded to float16/bfloat16 `dtype`, up with probability
    (|x| - |lo|) / (|hi| - |lo|) where lo, hi are the neighbours towards and away
    from zero. bfloat16: the top 16 bits of x's bits plus the low 16 of `bits` (a finite
    value that would become inf is truncated instead); float16: u = (bits >> 8) * 2^-24
    and x goes up iff u < that fraction."""
    dtype = jnp.dtype(dtype)
    near = x.astype(dtype)
    if dtype == jnp.dtype(jnp.bfloat16):
        xb = jax.lax.bitcast_convert_type(x, jnp.uint32)
        up = (xb + (bits & np.uint32(0xFFFF))) >> np.uint32(16)
        up = jnp.where((up & np.uint32(0x7F80)) == np.uint32(0x7F80), xb >> np.uint32(16), up)
        out = jax.lax.bitcast_convert_type(up.astype(jnp.uint16), dtype)
        return jnp.where(jnp.isfinite(x), out, near)
    b = jax.lax.bitcast_convert_type(near, jnp.uint16)
    lo = _bits_to_f32(b, dtype)
    down = jnp.abs(lo) > jnp.abs(x)
    b = jnp.where(down, b - np.uint16(1), b)
    lo = _bits_to_f32(b, dtype)
    hb = b + np.uint16(1)
    hi = _bits_to_f32(hb, dtype)
    frac = (jnp.abs(x) - jnp.abs(lo)) / (jnp.abs(hi) - jnp.abs(lo))
    u = (bits >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)
    out_bits = jnp.where((lo != x) & (u < frac), hb, b)
    out = jax.lax.bitcast_convert_type(out_bits, dtype)
    return jnp.where(jnp.isfinite(x), out, near)


def grad_stats(g_flat: jax.Array, hp: jax.Array) -> jax.Array:
    """(2,) float32: global norm of grad * gscale over the flat (total,) float32 gradient
    buffer, and 1.0 if every gradient is finite else 0.0 (the zero padding changes neither)."""
    s = g_flat * (hp[A.INV_SCALE] * hp[A.GRAD_MULT])
    return jnp.stack([jnp.sqrt(jnp.sum(s * s)), _all_finite(g_flat).astype(jnp.float32)])


def _all_finite(g_flat: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(g_flat))


def _indexable(layout: Layout) -> bool:
    """Whether int32 indices reach every element of the flat buffers."""
    return layout.total < 2 ** 31


def _scaled_grads(h, flags, g, clip_on, norm, layout: Layout):
    """The flat (total,) float32 gradients times gscale and, with CLIP, clipped. The
    padding stays zero as the kernel leaves it (``0 / norm`` is NaN for a NaN norm)."""
    g = g * h["gscale"]
    if flags & A.CLIP:
        g = jnp.where(clip_on, (g / norm) * h[A.MAX_NORM], g)
        if not _indexable(layout):  # no int32 index for every element: re-pad leaf by leaf
            return flatten([leaf_view(g, layout, i) for i in range(len(layout.sizes))], layout)
        idx = padding_index(layout)
        if idx.size:
            g = g.at[idx].set(0, indices_are_sorted=True, unique_indices=True)
    return g


def _moments(h, algo, flags, g, m, v):
    """New flat float32 moments (m, v) from the scaled gradients `g`; unused ones as given."""
    if algo == A.ADAM:
        m = h[A.ONE_MINUS_B1] * g + h[A.B1] * m
        v = h[A.ONE_MINUS_B2] * (g * g) + h[A.B2] * v
    elif flags & A.HAS_MU:
        m = g + h[A.B1] * m
    return m, v


def _leaf_delta(h, algo, flags, decay: bool, g, m, v, p):
    """One leaf's step d (its new value is p + d) from its slices of the scaled gradients
    and of the new moments: ``(u + wd * p) * (-lr)``, no decay term where it has none."""
    if algo == A.ADAM:
        u = (m * h[A.INV_BC1]) / (jnp.sqrt(v * h[A.INV_BC2] + h[A.EPS_ROOT]) + h[A.EPS])
    elif flags & A.HAS_MU:
        u = g + h[A.B1] * m if flags & A.NESTEROV else m
    else:
        u = g
    if decay:
        u = u + h[A.WD] * p
    return u * h["neg_lr"]


def fused_update(grads, params, mu, nu, master, hp, seed, *, algo: int, flags: int,
                 layout: Layout, decay: tuple):
    """Reference of ``jax_ls2_optim_update``.

    The gradients are concatenated once into the flat layout and the moments updated as
    whole flat buffers; then each leaf's new value (or update) is computed from its
    slices of those. The program thus holds a few whole-buffer operations plus one
    small fusion per leaf, which keeps its compile time and run time near optax's
    (per-leaf moments concatenated back into the flat state cost about 3x optax's
    compile time for many leaves, and an extra copy of the moments every step).

    Args:
      grads: list of L leaves (f32/f16/bf16), or [flat (total,) f32] with FLAT_GRADS.
      params: list of L leaves. mu, nu: (total,) f32/bf16 or None. master: (total,) f32 or None.
      hp: (HP_SIZE,) f32. seed: (4,) uint32.
    Returns:
      (outs, mu, nu, master, stats): outs are the new params (APPLY; param dtypes) or the
      updates (grad dtypes); stats (2,) f32 = (norm, finite): both from the norm pass with
      CHECK or CLIP, (0, finite) with REPORT, zeros otherwise.
    """
    L = len(params)
    if flags & A.FLAT_GRADS:
        g_flat = grads[0]
        g_dtypes = [g_flat.dtype] * L
    else:
        g_flat = flatten(grads, layout, jnp.float32)
        g_dtypes = [g.dtype for g in grads]
    if flags & (A.CHECK | A.CLIP):
        stats = grad_stats(g_flat, hp)
        norm = stats[0]
        clip_on = (flags & A.CLIP != 0) & ~(norm < hp[A.MAX_NORM])
        skip = stats[1] == 0 if flags & A.CHECK else None
    else:
        stats = jnp.zeros((2,), jnp.float32)
        if flags & A.REPORT:
            stats = jnp.stack([jnp.float32(0), _all_finite(g_flat).astype(jnp.float32)])
        norm, clip_on, skip = jnp.float32(0), jnp.bool_(False), None
    # skip None: no skipped steps, no selects in the program.
    keep = lambda old, new: new if skip is None else jnp.where(skip, old, new)
    # The hp slots as scalars, read once per step (slicing hp again for every leaf
    # multiplied the program's size by the leaf count).
    h = {k: hp[k] for k in range(A.HP_SIZE)}
    h["gscale"] = hp[A.INV_SCALE] * hp[A.GRAD_MULT]
    h["neg_lr"] = -hp[A.LR]
    g_flat = _scaled_grads(h, flags, g_flat, clip_on, norm, layout)
    zeros = jnp.zeros((layout.total,), jnp.float32)
    m, v = _moments(h, algo, flags, g_flat, zeros if mu is None else mu.astype(jnp.float32),
                    zeros if nu is None else nu.astype(jnp.float32))
    apply = bool(flags & A.APPLY)
    sr = bool(flags & A.SR) and master is None
    outs, new_master = [], []
    # Each leaf reads its slices of the flat buffers at an offset XLA cannot see (the
    # offsets pass an optimization barrier), so the leaves of one shape give one and the
    # same fusion, which the CPU compiler builds once: with static slices every leaf's
    # fusion differed by its offset, and a transformer's 1000 leaves compiled 2x slower.
    dynamic = L > 0 and _indexable(layout)
    offsets = jax.lax.optimization_barrier([jnp.int32(o) for o in layout.offsets]) if dynamic else layout.offsets
    for i in range(L):
        p_leaf = params[i]
        cur = p_leaf.astype(jnp.float32)
        view = ((lambda x: jax.lax.dynamic_slice(x, (offsets[i],), (layout.sizes[i],)).reshape(layout.shapes[i]))
                if dynamic else (lambda x: leaf_view(x, layout, i)))
        p = view(master) if master is not None else cur
        slices = (view(x) for x in (g_flat, m, v))
        d = _leaf_delta(h, algo, flags, bool(decay[i]), *slices, p)
        newp = p + d
        if apply:
            pdt = p_leaf.dtype
            if sr and jnp.dtype(pdt) != jnp.float32:
                base = offsets[i].astype(jnp.uint32) if dynamic else layout.offsets[i]
                idx = base + jnp.arange(layout.sizes[i], dtype=jnp.uint32).reshape(p.shape)
                out = round_stochastic(newp, pdt, sr_bits(idx, seed))
            else:
                out = newp.astype(pdt)
            outs.append(keep(p_leaf, out))
        else:
            upd = (newp - cur) if master is not None else d
            outs.append(keep(jnp.zeros((), upd.dtype), upd).astype(g_dtypes[i]))
        new_master.append(newp)
    new_state = lambda old, new: None if old is None else keep(old, new.astype(old.dtype))
    # The master weights are read per leaf (the decay term differs by leaf), so their
    # new buffer is one concatenation of the new leaves, with zero padding.
    return (outs, new_state(mu, m), new_state(nu, v),
            None if master is None else new_state(master, flatten(new_master, layout, jnp.float32)), stats)


def accumulate(acc, scale, grads, *, layout: Layout):
    """Reference of ``jax_ls2_optim_accumulate``: acc[offset_i + j] += grads_i[j] * scale[0]."""
    return acc + flatten(grads, layout, jnp.float32) * scale[0]
