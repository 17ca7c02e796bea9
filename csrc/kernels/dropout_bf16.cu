// The bias + dropout launchers for bfloat16 (kernels/dropout.cuh).
#include "kernels/dropout.cuh"

namespace jax_ls2 {
JAX_LS2_INSTANTIATE_DROPOUT(__nv_bfloat16)
}  // namespace jax_ls2
