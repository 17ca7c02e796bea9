"""Params-shaped views of a fused optimizer's flat state.

The state keeps the moments (and master weights) as flat (total,) buffers, the
operands the fused kernel reads and writes in place; turning them into per-leaf trees
inside every step would cost a concatenation and a split over all of them, as much
memory traffic as the update itself. Code that reads the moments as optax's states
hold them (``optax.tree.get(state, "mu")`` gives the flat buffer here) asks for a view.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax

from jax_ls2.optim import _per_leaf
from jax_ls2.optim._layout import layout_of, unflatten
from jax_ls2.optim.loss_scaling import find_state


class MomentsView(NamedTuple):
    """Trees like params (each leaf of the param's shape, in the buffer's dtype), or
    None where the optimizer keeps no such buffer."""
    mu: Optional[object]
    nu: Optional[object]
    master: Optional[object]


def moments(opt_state, params) -> MomentsView:
    """The first and second moments and the master weights of the `FusedState` inside
    `opt_state`, as trees like `params` (copies of the flat buffers: writing to them
    changes nothing; for params on the per-leaf path, the state's own trees)."""
    state = find_state(opt_state)
    leaves, treedef = jax.tree.flatten(params)
    if _per_leaf.takes_per_leaf(_per_leaf.as_arrays(leaves)):
        # The per-leaf path's state already holds trees like params (no master weights).
        for name in ("mu", "nu"):
            tree = getattr(state, name)
            if tree is not None and jax.tree.structure(tree) != treedef:
                raise ValueError(f"moments: state.{name} is not a tree like these params (which hold float64, "
                                 f"complex, integer or bool leaves): {jax.tree.structure(tree)}")
        return MomentsView(state.mu, state.nu, None)
    layout = layout_of(leaves)
    for name in ("mu", "nu", "master"):
        buf = getattr(state, name)
        if buf is not None and buf.shape != (layout.total,):
            raise ValueError(f"moments: state.{name} has shape {tuple(buf.shape)}, but these params need "
                             f"({layout.total},)")
    view = lambda buf: None if buf is None else jax.tree.unflatten(treedef, unflatten(buf, layout))
    return MomentsView(view(state.mu), view(state.nu), view(state.master))
