"""Token-level classification loss over the fused ``cross_entropy`` op."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ls2 import ops
from jax_ls2.nn._common import check_sequence_axis, check_tensor_parallel, require_tensor_axis, tensor_axis_size
from jax_ls2.parallel.cross_entropy import vocab_parallel_cross_entropy
from jax_ls2.parallel.mesh import DATA
from jax_ls2.parallel.tensor import bound_axis_size


class CrossEntropyCriterion(nnx.Module):
    """Label-smoothed cross entropy with an ignore index, averaged over counted tokens.

    Smoothed loss per token: ``(1 - eps) * nll + eps * (logsumexp - mean(logits))``.
    ``__call__(logits, labels)``: logits (..., vocab) any float dtype, labels int (...)
    -> (mean fp32 loss, fp32 number of counted tokens).
    ``linear(hidden, weight, labels, bias=None)``: the same loss of ``hidden @ weight.T
    + bias`` without materialising the logits (hidden (..., h), weight (vocab, h), bias
    (vocab,), one dtype).

    ``tensor_axis``: None, or the mesh axis the vocabulary is split over (a
    vocabulary-parallel output head, e.g. ``Embedding(tensor_axis=...)``'s table):
    ``linear`` then takes weight ``(vocab, h)`` and bias split by rows over that axis and
    runs inside ``shard_map`` over it (entered here under ``jit`` with the mesh set):
    each device forms its ``(..., vocab / n)`` logits and
    `jax_ls2.parallel.vocab_parallel_cross_entropy` combines the log-sum-exp across
    devices, never gathering the logits; hidden and labels are taken replicated over the
    axis (a sequence-split hidden is all-gathered). Already inside ``shard_map``, the
    mean is over this device's tokens. An axis of size 1 runs the unsplit op.

    ``sequence_axis``: None, or the mesh axis the sequence (dim 1 of hidden and labels)
    is split over: under ``jit`` with the mesh set, ``linear`` then runs inside
    ``shard_map`` on this device's positions (and batch part, over the mesh's
    ``"data"`` axis where it splits it), where the fused op would gather the sequence,
    and combines the parts' sums and counts, so nothing is gathered; the result is the
    mean over all counted tokens. Not together with ``tensor_axis``.
    """

    def __init__(self, *, label_smoothing: float = 0.0, ignore_index: int | None = None,
                 z_loss: float = 0.0, tensor_axis: str | None = None, sequence_axis: str | None = None):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"CrossEntropyCriterion: label_smoothing must be in [0, 1), "
                             f"got {label_smoothing}")
        self.label_smoothing, self.ignore_index = float(label_smoothing), ignore_index
        self.z_loss = float(z_loss)
        check_tensor_parallel("CrossEntropyCriterion", tensor_axis, False, {})
        self.tensor_axis = tensor_axis
        check_sequence_axis("CrossEntropyCriterion", sequence_axis, "auto")
        self.sequence_axis = sequence_axis

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
        if self.tensor_axis is not None and tensor_axis_size(self.tensor_axis) != 1:
            return self._vocab_parallel(hidden, weight, labels, bias)
        axis = self.sequence_axis
        if axis is not None and bound_axis_size(axis) is None and (tensor_axis_size(axis) or 1) > 1:
            return self._sequence_parallel(hidden, weight, labels, bias)
        loss, count = ops.linear_cross_entropy(hidden, weight, labels, bias=bias,
                                               label_smoothing=self.label_smoothing,
                                               ignore_index=self.ignore_index, z_loss=self.z_loss,
                                               reduction="mean")
        return loss, jnp.asarray(count, jnp.float32)

    def _sequence_parallel(self, hidden, weight, labels, bias):
        """`linear` on sequence parts: each device's mean and count over its positions,
        combined into the mean over all counted tokens."""
        axis = self.sequence_axis
        if hidden.ndim < 2:
            raise ValueError(f"CrossEntropyCriterion.linear: with sequence_axis hidden must be (batch, len, ..., h), "
                             f"got {tuple(hidden.shape)}")
        kw = dict(label_smoothing=self.label_smoothing, ignore_index=self.ignore_index, z_loss=self.z_loss,
                  reduction="mean")

        def local(hidden, weight, labels, *bias):
            loss, count = ops.linear_cross_entropy(hidden, weight, labels, bias=bias[0] if bias else None, **kw)
            count = jnp.asarray(count, jnp.float32)
            total = jax.lax.psum(jnp.where(count > 0, loss * count, 0.0), axis)
            count = jax.lax.psum(count, axis)
            return total / jnp.maximum(count, 1.0), count
        # Every mesh axis manual (the fused op's partitioning rule does not take a
        # partly manual mesh), the batch over the data axis where the mesh splits it.
        mesh = jax.sharding.get_abstract_mesh()
        data = DATA if DATA != axis and mesh.shape.get(DATA, 1) > 1 else None
        split = P(data, axis)
        args = (hidden, weight, labels) + (() if bias is None else (bias,))
        specs = (split, P(), split) + (() if bias is None else (P(),))

        def whole(hidden, weight, labels, *bias):
            loss, count = local(hidden, weight, labels, *bias)
            if data is None:
                return loss, count
            total = jax.lax.psum(loss * count, data)
            count = jax.lax.psum(count, data)
            return total / jnp.maximum(count, 1.0), count
        return jax.shard_map(whole, in_specs=specs, out_specs=(P(), P()))(*args)

    def _vocab_parallel(self, hidden, weight, labels, bias):
        axis = self.tensor_axis
        require_tensor_axis("CrossEntropyCriterion", axis, {"vocab (weight rows)": weight.shape[0]})
        if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"CrossEntropyCriterion.linear: weight must have shape (vocab, {hidden.shape[-1]}), "
                             f"got {tuple(weight.shape)}")
        kw = dict(label_smoothing=self.label_smoothing, ignore_index=self.ignore_index, z_loss=self.z_loss,
                  reduction="mean")

        def local(hidden, weight, labels, *bias):
            logits = jnp.dot(hidden, weight.T)
            if bias:
                logits = logits + bias[0]
            return vocab_parallel_cross_entropy(logits, labels, axis, **kw)
        args = (hidden, weight, labels) + (() if bias is None else (bias,))
        if bound_axis_size(axis) is None:
            specs = (P(), P(axis, None), P()) + (() if bias is None else (P(axis),))
            local = jax.shard_map(local, in_specs=specs, out_specs=(P(), P()), axis_names={axis})
        loss, count = local(*args)
        return loss, jnp.asarray(count, jnp.float32)
