// LayerNorm (optionally fused with a residual add) forward and backward launchers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

struct LayerNormFwdArgs {
  const void* x;         // (rows, hidden), T
  const void* residual;  // (rows, hidden), T, or nullptr
  const void* gamma;     // (hidden,), T
  const void* beta;      // (hidden,), T
  void* y;               // (rows, hidden), T
  void* sum;             // (rows, hidden), T: x + residual, or nullptr
  float* mean;           // (rows,)
  float* rstd;           // (rows,)
  int64_t rows, hidden;
  float eps;
};

struct LayerNormBwdArgs {
  const void* dy;     // (rows, hidden), T
  const void* dsum;   // (rows, hidden), T: cotangent of the returned sum, or nullptr
  const void* x;      // (rows, hidden), T: the normalised input (the sum when fused)
  const void* gamma;  // (hidden,), T
  const float* mean;  // (rows,)
  const float* rstd;  // (rows,)
  void* dx;           // (rows, hidden), T
  float* dgamma;      // (hidden,)
  float* dbeta;       // (hidden,)
  float* partials;    // (max_parts, 2, hidden) workspace
  int64_t max_parts;
  int64_t rows, hidden;
};

template <typename T>
cudaError_t LaunchLayerNormFwd(const LayerNormFwdArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchLayerNormBwd(const LayerNormBwdArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
