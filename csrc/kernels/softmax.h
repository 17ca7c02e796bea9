// Attention softmax with scale, additive bias, boolean/causal masking and dropout:
// forward and backward launchers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace jax_ls2 {

// How a row index (over the leading dims of scores, q_len included) maps to the
// start of the matching bias/mask row. Adjacent dims with compatible strides are
// merged on the host, so a padding mask (batch, 1, 1, k) over (batch, heads, q, k)
// costs one division per row.
constexpr int kSoftmaxMaxDims = 8;

// Division by a fixed divisor as a multiply-high and a shift (valid for
// numerators < 2^31): q = d == 1 ? n : umulhi(n, mul) >> shr.
struct FastDiv {
  uint32_t d, mul, shr;
};
inline FastDiv MakeFastDiv(uint32_t d) {
  FastDiv f{d, 0u, 0u};
  if (d > 1) {
    uint32_t l = 0;
    while ((1ull << l) < d) ++l;  // ceil(log2 d)
    const uint32_t p = 31 + l;
    f.mul = (uint32_t)(((1ull << p) + d - 1) / d);
    f.shr = p - 32;
  }
  return f;
}

struct SoftmaxBcast {
  int nd;                             // merged leading dims, 0..kSoftmaxMaxDims
  FastDiv size[kSoftmaxMaxDims];      // merged dim sizes, outermost first
  int64_t bias[kSoftmaxMaxDims];      // bias element stride per merged dim (0: broadcast)
  int64_t mask[kSoftmaxMaxDims];      // mask element stride per merged dim (0: broadcast)
};

struct SoftmaxProblem {
  const void* x;         // scores (rows, cols), T
  const void* bias;      // broadcastable bias, T or float32, or nullptr
  const uint8_t* mask;   // broadcastable bool mask (1 = attend), or nullptr
  const uint32_t* seed;  // uint32[4] dropout seed (k0, k1, base_lo, base_hi), common.cuh
  MaskRows numbering;    // the rows' global numbering (common.cuh)
  float* stats;          // (rows, 2) float32: row max of the logits, 1 / row sum
  int64_t rows;          // product of the leading dims, q_len included
  int64_t cols;          // k_len
  int64_t q_len;         // for causal masking: query i attends keys j <= i + cols - q_len
  FastDiv q_div;         // division by q_len
  int64_t bias_k, mask_k;  // element stride of bias/mask along k (1, or 0 when broadcast)
  SoftmaxBcast bc;
  float scale;           // logits = scale * scores + bias
  uint32_t threshold;    // 16-bit dropout threshold (0: no dropout)
  float keep_scale;      // 1 / kept fraction
  bool causal;
  bool bias_f32;         // bias is float32 (else scores' dtype)
};

struct SoftmaxFwdArgs {
  SoftmaxProblem p;
  void* y;  // (rows, cols), T: dropout(softmax(logits))
};

struct SoftmaxBwdArgs {
  SoftmaxProblem p;      // stats are read
  const void* dy;        // (rows, cols), T
  void* dx;              // (rows, cols), T
  float grad_scale;      // dx = grad_scale * p * (g - sum(g * p)), g = dy * keep * keep_scale
};

// Launch choices a benchmark may override (the FFI handlers fill them from the options
// set through jax_ls2._C.set_kernel_option); 0 keeps the built-in choice.
struct SoftmaxLaunchOptions {
  int elems = 0;  // 16 or 32 elements per thread (bfloat16, 16-byte register path)
};

template <typename T>
cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdArgs& a, const SoftmaxLaunchOptions& o, cudaStream_t stream);
template <typename T>
cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdArgs& a, const SoftmaxLaunchOptions& o, cudaStream_t stream);

}  // namespace jax_ls2
