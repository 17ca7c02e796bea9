// The second pass of the backward kernels that reduce over rows (dbias, dgamma, dbeta):
// sums the (parts, cols) float32 partial rows that the first pass wrote, one per block,
// in a fixed order, so the result is the same in every run.
// Internal linkage: each translation unit gets its own copy.
#pragma once
#include "kernels/common.cuh"

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

inline void LaunchSumColumnPartials(const float* partials, int parts, int64_t cols, int64_t split, float* out_lo,
                                    float* out_hi, cudaStream_t stream) {
  SumColumnPartialsKernel<<<(unsigned)((cols + 31) / 32), dim3(32, kColumnFoldLanes), 0, stream>>>(
      partials, parts, cols, split, out_lo, out_hi);
}

}  // namespace
}  // namespace jax_ls2
