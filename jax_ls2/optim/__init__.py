"""Fused mixed-precision optimizers for optax (LightSeq2's trainer).

One custom call updates the whole parameter pytree, whose optimizer state lives in
flat buffers; on backends without the CUDA kernels the same math runs in pure JAX.
"""
from jax_ls2.optim._core import FlatGrads, FusedState
from jax_ls2.optim.helpers import (accumulate, apply_updates, find_state, init_accumulator, loss_scale,
                                   scale_loss, unflatten_grads, update_nnx)
from jax_ls2.optim.transforms import adam, adamw, sgd

__all__ = ["adam", "adamw", "sgd", "apply_updates", "update_nnx", "accumulate", "init_accumulator", "unflatten_grads",
           "scale_loss", "loss_scale", "find_state", "FusedState", "FlatGrads"]
