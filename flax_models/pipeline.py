"""Pipeline parallelism for the zoo's encoder-stack models (GPT, BERT) and the LLaMA
family (its `jax_ls2.nn.DecoderLayer` list, `PipelinedDecoder`): the layer stack's
layers split into stages over the ``pipe`` mesh axis, micro-batches run through the
GPipe schedule of `jax_ls2.parallel.pipeline`.

``pipeline_model(model, num_microbatches=M)`` replaces the model's
`jax_ls2.nn.TransformerEncoder` (GPT's ``decoder``, BERT's ``encoder``) by a
`PipelinedEncoder` holding the same layers stacked: every layer variable gains a
leading layer dim ``(L, ...)`` partitioned over ``pipe`` (``P("pipe", *its spec)``), so
pipe stage ``s`` of ``S`` holds layers ``[s L / S, (s + 1) L / S)``. Everything else
(embeddings, the final LayerNorm, the output head and the loss) stays as it is,
replicated over ``pipe``: every stage computes it, on the pipeline's output, which a
``psum`` over ``pipe`` gives to all of them. Tensor parallelism (and Megatron sequence
parallelism) runs inside each stage as without the pipeline, the batch is split over
``data``; with the stack's ``sequence_axis`` the sequence is split over that axis too
and attention runs through the ring (a 4D mesh: pipe x data x seq x tensor). Not
supported: FP8 layers; attention dropout with both ``sequence_axis`` and a tensor axis
above 1 (the ring numbers its masks over the heads it is given).

Dropout draws the one-device model's masks: each layer draws its key once per step
from its own stream, as the unpipelined layer does, and a micro-batch's masks are
numbered from its first row in the whole batch (`jax_ls2._random.batch_rows_from`).

`unpipelined_state` maps a pipelined model's state (parameters, gradients) back to
the layout of the unpipelined model, e.g. to compare or to save it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import dataclasses

from jax_ls2 import _random
from jax_ls2.nn import DecoderLayer, TransformerEncoder
from jax_ls2.nn._common import resolve_deterministic, tensor_axis_size
from jax_ls2.parallel.mesh import DATA, PIPE
from jax_ls2.parallel.pipeline import pipeline

_OWNER = "PipelinedEncoder"


@dataclasses.dataclass(frozen=True)
class StackSettings:
    """What the pipeline reads of a stack's layers (a `jax_ls2.nn.LayerConfig` has
    these fields; a `jax_ls2.nn.DecoderLayer` these attributes)."""
    fp8: object
    sequence_axis: str | None
    sequence_balance: str
    tensor_axis: str | None
    sequence_parallel: bool
    attn_dropout: float
    activation_dropout: float
    hidden_dropout: float
    attention_backend: str

    @classmethod
    def of(cls, source):
        return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})


def _stacked_variable(variables, pipe_axis: str):
    """One variable holding ``variables`` (one per layer) stacked on a new leading dim,
    partitioned over ``pipe_axis``."""
    first = variables[0]
    value = jnp.stack([v.get_value() for v in variables])
    metadata = first.get_metadata(exclude_required=True)
    inner = metadata.get("out_sharding") or (None,) * (value.ndim - 1)
    metadata.update(out_sharding=(pipe_axis, *inner), eager_sharding=False)
    return type(first)(value, **metadata)


class PipelinedEncoder(nnx.Module):
    """A `jax_ls2.nn.TransformerEncoder`'s layers as GPipe stages over ``pipe_axis``.

    ``__call__(x, *, padding_mask=None, causal=False, deterministic=None)``: x float
    (batch, len, hidden), padding_mask bool (batch, len) True = token -> (batch, len,
    hidden) in x's dtype, the stack's result (its ``final_ln`` included). Call it under
    ``jax.set_mesh(mesh)`` (a mesh of `jax_ls2.parallel.make_mesh`), under ``jit``: it
    runs the layers in ``shard_map`` over all mesh axes, the batch split over
    ``data_axis`` (and the sequence over the stack's ``sequence_axis``, or with its
    ``sequence_parallel`` over its tensor axis, as the result comes back) and each
    device's part cut into ``num_microbatches`` micro-batches.

    ``layers``: one `TransformerEncoderLayer` whose variables are the stack's layers'
    stacked, ``(num_layers, ...)``, partitioned ``P(pipe_axis, ...)``;
    ``final_ln``: the stack's (None for post-LN stacks).

    Raises (at the call) ValueError: num_layers not a multiple of the pipe axis size, a
    local batch not a multiple of ``num_microbatches``, a length not a multiple of the
    sequence axis size (2x under zigzag balance), no mesh with ``pipe_axis``.
    """

    def __init__(self, stack: TransformerEncoder, *, num_microbatches: int, pipe_axis: str = PIPE,
                 data_axis: str = DATA):
        if not isinstance(stack, TransformerEncoder):
            raise TypeError(f"{_OWNER}: stack must be a jax_ls2.nn.TransformerEncoder, got {type(stack).__name__}")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"{_OWNER}: num_microbatches must be a positive int, got {num_microbatches!r}")
        self._setup(stack.config, list(stack.layers), stack.remat, stack.final_ln, num_microbatches, pipe_axis,
                    data_axis)

    def _setup(self, c, layers, remat, final_ln, num_microbatches, pipe_axis, data_axis):
        if c.fp8 is not None:
            raise ValueError(f"{_OWNER}: fp8 layers are not supported with pipeline parallelism (their scaling "
                             f"state is per step, not per micro-batch)")
        self.config = StackSettings.of(c)
        self.num_layers = len(layers)
        self.num_microbatches = num_microbatches
        self.pipe_axis, self.data_axis = pipe_axis, data_axis
        self.remat = remat
        graphdef, _ = nnx.split(layers[0])
        states = [nnx.state(layer) for layer in layers]
        stacked = jax.tree.map(lambda *vs: _stacked_variable(vs, pipe_axis), *states,
                               is_leaf=lambda v: isinstance(v, nnx.Variable))
        self.layers = nnx.merge(graphdef, stacked)
        self.final_ln = final_ln

    @staticmethod
    def _apply(layer, h, *, padding_mask, causal, deterministic, key):
        return layer(h, padding_mask=padding_mask, causal=causal, deterministic=deterministic, rngs=key)

    def _stages(self) -> int:
        stages = tensor_axis_size(self.pipe_axis)
        if stages is None:
            raise ValueError(f"{_OWNER}: needs a mesh with axis {self.pipe_axis!r}; call it under "
                             f"jax.set_mesh(jax_ls2.parallel.make_mesh('pipe=...'))")
        if self.num_layers % stages:
            raise ValueError(f"{_OWNER}: num_layers ({self.num_layers}) must be a multiple of the size ({stages}) "
                             f"of mesh axis {self.pipe_axis!r}, which the layers are split over; change the "
                             f"layer count or the pipe size")
        return stages

    def _sequence_split(self, x, causal: bool, deterministic: bool):
        """The sequence axis the layers' inputs are split over (None: not split), checked
        against x (batch, len, hidden)."""
        c = self.config
        size = tensor_axis_size(c.sequence_axis) if c.sequence_axis is not None else None
        if size in (None, 1):
            return None
        parts = 2 * size if causal and c.sequence_balance == "zigzag" else size
        if x.shape[1] % parts:
            raise ValueError(f"{_OWNER}: the sequence length ({x.shape[1]}) must be a multiple of {parts} (the size "
                             f"{size} of mesh axis {c.sequence_axis!r}{', twice: zigzag balance' if parts > size else ''}"
                             f"); pad the sequence or change the mesh")
        tensor = tensor_axis_size(c.tensor_axis) if c.tensor_axis is not None else None
        if c.attn_dropout > 0 and not deterministic and (tensor or 1) > 1:
            raise ValueError(f"{_OWNER}: attention dropout with sequence_axis and a tensor axis above 1 is not "
                             f"supported in pipeline stages (the ring numbers its masks over the heads it is "
                             f"given); set attn_dropout=0 or drop one of the axes")
        return c.sequence_axis

    def _check_flash_rows(self, x, seq, deterministic: bool):
        """Flash attention numbers a micro-batch's dropout rows by a 32-bit count of the
        query elements before it (`jax_ls2.ops.flash_attention`): that count must fit."""
        c = self.config
        if deterministic or c.attn_dropout == 0 or (seq is None and c.attention_backend != "flash"):
            return
        chunk = x.shape[1] // (tensor_axis_size(seq) if seq is not None else 1)
        if x.shape[0] * chunk * x.shape[2] >= 2**32:
            raise ValueError(f"{_OWNER}: with flash attention dropout, batch x sequence chunk x hidden must stay "
                             f"below 2**32 (a micro-batch's masks start at a 32-bit count of the query elements "
                             f"before it), got {x.shape[0]} x {chunk} x {x.shape[2]}; use a smaller batch per step")

    def _layer_keys(self, deterministic: bool):
        """(L,) keys, one per layer: the key the unpipelined layer draws this call; None
        without dropout. Each layer's stream advances once, as the unpipelined one does."""
        c = self.config
        if deterministic or not any((c.attn_dropout, c.activation_dropout, c.hidden_dropout)):
            return None
        stream = self.layers.rngs
        keys = jax.vmap(jax.random.fold_in)(stream.key[...], stream.count[...])
        stream.count[...] += 1
        return keys

    def __call__(self, x, *, padding_mask=None, causal: bool = False, deterministic: bool | None = None):
        self._stages()
        det = resolve_deterministic(_OWNER, deterministic, self.layers.deterministic)
        keys = self._layer_keys(det)
        graphdef, state = nnx.split(self.layers)
        data_size = tensor_axis_size(self.data_axis) or 1
        count = self.num_microbatches
        if x.ndim != 3 or x.shape[0] % (data_size * count):
            raise ValueError(f"{_OWNER}: x must be (batch, len, hidden) with the batch a multiple of the "
                             f"{self.data_axis!r} size ({data_size}) times num_microbatches ({count}), got shape "
                             f"{tuple(x.shape)}")
        seq = self._sequence_split(x, causal, det)
        self._check_flash_rows(x, seq, det)
        mask = jnp.ones(x.shape[:2], bool) if padding_mask is None else padding_mask.astype(bool)
        pipe, data, remat = self.pipe_axis, self.data_axis, self.remat

        def run_layers(state, keys, x, mask):
            local_batch = x.shape[0]
            rows = local_batch // count
            first_row = (jax.lax.axis_index(data) if data_size > 1 else 0) * local_batch
            masks = mask.reshape(count, rows, *mask.shape[1:])

            def stage(params, h, index):
                layer_states, layer_keys = params
                index = jnp.clip(index, 0, count - 1)
                micro_mask = None if padding_mask is None else jax.lax.dynamic_index_in_dim(masks, index, keepdims=False)

                def one(h, layer):
                    layer_state, key = layer
                    return self._apply(nnx.merge(graphdef, layer_state), h, padding_mask=micro_mask, causal=causal,
                                       deterministic=det, key=key), None
                one = jax.checkpoint(one) if remat else one
                with _random.batch_rows_from(first_row + index * rows):
                    return jax.lax.scan(one, h, (layer_states, layer_keys))[0]

            out = pipeline(stage, (state, keys), x.reshape(count, rows, *x.shape[1:]), axis_name=pipe, indexed=True)
            return out.reshape(x.shape)

        specs = nnx.get_partition_spec(state)
        key_spec = None if keys is None else P(pipe)
        # The layers take and give sequence parts over the sequence axis (ring attention) or,
        # under Megatron sequence parallelism, over the tensor axis.
        x_spec = P(data, seq or (self.config.tensor_axis if self.config.sequence_parallel else None))
        y = jax.shard_map(run_layers, in_specs=(specs, key_spec, x_spec, P(data, seq)), out_specs=x_spec)(
            state, keys, x, mask)
        return y if self.final_ln is None else self.final_ln(y)


class PipelinedDecoder(PipelinedEncoder):
    """A LLaMA-family model's `jax_ls2.nn.DecoderLayer` s as GPipe stages over
    ``pipe_axis``, as `PipelinedEncoder` (``__call__(x, *, deterministic=None)``: x
    (batch, len, hidden) -> same, causal; no final norm: the model applies its own).
    Rotary positions are each token's place in the whole sequence; segment ids are not
    supported. ``layers``: one `DecoderLayer` holding the layers' variables stacked."""

    def __init__(self, layers, *, remat: bool = False, num_microbatches: int, pipe_axis: str = PIPE,
                 data_axis: str = DATA):
        layers = list(layers)
        if not layers or not all(isinstance(layer, DecoderLayer) for layer in layers):
            raise TypeError(f"PipelinedDecoder: layers must be jax_ls2.nn.DecoderLayer s, got "
                            f"{sorted({type(layer).__name__ for layer in layers})}")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"PipelinedDecoder: num_microbatches must be a positive int, got {num_microbatches!r}")
        self._setup(layers[0], layers, remat, None, num_microbatches, pipe_axis, data_axis)

    @staticmethod
    def _apply(layer, h, *, padding_mask, causal, deterministic, key):
        del padding_mask, causal  # always causal, no padding
        return layer(h, deterministic=deterministic, rngs=key)

    def __call__(self, x, *, deterministic: bool | None = None):
        return super().__call__(x, causal=True, deterministic=deterministic)


def pipeline_model(model, *, num_microbatches: int, pipe_axis: str = PIPE, data_axis: str = DATA):
    """``model`` (a zoo GPT or BERT on jax_ls2 layers, e.g. ``flax_models.build(cfg)``)
    with its layer stack replaced by a `PipelinedEncoder` of the same layers and values
    (a LLaMA-family model: its ``layers`` by a `PipelinedDecoder`),
    in place; returns it. Then place its state with
    ``jax_ls2.parallel.mesh.shard_module(model, mesh)`` and train it under
    ``jax.set_mesh(mesh)`` as the unpipelined model: ``model.loss(batch)`` runs the
    layers as GPipe stages over ``pipe_axis`` with ``num_microbatches`` micro-batches
    per ``data_axis`` part of the batch (the batch: a multiple of data size times
    ``num_microbatches``).

    Raises:
      ValueError: a model without exactly one ``jax_ls2.nn.TransformerEncoder`` stack
        or a list of ``DecoderLayer`` s (the encoder-decoder Transformer and ViT's
        stacks are not supported),
        or a stack `PipelinedEncoder` does not take.
    """
    layers = getattr(model, "layers", None)
    if isinstance(layers, nnx.List) and layers and all(isinstance(layer, DecoderLayer) for layer in layers):
        model.layers = PipelinedDecoder(layers, remat=bool(model.cfg.remat), num_microbatches=num_microbatches,
                                        pipe_axis=pipe_axis, data_axis=data_axis)
        return model
    stacks = [name for name, value in vars(model).items() if isinstance(value, TransformerEncoder)]
    if len(stacks) != 1 or any(type(v).__name__ == "TransformerDecoder" for v in vars(model).values()):
        raise ValueError(f"pipeline_model: the model needs exactly one jax_ls2.nn.TransformerEncoder layer stack and "
                         f"no decoder stack (GPT and BERT built on jax_ls2 layers), got {type(model).__name__} with "
                         f"stacks {stacks}")
    name = stacks[0]
    setattr(model, name, PipelinedEncoder(getattr(model, name), num_microbatches=num_microbatches,
                                          pipe_axis=pipe_axis, data_axis=data_axis))
    return model


def unpipelined_state(state, like):
    """``state`` (of a `pipeline_model` model: parameters, gradients, any
    ``nnx.State``) in the layout of ``like`` (the same of the unpipelined model, or its
    ``nnx.eval_shape`` state): each stacked layer variable ``(L, ...)`` becomes the
    ``L`` layers' own. Only ``like``'s paths are kept; values are unchanged."""

    def unstack(stacked, want):
        if not isinstance(want, dict):
            return stacked
        if want and all(isinstance(k, int) for k in want) and not any(isinstance(k, int) for k in stacked):
            if set(stacked) == {"layers"}:  # a PipelinedDecoder in the place of the layer list
                stacked = stacked["layers"]
            return {i: unstack(jax.tree.map(lambda a: a[i], stacked), want[i]) for i in want}
        return {k: unstack(stacked[k], w) for k, w in want.items()}

    values = unstack(nnx.to_pure_dict(state), nnx.to_pure_dict(like))
    out = jax.tree.map(lambda a: a, like)
    nnx.replace_by_pure_dict(out, values)
    return out


__all__ = ["PipelinedDecoder", "PipelinedEncoder", "StackSettings", "pipeline_model", "unpipelined_state"]
