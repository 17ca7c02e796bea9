// Shared helpers of the kernels: the device count of SMs, vectorised access, fast math,
// reductions and the dropout hash. CUDA only: no XLA header may be included under
// csrc/kernels/ (the build compiles the kernels without XLA's include path).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace jax_ls2 {

// Rows of partial column sums a row-reducing backward (dbias, dgamma and dbeta) writes at
// most, one per block: the Python ops size the workspace (kMaxPartialRows, ...) with it,
// and the column fold (column_fold.cuh) reads them all in one memory round trip.
constexpr int kMaxPartialRows = 264;

// The multipliers of the dropout hash (DropoutHash below; jax_ls2/_random.py repeats it).
constexpr uint32_t kDropoutIndexMul = 0x9e3779b1u;
constexpr uint32_t kMix32Mul1 = 0x7feb352du, kMix32Mul2 = 0x846ca68bu;

// ---------------------------------------------------------------- mask numbering
// A mask element is numbered by its global coordinates (jax_ls2/_random.py): the array a
// kernel sees is a box of the whole array, and its element (row r, column c) has the
// 64-bit number g = base + sum_k digit_k(r) * stride[k] + c, where the digits are r
// written row-major over the nd merged leading dims of extents ext[k] (the row map of
// _random.row_map, given as FFI attributes) and base (the box's first element; from the
// seed buffer (k0, k1, base_lo, base_hi)) depends on the shard's position in the mesh.
constexpr int kMaskMaxRowDims = 6;
struct MaskRows {
  int nd = 1;
  uint32_t ext[kMaskMaxRowDims] = {1};
  uint64_t stride[kMaskMaxRowDims] = {0};
  bool even = true;  // every stride even: each row starts at the base's parity
};
// The row map from the attribute arrays; false when it cannot describe `rows` rows (too
// many dims, negative strides, extents whose product is not `rows`, or, over several
// dims, 2^32 rows or more: their digits are taken in 32 bits). Only the outermost
// extent is never read by the kernels.
inline bool MakeMaskRows(const int64_t* ext, const int64_t* stride, size_t nd, int64_t rows, MaskRows* out) {
  if (nd < 1 || nd > (size_t)kMaskMaxRowDims) return false;
  if (nd > 1 && rows > (int64_t)UINT32_MAX) return false;
  MaskRows m;
  m.nd = (int)nd;
  int64_t count = 1;
  for (size_t k = 0; k < nd; ++k) {
    if (ext[k] < 0 || stride[k] < 0 || (nd > 1 && ext[k] > (int64_t)UINT32_MAX)) return false;
    m.ext[k] = (uint32_t)ext[k];
    m.stride[k] = (uint64_t)stride[k];
    m.even = m.even && (stride[k] & 1) == 0;
    count *= ext[k];
  }
  if (count != rows) return false;
  *out = m;
  return true;
}

// Streaming multiprocessors of the current device (132 when it cannot be queried).
inline int SmCount() {
  static const int count = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();  // not the caller's error
      n = 0;
    }
    return n > 0 ? n : 132;
  }();
  return count;
}

// Device code from here on: host-only translation units (the FFI handlers, compiled as
// plain C++) see only the declarations above.
#if defined(__CUDACC__)
// ---------------------------------------------------------------- conversion
template <typename T> __device__ __forceinline__ float ToFloat(T v);
template <> __device__ __forceinline__ float ToFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ float ToFloat<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// A pack of N elements of T moved as one aligned load/store (16 bytes when possible).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
constexpr int kPack = 16 / sizeof(T);  // elements per 16-byte access

// dst = src as 32-bit words where the pack is a whole number of them: a loop-carried
// pack of 16-bit elements is otherwise moved half by half (two byte permutes a word).
template <typename T, int N>
__device__ __forceinline__ void CopyPack(Pack<T, N>& dst, const Pack<T, N>& src) {
  if constexpr (sizeof(T) * N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < (int)(sizeof(T) * N / 4); ++i)
      reinterpret_cast<uint32_t*>(dst.v)[i] = reinterpret_cast<const uint32_t*>(src.v)[i];
  } else {
    dst = src;
  }
}

// The N elements of a pack (taken by value: one wide load) as floats. bfloat16 pairs are read as 32-bit words: the
// lower element is the word shifted left by 16, the upper one the word with its low
// half cleared (one instruction each; converting element by element costs a byte
// permute more for every upper element).
template <typename T, int N>
__device__ __forceinline__ void UnpackFloats(const Pack<T, N> pk, float (&out)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const uint32_t w = reinterpret_cast<const uint32_t*>(pk.v)[i / 2];
      out[i] = __uint_as_float(w << 16);
      out[i + 1] = __uint_as_float(w & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = ToFloat(pk.v[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void LoadFloats(const T* p, float (&out)[N]) {
  UnpackFloats(*reinterpret_cast<const Pack<T, N>*>(p), out);
}
template <typename T, int N>
__device__ __forceinline__ void StoreFloats(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = FromFloat<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

// ---------------------------------------------------------------- fast math
// 2^t and 1/x by the special-function unit alone (one instruction each), subnormal
// inputs and results flushed to zero. exp2f and __fdividef without -ftz add a rescaling
// around it for subnormals; where the result feeds a 16-bit output or a sum >= 1 the
// flushed values (below 2^-126) cannot show.
constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = 2^(x * kLog2e)
__device__ __forceinline__ float Exp2Approx(float t) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(t));
  return y;
}
__device__ __forceinline__ float RcpApprox(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------- reductions
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide sum; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.f;
  return WarpSum(v);
}
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// ---------------------------------------------------------------- dropout
// Counter-based dropout, mirrored bit for bit by jax_ls2/_random.py.
// seed = (k0, k1, offset): the two words of the JAX key and an element offset
// (non-zero only for shards of a partitioned array). Element i (global index
// g = offset + i) is kept iff the 16-bit draw u16(g) >= threshold, where
// threshold = round(rate * 65536); u16(g) is the low (even g) or high (odd g) half of
// DropoutHash(g & ~1) = Mix32(((g & ~1) * kDropoutIndexMul + k0) ^ k1) (uint32 arithmetic).
//
// One Mix32 per pair of elements, about 9 integer instructions: the hash is the bulk
// of the dropout kernels' arithmetic, so it gets one round, not two (19). Hashing the
// even index rather than g >> 1 lets consecutive pairs share g0 * kDropoutIndexMul + k0 (one
// add each) and wrap exactly as the uint32 index does.
__device__ __forceinline__ uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMix32Mul1;
  x ^= x >> 15;
  x *= kMix32Mul2;
  x ^= x >> 16;
  return x;
}
// k1's share of Mix32's first step (see DropoutHashFolded).
__device__ __forceinline__ uint32_t FoldKey(uint32_t k1) { return k1 ^ (k1 >> 16); }
// DropoutHash with k1f = FoldKey(k1): Mix32(w ^ k1) with w = even_g * C + k0, its first
// step written as w ^ (w >> 16) ^ (k1 ^ (k1 >> 16)): the k1 term is loop-invariant, so
// the step stays one shift and one three-input xor.
__device__ __forceinline__ uint32_t DropoutHashFolded(uint32_t even_g, uint32_t k0, uint32_t k1f) {
  uint32_t x = even_g * kDropoutIndexMul + k0;
  x ^= (x >> 16) ^ k1f;
  x *= kMix32Mul1;
  x ^= x >> 15;
  x *= kMix32Mul2;
  x ^= x >> 16;
  return x;
}
__device__ __forceinline__ uint32_t DropoutHash(uint32_t even_g, uint32_t k0, uint32_t k1) {
  return DropoutHashFolded(even_g, k0, FoldKey(k1));
}
// The 64-bit index g = hi * 2^32 + lo (jax_ls2/_random.py, keep_bits_wide): element g
// draws from DropoutHash(lo & ~1, k0, k1 ^ c) ^ c with c = DropoutWideWord(hi, k1), which
// is 0 for hi = 0 (the 32-bit generator) and whitens every other 2^32 block.
__device__ __forceinline__ uint32_t DropoutWideWord(uint32_t hi, uint32_t k1) {
  return Mix32(hi * kDropoutIndexMul + k1) ^ Mix32(k1);
}
// The two draws of hash h against thr16 = threshold << 16: the low half u is kept iff
// (u << 16) >= thr16, the high half iff h >= thr16 (one compare each, no extraction).
__device__ __forceinline__ bool KeepLow(uint32_t h, uint32_t thr16) { return (h << 16) >= thr16; }
__device__ __forceinline__ bool KeepHigh(uint32_t h, uint32_t thr16) { return h >= thr16; }

// ---------------------------------------------------------------- global numbering
// The key words and the box's base number (see MaskRows), from the uint32[4] seed.
struct WideSeed {
  uint32_t k0, k1;
  uint64_t base;
};
__device__ __forceinline__ WideSeed LoadWideSeed(const uint32_t* seed) {
  return WideSeed{seed[0], seed[1], (uint64_t)seed[2] | ((uint64_t)seed[3] << 32)};
}
// The number of the first element of local row `row`.
__device__ __forceinline__ uint64_t MaskRowStart(const MaskRows& m, uint64_t base, int64_t row) {
  if (m.nd == 1) return base + (uint64_t)row * m.stride[0];
  uint32_t r = (uint32_t)row;
  uint64_t g = base;
  for (int k = m.nd - 1; k > 0; --k) {
    g += (uint64_t)(r % m.ext[k]) * m.stride[k];
    r /= m.ext[k];
  }
  return g + (uint64_t)r * m.stride[0];
}
// Keep flag of the element numbered g (64-bit): the draw of DropoutHash(lo & ~1, k0, k1 ^ c)
// ^ c, c = DropoutWideWord(hi, k1) (jax_ls2/_random.py, keep_bits_wide).
__device__ __forceinline__ bool DropoutKeepWide(uint64_t g, const WideSeed& s, uint32_t threshold) {
  const uint32_t lo = (uint32_t)g, hi = (uint32_t)(g >> 32);
  const uint32_t c = hi == 0u ? 0u : DropoutWideWord(hi, s.k1);
  const uint32_t h = DropoutHash(lo & ~1u, s.k0, s.k1 ^ c) ^ c;
  return (lo & 1u) ? KeepHigh(h, threshold << 16) : KeepLow(h, threshold << 16);
}
// Keep flags of elements g0 .. g0 + VEC - 1. PAIRS: the caller knows g0 is even, and each
// aligned pair takes one hash. The block word c is taken once per vector (0, and no work,
// below 2^32); a vector across a 2^32 boundary goes element by element.
template <int VEC, bool PAIRS>
__device__ __forceinline__ void KeepWide(uint64_t g0, const WideSeed& s, uint32_t threshold, bool (&keep)[VEC]) {
  const uint32_t lo0 = (uint32_t)g0, hi0 = (uint32_t)(g0 >> 32);
  if (lo0 > 0xffffffffu - (uint32_t)(VEC - 1)) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) keep[j] = DropoutKeepWide(g0 + (uint64_t)j, s, threshold);
    return;
  }
  const uint32_t c = hi0 == 0u ? 0u : DropoutWideWord(hi0, s.k1);
  const uint32_t k1f = FoldKey(s.k1 ^ c), thr16 = threshold << 16;
  if constexpr (PAIRS && VEC % 2 == 0) {
#pragma unroll
    for (int k = 0; k < VEC / 2; ++k) {
      const uint32_t h = DropoutHashFolded(lo0 + 2u * k, s.k0, k1f) ^ c;
      keep[2 * k] = KeepLow(h, thr16);
      keep[2 * k + 1] = KeepHigh(h, thr16);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const uint32_t lo = lo0 + (uint32_t)j;
      const uint32_t h = DropoutHashFolded(lo & ~1u, s.k0, k1f) ^ c;
      keep[j] = (lo & 1u) ? KeepHigh(h, thr16) : KeepLow(h, thr16);
    }
  }
}
// Runs body(keep_of) once, keep_of(g0, keep) giving the keep flags of elements g0 ..
// g0 + VEC - 1: one hash per pair when every g0 the body asks for is even (all_even).
template <int VEC, typename Body>
__device__ __forceinline__ void WithWideKeepFlags(bool all_even, const WideSeed& s, uint32_t threshold, Body&& body) {
  if (all_even) {
    body([&](uint64_t g0, bool (&keep)[VEC]) { KeepWide<VEC, true>(g0, s, threshold, keep); });
  } else {
    body([&](uint64_t g0, bool (&keep)[VEC]) { KeepWide<VEC, false>(g0, s, threshold, keep); });
  }
}

#endif  // __CUDACC__

}  // namespace jax_ls2
