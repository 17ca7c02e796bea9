// The bias + dropout launchers for float16 (kernels/dropout.cuh).
#include "kernels/dropout.cuh"

namespace jax_ls2 {
JAX_LS2_INSTANTIATE_DROPOUT(__half)
}  // namespace jax_ls2
