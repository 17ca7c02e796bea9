// The fused update with bfloat16 moments.
#include "kernels/optimizer_update.cuh"
#include "kernels/optimizer_update.h"

namespace jax_ls2 {
namespace optim {

void LaunchUpdateBf16Moments(const LeafTable& t, const StateArgs& a, cudaStream_t s) {
  LaunchUpdateKernel<__nv_bfloat16>(t, a, s);
}

}  // namespace optim
}  // namespace jax_ls2
