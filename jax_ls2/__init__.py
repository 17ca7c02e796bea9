"""jax_ls2: LightSeq2-style fused Transformer training kernels for JAX on NVIDIA GPUs."""
from jax_ls2._ffi import cuda_available, registered_targets

__version__ = "0.1.0"
__all__ = ["cuda_available", "registered_targets"]
