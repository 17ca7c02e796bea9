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

constexpr int kLayerNormMaxExtraDy = 3;

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
  // More cotangents of the output (rows, hidden), T, added to dy in float32 as they are
  // loaded: the gradient of an output that feeds several consumers, summed here instead
  // of by a separate pass. dy_more[0 .. n_more).
  const void* dy_more[kLayerNormMaxExtraDy];
  int n_more;
};

template <typename T>
cudaError_t LaunchLayerNormFwd(const LayerNormFwdArgs& a, cudaStream_t stream);
// Launch choices of the backward a benchmark may override (the FFI handlers fill them
// from the options set through jax_ls2._C.set_kernel_option); 0 keeps the built-in choice.
struct LayerNormBwdLaunchOptions {
  int elems = 0;   // elements per thread: 8 or 16 for the staged kernel, 16 or 32 for the register
                   // kernel (bfloat16, 16-byte path)
  int stages = 0;  // 1: the register kernel instead of the staged one (16-bit, 16-byte path, sm_90);
                   // 2..8: the staged kernel's stages
};

template <typename T>
cudaError_t LaunchLayerNormBwd(const LayerNormBwdArgs& a, const LayerNormBwdLaunchOptions& o,
                               cudaStream_t stream);

// The staged backward (layer_norm_staged.cu) for row groups of `tpr` threads holding
// `elems` (8 or 16) elements each, with a ring of `stages` shared-memory stages. Returns false, launching nothing, where it does not
// apply (float32, unaligned or extra cotangents, rows too long, a device or build before
// sm_90); else launches it, sets *parts to its grid (the partial rows written) and *err.
template <typename T>
bool LaunchLayerNormBwdStaged(const LayerNormBwdArgs& a, int tpr, int elems, int stages, cudaStream_t stream,
                              int* parts, cudaError_t* err);

}  // namespace jax_ls2
