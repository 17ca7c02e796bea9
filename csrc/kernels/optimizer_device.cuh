// Device helpers shared by the fused optimizer's kernels (optimizer.cu and the
// update kernels in optimizer_update_*.cu): element access, stochastic rounding, the
// leaf-table search and per-leaf dtype dispatch. Internal linkage: every translation
// unit gets its own copy.
#pragma once
#include <algorithm>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/optimizer.h"

namespace jax_ls2 {
namespace optim {
namespace {

// ---------------------------------------------------------------- element access
template <typename T>
__device__ __forceinline__ void Load4(const T* ptr, int64_t i, int n, bool vec, float (&out)[kVec]) {
  if (vec) {
    LoadFloats<T, kVec>(ptr + i, out);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = k < n ? ToFloat(ptr[i + k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void Store4(T* ptr, int64_t i, int n, bool vec, const float (&in)[kVec]) {
  if (vec) {
    StoreFloats<T, kVec>(ptr + i, in);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (k < n) ptr[i + k] = FromFloat<T>(in[k]);
  }
}

// ---------------------------------------------------------------- stochastic rounding
template <typename T> __device__ __forceinline__ uint16_t Bits16(T v);
template <> __device__ __forceinline__ uint16_t Bits16<__half>(__half v) { return __half_as_ushort(v); }
template <> __device__ __forceinline__ uint16_t Bits16<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
template <typename T> __device__ __forceinline__ T FromBits16(uint16_t b);
template <> __device__ __forceinline__ __half FromBits16<__half>(uint16_t b) { return __ushort_as_half(b); }
template <> __device__ __forceinline__ __nv_bfloat16 FromBits16<__nv_bfloat16>(uint16_t b) { return __ushort_as_bfloat16(b); }

// Rounds x to T up or down with probability proportional to proximity (unbiased).
// bfloat16: the top half of the float32 bits after adding the low 16 bits of h (a value
// that would round to inf is truncated instead). float16: u = (h >> 8) * 2^-24 and x
// goes up iff u < (|x| - |lo|) / (|hi| - |lo|).
template <typename T>
__device__ __forceinline__ T RoundStochastic(float x, uint32_t h) {
  if (!isfinite(x)) return FromFloat<T>(x);
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const uint32_t bits = __float_as_uint(x);
    uint32_t r = (bits + (h & 0xFFFFu)) >> 16;
    if ((r & 0x7F80u) == 0x7F80u) r = bits >> 16;
    return FromBits16<T>(static_cast<uint16_t>(r));
  }
  uint16_t b = Bits16(FromFloat<T>(x));
  float lo = ToFloat(FromBits16<T>(b));
  if (fabsf(lo) > fabsf(x)) {
    b = static_cast<uint16_t>(b - 1);
    lo = ToFloat(FromBits16<T>(b));
  }
  if (lo == x) return FromBits16<T>(b);
  const uint16_t hb = static_cast<uint16_t>(b + 1);
  const float hi = ToFloat(FromBits16<T>(hb));
  const float frac = __fdiv_rn(__fsub_rn(fabsf(x), fabsf(lo)), __fsub_rn(fabsf(hi), fabsf(lo)));
  const float u = static_cast<float>(h >> 8) * __int_as_float(0x33800000);  // 2^-24
  return FromBits16<T>(u < frac ? hb : b);
}

// ---------------------------------------------------------------- table helpers
__device__ __forceinline__ int FindLeaf(const LeafTable& t, int chunk) {
  int lo = 0, hi = t.n - 1;  // largest l with chunk_start[l] <= chunk
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (t.chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename Fn>
__device__ __forceinline__ void DispatchType(uint8_t code, Fn&& fn) {
  switch (code) {
    case kF16: fn(__half{}); break;
    case kBF16: fn(__nv_bfloat16{}); break;
    default: fn(float{}); break;
  }
}

}  // namespace
}  // namespace optim
}  // namespace jax_ls2
