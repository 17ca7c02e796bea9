// RMSNorm forward/backward over the last axis, fp32 statistics.
//
// Register path (hidden <= 16384 forward, <= 8192 backward with 16-byte accesses): a row
// group of blockDim.x threads owns one row in registers, blockDim.y row groups a block;
// every load of a row is issued before any is used. The backward is persistent over
// rows: each thread keeps its columns' dgamma partial sums in registers, the block folds
// its row groups in shared memory in a fixed order and writes one partial row; a second
// kernel sums the partial rows (column_fold.cuh), so dgamma is the same in every run.
// Looped path (longer rows): one row a block at a time, re-reading the row from L2.
#include <algorithm>
#include <initializer_list>

#include "kernels/column_fold.cuh"
#include "kernels/common.cuh"
#include "kernels/layer_norm_rows.cuh"
#include "kernels/rms_norm.h"

namespace jax_ls2 {
namespace {

// Elements a thread holds: the forward 32 with 16-byte accesses (16 scalar), the backward
// 16 (8 scalar), whose x, dy, weight and dgamma partials all stay in registers.
constexpr int kFwdWideElems = 32, kFwdElems = 16;
constexpr int kBwdWideElems = 16, kBwdElems = 8;
constexpr int kMaxThreads = 512;
constexpr int kLoopThreads = 512;
// Row groups wider than a warp reduce through shared memory, 64 floats each; there are at
// most kMaxThreads / 64 of them in a block.
constexpr int kScratch = 64 * (kMaxThreads / 64);

template <typename T>
__device__ __forceinline__ float RoundTo(float v) { return ToFloat(FromFloat<T>(v)); }

__device__ __forceinline__ float Weight(float g, bool unit_offset) { return unit_offset ? g + 1.f : g; }

// ------------------------------------------------------------------ forward
template <typename T, int VEC, int ITEMS, bool RES>
__global__ void __launch_bounds__(kMaxThreads) RmsNormFwdKernel(RmsNormFwdArgs a) {
  using PackT = Pack<T, VEC>;
  __shared__ float scratch[kScratch];
  const int H = (int)a.hidden;
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid = row < a.rows;
  const int64_t off = (valid ? row : 0) * a.hidden;
  PackT v[ITEMS], r[RES ? ITEMS : 1];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = (i * blockDim.x + threadIdx.x) * VEC;
    if (valid && col < H) {
      v[i] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.x) + off + col);
      if constexpr (RES) r[i] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.residual) + off + col);
    }
  }
  float ss = 0.f, unused = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = (i * blockDim.x + threadIdx.x) * VEC;
    if (valid && col < H) {
      if constexpr (RES) {
        // The packs then hold x + residual rounded to T, which is also the `sum` output.
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[i].v[j] = FromFloat<T>(ToFloat(v[i].v[j]) + ToFloat(r[i].v[j]));
        *reinterpret_cast<PackT*>(static_cast<T*>(a.sum) + off + col) = v[i];
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = ToFloat(v[i].v[j]);
        ss = fmaf(f, f, ss);
      }
    }
  }
  RowSum2(ss, unused, scratch);
  const float rstd = rsqrtf(ss / H + a.eps);
  if (!valid) return;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = (i * blockDim.x + threadIdx.x) * VEC;
    if (col < H) {
      float g[VEC], o[VEC];
      LoadFloats<T, VEC>(static_cast<const T*>(a.gamma) + col, g);
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = ToFloat(v[i].v[j]) * rstd * Weight(g[j], a.unit_offset);
      StoreFloats<T, VEC>(static_cast<T*>(a.y) + off + col, o);
    }
  }
  if (threadIdx.x == 0) a.rstd[row] = rstd;
}

// One block per row; re-reads the row (from L2) instead of holding it.
template <typename T, bool RES>
__global__ void __launch_bounds__(kLoopThreads) RmsNormFwdLoopKernel(RmsNormFwdArgs a) {
  __shared__ float scratch[64];
  const int64_t H = a.hidden, off = (int64_t)blockIdx.x * H;
  const T* src = static_cast<const T*>(a.x) + off;
  float ss = 0.f, unused = 0.f;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float v = ToFloat(src[c]);
    if constexpr (RES) {
      v = RoundTo<T>(v + ToFloat(static_cast<const T*>(a.residual)[off + c]));
      static_cast<T*>(a.sum)[off + c] = FromFloat<T>(v);
    }
    ss = fmaf(v, v, ss);
  }
  if constexpr (RES) src = static_cast<const T*>(a.sum) + off;
  RowSum2(ss, unused, scratch);  // its __syncthreads also publishes the sum row
  const float rstd = rsqrtf(ss / H + a.eps);
  const T* g = static_cast<const T*>(a.gamma);
  T* y = static_cast<T*>(a.y) + off;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x)
    y[c] = FromFloat<T>(ToFloat(src[c]) * rstd * Weight(ToFloat(g[c]), a.unit_offset));
  if (threadIdx.x == 0) a.rstd[blockIdx.x] = rstd;
}

// ------------------------------------------------------------------ backward
// dx = rstd * (dy * w - xhat * mean(dy * w * xhat)) [+ dsum], xhat = x * rstd, dy the sum
// of the NDY cotangents; dgamma = sum over rows of dy * xhat.
template <typename T, int VEC, int ITEMS, int NDY, bool RES>
__global__ void __launch_bounds__(kMaxThreads) RmsNormBwdKernel(RmsNormBwdArgs a) {
  __shared__ float scratch[kScratch];
  extern __shared__ float fold[];  // (hidden,)
  const int H = (int)a.hidden;
  const float inv_h = 1.f / H;
  float w[ITEMS][VEC], dg[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = (i * blockDim.x + threadIdx.x) * VEC;
    if (col < H) {
      LoadFloats<T, VEC>(static_cast<const T*>(a.gamma) + col, w[i]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[i][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      w[i][j] = col < H ? Weight(w[i][j], a.unit_offset) : 0.f;
      dg[i][j] = 0.f;
    }
  }

  for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < a.rows; base += (int64_t)gridDim.x * blockDim.y) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < a.rows;
    const int64_t off = (valid ? row : 0) * a.hidden;
    const float rstd = valid ? a.rstd[row] : 0.f;
    float xh[ITEMS][VEC], dy[ITEMS][VEC], ds[RES ? ITEMS : 1][VEC];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (valid && col < H) {
        float more[NDY > 1 ? NDY - 1 : 1][VEC];
        LoadFloats<T, VEC>(static_cast<const T*>(a.x) + off + col, xh[i]);
        LoadFloats<T, VEC>(static_cast<const T*>(a.dy[0]) + off + col, dy[i]);
#pragma unroll
        for (int m = 1; m < NDY; ++m) LoadFloats<T, VEC>(static_cast<const T*>(a.dy[m]) + off + col, more[m - 1]);
        if constexpr (RES) LoadFloats<T, VEC>(static_cast<const T*>(a.dsum) + off + col, ds[i]);
#pragma unroll
        for (int m = 1; m < NDY; ++m)
#pragma unroll
          for (int j = 0; j < VEC; ++j) dy[i][j] += more[m - 1][j];
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) xh[i][j] = dy[i][j] = 0.f;
      }
    }
    float s = 0.f, unused = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        xh[i][j] *= rstd;
        s = fmaf(dy[i][j] * w[i][j], xh[i][j], s);
        dg[i][j] = fmaf(dy[i][j], xh[i][j], dg[i][j]);
      }
    }
    RowSum2(s, unused, scratch);
    s *= inv_h;
    if (valid) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * blockDim.x + threadIdx.x) * VEC;
        if (col < H) {
          float o[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            o[j] = rstd * (dy[i][j] * w[i][j] - xh[i][j] * s);
            if constexpr (RES) o[j] += ds[i][j];
          }
          StoreFloats<T, VEC>(static_cast<T*>(a.dx) + off + col, o);
        }
      }
    }
  }

  // Fold the row groups' dgamma partials in a fixed order; write the block's partial row.
  for (int yy = 0; yy < (int)blockDim.y; ++yy) {
    if ((int)threadIdx.y == yy) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * blockDim.x + threadIdx.x) * VEC;
        if (col < H) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) fold[col + j] = yy == 0 ? dg[i][j] : fold[col + j] + dg[i][j];
        }
      }
    }
    __syncthreads();
  }
  float* part = a.partials + (int64_t)blockIdx.x * H;
  for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < H; c += blockDim.x * blockDim.y) part[c] = fold[c];
}

template <typename T>
__device__ __forceinline__ float DyAt(const RmsNormBwdArgs& a, int64_t i) {
  float d = ToFloat(static_cast<const T*>(a.dy[0])[i]);
  for (int m = 1; m < a.n_dy; ++m) d += ToFloat(static_cast<const T*>(a.dy[m])[i]);
  return d;
}

// Long rows: persistent blocks, one row at a time; each block accumulates its dgamma
// partial row in its slice of the workspace (each column owned by one thread).
template <typename T>
__global__ void __launch_bounds__(kLoopThreads) RmsNormBwdLoopKernel(RmsNormBwdArgs a) {
  __shared__ float scratch[64];
  const int64_t H = a.hidden;
  const float inv_h = 1.f / H;
  const T* gamma = static_cast<const T*>(a.gamma);
  const T* x = static_cast<const T*>(a.x);
  float* acc = a.partials + (int64_t)blockIdx.x * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) acc[c] = 0.f;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t off = row * H;
    const float rstd = a.rstd[row];
    float s = 0.f, unused = 0.f;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float xh = ToFloat(x[off + c]) * rstd, d = DyAt<T>(a, off + c);
      s = fmaf(d * Weight(ToFloat(gamma[c]), a.unit_offset), xh, s);
      acc[c] = fmaf(d, xh, acc[c]);
    }
    RowSum2(s, unused, scratch);
    s *= inv_h;
    T* dx = static_cast<T*>(a.dx) + off;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float xh = ToFloat(x[off + c]) * rstd;
      float o = rstd * (DyAt<T>(a, off + c) * Weight(ToFloat(gamma[c]), a.unit_offset) - xh * s);
      if (a.dsum != nullptr) o += ToFloat(static_cast<const T*>(a.dsum)[off + c]);
      dx[c] = FromFloat<T>(o);
    }
  }
}

// Threads per row group covering `hidden` with `elems` elements each: a power of two up
// to a warp, then whole warps; 0 when more than kMaxThreads would be needed.
int ThreadsPerRow(int64_t hidden, int vec, int elems) {
  const int64_t vecs = (hidden + vec - 1) / vec;
  const int items = elems / vec;
  const int64_t need = (vecs + items - 1) / items;
  int tpr = 1;
  while (tpr < need && tpr < 32) tpr <<= 1;
  if (need > 32) tpr = (int)((need + 31) / 32 * 32);
  return tpr <= kMaxThreads ? tpr : 0;
}

template <typename T>
int PickVec(int64_t hidden, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = kPack<T>;
  if (hidden % kVec != 0) return 1;
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return kVec;
}

template <typename T, int NDY>
auto PickBwdKernel(bool wide, bool res) -> void (*)(RmsNormBwdArgs) {
  constexpr int kVec = kPack<T>;
  if (wide) return res ? RmsNormBwdKernel<T, kVec, kBwdWideElems / kVec, NDY, true>
                       : RmsNormBwdKernel<T, kVec, kBwdWideElems / kVec, NDY, false>;
  return res ? RmsNormBwdKernel<T, 1, kBwdElems, NDY, true> : RmsNormBwdKernel<T, 1, kBwdElems, NDY, false>;
}

}  // namespace

template <typename T>
cudaError_t LaunchRmsNormFwd(const RmsNormFwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.hidden == 0) return cudaSuccess;
  constexpr int kVec = kPack<T>;
  const bool res = a.residual != nullptr;
  const bool wide = PickVec<T>(a.hidden, {a.x, a.residual, a.gamma, a.y, a.sum}) == kVec;
  const int tpr = ThreadsPerRow(a.hidden, wide ? kVec : 1, wide ? kFwdWideElems : kFwdElems);
  if (tpr == 0) {
    auto k = res ? RmsNormFwdLoopKernel<T, true> : RmsNormFwdLoopKernel<T, false>;
    k<<<(unsigned)a.rows, kLoopThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  const int ry = tpr >= 128 ? 1 : 128 / tpr;
  const dim3 block(tpr, ry);
  const unsigned grid = (unsigned)((a.rows + ry - 1) / ry);
  if (wide) {
    auto k = res ? RmsNormFwdKernel<T, kVec, kFwdWideElems / kVec, true>
                 : RmsNormFwdKernel<T, kVec, kFwdWideElems / kVec, false>;
    k<<<grid, block, 0, stream>>>(a);
  } else {
    auto k = res ? RmsNormFwdKernel<T, 1, kFwdElems, true> : RmsNormFwdKernel<T, 1, kFwdElems, false>;
    k<<<grid, block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchRmsNormBwd(const RmsNormBwdArgs& a, cudaStream_t stream) {
  if (a.hidden == 0) return cudaSuccess;
  if (a.n_dy < 1 || a.n_dy > kRmsNormMaxExtraDy + 1 || a.max_parts < 1) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaMemsetAsync(a.dgamma, 0, a.hidden * sizeof(float), stream);
  constexpr int kVec = kPack<T>;
  const bool res = a.dsum != nullptr;
  bool wide = PickVec<T>(a.hidden, {a.x, a.dsum, a.gamma, a.dx}) == kVec;
  for (int m = 0; m < a.n_dy; ++m) wide = wide && PickVec<T>(a.hidden, {a.dy[m]}) == kVec;
  const int tpr = ThreadsPerRow(a.hidden, wide ? kVec : 1, wide ? kBwdWideElems : kBwdElems);
  int parts = 0;
  if (tpr == 0) {
    parts = (int)std::min<int64_t>(a.rows, a.max_parts);
    RmsNormBwdLoopKernel<T><<<parts, kLoopThreads, 0, stream>>>(a);
  } else {
    const int ry = (int)std::min<int64_t>(std::max(1, kMaxThreads / tpr), a.rows);
    parts = (int)std::min<int64_t>((a.rows + ry - 1) / ry, a.max_parts);
    void (*k)(RmsNormBwdArgs) = nullptr;
    switch (a.n_dy) {
      case 1: k = PickBwdKernel<T, 1>(wide, res); break;
      case 2: k = PickBwdKernel<T, 2>(wide, res); break;
      case 3: k = PickBwdKernel<T, 3>(wide, res); break;
      default: k = PickBwdKernel<T, 4>(wide, res); break;
    }
    k<<<parts, dim3(tpr, ry), a.hidden * sizeof(float), stream>>>(a);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  LaunchSumColumnPartials(a.partials, parts, a.hidden, a.hidden, a.dgamma, nullptr, stream);
  return cudaGetLastError();
}

#define JAX_LS2_INSTANTIATE(T)                                                          \
  template cudaError_t LaunchRmsNormFwd<T>(const RmsNormFwdArgs&, cudaStream_t); \
  template cudaError_t LaunchRmsNormBwd<T>(const RmsNormBwdArgs&, cudaStream_t);
JAX_LS2_INSTANTIATE(float)
JAX_LS2_INSTANTIATE(__half)
JAX_LS2_INSTANTIATE(__nv_bfloat16)
#undef JAX_LS2_INSTANTIATE

}  // namespace jax_ls2
