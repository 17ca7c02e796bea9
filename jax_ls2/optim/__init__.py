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
message; Auto meshes and ``shard_map`` work. `shard_optimizer` updates params sharded
over a mesh where they lie (per-device flat buffers, nothing gathered to form them) and
optionally splits the state over the data axis (ZeRO-1); `gather_state` /
`scatter_state` move such a state to and from the standard layout.

The kernel takes float32, float16 and bfloat16 leaves. A params tree holding any
float64 (under x64), complex, integer or bool leaf is updated as a whole by optax's
own per-leaf math (optax's numbers and dtypes, nothing cast); its state keeps ``mu``
and ``nu`` as trees like params in optax's dtypes, and refuses master weights and
stochastic rounding. Other dtypes (float8, ...) raise a TypeError.

Gradients follow JAX's own conversion, as optax's math does: a Python float or a
float64 NumPy gradient leaf becomes float32 without x64 (``jnp.asarray``'s rule; the
updates equal optax's). A params tree of the kernel's dtypes takes gradients of those
dtypes only: an integer, bool, complex or (under x64) float64 gradient leaf raises a
TypeError naming the leaf's path (optax would promote the update, and under x64 its
moments, to the gradient's dtype). A state is refused by an optimizer that keeps
other buffers (an ``sgd`` state passed to ``adamw``'s update).

Values that cannot work raise a ValueError at construction (a non-finite or negative
learning rate or weight decay, loss-scaling parameters such as a growth factor <= 1);
a traced learning rate or weight decay (a schedule, ``inject_hyperparams``) that is
negative or not finite is taken as 0 in that step (the params keep their values) and
the state's ``finite`` flag reads False: checked on the device, with no host round trip.
"""
from jax_ls2.optim._options import PrecisionOptions
from jax_ls2.optim._transformation import FlatGrads, FusedGradientTransformation, FusedState
from jax_ls2.optim.accumulation import accumulate, init_accumulator, unflatten_grads
from jax_ls2.optim.apply import apply_updates, update_nnx
from jax_ls2.optim.loss_scaling import find_state, loss_scale, scale_loss
from jax_ls2.optim.sharded import gather_state, scatter_state, shard_optimizer
from jax_ls2.optim.state_views import MomentsView, moments
from jax_ls2.optim.transforms import adam, adamw, sgd

__all__ = ["adam", "adamw", "sgd", "apply_updates", "update_nnx", "accumulate", "init_accumulator", "unflatten_grads",
           "scale_loss", "loss_scale", "find_state", "FusedState", "FlatGrads", "FusedGradientTransformation",
           "PrecisionOptions", "moments", "MomentsView", "shard_optimizer", "gather_state", "scatter_state"]
