"""Nodes that a params or grads tree may hold beside the parameters without being
parameters (the FP8 metas of `jax_ls2.fp8`: scales and amax histories, and their
updates). Their package registers their types as `NotAParameter`, so that the
optimizers can refuse them without knowing that package: they must be split off
before an optimizer sees the tree."""
from __future__ import annotations

import abc

import jax


class NotAParameter(abc.ABC):
    """Virtual base of the pytree node types that are state beside the parameters
    (``NotAParameter.register(T)``): never a gradient, never updated by an optimizer."""


def is_not_a_parameter(node) -> bool:
    return isinstance(node, NotAParameter)


def count_non_parameters(tree) -> int:
    """Number of `NotAParameter` nodes in ``tree`` (a pytree or an ``nnx.State``)."""
    return sum(map(is_not_a_parameter, jax.tree.leaves(tree, is_leaf=is_not_a_parameter)))
