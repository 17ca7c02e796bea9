// Online softmax statistics of the row-per-block cross-entropy kernel (cross_entropy.cu):
// exp of shifted logits, and the running (max, sum of exp, sum of logits) folded per
// thread and merged across a block.
// Internal linkage: each translation unit gets its own copy.
#pragma once
#include <type_traits>

#include "kernels/common.cuh"

namespace jax_ls2 {
namespace {

// exp(t) for t = logit - max <= 0. fp32 logits use the accurate expf (its error matches
// XLA's); 16-bit logits, whose own rounding dominates, use the cheaper exp2.
template <typename T>
__device__ __forceinline__ float ExpShifted(float t) {
  if constexpr (std::is_same_v<T, float>) {
    return expf(t);
  } else {
    return Exp2Approx(t * kLog2e);
  }
}
// 16-bit logits keep an online (max, sum of exp) in one read of the row. fp32 logits
// take the row max first, then sum exp(x - max) in double in a second sweep, and form
// the gradient in double with the same exp: float sums of 50k terms, online
// rescalings and expf's own error each put the largest fp32 probabilities an ulp or
// more off, past XLA's error; in double the only rounding left is the final one. The
// fp32 path pays the double-precision arithmetic (FP64 runs at half the FP32 rate on
// sm_90); the 16-bit paths, whose own rounding hides all of this, do not.
template <typename T>
constexpr bool kOnline = !std::is_same_v<T, float>;

// Folds values v into the running (m, d = sum exp(x - m)) and the plain sum sx (the
// max and sx only, for fp32).
template <typename T, int N>
__device__ __forceinline__ void Accumulate(const float (&v)[N], float& m, float& d, float& sx) {
  float lm = v[0];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    lm = fmaxf(lm, v[j]);
    sx += v[j];
  }
  if constexpr (!kOnline<T>) {
    m = fmaxf(m, lm);
    return;
  }
  if (lm > m) {
    d *= ExpShifted<T>(m - lm);  // m = -inf: d is 0 and stays 0
    m = lm;
  }
  if (m == -INFINITY) return;
#pragma unroll
  for (int j = 0; j < N; ++j) d += ExpShifted<T>(v[j] - m);
}

template <typename T>
__device__ __forceinline__ void Merge(float& m, float& d, float m2, float d2) {
  if constexpr (!kOnline<T>) {
    m = fmaxf(m, m2);
    return;
  }
  const float nm = fmaxf(m, m2);
  if (nm == -INFINITY) return;
  d = d * ExpShifted<T>(m - nm) + d2 * ExpShifted<T>(m2 - nm);
  m = nm;
}

// Warp-wide merge of (m, d) and sum of sx; every lane gets the result.
template <typename T>
__device__ __forceinline__ void WarpMerge(float& m, float& d, float& sx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float d2 = __shfl_xor_sync(0xffffffffu, d, o);
    sx += __shfl_xor_sync(0xffffffffu, sx, o);
    Merge<T>(m, d, m2, d2);
  }
}

// Block-wide merge of (m, d) and sum of sx; every thread gets the result.
template <typename T>
__device__ __forceinline__ void BlockReduce(float& m, float& d, float& sx, float* sh) {
  WarpMerge<T>(m, d, sx);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) {
    sh[warp] = m;
    sh[32 + warp] = d;
    sh[64 + warp] = sx;
  }
  __syncthreads();
  m = lane < nw ? sh[lane] : -INFINITY;
  d = lane < nw ? sh[32 + lane] : 0.f;
  sx = lane < nw ? sh[64 + lane] : 0.f;
  WarpMerge<T>(m, d, sx);
}

}  // namespace
}  // namespace jax_ls2
