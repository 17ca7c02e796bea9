"""fp8_dot: a GEMM with delayed-scaled FP8 operands, forward and backward."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_ls2._dispatch import _varying_axes, match_varying
from jax_ls2._dispatch import fused_vjp
from jax_ls2.fp8.recipe import GRAD_OUTPUT, INPUT, NUM_OPERANDS, WEIGHT, DelayedScaling, fp8_max
from jax_ls2.fp8.state import CACHE_FILL, CACHE_REUSE, DotMeta, FP8DotMeta, FP8Meta, FP8WeightCache, WeightCopies

OP = "fp8_dot"
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def fp8_dot(x, w, meta, recipe: DelayedScaling, *, dtype=None, amax_axes=(), splits: int = 1):
    """``x @ w`` with both operands cast to FP8 by their delayed scales.

    Args:
      x: (..., K) float32/bfloat16/float16, at least rank 2.
      w: (K, N) float32/bfloat16/float16.
      meta: this GEMM's `DotMeta` (amax_history (3, L), scale (3,), scale_inv (3,),
        float32; L = recipe.amax_history_len), or an `FP8Meta` / `FP8DotMeta` holding it.
      recipe: the `DelayedScaling` the meta follows.
      dtype: the result dtype (float32/bfloat16/float16); default: x's and w's promoted dtype.
      amax_axes: mesh axis names (inside ``shard_map``) over which the amaxes are
        max-reduced when ``recipe.reduce_amax``. It must name every manual axis x or w
        varies over and the meta does not (ValueError otherwise); x and w are made
        varying over the union of their axes, so a replicated w gets its gradient
        summed over them. Under a sharded ``jit`` nothing is needed: the amax of a
        sharded array is already global.
      splits: w's N columns taken as ``splits`` equal blocks (say the q, k and v parts
        of a fused projection), each its own GEMM writing its own result, with x
        quantized once and w by one scale (one meta). The backward concatenates the
        blocks' gradients in the pass that quantizes them and runs one dgrad and one
        wgrad GEMM.

    Returns:
      (..., N) in ``dtype``; with ``splits > 1`` a tuple of ``splits`` arrays
      (..., N / splits).

    Forward: x and w are cast to E4M3 with ``meta.scale`` (saturating at 448) and
    multiplied as a 2-D FP8 ``dot_general`` accumulating in float32, scaled by the two
    scale_invs and written in ``dtype`` by the GEMM itself on CUDA (one cuBLASLt FP8
    call, see `_scaled_dot`); the GEMM reads w's FP8 copy transposed, (N, K), the
    K-major operand Hopper's FP8 GEMMs take. With an `FP8DotMeta` whose weight cache is
    on (`jax_ls2.fp8.cache_weights`), w's FP8 copies and amax are kept ("fill") or read
    instead of cast ("reuse"). Kept for the backward: the FP8 copies of x and w and the meta.
    Backward: the output gradient is cast to E5M2 (hybrid; E4M3 for "e4m3") with its
    delayed scale; dgrad and wgrad are FP8 ``dot_general``s. The gradient with respect
    to ``meta`` is the meta update: a `DotMeta` whose ``amax_history[:, 0]`` holds
    this step's amaxes of x, w and the output gradient (taken before casting), zeros
    elsewhere (see `jax_ls2.fp8.split_meta` and `update_meta`). Under ``jax.vmap``
    with a shared meta, the amaxes are taken over the whole mapped batch.
    Second-order derivatives raise NotImplementedError.
    """
    x, w, dm, dtype, axes = _prepare(OP, x, w, meta, recipe, dtype, amax_axes)
    splits = _check_splits(OP, splits, w)
    wc = _weight_copies(OP, w, meta, dm, recipe, axes)
    ys = _fp8_dot(recipe, dtype, axes, jnp.dtype(x.dtype), jnp.dtype(w.dtype), splits, x, w, wc, dm)
    return ys if splits > 1 else ys[0]


def _check_splits(op, splits, w) -> int:
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 or w.shape[1] % splits:
        raise ValueError(f"{op}: splits must be a positive int dividing w's N={w.shape[1]} columns, got {splits!r}")
    return splits


def _prepare(op, x, w, meta, recipe, dtype, amax_axes, *, x_name="x", w_name="w"):
    """Checks one FP8 GEMM's arguments as `fp8_dot` documents them (errors name ``op``);
    returns ``(x, w, dot_meta, dtype, axes)``: x and w made varying over the same mesh
    axes, the result dtype, and the mesh axes to max-reduce the amaxes over."""
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"{op}: recipe must be a jax_ls2.fp8.DelayedScaling, got {type(recipe).__name__}")
    for name, a in ((x_name, x), (w_name, w)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
        if jnp.dtype(a.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must have dtype in (float32, bfloat16, float16), got {a.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have shape (..., K) with rank >= 2, got {tuple(x.shape)}")
    if w.ndim != 2:
        raise ValueError(f"{op}: w must have shape (K, N) (rank 2), got {tuple(w.shape)}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{op}: x's last dim (K={x.shape[-1]}) must equal w's first dim, "
                         f"got x {tuple(x.shape)} and w {tuple(w.shape)}")
    dtype = jnp.dtype(jnp.result_type(x.dtype, w.dtype) if dtype is None else dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be one of (float32, bfloat16, float16), got {dtype}")
    dm = _as_dot_meta(meta, recipe, op)
    if isinstance(amax_axes, str):
        amax_axes = (amax_axes,)
    if not isinstance(amax_axes, (tuple, list)) or not all(isinstance(a, str) for a in amax_axes):
        raise TypeError(f"{op}: amax_axes must be a tuple of mesh axis names, got {amax_axes!r}")
    axes = tuple(amax_axes) if recipe.reduce_amax else ()
    # Inside shard_map: x and w enter per-device alike (their gradients come back summed
    # over the axes they were cast over); the amaxes must be reduced over every axis the
    # operands vary over and the meta does not, or replicas would record different ones.
    x, w = match_varying(x, w)
    unreduced = sorted(_varying_axes(x) - set(axes) - _varying_axes(dm.scale))
    if unreduced:
        raise ValueError(f"{op}: x and w vary over the mesh axes {tuple(unreduced)} (inside shard_map) but meta "
                         f"does not; pass amax_axes={tuple(unreduced)!r} with recipe.reduce_amax=True so every "
                         f"replica records the same amaxes, or give each device its own meta; got amax_axes="
                         f"{tuple(amax_axes)!r}, reduce_amax={recipe.reduce_amax}")
    return x, w, dm, dtype, axes


def _as_dot_meta(meta, recipe: DelayedScaling, op: str = OP) -> DotMeta:
    if isinstance(meta, FP8DotMeta):
        meta = meta.meta
    if isinstance(meta, FP8Meta):
        meta = meta.get_value()
    if not isinstance(meta, DotMeta):
        raise TypeError(f"{op}: meta must be a DotMeta, FP8Meta or FP8DotMeta, got {type(meta).__name__}")
    shapes = ((NUM_OPERANDS, recipe.amax_history_len), (NUM_OPERANDS,), (NUM_OPERANDS,))
    for name, a, shape in zip(DotMeta._fields, meta, shapes):
        if tuple(a.shape) != shape or jnp.dtype(a.dtype) != jnp.float32:
            raise ValueError(f"{op}: meta.{name} must be float32 of shape {shape} (amax_history_len="
                             f"{recipe.amax_history_len}), got {a.dtype} {tuple(a.shape)}")
    return meta


def _quantize(t, scale, fp8_dtype):
    """t * scale, saturated to the FP8 range, cast to ``fp8_dtype`` (round to nearest)."""
    limit = fp8_max(fp8_dtype)
    return jnp.clip(t.astype(jnp.float32) * scale, -limit, limit).astype(fp8_dtype)


# Output dtypes whose scale multiply is folded into the cuBLASLt FP8 call (see _scaled_dot).
_FOLDED_SCALE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _scaled_dot(a, b, contract, scale_inv, out_dtype):
    """The FP8 GEMM ``(a . b) * scale_inv`` of 2-D FP8 operands, in ``out_dtype``.

    a: (M, Ka) and b: (Kb, N)-like 2-D FP8 arrays contracted over ``contract``
    (``((a_dim,), (b_dim,))``); scale_inv: float32 scalar. Returns the 2-D result.

    Written in the form XLA's GPU gemm rewriter (gemm_rewriter.cc) turns into ONE
    cuBLASLt FP8 matmul (``__cublas$lt$matmul$f8``) writing ``out_dtype`` directly:
    a 2-D ``dot_general`` of the FP8 operands themselves (``MatchFp8Param``'s "directly
    operating on an FP8 operand" case; one contracting and one non-contracting dim each,
    as ``CreateF8CustomCall`` requires, so batch dims are flattened by the caller) whose
    result type is ``out_dtype`` (a supported D type: bf16, f16, f32), then a multiply by
    a broadcast scalar of that dtype, which ``HandleMultiply`` -> ``F8ScaleD`` folds into
    the call's A scale. cuBLASLt then scales the float32 accumulator and rounds once to
    ``out_dtype``: no float32 result is written and read back, no separate scaling pass.
    The scale is rounded to ``out_dtype`` first (bf16: relative 2**-9, far below the FP8
    rounding of the operands). float16 results keep the float32 route: a product of two
    scale_invs can underflow float16.
    """
    dn = (contract, ((), ()))
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype in _FOLDED_SCALE_DTYPES:
        acc = jax.lax.dot_general(a, b, dn, preferred_element_type=out_dtype)
        return acc * scale_inv.astype(out_dtype)
    acc = jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)
    return (acc * scale_inv).astype(out_dtype)


def _rows(t):
    """(..., K) -> (M, K): the leading dims flattened (a bitcast on FP8 data)."""
    return t.reshape(-1, t.shape[-1])


def _split_gemms(aq, wq_t, splits, scale_inv, dtype, lead):
    """aq (M, K) times each of the ``splits`` column blocks of w, read from its transposed
    FP8 copy wq_t (N, K): a tuple of (*lead, N / splits) results in ``dtype``."""
    n = wq_t.shape[0] // splits
    # One operand per GEMM: XLA's dot merger would otherwise merge GEMMs sharing aq back
    # into one, whose result slices cost full activation copies.
    aqs = jax.lax.optimization_barrier((aq,) * splits) if splits > 1 else (aq,)
    return tuple(_scaled_dot(a, wq_t[i * n:(i + 1) * n], ((1,), (1,)), scale_inv, dtype).reshape(*lead, n)
                 for i, a in enumerate(aqs))


def _joined(g):
    """The output gradient of `_split_gemms`' results as one (..., N) array (a
    concatenation XLA fuses into the pass that reads it)."""
    return g[0] if len(g) == 1 else jnp.concatenate(g, axis=-1)


@custom_vmap
def _amax(t, like_scale):
    """max |t| as a float32 scalar; ``like_scale`` (the meta's scale) only tells the
    vmap rule whether the meta is mapped."""
    del like_scale
    return jnp.max(jnp.abs(t)).astype(jnp.float32)


@_amax.def_vmap
def _amax_vmap(axis_size, in_batched, t, like_scale):
    # A shared (unmapped) meta sees one amax over the whole mapped batch, so its
    # update is one observation instead of axis_size observations that would be summed.
    t_batched, meta_batched = in_batched
    if not meta_batched:
        return jnp.max(jnp.abs(t)).astype(jnp.float32), False
    if t_batched:
        return jnp.max(jnp.abs(t), axis=tuple(range(1, t.ndim))).astype(jnp.float32), True
    return jnp.broadcast_to(jnp.max(jnp.abs(t)).astype(jnp.float32), (axis_size,)), True


def _mesh_max(amax, axes):
    """amax max-reduced over the mesh axes ``axes`` (inside shard_map), so every replica
    scales by the same numbers."""
    if not axes:
        return amax
    # pmax takes only axes the value varies over; an amax invariant over some of them
    # (a replicated weight) is marked varying first, so that one reduction serves all.
    invariant = tuple(a for a in axes if a not in _varying_axes(amax))
    if invariant:
        amax = jax.lax.pcast(amax, invariant, to="varying")
    return jax.lax.pmax(amax, axes)


def _reduced_amax(t, like_scale, axes):
    """amax of t, max-reduced over the mesh axes ``axes`` (inside shard_map)."""
    return _mesh_max(_amax(jax.lax.stop_gradient(t), jax.lax.stop_gradient(like_scale)), axes)


def _weight_copies(op, w, meta, dm, recipe, axes) -> WeightCopies:
    """The FP8 copies of w (K, N) that one call's GEMMs read, with w's observed amax:
    cast now (and, where ``meta`` is an `FP8DotMeta` in "fill" mode, kept in its
    weight cache), or read from that cache in "reuse" mode. Computed outside the GEMMs'
    custom_vjp so that the three modes run the same GEMMs on the same numbers."""
    mode = meta.weight_cache_mode if isinstance(meta, FP8DotMeta) else None
    if mode == CACHE_REUSE:
        return _cached_copies(op, w, meta, recipe)
    w, scale = jax.lax.stop_gradient((w, dm.scale))
    # The barrier makes the transpose read the FP8 copy: XLA would otherwise fuse a
    # second cast of w into it.
    wq = jax.lax.optimization_barrier(_quantize(w, scale[WEIGHT], recipe.forward_dtype))
    copies = WeightCopies(wq, wq.T, _reduced_amax(w, scale, axes))
    if mode == CACHE_FILL:
        # A new variable, not set_metadata: nnx.jit carries a replaced variable out
        # with its metadata, but not a metadata change of the one it was given.
        meta.weight_cache = FP8WeightCache(copies, recipe=recipe)
    return copies


def _cached_copies(op, w, meta: FP8DotMeta, recipe) -> WeightCopies:
    """The weight copies an `FP8DotMeta` in "reuse" mode holds, checked against this call."""
    copies = meta.weight_cache.get_value()
    if copies is None:
        raise ValueError(f"{op}: the FP8 weight cache is to be reused but was never filled; run the first "
                         f"micro-batch of each optimizer step with fp8.cache_weights(model, True) and the "
                         f"later ones with fp8.cache_weights(model, False)")
    filled_for = meta.weight_cache.get_metadata().get("recipe")
    if filled_for != recipe:
        raise ValueError(f"{op}: the FP8 weight cache was filled for recipe {filled_for}, this "
                         f"call uses {recipe}; refill it (fp8.cache_weights(model, True)) with this recipe")
    expected = (tuple(w.shape), tuple(w.shape[::-1]), (), recipe.forward_dtype)
    got = (tuple(copies.wq.shape), tuple(copies.wq_t.shape), tuple(copies.amax.shape), jnp.dtype(copies.wq.dtype))
    if got != expected:
        raise ValueError(f"{op}: the FP8 weight cache holds {got[3]} copies of a weight of shape {got[0]}, "
                         f"this call's w has shape {tuple(w.shape)} and the recipe casts weights to "
                         f"{expected[3]}; refill it (fp8.cache_weights(model, True)) for this weight")
    return copies


def _backward_gemms(gq, gq_t, hq, hq_t, wq, dm, h_dtype, w_dtype):
    """dgrad (M, N) x (K, N) -> (M, K) and wgrad (K, N) of one GEMM ``h @ w``.

    The wgrad reads the transposed copies where a kernel wrote them: hq_t (K, M) and
    gq_t (N, M), K-major as Hopper's FP8 GEMMs take them; XLA transposes hq (M, K) or
    gq (M, N) where they are None.
    """
    dh = _scaled_dot(gq, wq, ((1,), (1,)), dm.scale_inv[GRAD_OUTPUT] * dm.scale_inv[WEIGHT], h_dtype)
    a, a_dim = (hq, 0) if hq_t is None else (hq_t, 1)
    b, b_dim = (gq, 0) if gq_t is None else (gq_t, 1)
    dw = _scaled_dot(a, b, ((a_dim,), (b_dim,)), dm.scale_inv[INPUT] * dm.scale_inv[GRAD_OUTPUT], w_dtype)
    return dh, dw


@jax.custom_jvp
def _first_order_only(tree):
    return tree


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError(f"{OP}: second-order derivatives are not supported (the backward "
                              f"pass quantizes to FP8, which has no useful derivative)")


# w enters for its gradient only: the GEMMs read its FP8 copies ``wc`` (`WeightCopies`,
# made by `_weight_copies`), whose cotangent is zero.
@partial(fused_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5), op="fp8_dot",
         plain='jnp.dot(x, w) in the compute dtype')
def _fp8_dot(recipe, dtype, axes, x_dtype, w_dtype, splits, x, w, wc, dm):
    return _fp8_dot_fwd(recipe, dtype, axes, x_dtype, w_dtype, splits, x, w, wc, dm)[0]


def _fp8_dot_fwd(recipe, dtype, axes, x_dtype, w_dtype, splits, x, w, wc, dm):
    x, w, wc, dm = _first_order_only((x, w, wc, dm))
    amax_x = _reduced_amax(x, dm.scale, axes)
    xq = _quantize(x, dm.scale[INPUT], recipe.forward_dtype)
    ys = _split_gemms(_rows(xq), wc.wq_t, splits, dm.scale_inv[INPUT] * dm.scale_inv[WEIGHT], dtype,
                      x.shape[:-1])
    return ys, (xq, wc.wq, dm, amax_x, wc.amax)


def _fp8_dot_bwd(recipe, dtype, axes, x_dtype, w_dtype, splits, residuals, g):
    g, residuals = _first_order_only((g, residuals))
    xq, wq, dm, amax_x, amax_w = residuals
    g = _joined(g)
    amax_g = _reduced_amax(g, dm.scale, axes)
    gq = _rows(_quantize(g, dm.scale[GRAD_OUTPUT], recipe.backward_dtype))
    dx, dw = _backward_gemms(gq, None, _rows(xq), None, wq, dm, x_dtype, w_dtype)
    d_meta = DotMeta.observation(jnp.stack([amax_x, amax_w, amax_g], axis=-1), dm)
    return dx.reshape(xq.shape), dw, None, d_meta


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd, optimize_remat=True)
