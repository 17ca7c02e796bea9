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
#include "kernels/row_launch.cuh"

namespace jax_ls2 {
namespace {

// Elements a thread holds: the forward 32 with 16-byte accesses (16 scalar); the backward,
// whose weight, dgamma partials and current and next rows all stay in registers, 8 (two
// packs of float32) where a row fits in kMaxThreads threads so, else 16 with 16-byte
// accesses, and 8 scalar.
constexpr int kFwdWideElems = 32, kFwdElems = 16;
constexpr int kBwdWideElems = 8, kBwdWideLongElems = 16, kBwdElems = 8;
constexpr int kMaxThreads = 512;
constexpr int kLoopThreads = 512;
// Row groups wider than a warp reduce through shared memory, 64 floats each; there are at
// most kMaxThreads / 64 of them in a block.
constexpr int kScratch = 64 * (kMaxThreads / 64);

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
  float ss = 0.f;
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
  RowSum(ss, scratch);
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
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float v = ToFloat(src[c]);
    if constexpr (RES) {
      v = RoundTo<T>(v + ToFloat(static_cast<const T*>(a.residual)[off + c]));
      static_cast<T*>(a.sum)[off + c] = FromFloat<T>(v);
    }
    ss = fmaf(v, v, ss);
  }
  if constexpr (RES) src = static_cast<const T*>(a.sum) + off;
  RowSum(ss, scratch);  // its __syncthreads also publishes the sum row
  const float rstd = rsqrtf(ss / H + a.eps);
  const T* g = static_cast<const T*>(a.gamma);
  T* y = static_cast<T*>(a.y) + off;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x)
    y[c] = FromFloat<T>(ToFloat(src[c]) * rstd * Weight(ToFloat(g[c]), a.unit_offset));
  if (threadIdx.x == 0) a.rstd[blockIdx.x] = rstd;
}

// ------------------------------------------------------------------ backward
// dx = rstd * (dy * w - xhat * mean(dy * w * xhat)) [+ dsum], xhat = x * rstd, dy the sum
// of the NDY cotangents; dgamma = sum over rows of dy * xhat. A row group loads its next
// row (as raw packs) before it reduces and stores the current one, so loads stay in
// flight through the row reduction.
template <typename T, int VEC, int ITEMS, int NDY, bool RES>
__global__ void __launch_bounds__(kMaxThreads) RmsNormBwdKernel(RmsNormBwdArgs a) {
  using PackT = Pack<T, VEC>;
  constexpr int NARR = 1 + NDY + (RES ? 1 : 0);  // x, the cotangents of y, then dsum
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

  PackT next[NARR][ITEMS];
  float next_rstd = 0.f;
  auto load = [&](int64_t row) {
    if (row >= a.rows) return;
    const int64_t off = row * a.hidden;
    next_rstd = a.rstd[row];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (col < H) {
        next[0][i] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.x) + off + col);
#pragma unroll
        for (int m = 0; m < NDY; ++m)
          next[1 + m][i] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.dy[m]) + off + col);
        if constexpr (RES)
          next[NARR - 1][i] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.dsum) + off + col);
      }
    }
  };

  const int64_t stride = (int64_t)gridDim.x * blockDim.y;
  int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  load(row);
  // The trip count is the same for the whole block (RowSum synchronises it).
  for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < a.rows; base += stride, row += stride) {
    const bool valid = row < a.rows;
    const float rstd = valid ? next_rstd : 0.f;
    PackT cur[NARR][ITEMS];
#pragma unroll
    for (int k = 0; k < NARR; ++k)
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) CopyPack(cur[k][i], next[k][i]);
    load(row + stride);

    float xh[ITEMS][VEC], dy[ITEMS][VEC];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (valid && col < H) {
        UnpackFloats(cur[0][i], xh[i]);
        UnpackFloats(cur[1][i], dy[i]);
#pragma unroll
        for (int m = 1; m < NDY; ++m) {
          float more[VEC];
          UnpackFloats(cur[1 + m][i], more);
#pragma unroll
          for (int j = 0; j < VEC; ++j) dy[i][j] += more[j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) xh[i][j] = dy[i][j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        xh[i][j] *= rstd;
        s = fmaf(dy[i][j] * w[i][j], xh[i][j], s);
        dg[i][j] = fmaf(dy[i][j], xh[i][j], dg[i][j]);
      }
    }
    RowSum(s, scratch);
    s *= inv_h;
    if (valid) {
      const int64_t off = row * a.hidden;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * blockDim.x + threadIdx.x) * VEC;
        if (col < H) {
          float o[VEC], ds[VEC];
          if constexpr (RES) UnpackFloats(cur[NARR - 1][i], ds);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            o[j] = rstd * (dy[i][j] * w[i][j] - xh[i][j] * s);
            if constexpr (RES) o[j] += ds[j];
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
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float xh = ToFloat(x[off + c]) * rstd, d = DyAt<T>(a, off + c);
      s = fmaf(d * Weight(ToFloat(gamma[c]), a.unit_offset), xh, s);
      acc[c] = fmaf(d, xh, acc[c]);
    }
    RowSum(s, scratch);
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

// elems: kBwdWideElems or kBwdWideLongElems with 16-byte accesses (wide), else kBwdElems.
template <typename T, int NDY>
auto PickBwdKernel(bool wide, int elems, bool res) -> void (*)(RmsNormBwdArgs) {
  constexpr int kVec = kPack<T>, kShort = kBwdWideElems / kVec, kLong = kBwdWideLongElems / kVec;
  if (wide && elems == kBwdWideElems) return res ? RmsNormBwdKernel<T, kVec, kShort, NDY, true>
                                                 : RmsNormBwdKernel<T, kVec, kShort, NDY, false>;
  if (wide) return res ? RmsNormBwdKernel<T, kVec, kLong, NDY, true> : RmsNormBwdKernel<T, kVec, kLong, NDY, false>;
  return res ? RmsNormBwdKernel<T, 1, kBwdElems, NDY, true> : RmsNormBwdKernel<T, 1, kBwdElems, NDY, false>;
}

}  // namespace

template <typename T>
cudaError_t LaunchRmsNormFwd(const RmsNormFwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.hidden == 0) return cudaSuccess;
  constexpr int kVec = kPack<T>;
  const bool res = a.residual != nullptr;
  const bool wide = PickVec<T>(a.hidden, {a.x, a.residual, a.gamma, a.y, a.sum}) == kVec;
  const int tpr = ThreadsPerRow(a.hidden, wide ? kVec : 1, wide ? kFwdWideElems : kFwdElems, kMaxThreads,
                                /*warp_multiple=*/true);
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
  int elems = wide ? kBwdWideElems : kBwdElems;
  if (wide && ThreadsPerRow(a.hidden, kVec, elems, kMaxThreads, /*warp_multiple=*/true) == 0)
    elems = kBwdWideLongElems;
  const int tpr = ThreadsPerRow(a.hidden, wide ? kVec : 1, elems, kMaxThreads, /*warp_multiple=*/true);
  int parts = 0;
  if (tpr == 0) {
    parts = (int)std::min<int64_t>(a.rows, a.max_parts);
    RmsNormBwdLoopKernel<T><<<parts, kLoopThreads, 0, stream>>>(a);
  } else {
    const int ry = (int)std::min<int64_t>(std::max(1, kMaxThreads / tpr), a.rows);
    parts = (int)std::min<int64_t>((a.rows + ry - 1) / ry, a.max_parts);
    void (*k)(RmsNormBwdArgs) = nullptr;
    switch (a.n_dy) {
      case 1: k = PickBwdKernel<T, 1>(wide, elems, res); break;
      case 2: k = PickBwdKernel<T, 2>(wide, elems, res); break;
      case 3: k = PickBwdKernel<T, 3>(wide, elems, res); break;
      default: k = PickBwdKernel<T, 4>(wide, elems, res); break;
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
