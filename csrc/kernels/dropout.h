// Bias + dropout + residual and bias + activation + dropout, forward and backward.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace jax_ls2 {

// Activation codes of bias_act_dropout's `activation` attribute, in the order of
// jax_ls2.ops.dropout.ACTIVATIONS.
enum DropoutActivation : int { kActRelu = 0, kActGelu = 1, kActGeluTanh = 2 };

// Launch choices a benchmark may override (the FFI handlers fill them from the options
// set through jax_ls2._C.set_kernel_option); 0 keeps the built-in choice.
struct DropoutLaunchOptions {
  int rows_in_flight = 0;  // 2, 4 or 8 rows each thread loads before computing (bfloat16, 16-byte path)
  int full_grid = 0;       // 1: forward grids cover every row once instead of one resident wave
  int prefetch = 0;        // 2: the kernel that does not load the next rows before computing the current
                           // ones (bfloat16, 16-byte path; prefetching is the built-in choice)
};

struct DropoutFwdArgs {
  const void* x;         // (rows, hidden), T
  const void* bias;      // (hidden,), T
  const void* residual;  // (rows, hidden), T, or nullptr (bias_act_dropout)
  const uint32_t* seed;  // (4,) uint32 on the device: k0, k1, base_lo, base_hi (common.cuh, MaskRows)
  void* y;               // (rows, hidden), T
  int64_t rows, hidden;
  uint32_t threshold;    // drop iff the 16-bit draw < threshold; 0 = no dropout
  float scale;           // 1 / kept fraction
  int activation;        // DropoutActivation (bias_act_dropout only)
  MaskRows numbering;    // the rows' global numbering (sequence-first rows included)
};

struct DropoutBwdArgs {
  const void* dy;        // (rows, hidden), T
  const void* x;         // (rows, hidden), T: pre-activation input, or nullptr (bias_dropout_residual)
  const void* bias;      // (hidden,), T, or nullptr (bias_dropout_residual)
  const uint32_t* seed;  // (4,) uint32 on the device, as in DropoutFwdArgs
  void* dx;              // (rows, hidden), T
  float* dbias;          // (hidden,) f32: column sums of dx (before rounding to T)
  float* partials;       // (max_parts, hidden) f32 workspace
  int64_t max_parts;
  int64_t rows, hidden;
  uint32_t threshold;
  float scale;
  int activation;
  MaskRows numbering;    // as in DropoutFwdArgs
};

template <typename T>
cudaError_t LaunchBiasDropoutResidualFwd(const DropoutFwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBiasDropoutResidualBwd(const DropoutBwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBiasActDropoutFwd(const DropoutFwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBiasActDropoutBwd(const DropoutBwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream);

}  // namespace jax_ls2
