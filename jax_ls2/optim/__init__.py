"""Fused mixed-precision optimizers for optax (LightSeq2's trainer).

One custom call updates the whole parameter pytree, whose optimizer state lives in
flat buffers; on backends without the CUDA kernels the same math runs in pure JAX.

adamw, adam and sgd take optax's arguments in optax's order (then the precision
options, `PrecisionOptions`) and follow optax's contract: ``update(grads, state)``
without params where the math does not read them, prefix or callable weight-decay
masks, NumPy and Python-scalar leaves taken as ``jnp.asarray`` takes them.

The state's layout is a decision: the moments and master weights stay flat (total,)
buffers, the operands the kernel updates in place, rather than params-shaped trees
as in optax. Trees would have to be concatenated into the kernel's buffers and split
back inside every step, as much memory traffic as the update itself, and the fused
step would no longer be one custom call. Hence ``optax.tree.get(state, "mu")`` gives
the flat buffer; `moments(state, params)` gives params-shaped views (copies).
``optax.tree.map_params`` sees no params-shaped part in the state, so the usual recipe
that derives state shardings from the params' (``transform_non_params`` for the rest)
gives the flat buffers its non-params sharding, replicated for instance.
Parameters sharded over explicit mesh axes (``AxisType.Explicit``) are refused with a
message; Auto meshes and ``shard_map`` work. float64 and complex leaves are refused
(TypeError): the kernels take float32, float16 and bfloat16.
"""
from jax_ls2.optim._options import PrecisionOptions
from jax_ls2.optim._transformation import FlatGrads, FusedGradientTransformation, FusedState
from jax_ls2.optim.accumulation import accumulate, init_accumulator, unflatten_grads
from jax_ls2.optim.apply import apply_updates, update_nnx
from jax_ls2.optim.loss_scaling import find_state, loss_scale, scale_loss
from jax_ls2.optim.state_views import MomentsView, moments
from jax_ls2.optim.transforms import adam, adamw, sgd

__all__ = ["adam", "adamw", "sgd", "apply_updates", "update_nnx", "accumulate", "init_accumulator", "unflatten_grads",
           "scale_loss", "loss_scale", "find_state", "FusedState", "FlatGrads", "FusedGradientTransformation",
           "PrecisionOptions", "moments", "MomentsView"]
