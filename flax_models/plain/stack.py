"""Plain-Flax twins of jax_ls2.nn.TransformerEncoder / TransformerDecoder (per-layer
cross-attention K/V)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.plain.constants import EPSILON
from flax_models.plain.layers import LayerNorm, TransformerDecoderLayer, TransformerEncoderLayer


def remat_call(layer, fn, *args):
    """``fn(layer, *args)`` under ``jax.checkpoint``; the layer's state updates (dropout
    RNG counters) are written back. Works inside both nnx and plain jax transforms."""
    graphdef, state = nnx.split(layer)

    def pure(state, *args):
        # Only the variables the call changed (dropout RNG counters) go back, so a layer
        # run without dropout mutates nothing. Read before the call: the merged module
        # may share its variables with `state`.
        before = {k: v.get_raw_value() for k, v in nnx.to_flat_state(state)}
        m = nnx.merge(graphdef, state)
        out = fn(m, *args)
        changed = [(k, v) for k, v in nnx.to_flat_state(nnx.state(m)) if v.get_raw_value() is not before[k]]
        return out, nnx.from_flat_state(changed)
    out, changed = jax.checkpoint(pure)(state, *args)
    nnx.update(layer, changed)
    return out


def _final_ln(final_layer_norm, hidden_size, layer_kw, rngs):
    if final_layer_norm is None:
        final_layer_norm = layer_kw.get("pre_layer_norm", True)
    if not final_layer_norm:
        return nnx.data(None)
    return LayerNorm(hidden_size, epsilon=layer_kw.get("epsilon", EPSILON),
                     dtype=layer_kw.get("dtype"),
                     param_dtype=layer_kw.get("param_dtype", jnp.float32), rngs=rngs)


class TransformerEncoder(nnx.Module):
    def __init__(self, num_layers, hidden_size, ffn_size, num_heads, *, final_layer_norm=None,
                 remat=False, rngs, **layer_kw):
        self.layers = nnx.List([TransformerEncoderLayer(hidden_size, ffn_size, num_heads,
                                                        rngs=rngs, **layer_kw)
                                for _ in range(num_layers)])
        self.final_ln = _final_ln(final_layer_norm, hidden_size, layer_kw, rngs)
        self.remat = remat

    def __call__(self, x, *, padding_mask=None, causal=False, deterministic=None):
        def run(layer, x):
            return layer(x, padding_mask=padding_mask, causal=causal, deterministic=deterministic)
        for layer in self.layers:
            x = remat_call(layer, run, x) if self.remat else run(layer, x)
        return x if self.final_ln is None else self.final_ln(x)


class TransformerDecoder(nnx.Module):
    def __init__(self, num_layers, hidden_size, ffn_size, num_heads, *, final_layer_norm=None,
                 batched_cross_kv=False, remat=False, rngs, **layer_kw):
        del batched_cross_kv  # the plain twin always projects per layer
        self.layers = nnx.List([TransformerDecoderLayer(hidden_size, ffn_size, num_heads,
                                                        rngs=rngs, **layer_kw)
                                for _ in range(num_layers)])
        self.final_ln = _final_ln(final_layer_norm, hidden_size, layer_kw, rngs)
        self.remat = remat

    def __call__(self, x, memory, *, padding_mask=None, memory_padding_mask=None,
                 deterministic=None):
        def run(layer, x):
            return layer(x, memory, padding_mask=padding_mask,
                         memory_padding_mask=memory_padding_mask, deterministic=deterministic)
        for layer in self.layers:
            x = remat_call(layer, run, x) if self.remat else run(layer, x)
        return x if self.final_ln is None else self.final_ln(x)
