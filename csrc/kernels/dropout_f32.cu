// The bias + dropout launchers for float32 (kernels/dropout.cuh).
#include "kernels/dropout.cuh"

namespace jax_ls2 {
JAX_LS2_INSTANTIATE_DROPOUT(float)
}  // namespace jax_ls2
