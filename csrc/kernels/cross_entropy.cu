// Fused softmax cross entropy over the last axis, fp32 statistics.
//
// One block per row. Pass 1 streams the row once (16-byte loads after a scalar
// head that reaches alignment) keeping a per-thread online (max, sum of exp) and
// the plain sum of logits; the block merges them into the log-sum-exp (fp32 logits:
// the max only, then a second sweep sums exp(x - max) in double, see kOnline). The loss
//   lse - (1 - eps) * x[label] - eps * mean(x) + z * lse^2
// is written per row. With a gradient output, pass 2 writes
//   scale * (softmax * (1 + 2 z lse) - (1 - eps) * onehot - eps / vocab)
// in the logits dtype. Pass 2 reads the row from shared memory when it fits
// (CACHE: one DRAM read per element in all), otherwise again from global memory
// (usually an L2 hit). Ignored rows get loss 0 and a zero gradient row; a label
// outside [0, vocab) gives a NaN loss and a NaN gradient row.
#include <algorithm>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_reduce.cuh"

namespace jax_ls2 {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxThreads = 1024;  // CrossEntropyLaunchOptions::threads (bfloat16, 16-byte path)
constexpr int kUnroll = 4;
constexpr size_t kCacheBytes = 112 * 1024;  // two blocks per SM on sm_90

// Block-wide sum in double (the fp32 path's sum of exp); every thread gets the result.
// Starts with a barrier, so sh may still be in use by the caller's previous reduction.
__device__ __forceinline__ double BlockSumD(double v, double* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double ExpD(float v, float m) { return exp((double)v - (double)m); }

template <typename T, int VEC, bool CACHE, bool GRAD, int MAXT = kThreads>
__global__ void __launch_bounds__(MAXT) CrossEntropyKernel(CrossEntropyArgs a) {
  extern __shared__ __align__(16) unsigned char cache_raw[];
  __shared__ float sh[96];
  using PackT = Pack<T, VEC>;
  const int64_t row = blockIdx.x;
  const int64_t V = a.vocab;
  const int bd = blockDim.x;
  const T* x = static_cast<const T*>(a.logits) + row * a.ld;
  T* g = GRAD ? static_cast<T*>(a.grad) + row * a.ld : nullptr;
  if constexpr (GRAD) {
    for (int64_t c = V + threadIdx.x; c < a.ld; c += bd) g[c] = FromFloat<T>(0.f);
  }
  const int64_t label = a.labels[row];
  if (a.has_ignore && label == a.ignore_index) {
    if (a.loss != nullptr && threadIdx.x == 0) a.loss[row] = 0.f;
    if constexpr (GRAD) {
      for (int64_t c = threadIdx.x; c < V; c += bd) g[c] = FromFloat<T>(0.f);
    }
    return;
  }

  int64_t head = 0;
  if constexpr (VEC > 1) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
    head = (int64_t)(((16 - (addr & 15)) & 15) / sizeof(T));
    if (head > V) head = V;
  }
  const int64_t nvec = (V - head) / VEC;
  const int64_t body_end = head + nvec * VEC;
  const PackT* xb = reinterpret_cast<const PackT*>(x + head);
  PackT* cache = reinterpret_cast<PackT*>(cache_raw);

  // ---- pass 1: online max / sum of exp / sum
  float m = -INFINITY, d = 0.f, sx = 0.f;
  for (int64_t c = threadIdx.x; c < head; c += bd) {
    float v[1] = {ToFloat(x[c])};
    Accumulate<T>(v, m, d, sx);
  }
  for (int64_t c = body_end + threadIdx.x; c < V; c += bd) {
    float v[1] = {ToFloat(x[c])};
    Accumulate<T>(v, m, d, sx);
  }
  int64_t i = threadIdx.x;
  for (; i + (int64_t)(kUnroll - 1) * bd < nvec; i += (int64_t)kUnroll * bd) {
    PackT pk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) pk[u] = xb[i + u * bd];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (CACHE) cache[i + u * bd] = pk[u];
      float v[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = ToFloat(pk[u].v[j]);
      Accumulate<T>(v, m, d, sx);
    }
  }
  for (; i < nvec; i += bd) {
    const PackT pk = xb[i];
    if constexpr (CACHE) cache[i] = pk;
    float v[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = ToFloat(pk.v[j]);
    Accumulate<T>(v, m, d, sx);
  }
  BlockReduce<T>(m, d, sx, sh);
  double dd = 0.0;  // fp32 path: the sum of exp in double
  if constexpr (!kOnline<T>) {
    __shared__ double shd[32];
    if (m != -INFINITY) {
      double s = 0.0;
      for (int64_t c = threadIdx.x; c < head; c += bd) s += ExpD(ToFloat(x[c]), m);
      for (int64_t c = body_end + threadIdx.x; c < V; c += bd) s += ExpD(ToFloat(x[c]), m);
      for (int64_t k = threadIdx.x; k < nvec; k += bd) {
        const PackT pk = CACHE ? cache[k] : xb[k];
#pragma unroll
        for (int j = 0; j < VEC; ++j) s += ExpD(ToFloat(pk.v[j]), m);
      }
      dd = BlockSumD(s, shd);
      d = (float)dd;
    }
  }
  const float lse = kOnline<T> ? m + logf(d) : (float)((double)m + log(dd));
  const bool valid = label >= 0 && label < V;
  const float xl = valid ? ToFloat(x[valid ? label : 0]) : NAN;
  const float eps = a.smoothing;
  if (a.loss != nullptr && threadIdx.x == 0) {
    // Without smoothing the mean term is left out, not multiplied by 0 (a -inf logit, a
    // masked class, would make it NaN).
    const float smooth = eps != 0.f ? eps * (sx / (float)V) : 0.f;
    a.loss[row] = lse - (1.f - eps) * xl - smooth + a.z_loss * lse * lse;
  }
  if constexpr (GRAD) {
    // ---- pass 2: gradient
    float s = 1.f;
    if (a.scale != nullptr) s = a.scale_per_row ? a.scale[row] : a.scale[0];
    if (!valid) s = NAN;
    const float pz = 1.f + 2.f * a.z_loss * lse;
    const float off = eps / (float)V, on = 1.f - eps;
    // softmax as exp(v - max) / sum rather than exp(v - lse): the rounding of lse
    // (half an ulp of ~log(vocab)) would otherwise shift every probability alike.
    const float inv_d = 1.f / d;
    auto grad_of = [&](float v, int64_t c) {
      if constexpr (kOnline<T>) {
        const float p = ExpShifted<T>(v - m) * inv_d;
        return s * (p * pz - (c == label ? on + off : off));
      } else {
        const double p = ExpD(v, m) / dd;
        return (float)((double)s * (p * (double)pz - (c == label ? (double)on + (double)off : (double)off)));
      }
    };
    for (int64_t c = threadIdx.x; c < head; c += bd) g[c] = FromFloat<T>(grad_of(ToFloat(x[c]), c));
    for (int64_t c = body_end + threadIdx.x; c < V; c += bd) g[c] = FromFloat<T>(grad_of(ToFloat(x[c]), c));
    PackT* gb = reinterpret_cast<PackT*>(g + head);
    for (int64_t k = threadIdx.x; k < nvec; k += bd) {
      const PackT pk = CACHE ? cache[k] : xb[k];
      PackT out;
      const int64_t c0 = head + k * VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(grad_of(ToFloat(pk.v[j]), c0 + j));
      gb[k] = out;
    }
  }
}

template <typename T, int VEC>
__global__ void ScaleKernel(ScaleArgs a) {
  const float s = *a.scale;
  if (s == 1.f && a.in == a.out) return;
  using PackT = Pack<T, VEC>;
  const int64_t nvec = a.n / VEC;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const PackT* in = static_cast<const PackT*>(a.in);
  PackT* out = static_cast<PackT*>(a.out);
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < nvec; k += stride) {
    PackT pk = in[k];
#pragma unroll
    for (int j = 0; j < VEC; ++j) pk.v[j] = FromFloat<T>(ToFloat(pk.v[j]) * s);
    out[k] = pk;
  }
  if (blockIdx.x == 0) {
    for (int64_t c = nvec * VEC + threadIdx.x; c < a.n; c += blockDim.x)
      static_cast<T*>(a.out)[c] = FromFloat<T>(ToFloat(static_cast<const T*>(a.in)[c]) * s);
  }
}

template <typename T, int VEC, bool CACHE, bool GRAD>
cudaError_t Launch(const CrossEntropyArgs& a, int threads, size_t smem, cudaStream_t stream) {
  auto k = CrossEntropyKernel<T, VEC, CACHE, GRAD>;
  if constexpr (std::is_same_v<T, __nv_bfloat16> && VEC > 1) {
    if (threads > kThreads) k = CrossEntropyKernel<T, VEC, CACHE, GRAD, kMaxThreads>;
  }
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
  }
  k<<<(unsigned)a.rows, threads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchCrossEntropy(const CrossEntropyArgs& a, const CrossEntropyLaunchOptions& o, cudaStream_t stream) {
  if (a.rows == 0 || a.vocab == 0) return cudaSuccess;
  cudaError_t staged_err;
  if (LaunchCrossEntropyStaged<T>(a, o, stream, &staged_err)) return staged_err;
  constexpr int kVec = kPack<T>;
  const uintptr_t xa = reinterpret_cast<uintptr_t>(a.logits), ga = reinterpret_cast<uintptr_t>(a.grad);
  const bool vec = a.grad == nullptr || (xa & 15) == (ga & 15);
  int threads = 32;
  const int opt = o.threads;
  // The 1024-thread variant exists for bfloat16 with 16-byte accesses only.
  // Loss only: 256 threads a row, the fastest in the launch-option sweep
  // (bench/PERF_NOTES.md, "Kernel design history").
  const int cap = opt == 256 || (opt == 1024 && std::is_same_v<T, __nv_bfloat16> && vec) ? opt
                  : a.grad == nullptr ? 256 : kThreads;
  while (threads < cap && (int64_t)threads * kVec * 2 < a.vocab) threads <<= 1;
  if (a.grad == nullptr) {
    return vec ? Launch<T, kVec, false, false>(a, threads, 0, stream)
               : Launch<T, 1, false, false>(a, threads, 0, stream);
  }
  const size_t bytes = (size_t)a.vocab * sizeof(T);
  if (bytes <= kCacheBytes) {
    return vec ? Launch<T, kVec, true, true>(a, threads, bytes, stream)
               : Launch<T, 1, true, true>(a, threads, bytes, stream);
  }
  return vec ? Launch<T, kVec, false, true>(a, threads, 0, stream)
             : Launch<T, 1, false, true>(a, threads, 0, stream);
}

template <typename T>
cudaError_t LaunchScale(const ScaleArgs& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  constexpr int kVec = kPack<T>;
  const bool vec = reinterpret_cast<uintptr_t>(a.in) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  const int64_t work = vec ? a.n / kVec : a.n;
  const unsigned blocks = (unsigned)std::max<int64_t>(1, std::min<int64_t>((work + 255) / 256, 132 * 16));
  if (vec) ScaleKernel<T, kVec><<<blocks, 256, 0, stream>>>(a);
  else ScaleKernel<T, 1><<<blocks, 256, 0, stream>>>(a);
  return cudaGetLastError();
}

#define JAX_LS2_INSTANTIATE(T)                                                                                   \
  template cudaError_t LaunchCrossEntropy<T>(const CrossEntropyArgs&, const CrossEntropyLaunchOptions&, cudaStream_t); \
  template cudaError_t LaunchScale<T>(const ScaleArgs&, cudaStream_t);
JAX_LS2_INSTANTIATE(float)
JAX_LS2_INSTANTIATE(__half)
JAX_LS2_INSTANTIATE(__nv_bfloat16)
#undef JAX_LS2_INSTANTIATE

}  // namespace jax_ls2
