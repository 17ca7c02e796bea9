// Fused FP8 casts (kernels/fp8_cast.h), one pass over memory each.
//
// LayerNorm: a "row group" of blockDim.x threads holds one row in registers (the
// layout of the LayerNorm forward in layer_norm.cu), float32 statistics, and writes the
// normalised row as FP8; longer rows take one block per row, re-reading it from L2.
// Bias + activation: thread x of a block owns one column pack (16-byte loads where the
// sizes allow) and its bias, its row lanes stride over the rows.
// Cast + transpose (with or without the activation's backward and dbias): 64 x 64
// tiles; each thread loads packs along a row (coalesced), writes their FP8 bytes to the
// row-major output (coalesced) and to a shared-memory tile, from which 16 bytes of a
// column are gathered per thread and written as one store of the transposed output
// (coalesced along its rows). Blocks are persistent over row tiles; with dbias each
// keeps its columns' partial sums in registers, folds its row lanes in a fixed order
// and writes one partial row; a second kernel sums the partial rows in a fixed order,
// so dbias is the same in every run.
#include <cuda_fp8.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "kernels/activation.cuh"
#include "kernels/column_fold.cuh"
#include "kernels/common.cuh"
#include "kernels/dropout.h"
#include "kernels/fp8_cast.h"
#include "kernels/layer_norm_rows.cuh"

namespace jax_ls2 {
namespace {

// ------------------------------------------------------------------ casts and amax
template <int F>
constexpr __nv_fp8_interpretation_t kInterp = F == kFp8E4M3 ? __NV_E4M3 : __NV_E5M2;

// N float32 values (already scaled) as N FP8 bytes: one byte, or 32-bit words (N a
// multiple of 4) each assembled from two conversions' byte pairs and stored whole, to
// global memory and to the transpose tile alike. Never split into bytes: from correct
// PTX, ptxas 13.0 (sm_90) mis-assembled a byte-wise pack stored both as one 8-byte value
// and word by word (in the 8-byte store, byte 2 of each word repeated byte 0).
template <int N>
struct alignas(N) Fp8Pack {
  static_assert(N % 4 == 0, "whole 32-bit words");
  uint32_t w[N / 4];
};
template <>
struct Fp8Pack<1> {
  uint8_t b;
};
template <int F, int N>
__device__ __forceinline__ Fp8Pack<N> ToFp8(const float (&v)[N]) {
  Fp8Pack<N> p;
  if constexpr (N == 1) {
    p.b = __nv_cvt_float_to_fp8(v[0], __NV_SATFINITE, kInterp<F>);
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      // Each pair: the lower element in the low byte.
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[i], v[i + 1]), __NV_SATFINITE, kInterp<F>);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[i + 2], v[i + 3]), __NV_SATFINITE, kInterp<F>);
      p.w[i / 4] = lo | (hi << 16);
    }
  }
  return p;
}

// |v| as bits: ordered like |v| as unsigned integers, NaN above infinity.
__device__ __forceinline__ uint32_t AbsBits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Block-wide max of `bits` into *amax (float32 bits; zeroed by the launcher). Every
// thread of the block must call it; blockDim is a multiple of 32.
__device__ __forceinline__ void AmaxToGlobal(uint32_t bits, float* amax) {
  __shared__ uint32_t warps[32];
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  const int lane = tid & 31, warp = tid >> 5;
  bits = __reduce_max_sync(0xffffffffu, bits);
  __syncthreads();  // `warps` may still be read by an earlier call's warp 0
  if (lane == 0) warps[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = __reduce_max_sync(0xffffffffu, lane < (nthreads >> 5) ? warps[lane] : 0u);
    if (lane == 0 && bits != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax), bits);
  }
}

// The activation the FP8 ops apply, NaN propagating through relu as through max in jnp.
template <int ACT, typename T>
__device__ __forceinline__ float Act(float v) {
  if constexpr (ACT == kActRelu) {
    return v > 0.f || v != v ? v : 0.f;
  } else {
    return ActScaled<ACT, T>(v, 1.f, 0.f);
  }
}

template <typename T>
bool Aligned(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-byte packs of T where `n` and every pointer allow, else single elements.
template <typename T>
int PickVec(int64_t n, std::initializer_list<const void*> ptrs) {
  if (n % kPack<T> != 0) return 1;
  for (const void* p : ptrs)
    if (!Aligned<T>(p)) return 1;
  return kPack<T>;
}

int NextPow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Resident blocks aimed at by the persistent grids (a few per SM).
constexpr int kBlocksPerSm = 8;

// ------------------------------------------------------------------ LayerNorm
constexpr int kLnWideElems = 32, kLnElems = 16, kLnMaxThreads = 512, kLnLoopThreads = 512;

template <typename T, int VEC, int ELEMS, int F>
__global__ void __launch_bounds__(kLnMaxThreads) LayerNormFp8Kernel(LayerNormFp8Args a) {
  constexpr int ITEMS = ELEMS / VEC;
  using PackT = Pack<T, VEC>;
  __shared__ float scratch[64 * 32];
  const int H = (int)a.hidden;
  const float scale = *a.scale;
  const int64_t stride = (int64_t)gridDim.x * blockDim.y;
  uint32_t amax = 0u;
  int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  // The trip count is the same for the whole block (RowSum synchronises it).
  for (int64_t first = (int64_t)blockIdx.x * blockDim.y; first < a.rows; first += stride, row += stride) {
    const bool valid = row < a.rows;
    const int64_t off = (valid ? row : 0) * a.hidden;
    PackT v[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (valid && col < H) v[i] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.x) + off + col);
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (valid && col < H) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) s += ToFloat(v[i].v[j]);
      }
    }
    RowSum(s, scratch);
    const float mean = s / H;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (valid && col < H) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = ToFloat(v[i].v[j]) - mean;
          ss += d * d;
        }
      }
    }
    RowSum(ss, scratch);
    const float rstd = rsqrtf(ss / H + a.eps);
    if (valid) {
      uint8_t* y = static_cast<uint8_t*>(a.y) + off;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * blockDim.x + threadIdx.x) * VEC;
        if (col < H) {
          float g[VEC], b[VEC], o[VEC];
          LoadFloats<T, VEC>(static_cast<const T*>(a.gamma) + col, g);
          LoadFloats<T, VEC>(static_cast<const T*>(a.beta) + col, b);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float out = (ToFloat(v[i].v[j]) - mean) * rstd * g[j] + b[j];
            amax = max(amax, AbsBits(out));
            o[j] = out * scale;
          }
          *reinterpret_cast<Fp8Pack<VEC>*>(y + col) = ToFp8<F, VEC>(o);
        }
      }
      if (threadIdx.x == 0) {
        a.mean[row] = mean;
        a.rstd[row] = rstd;
      }
    }
  }
  AmaxToGlobal(amax, a.amax);
}

// Rows too long for registers: one block per row at a time, three reads of the row.
template <typename T, int F>
__global__ void __launch_bounds__(kLnLoopThreads) LayerNormFp8LoopKernel(LayerNormFp8Args a) {
  __shared__ float scratch[64];
  const int64_t H = a.hidden;
  const float scale = *a.scale;
  const T* g = static_cast<const T*>(a.gamma);
  const T* b = static_cast<const T*>(a.beta);
  uint32_t amax = 0u;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t off = row * H;
    const T* x = static_cast<const T*>(a.x) + off;
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) s += ToFloat(x[c]);
    RowSum(s, scratch);
    const float mean = s / H;
    float ss = 0.f;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float d = ToFloat(x[c]) - mean;
      ss += d * d;
    }
    RowSum(ss, scratch);
    const float rstd = rsqrtf(ss / H + a.eps);
    uint8_t* y = static_cast<uint8_t*>(a.y) + off;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float out[1] = {(ToFloat(x[c]) - mean) * rstd * ToFloat(g[c]) + ToFloat(b[c])};
      amax = max(amax, AbsBits(out[0]));
      const float o[1] = {out[0] * scale};
      y[c] = ToFp8<F, 1>(o).b;
    }
    if (threadIdx.x == 0) {
      a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
  }
  AmaxToGlobal(amax, a.amax);
}

template <typename T, int F>
cudaError_t LayerNormFp8(const LayerNormFp8Args& a, cudaStream_t stream) {
  const int vec = PickVec<T>(a.hidden, {a.x, a.gamma, a.beta, a.y});
  constexpr int kVec = kPack<T>;
  const int elems = vec == kVec ? kLnWideElems : kLnElems;
  const int64_t need = ((a.hidden + vec - 1) / vec + elems / vec - 1) / (elems / vec);
  const int cap = SmCount() * kBlocksPerSm;
  if (need > kLnMaxThreads) {
    LayerNormFp8LoopKernel<T, F><<<(unsigned)std::min<int64_t>(a.rows, cap), kLnLoopThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  const int tpr = NextPow2(need);
  const int ry = tpr >= 128 ? 1 : 128 / tpr;
  const dim3 block(tpr, ry);
  const unsigned grid = (unsigned)std::min<int64_t>((a.rows + ry - 1) / ry, cap);
  if (vec == kVec) {
    LayerNormFp8Kernel<T, kVec, kLnWideElems, F><<<grid, block, 0, stream>>>(a);
  } else {
    LayerNormFp8Kernel<T, 1, kLnElems, F><<<grid, block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

// ------------------------------------------------------------------ bias + activation
constexpr int kBiasActThreads = 512, kBiasActRows = 4;  // rows each thread loads before computing

template <typename T, int VEC, int ACT, int F>
__global__ void __launch_bounds__(kBiasActThreads) BiasActFp8Kernel(BiasActFp8Args a) {
  using PackT = Pack<T, VEC>;
  const int64_t col = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  const bool has_col = col < a.cols;
  const float scale = *a.scale;
  float bias[VEC];
  if (has_col) LoadFloats<T, VEC>(static_cast<const T*>(a.bias) + col, bias);
  uint32_t amax = 0u;
  const int64_t stride = (int64_t)gridDim.y * blockDim.y;
  for (int64_t row = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; has_col && row < a.rows;
       row += kBiasActRows * stride) {
    PackT in[kBiasActRows];
#pragma unroll
    for (int u = 0; u < kBiasActRows; ++u) {
      const int64_t r = row + u * stride;
      if (r < a.rows) in[u] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.x) + r * a.cols + col);
    }
#pragma unroll
    for (int u = 0; u < kBiasActRows; ++u) {
      const int64_t r = row + u * stride;
      if (r < a.rows) {
        float v[VEC], o[VEC];
        UnpackFloats(in[u], v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float y = Act<ACT, T>(v[j] + bias[j]);
          amax = max(amax, AbsBits(y));
          o[j] = y * scale;
        }
        *reinterpret_cast<Fp8Pack<VEC>*>(static_cast<uint8_t*>(a.y) + r * a.cols + col) = ToFp8<F, VEC>(o);
      }
    }
  }
  AmaxToGlobal(amax, a.amax);
}

template <typename T, int ACT, int F>
cudaError_t BiasActFp8(const BiasActFp8Args& a, cudaStream_t stream) {
  const int vec = PickVec<T>(a.cols, {a.x, a.bias, a.y});
  const int64_t packs = (a.cols + vec - 1) / vec;
  const int tx = (int)std::min<int64_t>(256, std::max(32, NextPow2(packs)));
  const int ty = kBiasActThreads / tx;
  const int64_t gx = (packs + tx - 1) / tx;
  const int64_t want_y = std::max<int64_t>(1, SmCount() * kBlocksPerSm / 2 / gx);
  const int64_t gy = std::min<int64_t>({(a.rows + ty - 1) / ty, want_y, 65535});
  const dim3 grid((unsigned)gx, (unsigned)gy), block(tx, ty);
  constexpr int kVec = kPack<T>;
  if (vec == kVec) {
    BiasActFp8Kernel<T, kVec, ACT, F><<<grid, block, 0, stream>>>(a);
  } else {
    BiasActFp8Kernel<T, 1, ACT, F><<<grid, block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

// ------------------------------------------------------------------ cast + transpose
constexpr int kTile = 64, kCtThreads = 256;
constexpr int kTileStride = kTile + 4;  // bytes per shared row: 4-byte aligned, gathers 2-way conflicted at most
constexpr int kNoAct = -1;              // ACT of the plain cast + transpose

// ACT == kNoAct: v = x; else v = grad * act'(x) and dbias partials. WIDE_T: the
// transposed rows take 16-byte stores (rows % 16 == 0).
template <typename T, int VEC, int ACT, int F, bool WIDE_T>
__global__ void __launch_bounds__(kCtThreads) CastTransposeKernel(CastTransposeArgs a) {
  constexpr int LANES = kTile / VEC;              // threads along a tile row
  constexpr int RPP = kCtThreads / LANES;         // tile rows per pass
  constexpr int PASSES = kTile / RPP;
  constexpr bool kGrad = ACT != kNoAct;
  using PackT = Pack<T, VEC>;
  __shared__ alignas(16) uint8_t tile[kTile * kTileStride];
  const int lane = threadIdx.x % LANES, rl = threadIdx.x / LANES;
  const int64_t c0 = (int64_t)blockIdx.x * kTile;
  const int64_t col = c0 + lane * VEC;
  const bool has_col = col < a.cols;  // whole packs: cols % VEC == 0
  const float scale = *a.scale;
  uint32_t amax = 0u;
  float db[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) db[j] = 0.f;
  // The transposed store: column k of the tile, its 16 rows from m0.
  const int tk = threadIdx.x / (kTile / 16), tm = (threadIdx.x % (kTile / 16)) * 16;
  const int64_t row_tiles = (a.rows + kTile - 1) / kTile;

  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t r0 = rt * kTile;
    PackT xin[PASSES], gin[kGrad ? PASSES : 1];
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int64_t row = r0 + p * RPP + rl;
      if (has_col && row < a.rows) {
        xin[p] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.x) + row * a.cols + col);
        if constexpr (kGrad) gin[p] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.grad) + row * a.cols + col);
      }
    }
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int r = p * RPP + rl;
      const int64_t row = r0 + r;
      if (has_col && row < a.rows) {
        float v[VEC], o[VEC];
        UnpackFloats(xin[p], v);
        if constexpr (kGrad) {
          float g[VEC];
          UnpackFloats(gin[p], g);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            v[j] = g[j] * ActGradScaled<ACT, T>(v[j], 1.f, 0.f);
            db[j] += v[j];
          }
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          amax = max(amax, AbsBits(v[j]));
          o[j] = v[j] * scale;
        }
        const Fp8Pack<VEC> q = ToFp8<F, VEC>(o);
        *reinterpret_cast<Fp8Pack<VEC>*>(static_cast<uint8_t*>(a.out) + row * a.cols + col) = q;
        uint8_t* s = tile + r * kTileStride + lane * VEC;
        if constexpr (VEC == 1) {
          s[0] = q.b;
        } else {
#pragma unroll
          for (int w = 0; w < VEC / 4; ++w) reinterpret_cast<uint32_t*>(s)[w] = q.w[w];
        }
      }
    }
    __syncthreads();
    if (c0 + tk < a.cols && r0 + tm < a.rows) {
      uint8_t* dst = static_cast<uint8_t*>(a.out_t) + (c0 + tk) * a.rows + r0 + tm;
      if (WIDE_T && r0 + tm + 16 <= a.rows) {
        alignas(16) uint8_t b[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) b[i] = tile[(tm + i) * kTileStride + tk];
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(b);
      } else {
        const int n = (int)std::min<int64_t>(16, a.rows - r0 - tm);
        for (int i = 0; i < n; ++i) dst[i] = tile[(tm + i) * kTileStride + tk];
      }
    }
    __syncthreads();  // the tile is rewritten by the next row tile
  }
  AmaxToGlobal(amax, a.amax);
  if constexpr (kGrad) {
    // The row lanes' column sums, folded in lane order: one partial row per block.
    __shared__ float fold[RPP][kTile];
#pragma unroll
    for (int j = 0; j < VEC; ++j) fold[rl][lane * VEC + j] = db[j];
    __syncthreads();
    if (threadIdx.x < kTile && c0 + threadIdx.x < a.cols) {
      float s = 0.f;
#pragma unroll
      for (int l = 0; l < RPP; ++l) s += fold[l][threadIdx.x];
      a.partials[(int64_t)blockIdx.y * a.cols + c0 + threadIdx.x] = s;
    }
  }
}

template <typename T, int ACT, int F>
cudaError_t CastTranspose(const CastTransposeArgs& a, cudaStream_t stream) {
  constexpr bool kGrad = ACT != kNoAct;
  const int vec = PickVec<T>(a.cols, {a.x, a.grad, a.out});
  const bool wide_t = a.rows % 16 == 0 && Aligned<T>(a.out_t);
  const int64_t col_tiles = (a.cols + kTile - 1) / kTile, row_tiles = (a.rows + kTile - 1) / kTile;
  int64_t gy = std::min<int64_t>(row_tiles, std::max<int64_t>(1, SmCount() * kBlocksPerSm / col_tiles));
  if (kGrad) gy = std::min<int64_t>(gy, a.max_parts);
  gy = std::min<int64_t>(gy, 65535);
  const dim3 grid((unsigned)col_tiles, (unsigned)gy);
  constexpr int kVec = kPack<T>;
  void (*k)(CastTransposeArgs) = nullptr;
  if (vec == kVec) {
    k = wide_t ? CastTransposeKernel<T, kVec, ACT, F, true> : CastTransposeKernel<T, kVec, ACT, F, false>;
  } else {
    k = wide_t ? CastTransposeKernel<T, 1, ACT, F, true> : CastTransposeKernel<T, 1, ACT, F, false>;
  }
  k<<<grid, kCtThreads, 0, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || !kGrad) return err;
  LaunchSumColumnPartials(a.partials, (int)gy, a.cols, a.cols, a.dbias, nullptr, stream);
  return cudaGetLastError();
}

// Calls fn(std::integral_constant<int, F>{}) for the format.
template <typename Fn>
cudaError_t WithFormat(Fp8Format f, Fn&& fn) {
  switch (f) {
    case kFp8E4M3: return fn(std::integral_constant<int, kFp8E4M3>{});
    case kFp8E5M2: return fn(std::integral_constant<int, kFp8E5M2>{});
  }
  return cudaErrorInvalidValue;
}

// Calls fn(std::integral_constant<int, ACT>{}) for the activation code.
template <typename Fn>
cudaError_t WithActivation(int act, Fn&& fn) {
  switch (act) {
    case kActRelu: return fn(std::integral_constant<int, kActRelu>{});
    case kActGelu: return fn(std::integral_constant<int, kActGelu>{});
    case kActGeluTanh: return fn(std::integral_constant<int, kActGeluTanh>{});
  }
  return cudaErrorInvalidValue;
}

// The amax output starts at 0 (the kernels' atomicMax only raises it).
cudaError_t ZeroAmax(float* amax, cudaStream_t stream) { return cudaMemsetAsync(amax, 0, sizeof(float), stream); }

}  // namespace

template <typename T>
cudaError_t LaunchLayerNormFp8(const LayerNormFp8Args& a, Fp8Format f, cudaStream_t stream) {
  cudaError_t err = ZeroAmax(a.amax, stream);
  if (err != cudaSuccess || a.rows == 0 || a.hidden == 0) return err;
  return WithFormat(f, [&](auto fmt) { return LayerNormFp8<T, decltype(fmt)::value>(a, stream); });
}

template <typename T>
cudaError_t LaunchBiasActFp8(const BiasActFp8Args& a, Fp8Format f, cudaStream_t stream) {
  cudaError_t err = ZeroAmax(a.amax, stream);
  if (err != cudaSuccess || a.rows == 0 || a.cols == 0) return err;
  return WithFormat(f, [&](auto fmt) {
    return WithActivation(a.activation, [&](auto act) {
      return BiasActFp8<T, decltype(act)::value, decltype(fmt)::value>(a, stream);
    });
  });
}

template <typename T>
cudaError_t LaunchCastTranspose(const CastTransposeArgs& a, Fp8Format f, cudaStream_t stream) {
  cudaError_t err = ZeroAmax(a.amax, stream);
  if (err != cudaSuccess || a.cols == 0) return err;
  if (a.rows == 0) {
    return a.grad != nullptr ? cudaMemsetAsync(a.dbias, 0, a.cols * sizeof(float), stream) : cudaSuccess;
  }
  if (a.grad != nullptr && a.max_parts < 1) return cudaErrorInvalidValue;
  return WithFormat(f, [&](auto fmt) {
    constexpr int F = decltype(fmt)::value;
    if (a.grad == nullptr) return CastTranspose<T, kNoAct, F>(a, stream);
    return WithActivation(a.activation, [&](auto act) { return CastTranspose<T, decltype(act)::value, F>(a, stream); });
  });
}

#define JAX_LS2_INSTANTIATE(T)                                                                  \
  template cudaError_t LaunchLayerNormFp8<T>(const LayerNormFp8Args&, Fp8Format, cudaStream_t); \
  template cudaError_t LaunchBiasActFp8<T>(const BiasActFp8Args&, Fp8Format, cudaStream_t);     \
  template cudaError_t LaunchCastTranspose<T>(const CastTransposeArgs&, Fp8Format, cudaStream_t);
JAX_LS2_INSTANTIATE(float)
JAX_LS2_INSTANTIATE(__half)
JAX_LS2_INSTANTIATE(__nv_bfloat16)
#undef JAX_LS2_INSTANTIATE

}  // namespace jax_ls2
