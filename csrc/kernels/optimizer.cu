// Fused optimizer kernels (Adam/AdamW, SGD with momentum, gradient accumulation),
// mirrored element for element by jax_ls2/optim/_reference.py. See optimizer.h.
//
// Element math (float32 in registers, no FMA contraction so the reference agrees):
//   g  = grad * inv_scale * grad_mult;  if clipping and !(norm < max_norm): g = g / norm * max_norm
//   Adam: m = (1-b1) g + b1 m;  v = (1-b2) g^2 + b2 v;  u = (m/bc1) / (sqrt(v/bc2 + eps_root) + eps)
//   SGD:  m = g + b1 m;  u = nesterov ? g + b1 m : m   (u = g without momentum)
//   u += wd * p (leaves with the decay flag);  upd = u * (-lr);  p' = p + upd
#include "common.cuh"
#include "kernels/optimizer.h"

namespace jax_ls2 {
namespace optim {
namespace {

// ---------------------------------------------------------------- element access
template <typename T>
__device__ __forceinline__ void Load4(const T* ptr, int64_t i, int n, bool vec, float (&out)[kVec]) {
  if (vec) {
    LoadFloats<T, kVec>(ptr + i, out);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = k < n ? ToFloat(ptr[i + k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void Store4(T* ptr, int64_t i, int n, bool vec, const float (&in)[kVec]) {
  if (vec) {
    StoreFloats<T, kVec>(ptr + i, in);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (k < n) ptr[i + k] = FromFloat<T>(in[k]);
  }
}

// ---------------------------------------------------------------- stochastic rounding
__device__ __forceinline__ uint32_t SrBits(uint32_t idx, const uint32_t* seed) {
  uint32_t salt = Mix32(seed[2] * 0x85EBCA6Bu ^ seed[1]);
  return Mix32(Mix32(idx * 0x9E3779B1u ^ seed[0]) ^ salt);
}

template <typename T> __device__ __forceinline__ uint16_t Bits16(T v);
template <> __device__ __forceinline__ uint16_t Bits16<__half>(__half v) { return __half_as_ushort(v); }
template <> __device__ __forceinline__ uint16_t Bits16<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
template <typename T> __device__ __forceinline__ T FromBits16(uint16_t b);
template <> __device__ __forceinline__ __half FromBits16<__half>(uint16_t b) { return __ushort_as_half(b); }
template <> __device__ __forceinline__ __nv_bfloat16 FromBits16<__nv_bfloat16>(uint16_t b) { return __ushort_as_bfloat16(b); }

// Rounds x to T up or down with probability proportional to proximity (unbiased);
// u = (h >> 8) * 2^-24 and x goes up iff u < (|x| - |lo|) / (|hi| - |lo|).
template <typename T>
__device__ __forceinline__ T RoundStochastic(float x, uint32_t h) {
  if (!isfinite(x)) return FromFloat<T>(x);
  uint16_t b = Bits16(FromFloat<T>(x));
  float lo = ToFloat(FromBits16<T>(b));
  if (fabsf(lo) > fabsf(x)) {
    b = static_cast<uint16_t>(b - 1);
    lo = ToFloat(FromBits16<T>(b));
  }
  if (lo == x) return FromBits16<T>(b);
  const uint16_t hb = static_cast<uint16_t>(b + 1);
  const float hi = ToFloat(FromBits16<T>(hb));
  const float frac = __fdiv_rn(__fsub_rn(fabsf(x), fabsf(lo)), __fsub_rn(fabsf(hi), fabsf(lo)));
  const float u = static_cast<float>(h >> 8) * __int_as_float(0x33800000);  // 2^-24
  return FromBits16<T>(u < frac ? hb : b);
}

template <typename T>
__device__ __forceinline__ void StoreParam4(T* ptr, int64_t i, int n, bool vec, const float (&in)[kVec],
                                            bool sr, int64_t flat, const uint32_t* seed) {
  if constexpr (std::is_same<T, float>::value) {
    Store4(ptr, i, n, vec, in);
  } else {
    if (!sr) {
      Store4(ptr, i, n, vec, in);
      return;
    }
    Pack<T, kVec> pk;
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      pk.v[k] = RoundStochastic<T>(in[k], SrBits(static_cast<uint32_t>(flat + k), seed));
    if (vec) {
      *reinterpret_cast<Pack<T, kVec>*>(ptr + i) = pk;
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        if (k < n) ptr[i + k] = pk.v[k];
    }
  }
}

// ---------------------------------------------------------------- table helpers
__device__ __forceinline__ int FindLeaf(const LeafTable& t, int chunk) {
  int lo = 0, hi = t.n - 1;  // largest l with chunk_start[l] <= chunk
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (t.chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename Fn>
__device__ __forceinline__ void DispatchType(uint8_t code, Fn&& fn) {
  switch (code) {
    case kF16: fn(__half{}); break;
    case kBF16: fn(__nv_bfloat16{}); break;
    default: fn(float{}); break;
  }
}

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

// ---------------------------------------------------------------- update
struct Scalars {
  float lr, b1, b2, omb1, omb2, eps, eps_root, wd, bc1, bc2, gscale, norm, max_norm;
  bool clip;
};

// One element's update; p is the current value (master or param) in float32.
__device__ __forceinline__ float Step(const Scalars& s, int algo, int flags, bool decay, float g, float p,
                                      float& m, float& v) {
  g = __fmul_rn(g, s.gscale);
  if (s.clip) g = __fmul_rn(__fdiv_rn(g, s.norm), s.max_norm);
  float u;
  if (algo == kAdam) {
    m = __fadd_rn(__fmul_rn(s.omb1, g), __fmul_rn(s.b1, m));
    v = __fadd_rn(__fmul_rn(s.omb2, __fmul_rn(g, g)), __fmul_rn(s.b2, v));
    const float mhat = __fdiv_rn(m, s.bc1);
    const float vhat = __fdiv_rn(v, s.bc2);
    u = __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(__fadd_rn(vhat, s.eps_root)), s.eps));
  } else if (flags & kHasMu) {
    m = __fadd_rn(g, __fmul_rn(s.b1, m));
    u = (flags & kNesterov) ? __fadd_rn(g, __fmul_rn(s.b1, m)) : m;
  } else {
    u = g;
  }
  if (decay) u = __fadd_rn(u, __fmul_rn(s.wd, p));
  return __fmul_rn(u, -s.lr);
}

template <typename P, typename G, typename M>
__device__ __forceinline__ void UpdateChunk(const LeafTable& t, const StateArgs& a, const Scalars& s, int leaf,
                                            int64_t begin, int64_t end) {
  const G* g = static_cast<const G*>(t.grad[leaf]);
  const P* p = static_cast<const P*>(t.param[leaf]);
  const int64_t off = t.offset[leaf];
  M* mu = a.mu ? static_cast<M*>(a.mu) + off : nullptr;
  M* nu = a.nu ? static_cast<M*>(a.nu) + off : nullptr;
  float* master = a.master ? a.master + off : nullptr;
  const bool aligned = t.flags[leaf] & kAligned;
  const bool decay = t.flags[leaf] & kDecay;
  const bool apply = a.flags & kApply;
  const bool sr = (a.flags & kSr) && !master;
  for (int64_t i = begin + threadIdx.x * kVec; i < end; i += kThreads * kVec) {
    const int n = static_cast<int>(end - i < kVec ? end - i : kVec);
    const bool vec = aligned && n == kVec;
    float gv[kVec], pv[kVec], mv[kVec], vv[kVec], upd[kVec];
    Load4(g, i, n, vec, gv);
    if (master) Load4(master, i, n, n == kVec, pv);
    if (!master || !apply) {
      float cur[kVec];
      Load4(p, i, n, vec, cur);
      if (!master) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) pv[k] = cur[k];
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) upd[k] = cur[k];  // param value, for updates = p' - param
      }
    }
    if (mu) Load4(mu, i, n, n == kVec, mv); else for (int k = 0; k < kVec; ++k) mv[k] = 0.f;
    if (nu) Load4(nu, i, n, n == kVec, vv); else for (int k = 0; k < kVec; ++k) vv[k] = 0.f;
    float newp[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float d = Step(s, a.algo, a.flags, decay, gv[k], pv[k], mv[k], vv[k]);
      newp[k] = __fadd_rn(pv[k], d);
      if (!apply) upd[k] = master ? __fsub_rn(newp[k], upd[k]) : d;
    }
    if (mu) Store4(mu, i, n, n == kVec, mv);
    if (nu) Store4(nu, i, n, n == kVec, vv);
    if (master) Store4(master, i, n, n == kVec, newp);
    if (apply) {
      StoreParam4(static_cast<P*>(t.out[leaf]), i, n, vec, newp, sr, off + i, a.seed);
    } else {
      Store4(static_cast<G*>(t.out[leaf]), i, n, vec, upd);
    }
  }
}

// Writes zero updates (the step was skipped in the standard contract).
template <typename G>
__device__ __forceinline__ void ZeroChunk(const LeafTable& t, int leaf, int64_t begin, int64_t end) {
  G* out = static_cast<G*>(t.out[leaf]);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) out[i] = FromFloat<G>(0.f);
}

template <typename M>
__global__ void __launch_bounds__(kThreads) UpdateKernel(const LeafTable t, const StateArgs a) {
  const float* hp = a.hp;
  Scalars s;
  s.lr = hp[kLr]; s.b1 = hp[kB1]; s.b2 = hp[kB2]; s.omb1 = hp[kOneMinusB1]; s.omb2 = hp[kOneMinusB2];
  s.eps = hp[kEps]; s.eps_root = hp[kEpsRoot]; s.wd = hp[kWd]; s.bc1 = hp[kBc1]; s.bc2 = hp[kBc2];
  s.gscale = __fmul_rn(hp[kInvScale], hp[kGradMult]);
  s.max_norm = hp[kMaxNorm];
  s.norm = a.ctl ? a.ctl[0] : 0.f;
  s.clip = a.ctl && a.ctl[1] != 0.f;
  const bool skip = a.ctl && a.ctl[2] != 0.f;
  if (skip && (a.flags & kApply)) return;  // outputs alias their inputs: nothing to write
  const int chunks = t.chunk_start[t.n];
  for (int c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int leaf = FindLeaf(t, c);
    const int64_t begin = static_cast<int64_t>(c - t.chunk_start[leaf]) * kChunk;
    const int64_t end = min(begin + kChunk, t.size[leaf]);
    if (skip) {
      DispatchType(t.gtype[leaf], [&](auto tag) {
        using G = decltype(tag);
        ZeroChunk<G>(t, leaf, begin, end);
      });
      continue;
    }
    DispatchType(t.ptype[leaf], [&](auto ptag) {
      using P = decltype(ptag);
      DispatchType(t.gtype[leaf], [&](auto gtag) {
        using G = decltype(gtag);
        UpdateChunk<P, G, M>(t, a, s, leaf, begin, end);
      });
    });
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
    UpdateKernel<__nv_bfloat16><<<UpdateGrid(t), kThreads, 0, s>>>(t, a);
  } else {
    UpdateKernel<float><<<UpdateGrid(t), kThreads, 0, s>>>(t, a);
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
