// RMSNorm (optionally fused with a residual add) forward and backward launchers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

// Cotangents of y the backward adds as it loads them, beyond the first (the copies of y
// that feed several consumers).
constexpr int kRmsNormMaxExtraDy = 3;

struct RmsNormFwdArgs {
  const void* x;         // (rows, hidden), T
  const void* residual;  // (rows, hidden), T, or nullptr
  const void* gamma;     // (hidden,), T
  void* y;               // (rows, hidden), T
  void* sum;             // (rows, hidden), T: x + residual, or nullptr
  float* rstd;           // (rows,)
  int64_t rows, hidden;
  float eps;
  bool unit_offset;      // the weight is 1 + gamma (formed in float32)
};

struct RmsNormBwdArgs {
  const void* dy[kRmsNormMaxExtraDy + 1];  // (rows, hidden), T: dy[0 .. n_dy), summed in float32 in order
  int n_dy;
  const void* dsum;   // (rows, hidden), T: cotangent of the input's other use, added to dx, or nullptr
  const void* x;      // (rows, hidden), T: the normalised input (the sum when fused)
  const void* gamma;  // (hidden,), T
  const float* rstd;  // (rows,)
  void* dx;           // (rows, hidden), T
  float* dgamma;      // (hidden,)
  float* partials;    // (max_parts, hidden) workspace
  int64_t max_parts;
  int64_t rows, hidden;
  bool unit_offset;
};

template <typename T>
cudaError_t LaunchRmsNormFwd(const RmsNormFwdArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchRmsNormBwd(const RmsNormBwdArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
