// Launchers of the fused update kernel, one per moments dtype, each defined in its own
// translation unit (optimizer_update_f32.cu, optimizer_update_bf16.cu).
#pragma once
#include <cuda_runtime.h>

#include "kernels/optimizer.h"

namespace jax_ls2 {
namespace optim {

void LaunchUpdateF32Moments(const LeafTable& t, const StateArgs& a, cudaStream_t s);
void LaunchUpdateBf16Moments(const LeafTable& t, const StateArgs& a, cudaStream_t s);

}  // namespace optim
}  // namespace jax_ls2
