"""Token-level classification loss over the fused ``cross_entropy`` op."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_ls2.nn import _ops_compat as ops


class CrossEntropyCriterion(nnx.Module):
    """Label-smoothed cross entropy with an ignore index, averaged over counted tokens.

    Smoothed loss per token: ``(1 - eps) * nll + eps * (logsumexp - mean(logits))``.
    ``__call__(logits, labels)``: logits (..., vocab) any float dtype, labels int (...)
    -> (mean fp32 loss, fp32 number of counted tokens).
    ``linear(hidden, weight, labels, bias=None)``: the same loss of ``hidden @ weight.T
    + bias`` without materialising the logits (hidden (..., h), weight (vocab, h), bias
    (vocab,), one dtype).
    """

    def __init__(self, *, label_smoothing: float = 0.0, ignore_index: int | None = None,
                 z_loss: float = 0.0):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"CrossEntropyCriterion: label_smoothing must be in [0, 1), "
                             f"got {label_smoothing}")
        self.label_smoothing, self.ignore_index = float(label_smoothing), ignore_index
        self.z_loss = float(z_loss)

    def __call__(self, logits, labels):
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"CrossEntropyCriterion: labels must have shape {logits.shape[:-1]}, "
                             f"got {tuple(labels.shape)}")
        # reduction="mean": the logits' gradient is formed in the loss's own pass.
        loss, count = ops.cross_entropy(logits, labels, label_smoothing=self.label_smoothing,
                                        ignore_index=self.ignore_index, z_loss=self.z_loss,
                                        reduction="mean")
        return loss, jnp.asarray(count, jnp.float32)

    def linear(self, hidden, weight, labels, bias=None):
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"CrossEntropyCriterion.linear: labels must have shape {hidden.shape[:-1]}, "
                             f"got {tuple(labels.shape)}")
        loss, count = ops.linear_cross_entropy(hidden, weight, labels, bias=bias,
                                               label_smoothing=self.label_smoothing,
                                               ignore_index=self.ignore_index, z_loss=self.z_loss,
                                               reduction="mean")
        return loss, jnp.asarray(count, jnp.float32)
