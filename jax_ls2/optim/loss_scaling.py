"""Loss scaling read from a fused optimizer's state: the current scale and the loss
to differentiate."""
from __future__ import annotations

import jax

from jax_ls2.optim._transformation import FusedState


def find_state(opt_state) -> FusedState:
    """The `FusedState` inside a (possibly chained or wrapped) optimizer state."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, FusedState))
             if isinstance(s, FusedState)]
    if len(found) != 1:
        raise ValueError(f"find_state: expected exactly one FusedState in the optimizer state, got {len(found)}")
    return found[0]


def loss_scale(opt_state) -> jax.Array:
    """The current loss scale () float32 (1 without loss scaling)."""
    return find_state(opt_state).loss_scale


def scale_loss(loss: jax.Array, opt_state) -> jax.Array:
    """`loss` multiplied by the current loss scale (differentiate this one)."""
    return loss * loss_scale(opt_state).astype(loss.dtype)
