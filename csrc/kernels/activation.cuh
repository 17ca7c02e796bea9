// The activations of the fused bias + activation ops (relu, GELU by erf, GELU by tanh)
// and their derivatives, in float32, for the dropout kernels and the FP8 casts alike.
// Internal linkage: each translation unit gets its own copy.
#pragma once
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dropout.h"

namespace jax_ls2 {
namespace {

// The normal distribution's tail for the exact GELU on bfloat16 activations, times a
// scale c (the dropout's 1 / kept fraction, folded in for free as log2 c in the exp2):
//   h = c * 0.5 * erfc(|v| / sqrt 2) = c * min(Phi(v), 1 - Phi(v)),  e = c * exp(-v^2 / 2),
// by Abramowitz & Stegun 7.1.26 (erfc(a) ~ t * poly(t) * exp(-a^2), t = 1 / (1 +
// 0.3275911 a), within 1.5e-7 absolute), branch-free: the hardware exp2 and reciprocal,
// five multiply-adds and two multiplies. Taking the tail itself rather than 1 - erf
// keeps GELU's negative side free of cancellation; its error is far below bfloat16's
// rounding (2^-8 relative). float32 and float16 keep erff.
struct NormalTail {
  float h, e;
};
__device__ __forceinline__ NormalTail NormalTailOf(float v, float log2_c) {
  constexpr float kHalf = 0.5f, kA = 0.3275911f * 0.70710678118654752f;
  const float e = Exp2Approx(fmaf(v * (-0.5f * kLog2e), v, log2_c));
  const float t = RcpApprox(fmaf(kA, fabsf(v), 1.f));
  float p = fmaf(kHalf * 1.061405429f, t, kHalf * -1.453152027f);
  p = fmaf(p, t, kHalf * 1.421413741f);
  p = fmaf(p, t, kHalf * -0.284496736f);
  p = fmaf(p, t, kHalf * 0.254829592f);
  return NormalTail{p * t * e, e};
}
// c * Phi(v) from the scaled tail.
__device__ __forceinline__ float NormalCdf(float v, const NormalTail& n, float c) { return v >= 0.f ? c - n.h : n.h; }

__device__ __forceinline__ float ExpApprox(float x) { return Exp2Approx(x * kLog2e); }

// 0.5 * (1 + tanh(u)) for the tanh-approximated GELU, as the logistic function of 2u:
// for bfloat16 by the hardware exp2 and reciprocal (about 5 instructions against tanhf's
// ~20), and without the cancellation of 1 + tanh(u) in the negative tail (within 3e-6
// relative of the float64 value, far below bfloat16's 2^-8); float32 and float16 keep
// tanhf.
template <typename T>
__device__ __forceinline__ float HalfOnePlusTanh(float u) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return RcpApprox(1.f + ExpApprox(-2.f * u));
  } else {
    return 0.5f * (1.f + tanhf(u));
  }
}

// act(v) * c and act'(v) * c, c the dropout's scale (log2_c its log2; 1 and 0 without
// dropout): the exact GELU on bfloat16 takes c inside its tail, the others multiply.
template <int ACT, typename T>
__device__ __forceinline__ float ActScaled(float v, float c, float log2_c) {
  if constexpr (ACT == kActRelu) {
    return fmaxf(v, 0.f) * c;
  } else if constexpr (ACT == kActGelu) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return v * NormalCdf(v, NormalTailOf(v, log2_c), c);
    } else {
      return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)) * c;
    }
  } else {
    const float u = 0.79788456080286536f * (v + 0.044715f * v * v * v);
    return v * HalfOnePlusTanh<T>(u) * c;
  }
}

template <int ACT, typename T>
__device__ __forceinline__ float ActGradScaled(float v, float c, float log2_c) {
  if constexpr (ACT == kActRelu) {
    return v > 0.f ? c : 0.f;
  } else if constexpr (ACT == kActGelu) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // One exp for both: the tail needs exp(-v^2 / 2), as does the density.
      const NormalTail n = NormalTailOf(v, log2_c);
      return fmaf(v * 0.39894228040143268f, n.e, NormalCdf(v, n, c));
    } else {
      const float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
      return (cdf + v * (0.39894228040143268f * expf(-0.5f * v * v))) * c;
    }
  } else {
    // With s = 0.5 * (1 + tanh(u)): 0.5 * (1 - tanh(u)^2) = 2 * s * (1 - s).
    const float k = 0.79788456080286536f, cc = 0.044715f;
    const float s = HalfOnePlusTanh<T>(k * (v + cc * v * v * v));
    return (s + 2.f * v * s * (1.f - s) * k * (1.f + 3.f * cc * v * v)) * c;
  }
}

}  // namespace
}  // namespace jax_ls2
