// Bias + dropout + residual and bias + activation + dropout, forward and backward.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

enum DropoutActivation : int { kActRelu = 0, kActGelu = 1, kActGeluTanh = 2 };

struct DropoutFwdArgs {
  const void* x;         // (rows, hidden), T
  const void* bias;      // (hidden,), T
  const void* residual;  // (rows, hidden), T, or nullptr (bias_act_dropout)
  const uint32_t* seed;  // (3,) uint32 on the device: k0, k1, element offset
  void* y;               // (rows, hidden), T
  int64_t rows, hidden;
  uint32_t threshold;    // drop iff the 16-bit draw < threshold; 0 = no dropout
  float scale;           // 1 / kept fraction
  int activation;        // DropoutActivation (bias_act_dropout only)
  int64_t seq_batch;     // > 0: rows are (len, seq_batch), numbered as the (seq_batch, len) transpose
};

struct DropoutBwdArgs {
  const void* dy;        // (rows, hidden), T
  const void* x;         // (rows, hidden), T: pre-activation input, or nullptr (bias_dropout_residual)
  const void* bias;      // (hidden,), T, or nullptr (bias_dropout_residual)
  const uint32_t* seed;  // (3,) uint32 on the device
  void* dx;              // (rows, hidden), T
  float* dbias;          // (hidden,) f32: column sums of dx (before rounding to T)
  float* partials;       // (max_parts, hidden) f32 workspace
  int64_t max_parts;
  int64_t rows, hidden;
  uint32_t threshold;
  float scale;
  int activation;
  int64_t seq_batch;     // as in DropoutFwdArgs
};

template <typename T>
cudaError_t LaunchBiasDropoutResidualFwd(const DropoutFwdArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBiasDropoutResidualBwd(const DropoutBwdArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBiasActDropoutFwd(const DropoutFwdArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBiasActDropoutBwd(const DropoutBwdArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
