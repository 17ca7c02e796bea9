"""The one choice of attention backend, used by every caller (the layers, the decoder
layer, decoding, the ring, the pipeline stages).

Backends:

* ``"cudnn"``: cuDNN fused attention through ``jax.nn.dot_product_attention``; no
  attention dropout, no segment ids, no decode-cache mask.
* ``"fused"``: ``q k^T`` GEMM, the jax_ls2 fused ``softmax_dropout`` op, ``p v`` GEMM.
* ``"xla"``: the XLA reference (``jax.nn.dot_product_attention(implementation="xla")``
  without dropout; with it the same GEMMs as ``"fused"`` around a pure-jnp softmax and
  the shared dropout mask, so ``"xla"`` and ``"fused"`` draw identical masks).
* ``"flash"``: ``jax_ls2.ops.flash_attention`` (tiled; padding masks, causal, segment
  ids, an additive bias, grouped-query heads and dropout inside, with its own mask
  numbering, so its masks are not the ``"fused"`` / ``"xla"`` ones).

``"auto"`` picks, by the first row that holds:

=====================================================================  =========
the call                                                               backend
=====================================================================  =========
decoding on a KV cache (a cache mask), no active attention dropout     ``xla``
cuDNN takes it (see `cudnn_applies`), no dropout, no segment ids       ``cudnn``
segment ids, a cache mask, or grouped-query heads (kv_heads < heads)   ``flash``
active attention dropout                                               ``fused``
otherwise                                                              ``xla``
=====================================================================  =========

The sequence axis (ring attention) always runs flash blocks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "cudnn", "fused", "xla", "flash")


def cudnn_applies(q_len: int, k_len: int, head_dim: int, dtype) -> bool:
    """Whether cuDNN fused attention takes this problem (conservative): a GPU, fp16 or
    bf16, head_dim a multiple of 8 up to 128, both lengths multiples of 64."""
    return (jax.default_backend() == "gpu"
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim % 8 == 0 and head_dim <= 128
            and q_len % 64 == 0 and k_len % 64 == 0)


def select_backend(requested: str, *, dropout_active: bool, q_len: int, k_len: int, head_dim: int, dtype,
                   grouped: bool = False, segments: bool = False, cache_mask: bool = False,
                   owner: str = "attention") -> str:
    """The backend that runs: ``requested`` unless "auto" (the table of the module
    docstring). ``grouped``: fewer kv heads than query heads; ``segments``: segment ids
    given; ``cache_mask``: decoding on a KV cache. Raises ValueError naming ``owner``
    where the requested backend cannot take the call."""
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "cudnn":
        if dropout_active:
            raise ValueError("attention_backend='cudnn' has no attention-probability dropout; use "
                             "'fused' or 'auto', or set attn_dropout=0 / deterministic=True")
        if segments or cache_mask or not cudnn_applies(q_len, k_len, head_dim, dtype):
            raise ValueError(f"{owner}: attention_backend='cudnn' does not take this call (it needs a GPU, "
                             "fp16/bf16, head_dim a multiple of 8 up to 128, lengths multiples of 64, no attention "
                             f"dropout, no segment ids, no decoding); got lengths {q_len}/{k_len}, head_dim "
                             f"{head_dim}, dtype {jnp.dtype(dtype).name}, segment ids {segments}, decoding "
                             f"{cache_mask}")
    if (requested == "fused" or (requested == "xla" and dropout_active)) and (segments or cache_mask):
        raise ValueError(f"{owner}: attention_backend={requested!r}" + (" with attention dropout" * dropout_active)
                         + " takes no segment ids and no decode cache; use 'flash' or 'auto'")
    if requested != "auto":
        return requested
    if cache_mask and not dropout_active:
        return "xla"
    if not (dropout_active or segments or cache_mask) and cudnn_applies(q_len, k_len, head_dim, dtype):
        return "cudnn"
    if segments or cache_mask or grouped:
        return "flash"
    return "fused" if dropout_active else "xla"


def explicit_gemm_path(requested: str, *, dropout_active: bool, q_len: int, k_len: int,
                       head_dim: int, dtype) -> bool:
    """Whether attention runs as two XLA GEMMs around a softmax (the "fused" backend, or
    "xla" with dropout) rather than one fused attention call: the case where the
    sequence-first layout spares XLA the transposes around the GEMMs."""
    impl = select_backend(requested, dropout_active=dropout_active, q_len=q_len, k_len=k_len,
                          head_dim=head_dim, dtype=dtype)
    return impl == "fused" or (impl == "xla" and dropout_active)
