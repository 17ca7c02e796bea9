"""jax_ls2: LightSeq2-style fused Transformer training kernels for JAX on NVIDIA GPUs."""
from jax_ls2._dispatch import KernelsUnavailableWarning, implementation
from jax_ls2._ffi import cuda_available, kernels_built, registered_targets

__version__ = "0.1.0"
__all__ = ["KernelsUnavailableWarning", "cuda_available", "implementation", "kernels_built",
           "registered_targets"]
