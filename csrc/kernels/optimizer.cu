// Fused optimizer kernels (Adam/AdamW, SGD with momentum, gradient accumulation),
// mirrored element for element by jax_ls2/optim/_reference.py. See optimizer.h.
//
// Element math (float32 in registers, no FMA contraction so the reference agrees):
//   g  = grad * inv_scale * grad_mult;  if clipping and !(norm < max_norm): g = g / norm * max_norm
//   Adam: m = (1-b1) g + b1 m;  v = (1-b2) g^2 + b2 v;  u = (m * (1/bc1)) / (sqrt(v * (1/bc2) + eps_root) + eps)
//   SGD:  m = g + b1 m;  u = nesterov ? g + b1 m : m   (u = g without momentum)
//   u += wd * p (leaves with the decay flag);  upd = u * (-lr);  p' = p + upd
#include <algorithm>

#include "kernels/optimizer_device.cuh"
#include "kernels/optimizer_update.h"

namespace jax_ls2 {
namespace optim {
namespace {

// ---------------------------------------------------------------- norm pass
template <typename G>
__device__ __forceinline__ void NormChunk(const LeafTable& t, int leaf, int64_t begin, int64_t end,
                                          float inv_scale, float& sumsq, float& bad) {
  const G* g = static_cast<const G*>(t.grad[leaf]);
  const bool aligned = t.flags[leaf] & kAligned;
  for (int64_t i = begin + threadIdx.x * kVec; i < end; i += kThreads * kVec) {
    const int n = static_cast<int>(end - i < kVec ? end - i : kVec);
    float x[kVec];
    Load4(g, i, n, aligned && n == kVec, x);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < n) {
        const float s = __fmul_rn(x[k], inv_scale);
        sumsq = __fadd_rn(sumsq, __fmul_rn(s, s));
        bad += isfinite(x[k]) ? 0.f : 1.f;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) GradNormKernel(const LeafTable t, const float* hp, float* partial) {
  __shared__ float scratch[32];
  const float inv_scale = hp[kInvScale] * hp[kGradMult];
  float sumsq = 0.f, bad = 0.f;
  const int chunks = t.chunk_start[t.n];
  for (int c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int leaf = FindLeaf(t, c);
    const int64_t begin = static_cast<int64_t>(c - t.chunk_start[leaf]) * kChunk;
    const int64_t end = min(begin + kChunk, t.size[leaf]);
    DispatchType(t.gtype[leaf], [&](auto tag) {
      using G = decltype(tag);
      NormChunk<G>(t, leaf, begin, end, inv_scale, sumsq, bad);
    });
  }
  sumsq = BlockSum(sumsq, scratch);
  bad = BlockSum(bad, scratch);
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = sumsq;
    partial[2 * blockIdx.x + 1] = bad;
  }
}

__global__ void __launch_bounds__(1024) NormFinalizeKernel(const float* partial, int count, const float* hp,
                                                           int flags, float* stats, float* ctl) {
  __shared__ float scratch[32];
  float sumsq = 0.f, bad = 0.f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    sumsq += partial[2 * i];
    bad += partial[2 * i + 1];
  }
  sumsq = BlockSum(sumsq, scratch);
  bad = BlockSum(bad, scratch);
  if (threadIdx.x == 0) {
    const float norm = sqrtf(sumsq);
    const bool finite = bad == 0.f;
    stats[0] = norm;
    stats[1] = finite ? 1.f : 0.f;
    ctl[0] = norm;
    ctl[1] = ((flags & kClip) && !(norm < hp[kMaxNorm])) ? 1.f : 0.f;
    ctl[2] = ((flags & kCheck) && !finite) ? 1.f : 0.f;
    ctl[3] = 0.f;
  }
}

// ---------------------------------------------------------------- accumulation
template <typename G>
__device__ __forceinline__ void AccumulateChunk(const LeafTable& t, float* acc, float scale, int leaf,
                                                int64_t begin, int64_t end) {
  const G* g = static_cast<const G*>(t.grad[leaf]);
  float* dst = acc + t.offset[leaf];
  const bool aligned = t.flags[leaf] & kAligned;
  for (int64_t i = begin + threadIdx.x * kVec; i < end; i += kThreads * kVec) {
    const int n = static_cast<int>(end - i < kVec ? end - i : kVec);
    float gv[kVec], av[kVec];
    Load4(g, i, n, aligned && n == kVec, gv);
    Load4(dst, i, n, n == kVec, av);
#pragma unroll
    for (int k = 0; k < kVec; ++k) av[k] = __fadd_rn(av[k], __fmul_rn(gv[k], scale));
    Store4(dst, i, n, n == kVec, av);
  }
}

__global__ void __launch_bounds__(kThreads) AccumulateKernel(const LeafTable t, float* acc, const float* scale) {
  const float sc = scale[0];
  const int chunks = t.chunk_start[t.n];
  for (int c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int leaf = FindLeaf(t, c);
    const int64_t begin = static_cast<int64_t>(c - t.chunk_start[leaf]) * kChunk;
    const int64_t end = min(begin + kChunk, t.size[leaf]);
    DispatchType(t.gtype[leaf], [&](auto tag) {
      using G = decltype(tag);
      AccumulateChunk<G>(t, acc, sc, leaf, begin, end);
    });
  }
}

int UpdateGrid(const LeafTable& t) {
  return static_cast<int>(std::max(1, std::min(t.chunk_start[t.n], kMaxUpdateBlocks)));
}

}  // namespace

cudaError_t LaunchGradNorm(const LeafTable& t, const float* hp, float* partial, cudaStream_t s) {
  GradNormKernel<<<kNormBlocks, kThreads, 0, s>>>(t, hp, partial);
  return cudaGetLastError();
}

cudaError_t LaunchNormFinalize(const float* partial, int launches, const float* hp, int flags, float* stats,
                               float* ctl, cudaStream_t s) {
  NormFinalizeKernel<<<1, 1024, 0, s>>>(partial, launches * kNormBlocks, hp, flags, stats, ctl);
  return cudaGetLastError();
}

cudaError_t LaunchUpdate(const LeafTable& t, const StateArgs& a, cudaStream_t s) {
  if (t.chunk_start[t.n] == 0) return cudaSuccess;
  if (a.flags & kMomentBf16) {
    LaunchUpdateBf16Moments(t, a, s);
  } else {
    LaunchUpdateF32Moments(t, a, s);
  }
  return cudaGetLastError();
}

cudaError_t LaunchAccumulate(const LeafTable& t, float* acc, const float* scale, cudaStream_t s) {
  if (t.chunk_start[t.n] == 0) return cudaSuccess;
  AccumulateKernel<<<UpdateGrid(t), kThreads, 0, s>>>(t, acc, scale);
  return cudaGetLastError();
}


}  // namespace optim
}  // namespace jax_ls2
