// LayerNorm backward with the rows staged in shared memory (sm_90; 16-bit rows with
// 16-byte accesses, hidden 264 to 4096).
//
// The register kernel (layer_norm.cu) keeps one row per row group in flight: load x and
// dy, wait, reduce across the row, store dx, and only then load the next row. At hidden
// 4096 that leaves an SM two rows of loads in flight and the kernel latency-bound. Here
// persistent blocks walk tiles of blockDim.y contiguous rows (one per row group), and the
// bulk-copy engine fills a ring of `stages` shared-memory buffers with the tiles' x, dy
// (and dsum) rows: while the block reduces tile k, tiles k + 1 .. k + stages - 1 are
// loading. Threads read their packs from shared memory twice (for the row sums, then for
// dx), so nothing is held in registers across the row reduction. dgamma/dbeta partials
// stay in registers and are folded per block as in the register kernel.
#include <algorithm>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/bulk_copy.cuh"
#include "kernels/layer_norm.h"
#include "kernels/layer_norm_rows.cuh"

namespace jax_ls2 {
namespace {

// Row groups of 8 elements per thread run in blocks of up to 512 threads, two per SM; of
// 16 (the default above hidden 2048), in blocks of up to 256, three per SM.
constexpr int StagedMaxThreads(int elems) { return elems <= 8 ? 512 : 256; }
constexpr int StagedMinBlocks(int elems) { return elems <= 8 ? 2 : 3; }
constexpr int kMaxStages = 8;
constexpr size_t kStagedSmemBytes = 227 * 1024 - 8 * 1024;  // opt-in limit less the static part

// Block (tpr, ry): each thread owns the columns (i * tpr + threadIdx.x) * kPack<T> + j of
// row tile * ry + threadIdx.y. Shared memory: stage s, array k (x, dy, dsum) of a tile at
// ring + (s * NARR + k) * ry * H elements; the ring is reused for the dgamma/dbeta fold.
template <typename T, bool RES, int ELEMS>
__global__ void __launch_bounds__(StagedMaxThreads(ELEMS), StagedMinBlocks(ELEMS))
    LayerNormBwdStagedKernel(LayerNormBwdArgs a, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int VEC = kPack<T>, ITEMS = ELEMS / VEC;
  constexpr int NARR = RES ? 3 : 2;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  __shared__ float scratch[64 * 16];
  T* const ring = reinterpret_cast<T*>(smem);
  const int H = static_cast<int>(a.hidden), ry = blockDim.y;
  const int tile_elems = ry * H;
  const int64_t ntiles = (a.rows + ry - 1) / ry, grid = gridDim.x;
  const bool leader = threadIdx.x == 0 && threadIdx.y == 0;
  const float inv_h = 1.f / H;

  float gam[ITEMS][VEC], dg[ITEMS][VEC], db[ITEMS][VEC];
  bool has_col[ITEMS];
  InitBwdColumns<T>(a.gamma, H, has_col, gam, dg, db);

  // Loads tile `tile` (if it exists) into stage `s`; by the leader only.
  auto issue = [&](int64_t tile, int s) {
    if (tile >= ntiles) return;
    const int64_t first = tile * ry, off = first * H;
    const uint32_t bytes = static_cast<uint32_t>(min(static_cast<int64_t>(ry), a.rows - first) * H * sizeof(T));
    T* dst = ring + static_cast<int64_t>(s) * NARR * tile_elems;
    MbarArriveExpect(&bars[s], NARR * bytes);
    BulkLoad(dst, static_cast<const T*>(a.x) + off, bytes, &bars[s]);
    BulkLoad(dst + tile_elems, static_cast<const T*>(a.dy) + off, bytes, &bars[s]);
    if constexpr (RES) BulkLoad(dst + 2 * tile_elems, static_cast<const T*>(a.dsum) + off, bytes, &bars[s]);
  };
  if (leader) {
    for (int s = 0; s < stages; ++s) MbarInit(&bars[s]);
  }
  __syncthreads();
  if (leader) {
    for (int s = 0; s + 1 < stages; ++s) issue(blockIdx.x + s * grid, s);
  }

  int64_t row = blockIdx.x * static_cast<int64_t>(ry) + threadIdx.y;
  float mean = row < a.rows ? a.mean[row] : 0.f, rstd = row < a.rows ? a.rstd[row] : 0.f;
  int s = 0;
  uint32_t phase = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += grid) {
    const bool valid = row < a.rows;
    const int64_t next_row = row + grid * ry;
    const float next_mean = next_row < a.rows ? a.mean[next_row] : 0.f;
    const float next_rstd = next_row < a.rows ? a.rstd[next_row] : 0.f;
    const T* sx = ring + static_cast<int64_t>(s) * NARR * tile_elems + threadIdx.y * H + threadIdx.x * VEC;
    MbarWait(&bars[s], phase);

    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (valid && has_col[i]) {
        float xv[VEC], dv[VEC];
        LoadFloats<T, VEC>(sx + i * blockDim.x * VEC, xv);
        LoadFloats<T, VEC>(sx + i * blockDim.x * VEC + tile_elems, dv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xh = (xv[j] - mean) * rstd, gd = dv[j] * gam[i][j];
          s1 += gd;
          s2 += gd * xh;
          dg[i][j] += dv[j] * xh;
          db[i][j] += dv[j];
        }
      }
    }
    RowSum2(s1, s2, scratch);
    // RowSum2 synchronised the block, so every thread is done with tile - grid: its
    // stage, the one before s, takes the tile stages - 1 ahead.
    if (leader) issue(tile + (stages - 1) * grid, s == 0 ? stages - 1 : s - 1);
    // dx = rstd * (dy * gamma - s1 / H - xhat * s2 / H)
    //    = dy * (rstd * gamma) + (x - mean) * a1 + a0,  a1 = -rstd^2 s2 / H,  a0 = -rstd s1 / H
    const float a1 = -rstd * rstd * s2 * inv_h, a0 = -rstd * s1 * inv_h;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (valid && has_col[i]) {
        const T* p = sx + i * blockDim.x * VEC;
        float xv[VEC], dv[VEC], o[VEC];
        LoadFloats<T, VEC>(p, xv);
        LoadFloats<T, VEC>(p + tile_elems, dv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = fmaf(dv[j], rstd * gam[i][j], fmaf(xv[j] - mean, a1, a0));
        if constexpr (RES) {
          float d[VEC];
          LoadFloats<T, VEC>(p + 2 * tile_elems, d);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] += d[j];
        }
        StoreFloats<T, VEC>(static_cast<T*>(a.dx) + row * H + (i * blockDim.x + threadIdx.x) * VEC, o);
      }
    }
    row = next_row;
    mean = next_mean;
    rstd = next_rstd;
    if (++s == stages) {
      s = 0;
      phase ^= 1u;
    }
  }
  __syncthreads();  // the ring becomes the fold buffer
  StoreBlockPartials<ITEMS, VEC>(dg, db, reinterpret_cast<float*>(smem), H, a.partials + blockIdx.x * 2 * a.hidden);
#endif
}

}  // namespace

template <typename T>
bool LaunchLayerNormBwdStaged(const LayerNormBwdArgs& a, int tpr, int elems, int stages, cudaStream_t stream,
                              int* parts, cudaError_t* err) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    // Row groups of whole warps (RowSum2 synchronises the block only then) covering the
    // row with `elems` per thread, 16-byte aligned rows.
    if (elems != 8 && elems != 16) return false;
    const int max_threads = StagedMaxThreads(elems);
    if (tpr <= 32 || tpr > max_threads || tpr % 32 != 0 || stages < 2 || stages > kMaxStages) return false;
    if (a.n_more != 0 || a.hidden % kPack<T> != 0 || a.hidden > (int64_t)tpr * elems) return false;
    const bool res = a.dsum != nullptr;
    auto kernel = elems == 8 ? (res ? LayerNormBwdStagedKernel<T, true, 8> : LayerNormBwdStagedKernel<T, false, 8>)
                             : (res ? LayerNormBwdStagedKernel<T, true, 16> : LayerNormBwdStagedKernel<T, false, 16>);
    static const bool hopper = BuiltForHopper(LayerNormBwdStagedKernel<T, false, 8>);
    if (!hopper) return false;
    const int ry = max_threads / tpr;
    const size_t ring = static_cast<size_t>(stages) * (res ? 3 : 2) * ry * a.hidden * sizeof(T);
    const size_t smem = std::max(ring, static_cast<size_t>(2 * a.hidden * sizeof(float)));
    if (smem > kStagedSmemBytes) return false;
    *err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    int per_sm = 0;
    if (*err == cudaSuccess) *err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, tpr * ry, smem);
    if (*err != cudaSuccess) return true;
    const int64_t ntiles = (a.rows + ry - 1) / ry;
    *parts = static_cast<int>(std::min<int64_t>({ntiles, static_cast<int64_t>(std::max(per_sm, 1)) * SmCount(),
                                                 a.max_parts}));
    kernel<<<*parts, dim3(tpr, ry), smem, stream>>>(a, stages);
    *err = cudaGetLastError();
    return true;
  }
}

template bool LaunchLayerNormBwdStaged<float>(const LayerNormBwdArgs&, int, int, int, cudaStream_t, int*, cudaError_t*);
template bool LaunchLayerNormBwdStaged<__half>(const LayerNormBwdArgs&, int, int, int, cudaStream_t, int*, cudaError_t*);
template bool LaunchLayerNormBwdStaged<__nv_bfloat16>(const LayerNormBwdArgs&, int, int, int, cudaStream_t, int*,
                                                      cudaError_t*);

}  // namespace jax_ls2
