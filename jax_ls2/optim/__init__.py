"""Fused mixed-precision optimizers for optax (LightSeq2's trainer).

One custom call updates the whole parameter pytree, whose optimizer state lives in
flat buffers; on backends without the CUDA kernels the same math runs in pure JAX.
"""
from jax_ls2.optim._options import PrecisionOptions
from jax_ls2.optim._transformation import FlatGrads, FusedGradientTransformation, FusedState
from jax_ls2.optim.accumulation import accumulate, init_accumulator, unflatten_grads
from jax_ls2.optim.apply import apply_updates, update_nnx
from jax_ls2.optim.loss_scaling import find_state, loss_scale, scale_loss
from jax_ls2.optim.transforms import adam, adamw, sgd

__all__ = ["adam", "adamw", "sgd", "apply_updates", "update_nnx", "accumulate", "init_accumulator", "unflatten_grads",
           "scale_loss", "loss_scale", "find_state", "FusedState", "FlatGrads", "FusedGradientTransformation",
           "PrecisionOptions"]
