"""Fused softmax cross entropy, and the output projection fused with it.

Label smoothing convention (the one of ``optax.smooth_labels``): with smoothing
``eps`` over a vocabulary of ``V`` classes the target distribution is
``(1 - eps) * onehot(label) + eps / V`` (the true class keeps ``1 - eps + eps / V``),
so the per-token loss is

    (1 - eps) * (lse - x[label]) + eps * (lse - mean(x)) + z_loss * lse**2,

``lse = logsumexp(x)``; with ``z_loss = 0`` it equals
``optax.softmax_cross_entropy(x, optax.smooth_labels(one_hot(label, V), eps))``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2._dispatch import PARAM, ROWS, FusedKernel, Role, match_varying, result_type
from jax_ls2._dispatch import fused_vjp
from jax_ls2.ops import _checks

F32 = jnp.float32
_REDUCTIONS = (None, "none", "sum", "mean")


# ---------------------------------------------------------------- reference math
def _stats(logits):
    x = logits.astype(F32)
    lse = jax.nn.logsumexp(x, axis=-1)
    return x, lse


def _masks(labels, vocab, ignore_index, has_ignore):
    ignored = (labels == ignore_index) if has_ignore else jnp.zeros(labels.shape, bool)
    valid = (labels >= 0) & (labels < vocab)
    return ignored, valid


def _loss_of(x, lse, labels, smoothing, z_loss, ignore_index, has_ignore):
    vocab = x.shape[-1]
    ignored, valid = _masks(labels, vocab, ignore_index, has_ignore)
    safe = jnp.where(valid, labels, 0).astype(jnp.int32)
    picked = jnp.take_along_axis(x, safe[..., None], axis=-1)[..., 0]
    loss = lse - (1.0 - smoothing) * picked + z_loss * lse * lse
    if smoothing:  # left out, not multiplied by 0: a -inf logit (a masked class) makes it NaN
        loss = loss - smoothing * jnp.mean(x, axis=-1)
    loss = jnp.where(valid, loss, jnp.nan)
    return jnp.where(ignored, 0.0, loss)


def _grad_of(x, lse, labels, scale, smoothing, z_loss, ignore_index, has_ignore, dtype):
    vocab = x.shape[-1]
    ignored, valid = _masks(labels, vocab, ignore_index, has_ignore)
    p = jnp.exp(x - lse[..., None])
    onehot = jnp.arange(vocab, dtype=jnp.int32) == labels[..., None].astype(jnp.int32)
    target = (1.0 - smoothing) * onehot + smoothing / vocab
    s = jnp.where(valid, scale, jnp.nan)
    g = s[..., None] * (p * (1.0 + 2.0 * z_loss * lse)[..., None] - target)
    return jnp.where(ignored[..., None], 0.0, g).astype(dtype)


def _fwd_reference(logits, labels, *, smoothing, z_loss, ignore_index, has_ignore):
    x, lse = _stats(logits)
    return (_loss_of(x, lse, labels, smoothing, z_loss, ignore_index, has_ignore),)


def _fwd_grad_reference(logits, labels, scale, *, smoothing, z_loss, ignore_index, has_ignore,
                        valid_vocab=0):
    # valid_vocab > 0: only the first valid_vocab columns are logits; the rest is padding
    # whose gradient is 0.
    width = logits.shape[-1]
    if valid_vocab:
        logits = logits[..., :valid_vocab]
    x, lse = _stats(logits)
    loss = _loss_of(x, lse, labels, smoothing, z_loss, ignore_index, has_ignore)
    s = jnp.broadcast_to(scale.astype(F32), labels.shape)
    g = _grad_of(x, lse, labels, s, smoothing, z_loss, ignore_index, has_ignore, logits.dtype)
    if g.shape[-1] != width:
        g = jnp.pad(g, [(0, 0)] * (g.ndim - 1) + [(0, width - g.shape[-1])])
    return loss, g


def _bwd_reference(logits, labels, dloss, *, smoothing, z_loss, ignore_index, has_ignore):
    x, lse = _stats(logits)
    return (_grad_of(x, lse, labels, dloss.astype(F32), smoothing, z_loss, ignore_index, has_ignore,
                     logits.dtype),)


def _scale_reference(g, scale):
    return ((g.astype(F32) * scale.astype(F32)).astype(g.dtype),)


# ---------------------------------------------------------------- CUDA calls
def _attrs(*arrays, smoothing, z_loss, ignore_index, has_ignore):
    return dict(smoothing=np.float32(smoothing), z_loss=np.float32(z_loss),
                ignore_index=np.int64(ignore_index), has_ignore=bool(has_ignore))


def _loss_grad_attrs(*arrays, valid_vocab=0, **static):
    return dict(_attrs(**static), valid_vocab=np.int64(valid_vocab))


def _loss_types(logits, labels, *arrays, **static):
    return (result_type(logits, labels.shape, F32),)


def _loss_grad_types(logits, labels, *arrays, **static):
    return result_type(logits, labels.shape, F32), result_type(logits)


def _grad_types(logits, *arrays, **static):
    return (result_type(logits),)


_X, _Y, _P = Role(ROWS, 1), Role(ROWS, 0), Role(PARAM)
_FWD = FusedKernel("jax_ls2_cross_entropy_fwd", _fwd_reference, operands=(_X, _Y), results=(_Y,),
                   result_types=_loss_types, attrs=_attrs, vmap_method="broadcast_all")
_FWD_GRAD = FusedKernel("jax_ls2_cross_entropy_fwd_grad", _fwd_grad_reference, operands=(_X, _Y, _P),
                        results=(_Y, _X), result_types=_loss_grad_types, attrs=_loss_grad_attrs,
                        vmap_method="sequential")
_BWD = FusedKernel("jax_ls2_cross_entropy_bwd", _bwd_reference, operands=(_X, _Y, _Y), results=(_X,),
                   result_types=_grad_types, attrs=_attrs, vmap_method="broadcast_all")
# In place: the gradient buffer is multiplied by the cotangent.
_SCALE = FusedKernel("jax_ls2_cross_entropy_scale", _scale_reference, operands=(_X, _P), results=(_X,),
                     result_types=_grad_types, vmap_method="sequential", input_output_aliases={0: 0})


# ---------------------------------------------------------------- custom_vjp
# cfg = (smoothing, z_loss, ignore_index, has_ignore), hashable and static.
def _static(cfg):
    s, z, ii, hi = cfg
    return dict(smoothing=s, z_loss=z, ignore_index=ii, has_ignore=hi)


@functools.partial(fused_vjp, nondiff_argnums=(2,), op="cross_entropy",
                   plain='optax.softmax_cross_entropy_with_integer_labels(logits, labels)')
def _ce_tokens(logits, labels, cfg):
    return _FWD(logits, labels, **_static(cfg))[0]


def _ce_tokens_fwd(logits, labels, cfg):
    return _FWD(logits, labels, **_static(cfg))[0], (logits, labels)


def _ce_tokens_bwd(cfg, res, dloss):
    logits, labels = res
    return _BWD(logits, labels, dloss.astype(F32), **_static(cfg))[0], None


_ce_tokens.defvjp(_ce_tokens_fwd, _ce_tokens_bwd, optimize_remat=True)


@functools.partial(fused_vjp, nondiff_argnums=(3,), op="cross_entropy",
                   plain='optax.softmax_cross_entropy_with_integer_labels(logits, labels)')
def _ce_reduced(logits, labels, scale, cfg):
    loss = _FWD(logits, labels, **_static(cfg))[0]
    return jnp.sum(loss) * scale


def _ce_reduced_fwd(logits, labels, scale, cfg):
    # The gradient (already multiplied by `scale`) is formed in the same pass as the loss
    # and kept instead of the logits.
    loss, g = _FWD_GRAD(logits, labels, scale, **_static(cfg))
    return jnp.sum(loss) * scale, (g,)


def _ce_reduced_bwd(cfg, res, ct):
    (g,) = res
    # In place; a unit cotangent reads and writes nothing on the GPU.
    return _SCALE(g, jnp.asarray(ct, F32))[0], None, None


_ce_reduced.defvjp(_ce_reduced_fwd, _ce_reduced_bwd, optimize_remat=True)


# ---------------------------------------------------------------- validation
def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_common(op, vocab, labels, label_smoothing, ignore_index, z_loss, reduction):
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"{op}: label_smoothing must be a Python float in [0, 1), got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or not float(z_loss) >= 0.0:
        raise ValueError(f"{op}: z_loss must be a Python float >= 0, got {z_loss!r}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer))):
        raise TypeError(f"{op}: ignore_index must be a Python int or None, got {type(ignore_index).__name__}")
    if ignore_index is not None and not -2**31 <= int(ignore_index) < 2**31:
        raise ValueError(f"{op}: ignore_index must fit in int32, got {ignore_index}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of None, 'none', 'sum', 'mean', got {reduction!r}")
    if not 1 <= vocab < 2**31:
        raise ValueError(f"{op}: the vocabulary (last axis) must have 1 <= size < 2**31, got {vocab}")
    if _is_concrete(labels) and labels.size:
        lab = np.asarray(labels)
        bad = (lab < 0) | (lab >= vocab)
        if ignore_index is not None:
            bad &= lab != int(ignore_index)
        if bad.any():
            v = lab[bad].reshape(-1)[0]
            raise ValueError(f"{op}: labels must be in [0, {vocab}) or equal ignore_index "
                             f"({ignore_index}), got {v}")


def _count(labels, ignore_index):
    if ignore_index is None:
        return jnp.asarray(labels.size, jnp.int32)
    return jnp.sum(labels != ignore_index, dtype=jnp.int32)


def _check_weights(op, weights, shape):
    _checks.check_array(op, "weights", weights, dtypes=None)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"{op}: weights must have a floating dtype, got {weights.dtype}")
    _checks.check_shape(op, "weights", weights, shape)


def _weight_sum(weights, labels, ignore_index):
    """float32 sum of the weights of the counted (not ignored) tokens."""
    w = weights.astype(F32)
    if ignore_index is not None:
        w = jnp.where(labels != ignore_index, w, 0.0)
    return jnp.sum(w)


def _mean_scale(count):
    """1 / count, or 1 where nothing is counted (the sum is then 0 too)."""
    count = count.astype(F32)
    return 1.0 / jnp.where(count != 0, count, 1.0)


def cross_entropy(logits, labels, *, weights=None, label_smoothing: float = 0.0, ignore_index: int | None = None,
                  z_loss: float = 0.0, reduction: str | None = None):
    """Softmax cross entropy with integer labels, log-softmax and NLL fused.

    Args:
      logits: ``(..., vocab)`` float32, float16 or bfloat16 (vocab any size >= 1).
      labels: ``(...)`` integer, in ``[0, vocab)`` or equal to ``ignore_index``.
        Concrete labels are checked (``ValueError``); under tracing a label outside
        the range (and not ignored) gives a NaN loss and a NaN gradient row. Wider
        integers (int64 under x64) are clamped to int32's range, never wrapped, so
        a huge label stays out of range.
      weights: optional ``labels.shape`` floating per-token weights, multiplying each
        token's loss and so its gradient (their own gradient is the token's loss).
        ``"sum"`` is then the weighted sum and ``"mean"`` the weighted sum divided by
        the sum of the counted tokens' weights (as torch's ``CrossEntropyLoss`` does
        with class weights); ``count`` becomes that float32 sum.
      label_smoothing: ``eps`` in ``[0, 1)``; target ``(1 - eps) * onehot + eps / vocab``
        (``optax.smooth_labels``'s convention, see the module docstring).
      ignore_index: tokens with this label contribute nothing to the loss, the count
        or the gradient.
      z_loss: adds ``z_loss * logsumexp(logits)**2`` per counted token.
      reduction: ``None``/``"none"``: per-token loss; ``"sum"``: its sum; ``"mean"``:
        its sum divided by ``max(count, 1)`` (an all-ignored batch gives 0).

    Returns:
      ``(loss, count)``: ``loss`` float32 of shape ``labels.shape`` (or a scalar when
      reduced), 0 for ignored tokens; ``count`` the int32 number of counted tokens
      (with ``weights``, the float32 sum of their weights).

    Statistics (max, log-sum-exp) and the loss are float32. The gradient is
    ``(softmax - target) * dloss`` in the logits dtype, never an fp32 copy of the
    logits. Per token, the forward keeps the logits and the backward re-reads them
    (one kernel, read logits + write gradient). Reduced, the gradient is formed in
    the forward kernel itself and kept instead of the logits; the backward multiplies
    it by the cotangent in place (skipped when the cotangent is 1), so a training step
    reads the logits once and writes the gradient once. With ``weights`` every
    reduction takes the per-token path (the backward re-reads the logits).
    """
    op = "cross_entropy"
    _checks.check_array(op, "logits", logits, min_ndim=1)
    _checks.check_array(op, "labels", labels, dtypes=None)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{op}: labels must have an integer dtype, got {labels.dtype}")
    _checks.check_shape(op, "labels", labels, logits.shape[:-1])
    vocab = logits.shape[-1]
    _check_common(op, vocab, labels, label_smoothing, ignore_index, z_loss, reduction)
    cfg = (float(label_smoothing), float(z_loss), int(ignore_index or 0), ignore_index is not None)
    if weights is not None:
        _check_weights(op, weights, labels.shape)
    labels = _checks.clamp_to_int32(labels)
    if weights is not None:
        count = _weight_sum(weights, labels, ignore_index)
        loss = _ce_tokens(logits, labels, cfg) * weights.astype(F32)
        if reduction in (None, "none"):
            return loss, count
        return jnp.sum(loss) * (_mean_scale(count) if reduction == "mean" else 1.0), count
    count = _count(labels, ignore_index)
    if reduction in (None, "none"):
        return _ce_tokens(logits, labels, cfg), count
    scale = (1.0 / jnp.maximum(count, 1).astype(F32)) if reduction == "mean" else jnp.ones((), F32)
    return _ce_reduced(logits, labels, scale, cfg), count


# ---------------------------------------------------------------- linear + cross entropy
_VOCAB_ALIGN = 64


def _default_chunk(n, vocab):
    # About 2**27 logits (256 MiB in bf16) per chunk, a multiple of 128 tokens; among
    # those of at least half that size, one that divides n, so no token is padded.
    c = max(1, (1 << 27) // max(vocab, 1))
    if c >= 128:
        c = c // 128 * 128
        for d in range(c, c // 2 - 1, -128):
            if n % d == 0:
                return d
    return max(1, min(n, c))


def _logits(h, weight, bias):
    z = jax.lax.dot_general(h, weight, (((1,), (1,)), ((), ())))
    if bias is not None:
        z = z + bias.astype(z.dtype)
    return z


def _lce_loss_only(h, weight, bias, labels, token_weights, scale, cfg):
    def body(total, xs):
        h_c, y_c, w_c = xs
        loss = _FWD(_logits(h_c, weight, bias), y_c, **_static(cfg))[0]
        if w_c is not None:
            loss = loss * w_c
        return total + jnp.sum(loss), None

    (total,) = match_varying(h, jnp.zeros((), F32))[1:]  # the carry varies as h does under shard_map
    total, _ = jax.lax.scan(body, total, (h, labels, token_weights))
    return total * scale


@functools.partial(fused_vjp, nondiff_argnums=(6, 7), op="linear_cross_entropy",
                   plain='optax.softmax_cross_entropy_with_integer_labels(hidden @ weight + bias, labels)')
def _lce(h, weight, bias, labels, token_weights, scale, cfg, dtypes):
    return _lce_loss_only(h, weight, bias, labels, token_weights, scale, cfg)


def _lce_fwd(h, weight, bias, labels, token_weights, scale, cfg, dtypes):
    # h: (chunks, chunk, hidden); labels, token_weights: (chunks, chunk). Per chunk:
    # logits (chunk, vocab) by XLA, loss and dlogits (already times `scale`) by the
    # fused kernel, then dh = dlogits @ W and dW += dlogits^T @ h (fp32) by XLA; the
    # logits of one chunk are all that exist at a time. Token weights scale the rows of
    # dh and of h in dW (hidden-sized work), never the (chunk, vocab) dlogits.
    vocab, hidden = weight.shape
    # The vocabulary is padded to a multiple of 64 with zero rows (and the kernel told to
    # ignore the padding): odd widths such as 50257 leave the GEMMs' leading dimensions
    # misaligned, which makes XLA pad or pick slower GEMM kernels in every chunk.
    padded = -(-vocab // _VOCAB_ALIGN) * _VOCAB_ALIGN
    valid = vocab if padded != vocab else 0
    if valid:
        weight = jnp.pad(weight, ((0, padded - vocab), (0, 0)))
        bias = None if bias is None else jnp.pad(bias, (0, padded - vocab))

    def body(carry, xs):
        total, dw, db = carry
        h_c, y_c, w_c = xs
        loss, g = _FWD_GRAD(_logits(h_c, weight, bias), y_c, scale, valid_vocab=valid, **_static(cfg))
        dh = jax.lax.dot_general(g, weight, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        rows = h_c
        token_loss = loss
        if w_c is not None:
            loss = loss * w_c
            dh = dh * w_c[:, None]
            rows = (h_c.astype(F32) * w_c[:, None]).astype(h_c.dtype)
        dw = dw + jax.lax.dot_general(g, rows, (((0,), (0,)), ((), ())), preferred_element_type=F32)
        if db is not None:
            gf = g.astype(F32)
            # An elementwise product, not w_c @ g: a GEMM would run in TF32 on the GPU.
            db = db + jnp.sum(gf if w_c is None else gf * w_c[:, None], axis=0)
        return (total + jnp.sum(loss), dw, db), (dh.astype(h.dtype), token_loss)

    init = (jnp.zeros((), F32), jnp.zeros((padded, hidden), F32),
            None if bias is None else jnp.zeros((padded,), F32))
    init = match_varying(h, *init)[1:]  # the carries vary as h does under shard_map
    (total, dw, db), (dh, token_loss) = jax.lax.scan(body, init, (h, labels, token_weights))
    dw = dw[:vocab]
    db = None if db is None else db[:vocab]
    if token_weights is None:
        token_loss = None
    return total * scale, (dh, dw, db, token_loss, total, scale)


def _lce_bwd(cfg, dtypes, res, ct):
    # The loss is scale * sum(token_weights * token_loss): the gradients of h, W and b
    # (formed in the forward, already times scale) times ct, and those of the token
    # weights and of scale (a function of the weights for "mean") from the saved sums.
    dh, dw, db, token_loss, total, scale = res
    ct = jnp.asarray(ct, F32)
    dh = (dh.astype(F32) * ct).astype(dh.dtype)
    dw = (dw * ct).astype(dtypes)
    db = None if db is None else (db * ct).astype(dtypes)
    dweights = None if token_loss is None else token_loss * (ct * scale)
    return dh, dw, db, None, dweights, ct * total


_lce.defvjp(_lce_fwd, _lce_bwd, optimize_remat=True)


def linear_cross_entropy(hidden, weight, labels, *, bias=None, weights=None, label_smoothing: float = 0.0,
                         ignore_index: int | None = None, chunk_size: int | None = None,
                         z_loss: float = 0.0, reduction: str = "mean"):
    """``cross_entropy(hidden @ weight.T + bias, labels)`` without the whole logits.

    Args:
      hidden: ``(..., hidden)`` float32, float16 or bfloat16.
      weight: ``(vocab, hidden)`` in ``hidden.dtype`` (the output projection / tied
        embedding table).
      labels: ``(...)`` integer, as for `cross_entropy`.
      bias: optional ``(vocab,)`` in ``hidden.dtype``.
      weights: optional per-token weights, as for `cross_entropy`. They scale rows
        of ``dhidden`` and of ``hidden`` in the ``dweight`` GEMM (``hidden * weights``
        rounded to ``hidden.dtype``), never the logits' gradient.
      label_smoothing, ignore_index, z_loss: as for `cross_entropy`. With
        ``ignore_index=None`` no label is ignored: every token is counted, and a
        traced label outside ``[0, vocab)`` (-1 included) gives a NaN loss.
      chunk_size: tokens per chunk (default: about 2**27 logits per chunk, a multiple
        of 128 tokens). Tokens are padded up to a multiple of it (padding is ignored).
      reduction: ``"mean"`` (over counted tokens; 0 for an all-ignored batch) or ``"sum"``.

    Returns:
      ``(loss, count)``: float32 scalar loss and the int32 number of counted tokens
      (with ``weights``, the float32 sum of their weights).

    Per chunk of tokens the logits ``(chunk, vocab)`` are formed by an XLA GEMM
    (in ``hidden.dtype``, fp32 accumulation), the fused cross-entropy kernel gives the
    loss and the logits' gradient, and XLA GEMMs give ``dhidden`` for the chunk and add
    the chunk's ``dweight`` to an fp32 accumulator. So the gradients are computed in
    the forward pass when the loss is differentiated; the backward pass only scales
    them by the cotangent. Kept for the backward: ``dhidden`` (tokens, hidden) in
    ``hidden.dtype`` and ``dweight`` (vocab, hidden) (and ``dbias``) in float32.
    """
    op = "linear_cross_entropy"
    _checks.check_array(op, "hidden", hidden, min_ndim=1)
    _checks.check_array(op, "weight", weight, ndim=2)
    _checks.check_array(op, "labels", labels, dtypes=None)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{op}: labels must have an integer dtype, got {labels.dtype}")
    h = hidden.shape[-1]
    vocab = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(f"{op}: weight must have shape (vocab, {h}), got {tuple(weight.shape)}")
    _checks.check_same_dtype(op, "weight", weight, hidden.dtype)
    _checks.check_shape(op, "labels", labels, hidden.shape[:-1])
    if bias is not None:
        _checks.check_array(op, "bias", bias, ndim=1)
        _checks.check_shape(op, "bias", bias, (vocab,))
        _checks.check_same_dtype(op, "bias", bias, hidden.dtype)
    if weights is not None:
        _check_weights(op, weights, labels.shape)
    if reduction not in ("sum", "mean"):
        raise ValueError(f"{op}: reduction must be 'mean' or 'sum', got {reduction!r}")
    _check_common(op, vocab, labels, label_smoothing, ignore_index, z_loss, reduction)
    n = math.prod(labels.shape)
    if chunk_size is None:
        chunk_size = _default_chunk(n, vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int or None, got {chunk_size!r}")
    chunk = int(min(chunk_size, max(n, 1)))
    labels = _checks.clamp_to_int32(labels).reshape(n)
    chunks = max(1, -(-n // chunk))
    pad = chunks * chunk - n
    h2 = hidden.reshape(n, h)
    token_weights = None
    if weights is not None:
        token_weights = weights.astype(F32).reshape(n)
        count = _weight_sum(token_weights, labels, ignore_index)
    else:
        count = _count(labels, ignore_index)
    if ignore_index is not None:
        # Padding rows carry the ignore label.
        cfg = (float(label_smoothing), float(z_loss), int(ignore_index), True)
        pad_label = int(ignore_index)
    else:
        # No label is ignored; padding rows get label 0 and token weight 0.
        cfg = (float(label_smoothing), float(z_loss), 0, False)
        pad_label = 0
        if pad and token_weights is None:
            token_weights = jnp.ones((n,), F32)
    if pad and token_weights is not None:
        token_weights = jnp.pad(token_weights, (0, pad))
    if pad:
        h2 = jnp.pad(h2, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad), constant_values=pad_label)
    h3 = h2.reshape(chunks, chunk, h)
    y2 = labels.reshape(chunks, chunk)
    w2 = None if token_weights is None else token_weights.reshape(chunks, chunk)
    scale = _mean_scale(count) if reduction == "mean" else jnp.ones((), F32)
    # Under shard_map, a replicated weight (and bias) meeting per-device hidden states
    # becomes per-device too; its gradient is summed over the devices (match_varying).
    h3, weight, bias, y2, w2, scale = match_varying(h3, weight, bias, y2, w2, scale)
    loss = _lce(h3, weight, bias, y2, w2, scale, cfg, jnp.dtype(weight.dtype).name)
    return loss, count
