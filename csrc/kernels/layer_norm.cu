// LayerNorm forward/backward over the last axis, fp32 statistics.
//
// Register path (hidden <= 16384 forward, <= 8192 backward): a "row group" of
// blockDim.x threads owns one row and holds it in registers (32 elements per
// thread with 16-byte accesses, else 16); blockDim.y row groups per block.
// The backward is persistent over rows: each row group keeps its dgamma/dbeta
// partial sums in registers, the block folds its row groups in shared memory and
// writes one partial row per block; a second kernel sums the partials (fixed
// order, so results are deterministic). 16-bit rows of up to 4096 with 16-byte
// accesses take the staged backward on sm_90 instead (layer_norm_staged.cu).
// Looped path (larger hidden): one block per row, passes re-read the row.
#include <algorithm>
#include <initializer_list>

#include "kernels/common.cuh"
#include "kernels/column_fold.cuh"
#include "kernels/layer_norm.h"
#include "kernels/layer_norm_rows.cuh"
#include "kernels/row_launch.cuh"

namespace jax_ls2 {
namespace {

// Forward elements per thread held in registers: 32 with 16-byte accesses, 16 with
// scalar ones (odd hidden sizes); the fastest of the variants tried (bench/PERF_NOTES.md,
// "Kernel design history").
constexpr int kFwdWideElems = 32;
constexpr int kFwdElems = 16;
// A row of up to 16384 elements stays in registers; bounding the block size by it
// lets ptxas give the 32-element variant the registers it needs.
constexpr int FwdMaxThreads(int elems) { return 16384 / elems; }
constexpr int kBwdElems = 8;    // backward: x, dy and the dgamma/dbeta partials all live in registers
constexpr int kBwdMaxThreads = 512;
constexpr int kBwdStages = 3;   // shared-memory stages of the staged backward (more gain nothing)
// Block size bound of a backward variant holding `elems` per thread (16 and 32 are
// launch options for sweeps, LayerNormBwdLaunchOptions::elems): five arrays of that many floats.
constexpr int BwdMaxThreads(int elems) { return elems <= 16 ? kBwdMaxThreads : 256; }
constexpr int kLoopThreads = 512;

// ------------------------------------------------------------------ forward
// Row group g of block b handles row b * ry + g, and rows gridDim.x * ry further on
// when the grid is smaller than the rows. Each row's loads are all issued before any
// is used, so they are in flight together rather than one pack at a time.
template <typename T, int VEC, int ELEMS, bool RES>
__global__ void __launch_bounds__(FwdMaxThreads(ELEMS)) LayerNormFwdKernel(LayerNormFwdArgs a) {
  constexpr int ITEMS = ELEMS / VEC;
  using PackT = Pack<T, VEC>;
  __shared__ float scratch[64 * 32];
  const int H = (int)a.hidden;
  const int64_t stride = (int64_t)gridDim.x * blockDim.y;

  // The row stays in registers as raw packs (half the registers of floats for 16-bit
  // types, so more rows in flight per SM); values are converted where used.
  PackT lx[ITEMS], lr[RES ? ITEMS : 1];
  auto load = [&](int64_t row) {
    if (row >= a.rows) return;
    const T* x = static_cast<const T*>(a.x) + row * a.hidden;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (col < H) {
        lx[i] = *reinterpret_cast<const PackT*>(x + col);
        if constexpr (RES) lr[i] = *reinterpret_cast<const PackT*>(static_cast<const T*>(a.residual) + row * a.hidden + col);
      }
    }
  };

  int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  // The trip count is the same for the whole block (RowSum synchronises it).
  for (int64_t first = (int64_t)blockIdx.x * blockDim.y; first < a.rows; first += stride, row += stride) {
    const bool valid = row < a.rows;
    const int64_t off = (valid ? row : 0) * a.hidden;
    load(row);
    PackT v[ITEMS];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      v[i] = lx[i];
      if (valid && col < H) {
        if constexpr (RES) {
          // The packs then hold x + residual rounded to T, which is also the `sum` output.
#pragma unroll
          for (int j = 0; j < VEC; ++j) v[i].v[j] = FromFloat<T>(ToFloat(v[i].v[j]) + ToFloat(lr[i].v[j]));
          *reinterpret_cast<PackT*>(static_cast<T*>(a.sum) + off + col) = v[i];
        }
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
      T* y = static_cast<T*>(a.y) + off;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * blockDim.x + threadIdx.x) * VEC;
        if (col < H) {
          float g[VEC], b[VEC], o[VEC];
          LoadFloats<T, VEC>(static_cast<const T*>(a.gamma) + col, g);
          LoadFloats<T, VEC>(static_cast<const T*>(a.beta) + col, b);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = (ToFloat(v[i].v[j]) - mean) * rstd * g[j] + b[j];
          StoreFloats<T, VEC>(y + col, o);
        }
      }
      if (threadIdx.x == 0) {
        a.mean[row] = mean;
        a.rstd[row] = rstd;
      }
    }
  }
}

// One block per row; re-reads the row (from L2) instead of holding it.
template <typename T, bool RES>
__global__ void LayerNormFwdLoopKernel(LayerNormFwdArgs a) {
  __shared__ float scratch[64];
  const int64_t row = blockIdx.x;
  const int64_t H = a.hidden, off = row * H;
  const T* x = static_cast<const T*>(a.x) + off;
  const T* src = x;
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float v = ToFloat(x[c]);
    if constexpr (RES) {
      v = RoundTo<T>(v + ToFloat(static_cast<const T*>(a.residual)[off + c]));
      static_cast<T*>(a.sum)[off + c] = FromFloat<T>(v);
    }
    s += v;
  }
  if constexpr (RES) src = static_cast<const T*>(a.sum) + off;
  RowSum(s, scratch);  // its __syncthreads also publishes the sum row
  const float mean = s / H;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    const float d = ToFloat(src[c]) - mean;
    ss += d * d;
  }
  RowSum(ss, scratch);
  const float rstd = rsqrtf(ss / H + a.eps);
  T* y = static_cast<T*>(a.y) + off;
  const T* g = static_cast<const T*>(a.gamma);
  const T* b = static_cast<const T*>(a.beta);
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    y[c] = FromFloat<T>((ToFloat(src[c]) - mean) * rstd * ToFloat(g[c]) + ToFloat(b[c]));
  }
  if (threadIdx.x == 0) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
}

// ------------------------------------------------------------------ backward
// EARLY (the bfloat16 16-byte path with a residual): the residual branch's gradient
// dsum is loaded with x and dy, before the row reduction, instead of after it: one
// round trip to memory per row instead of two, for 8 more registers (two blocks of 512
// threads per SM still fit: the bound asks ptxas for at most 64 registers).
// MORE: the number of extra cotangents (a.dy_more) summed into dy as it is loaded.
template <typename T, int VEC, bool RES, int ELEMS = kBwdElems, bool EARLY = false, int MORE = 0>
__global__ void __launch_bounds__(BwdMaxThreads(ELEMS), EARLY || (MORE > 0 && VEC > 1) ? 2 : 1)
    LayerNormBwdKernel(LayerNormBwdArgs a) {
  constexpr int ITEMS = ELEMS / VEC > 0 ? ELEMS / VEC : 1;
  __shared__ float scratch[64 * 16];
  extern __shared__ float fold[];  // (2, hidden)
  const int H = (int)a.hidden;
  const float inv_h = 1.f / H;

  float gam[ITEMS][VEC], dg[ITEMS][VEC], db[ITEMS][VEC];
  bool has_col[ITEMS];  // unused here: the loops test their columns themselves
  InitBwdColumns<T>(a.gamma, H, has_col, gam, dg, db);

  for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < a.rows;
       base += (int64_t)gridDim.x * blockDim.y) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < a.rows;
    const int64_t off = (valid ? row : 0) * a.hidden;
    const float mean = valid ? a.mean[row] : 0.f;
    const float rstd = valid ? a.rstd[row] : 0.f;
    constexpr bool kEarly = RES && EARLY;
    float xh[ITEMS][VEC], dy[ITEMS][VEC], ds[kEarly ? ITEMS : 1][VEC];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * blockDim.x + threadIdx.x) * VEC;
      if (valid && col < H) {
        LoadFloats<T, VEC>(static_cast<const T*>(a.x) + off + col, xh[i]);
        LoadFloats<T, VEC>(static_cast<const T*>(a.dy) + off + col, dy[i]);
        if constexpr (kEarly) LoadFloats<T, VEC>(static_cast<const T*>(a.dsum) + off + col, ds[i]);
        if constexpr (MORE > 0) {
          float more[MORE][VEC];
#pragma unroll
          for (int m = 0; m < MORE; ++m) LoadFloats<T, VEC>(static_cast<const T*>(a.dy_more[m]) + off + col, more[m]);
#pragma unroll
          for (int m = 0; m < MORE; ++m)
#pragma unroll
            for (int j = 0; j < VEC; ++j) dy[i][j] += more[m][j];
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          xh[i][j] = (xh[i][j] - mean) * rstd;
          const float gd = dy[i][j] * gam[i][j];
          s1 += gd;
          s2 += gd * xh[i][j];
          dg[i][j] += dy[i][j] * xh[i][j];
          db[i][j] += dy[i][j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) xh[i][j] = dy[i][j] = 0.f;
      }
    }
    RowSum2(s1, s2, scratch);
    s1 *= inv_h;
    s2 *= inv_h;
    if (valid) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * blockDim.x + threadIdx.x) * VEC;
        if (col < H) {
          float o[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = rstd * (dy[i][j] * gam[i][j] - s1 - xh[i][j] * s2);
          if constexpr (kEarly) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) o[j] += ds[i][j];
          } else if constexpr (RES) {
            float d[VEC];
            LoadFloats<T, VEC>(static_cast<const T*>(a.dsum) + off + col, d);
#pragma unroll
            for (int j = 0; j < VEC; ++j) o[j] += d[j];
          }
          StoreFloats<T, VEC>(static_cast<T*>(a.dx) + off + col, o);
        }
      }
    }
  }

  StoreBlockPartials<ITEMS, VEC>(dg, db, fold, H, a.partials + (int64_t)blockIdx.x * 2 * H);
}

// dy[c] plus the extra cotangents of the row at `off`, in the kernels' order.
template <typename T>
__device__ __forceinline__ float DyAt(const LayerNormBwdArgs& a, const T* dy, int64_t off, int64_t c) {
  float d = ToFloat(dy[c]);
  for (int m = 0; m < a.n_more; ++m) d += ToFloat(static_cast<const T*>(a.dy_more[m])[off + c]);
  return d;
}

// Large hidden: persistent blocks, one row at a time; each block accumulates its
// dgamma/dbeta partial row directly in its slice of the workspace (each column
// owned by one thread, so no races).
template <typename T, bool RES>
__global__ void LayerNormBwdLoopKernel(LayerNormBwdArgs a) {
  __shared__ float scratch[64];
  const int64_t H = a.hidden;
  const float inv_h = 1.f / H;
  const T* gamma = static_cast<const T*>(a.gamma);
  float* acc = a.partials + (int64_t)blockIdx.x * 2 * H;
  for (int64_t c = threadIdx.x; c < 2 * H; c += blockDim.x) acc[c] = 0.f;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t off = row * H;
    const T* x = static_cast<const T*>(a.x) + off;
    const T* dy = static_cast<const T*>(a.dy) + off;
    const float mean = a.mean[row], rstd = a.rstd[row];
    float s1 = 0.f, s2 = 0.f;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float xh = (ToFloat(x[c]) - mean) * rstd;
      const float d = DyAt<T>(a, dy, off, c);
      const float gd = d * ToFloat(gamma[c]);
      s1 += gd;
      s2 += gd * xh;
      acc[c] += d * xh;
      acc[H + c] += d;
    }
    RowSum2(s1, s2, scratch);
    s1 *= inv_h;
    s2 *= inv_h;
    T* dx = static_cast<T*>(a.dx) + off;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float xh = (ToFloat(x[c]) - mean) * rstd;
      float o = rstd * (DyAt<T>(a, dy, off, c) * ToFloat(gamma[c]) - s1 - xh * s2);
      if constexpr (RES) o += ToFloat(static_cast<const T*>(a.dsum)[off + c]);
      dx[c] = FromFloat<T>(o);
    }
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchLayerNormFwd(const LayerNormFwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.hidden == 0) return cudaSuccess;
  const int vec = PickVec<T>(a.hidden, {a.x, a.residual, a.gamma, a.beta, a.y, a.sum});
  const bool wide = vec > 1;
  const int elems = wide ? kFwdWideElems : kFwdElems;
  const int tpr = ThreadsPerRow(a.hidden, vec, elems, FwdMaxThreads(elems));
  const bool res = a.residual != nullptr;
  if (tpr == 0) {
    auto k = res ? LayerNormFwdLoopKernel<T, true> : LayerNormFwdLoopKernel<T, false>;
    k<<<(unsigned)a.rows, kLoopThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  const int ry = tpr >= 128 ? 1 : 128 / tpr;
  dim3 block(tpr, ry);
  const unsigned grid = (unsigned)((a.rows + ry - 1) / ry);
  constexpr int kVec = kPack<T>;
  if (vec == kVec) {
    auto k = res ? LayerNormFwdKernel<T, kVec, kFwdWideElems, true> : LayerNormFwdKernel<T, kVec, kFwdWideElems, false>;
    k<<<grid, block, 0, stream>>>(a);
  } else {
    auto k = res ? LayerNormFwdKernel<T, 1, kFwdElems, true> : LayerNormFwdKernel<T, 1, kFwdElems, false>;
    k<<<grid, block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

// The register-path backward for MORE extra cotangents: 16-byte accesses or scalar
// ones, with or without the residual branch's gradient; bfloat16 with it loads that
// gradient early (EARLY).
template <typename T, int MORE>
auto PickBwdKernel(bool wide, bool res) -> void (*)(LayerNormBwdArgs) {
  constexpr int kVec = kPack<T>;
  constexpr bool kEarlyRes = std::is_same_v<T, __nv_bfloat16>;
  if (!wide) return res ? LayerNormBwdKernel<T, 1, true, kBwdElems, false, MORE>
                        : LayerNormBwdKernel<T, 1, false, kBwdElems, false, MORE>;
  return res ? LayerNormBwdKernel<T, kVec, true, kBwdElems, kEarlyRes, MORE>
             : LayerNormBwdKernel<T, kVec, false, kBwdElems, false, MORE>;
}

template <typename T>
cudaError_t LaunchLayerNormBwd(const LayerNormBwdArgs& a, const LayerNormBwdLaunchOptions& o, cudaStream_t stream) {
  if (a.hidden == 0) return cudaSuccess;
  if (a.rows == 0) {
    cudaMemsetAsync(a.dgamma, 0, a.hidden * sizeof(float), stream);
    cudaMemsetAsync(a.dbeta, 0, a.hidden * sizeof(float), stream);
    return cudaGetLastError();
  }
  const bool res = a.dsum != nullptr;
  if (a.n_more < 0 || a.n_more > kLayerNormMaxExtraDy) return cudaErrorInvalidValue;
  int vec = PickVec<T>(a.hidden, {a.x, a.dy, a.dsum, a.gamma, a.dx});
  for (int m = 0; m < a.n_more; ++m) vec = std::min(vec, PickVec<T>(a.hidden, {a.dy_more[m]}));
  constexpr int kVec = kPack<T>;
  const int opt = o.elems, stages_opt = o.stages;
  int parts = 0;
  // The staged kernel (layer_norm_staged.cu) where it applies (16-bit, 16-byte rows up to
  // 4096, sm_90) unless the register kernel is asked for, with 8 elements per thread up
  // to hidden 2048 and 16 above (the faster of the two at the widths measured).
  bool staged = false;
  if (vec == kVec && a.n_more == 0 && stages_opt != 1 && (opt == 0 || opt == 8 || opt == 16)) {
    const int staged_elems = opt != 0 ? opt : (a.hidden > 2048 ? 16 : 8);
    const int staged_tpr = ThreadsPerRow(a.hidden, vec, staged_elems, kBwdMaxThreads, /*warp_multiple=*/true);
    cudaError_t err = cudaSuccess;
    staged = staged_tpr > 0 && LaunchLayerNormBwdStaged<T>(a, staged_tpr, staged_elems,
                                                            stages_opt >= 2 ? stages_opt : kBwdStages, stream,
                                                            &parts, &err);
    if (err != cudaSuccess) return err;
  }
  if (!staged) {  // the register kernel, or the looped one for longer rows
    const int elems = std::is_same_v<T, __nv_bfloat16> && vec == kVec && a.n_more == 0 && (opt == 16 || opt == 32)
                          ? opt : kBwdElems;
    const int max_threads = BwdMaxThreads(elems);
    // Row groups of whole warps rather than a power of two when a row needs more than one
    // warp (hidden 768: 96 threads, not 128 with 32 idle).
    const int tpr = ThreadsPerRow(a.hidden, vec, elems, max_threads, /*warp_multiple=*/true);
    const size_t smem = 2 * a.hidden * sizeof(float);
    if (tpr == 0) {
      auto k = res ? LayerNormBwdLoopKernel<T, true> : LayerNormBwdLoopKernel<T, false>;
      parts = (int)std::min<int64_t>(a.rows, a.max_parts);
      k<<<parts, kLoopThreads, 0, stream>>>(a);
    } else {
      const int ry = max_threads / tpr < 1 ? 1 : max_threads / tpr;
      const int ry_used = (int)std::min<int64_t>(ry, a.rows);
      dim3 block(tpr, ry_used);
      parts = (int)std::min<int64_t>((a.rows + ry_used - 1) / ry_used, a.max_parts);
      void (*k)(LayerNormBwdArgs) = nullptr;
      switch (a.n_more) {
        case 0: k = PickBwdKernel<T, 0>(vec == kVec, res); break;
        case 1: k = PickBwdKernel<T, 1>(vec == kVec, res); break;
        case 2: k = PickBwdKernel<T, 2>(vec == kVec, res); break;
        default: k = PickBwdKernel<T, 3>(vec == kVec, res); break;
      }
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        if (elems == 16) k = res ? LayerNormBwdKernel<T, kVec, true, 16> : LayerNormBwdKernel<T, kVec, false, 16>;
        if (elems == 32) k = res ? LayerNormBwdKernel<T, kVec, true, 32> : LayerNormBwdKernel<T, kVec, false, 32>;
      }
      if (smem > 48 * 1024) cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      k<<<parts, block, smem, stream>>>(a);
    }
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t cols = 2 * a.hidden;
  LaunchSumColumnPartials(a.partials, parts, cols, a.hidden, a.dgamma, a.dbeta, stream);
  return cudaGetLastError();
}

#define JAX_LS2_INSTANTIATE(T)                                                                                   \
  template cudaError_t LaunchLayerNormFwd<T>(const LayerNormFwdArgs&, cudaStream_t);                              \
  template cudaError_t LaunchLayerNormBwd<T>(const LayerNormBwdArgs&, const LayerNormBwdLaunchOptions&, cudaStream_t);
JAX_LS2_INSTANTIATE(float)
JAX_LS2_INSTANTIATE(__half)
JAX_LS2_INSTANTIATE(__nv_bfloat16)
#undef JAX_LS2_INSTANTIATE

}  // namespace jax_ls2
