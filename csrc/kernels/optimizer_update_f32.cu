// The fused update with float32 moments.
#include "kernels/optimizer_update.cuh"
#include "kernels/optimizer_update.h"

namespace jax_ls2 {
namespace optim {

void LaunchUpdateF32Moments(const LeafTable& t, const StateArgs& a, cudaStream_t s) {
  LaunchUpdateKernel<float>(t, a, s);
}

}  // namespace optim
}  // namespace jax_ls2
