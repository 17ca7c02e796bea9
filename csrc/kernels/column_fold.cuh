// The second pass of the backward kernels that reduce over rows (dbias, dgamma, dbeta):
// sums the (parts, cols) float32 partial rows that the first pass wrote, one per block,
// in a fixed order, so the result is the same in every run.
// Internal linkage: each translation unit gets its own copy.
#pragma once
#include <cooperative_groups.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "common.cuh"
#include "registry.h"

namespace jax_ls2 {
namespace {

// Block (32, kColumnFoldLanes): 32 columns, each summed by kColumnFoldLanes lanes. A
// lane issues the loads of all its parts (up to kColumnFoldPerLane) before adding any,
// so one memory round trip covers kColumnFoldLanes * kColumnFoldPerLane parts (288:
// the backward kernels write at most 264); sums are compensated (Kahan), then the
// lanes are folded in order through shared memory.
constexpr int kColumnFoldLanes = 32, kColumnFoldPerLane = 9;

// out_lo[c] = sum_p partials[p * cols + c] for c < split, out_hi[c - split] for c >= split.
__global__ void __launch_bounds__(32 * kColumnFoldLanes)
    SumColumnPartialsKernel(const float* partials, int parts, int64_t cols, int64_t split, float* out_lo,
                            float* out_hi) {
  __shared__ float lanes[kColumnFoldLanes][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float s = 0.f, comp = 0.f;
  if (c < cols) {
    for (int p0 = threadIdx.y; p0 < parts; p0 += kColumnFoldLanes * kColumnFoldPerLane) {
      float v[kColumnFoldPerLane];
#pragma unroll
      for (int k = 0; k < kColumnFoldPerLane; ++k) {
        const int p = p0 + k * kColumnFoldLanes;
        v[k] = p < parts ? partials[(int64_t)p * cols + c] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < kColumnFoldPerLane; ++k) {
        const float y = v[k] - comp;
        const float t = s + y;
        comp = (t - s) - y;
        s = t;
      }
    }
  }
  lanes[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float total = 0.f;
#pragma unroll
  for (int l = 0; l < kColumnFoldLanes; ++l) total += lanes[l][threadIdx.x];
  if (c < split) {
    out_lo[c] = total;
  } else {
    out_hi[c - split] = total;
  }
}

// The first pass's partial rows, folded across a thread-block cluster (sm_90): when the
// grid runs in clusters of C blocks, the C blocks' shared-memory rows fold[0, n) are
// summed in rank order (each block a slice of the columns, read through distributed
// shared memory) into one partial row per cluster, partials[blockIdx.x / C]: C times
// fewer rows written and read back by SumColumnPartialsKernel. Every thread of the block
// calls it after its fold is complete; returns false (nothing written) without clusters.
__device__ __forceinline__ bool WriteClusterPartial(float* fold, int n, float* partials) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int c = (int)cluster.num_blocks();
  if (c == 1) return false;
  cluster.sync();  // every block's fold row is complete
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  const int per = (n + c - 1) / c, lo = rank * per, hi = min(n, lo + per);
  float* part = partials + (int64_t)(blockIdx.x / c) * n;
  for (int i = lo + tid; i < hi; i += nthreads) {
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = q < c ? cluster.map_shared_rank(fold, q)[i] : 0.f;
    float s = v[0];
#pragma unroll
    for (int q = 1; q < 8; ++q) s += v[q];
    part[i] = s;
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
  return true;
#else
  return false;
#endif
}

// Launches kernel(args) over `parts` blocks, in clusters of 8 (else 4) blocks where the
// device has clusters (compute capability 9+) and all `parts` blocks stay resident in
// them (the kernels are persistent: fewer blocks, or a second wave, would cost more than
// the fold saves); returns the number of partial rows the kernel writes with
// WriteClusterPartial (parts / C), or parts for a plain launch (also with the
// fold_clusters=1 kernel option).
template <typename Args>
int LaunchInFoldClusters(void (*kernel)(Args), int parts, dim3 block, size_t smem, const Args& args,
                         cudaStream_t stream) {
  static const bool has_clusters = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major >= 9;
  }();
  static std::mutex mu;
  static std::map<std::tuple<const void*, unsigned, unsigned, size_t, int>, int> active_clusters;
  for (int c : {8, 4}) {
    if (!has_clusters || GetKernelOption(kFoldClusters) == 1) break;
    if (parts % c != 0) continue;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)parts);
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)c;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int active = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto key = std::make_tuple((const void*)kernel, block.x, block.y, smem, c);
      auto it = active_clusters.find(key);
      if (it == active_clusters.end()) {
        if (cudaOccupancyMaxActiveClusters(&active, kernel, &cfg) != cudaSuccess) {
          cudaGetLastError();
          active = 0;
        }
        it = active_clusters.emplace(key, active).first;
      }
      active = it->second;
    }
    if (active * c < parts) continue;
    if (cudaLaunchKernelEx(&cfg, kernel, args) == cudaSuccess) return parts / c;
    cudaGetLastError();
  }
  kernel<<<parts, block, smem, stream>>>(args);
  return parts;
}

inline void LaunchSumColumnPartials(const float* partials, int parts, int64_t cols, int64_t split, float* out_lo,
                                    float* out_hi, cudaStream_t stream) {
  SumColumnPartialsKernel<<<(unsigned)((cols + 31) / 32), dim3(32, kColumnFoldLanes), 0, stream>>>(
      partials, parts, cols, split, out_lo, out_hi);
}

}  // namespace
}  // namespace jax_ls2
