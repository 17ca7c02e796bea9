// Fused optimizer kernels (Adam/AdamW, SGD with momentum, gradient accumulation),
// mirrored element for element by jax_ls2/optim/_reference.py. See optimizer.h.
//
// Element math (float32 in registers, no FMA contraction so the reference agrees):
//   g  = grad * inv_scale * grad_mult;  if clipping and !(norm < max_norm): g = g / norm * max_norm
//   Adam: m = (1-b1) g + b1 m;  v = (1-b2) g^2 + b2 v;  u = (m/bc1) / (sqrt(v/bc2 + eps_root) + eps)
//   SGD:  m = g + b1 m;  u = nesterov ? g + b1 m : m   (u = g without momentum)
//   u += wd * p (leaves with the decay flag);  upd = u * (-lr);  p' = p + upd
#include <algorithm>
#include <type_traits>

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
template <typename T> __device__ __forceinline__ uint16_t Bits16(T v);
template <> __device__ __forceinline__ uint16_t Bits16<__half>(__half v) { return __half_as_ushort(v); }
template <> __device__ __forceinline__ uint16_t Bits16<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
template <typename T> __device__ __forceinline__ T FromBits16(uint16_t b);
template <> __device__ __forceinline__ __half FromBits16<__half>(uint16_t b) { return __ushort_as_half(b); }
template <> __device__ __forceinline__ __nv_bfloat16 FromBits16<__nv_bfloat16>(uint16_t b) { return __ushort_as_bfloat16(b); }

// Rounds x to T up or down with probability proportional to proximity (unbiased).
// bfloat16: the top half of the float32 bits after adding the low 16 bits of h (a value
// that would round to inf is truncated instead). float16: u = (h >> 8) * 2^-24 and x
// goes up iff u < (|x| - |lo|) / (|hi| - |lo|).
template <typename T>
__device__ __forceinline__ T RoundStochastic(float x, uint32_t h) {
  if (!isfinite(x)) return FromFloat<T>(x);
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const uint32_t bits = __float_as_uint(x);
    uint32_t r = (bits + (h & 0xFFFFu)) >> 16;
    if ((r & 0x7F80u) == 0x7F80u) r = bits >> 16;
    return FromBits16<T>(static_cast<uint16_t>(r));
  }
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
// Work split: the table's chunks (kChunk elements of one leaf, chunk_start order) are cut
// into gridDim.x contiguous ranges, one per block, and the grid is one resident wave
// (LaunchUpdate), so each block reads hp/ctl/seed and finds its first leaf once, then
// walks its leaves in order (leaf metadata read once per leaf, no per-chunk search).
// Per chunk, thread t handles kGroupsPerChunk groups of kGroup consecutive elements at
// t * kGroup + j * kGroupStride: 16-byte accesses (one for 16-bit types, two for float32),
// every load of all the groups issued before any math.
constexpr int kGroup = 8;                                     // elements per group
constexpr int kGroupStride = kThreads * kGroup;               // 2048
constexpr int kGroupsPerChunk = kChunk / kGroupStride;        // 2
// Resident blocks per SM the update is compiled for: caps it at 128 registers, which
// hold both groups of every array (fp32: 4 arrays x 16 floats) without spilling.
constexpr int kUpdateMinBlocks = 2;
static_assert(kGroupsPerChunk * kGroupStride == kChunk, "kChunk must be a multiple of kThreads * kGroup");
static_assert(kPad % kGroup == 0, "flat offsets must keep groups of the state buffers 16-byte aligned");

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

// Group access: kGroup elements at ptr. vec: one or two aligned 16-byte accesses (ptr is
// 16-byte aligned and all kGroup elements exist); else element by element, the first n
// (loads give 0 beyond n).
template <typename T>
__device__ __forceinline__ void LoadGroup(const T* ptr, int n, bool vec, float (&out)[kGroup]) {
  constexpr int kW = kPack<T>;  // elements per 16-byte access
  static_assert(kGroup % kW == 0, "a group is whole 16-byte accesses");
  if (vec) {
#pragma unroll
    for (int j = 0; j < kGroup / kW; ++j) {
      const Pack<T, kW> pk = *reinterpret_cast<const Pack<T, kW>*>(ptr + j * kW);
#pragma unroll
      for (int k = 0; k < kW; ++k) out[j * kW + k] = ToFloat(pk.v[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) out[k] = k < n ? ToFloat(ptr[k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void StoreGroup(T* ptr, int n, bool vec, const float (&in)[kGroup]) {
  constexpr int kW = kPack<T>;
  if (vec) {
#pragma unroll
    for (int j = 0; j < kGroup / kW; ++j) {
      Pack<T, kW> pk;
#pragma unroll
      for (int k = 0; k < kW; ++k) pk.v[k] = FromFloat<T>(in[j * kW + k]);
      *reinterpret_cast<Pack<T, kW>*>(ptr + j * kW) = pk;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kGroup; ++k)
      if (k < n) ptr[k] = FromFloat<T>(in[k]);
  }
}

// Stochastic-rounding key: SrBits(idx) = Mix32(Mix32(idx * 0x9E3779B1 ^ seed[0]) ^ salt),
// salt = Mix32(seed[2] * 0x85EBCA6B ^ seed[1]), computed once per block.
struct SrKey {
  uint32_t k0, salt;
};
__device__ __forceinline__ SrKey MakeSrKey(const uint32_t* seed) {
  return SrKey{seed[0], Mix32(seed[2] * 0x85EBCA6Bu ^ seed[1])};
}
__device__ __forceinline__ uint32_t SrBits(uint32_t idx, const SrKey& key) {
  return Mix32(Mix32(idx * 0x9E3779B1u ^ key.k0) ^ key.salt);
}

// New params of a group: float32 as is, 16-bit rounded to nearest or stochastically
// (bits of flat element flat + k).
template <typename T>
__device__ __forceinline__ void StoreParamGroup(T* ptr, int n, bool vec, const float (&in)[kGroup], bool sr,
                                                int64_t flat, const SrKey& key) {
  if constexpr (std::is_same<T, float>::value) {
    StoreGroup(ptr, n, vec, in);
  } else {
    if (!sr) {
      StoreGroup(ptr, n, vec, in);
      return;
    }
    Pack<T, kGroup> pk;
#pragma unroll
    for (int k = 0; k < kGroup; ++k)
      pk.v[k] = RoundStochastic<T>(in[k], SrBits(static_cast<uint32_t>(flat + k), key));
    if (vec) {
      static_assert(sizeof(Pack<T, kGroup>) == 16, "one 16-byte store");
      *reinterpret_cast<Pack<T, kGroup>*>(ptr) = pk;
    } else {
#pragma unroll
      for (int k = 0; k < kGroup; ++k)
        if (k < n) ptr[k] = pk.v[k];
    }
  }
}

// One leaf as the update sees it.
template <typename P, typename G, typename M>
struct LeafRef {
  const G* g;
  const P* p;
  void* out;       // P (apply) or G (updates)
  M* mu;           // state pointers already advanced by the leaf's offset, or null
  M* nu;
  float* master;
  int64_t off;     // flat offset (SR index of element 0)
  bool decay;
};

// NG groups at leaf elements i + j * kGroupStride (j < NG). kFull: every group holds kGroup
// elements and every access is one or two 16-byte vectors (leaf pointers 16-byte aligned);
// else NG == 1 and the group holds n elements (1..kGroup), leaf arrays vectorised iff lvec.
// All loads of all groups come before the math, all stores after, so a thread has
// NG * (16..32) bytes of every array in flight at once.
template <int NG, bool kFull, typename P, typename G, typename M>
__device__ __forceinline__ void UpdateGroups(const LeafRef<P, G, M>& L, const StateArgs& a, const Scalars& s,
                                             const SrKey& key, int64_t i, int n, bool lvec) {
  static_assert(kFull || NG == 1, "partial groups go one at a time");
  const bool apply = a.flags & kApply;
  const bool sr = (a.flags & kSr) && !L.master;
  const bool lv = kFull || lvec;          // leaf arrays (grads, params, out)
  const bool sv = kFull || n == kGroup;   // state arrays (always 16-byte aligned)
  const int cnt = kFull ? kGroup : n;
  float gv[NG][kGroup], pv[NG][kGroup], mv[NG][kGroup], vv[NG][kGroup];
#pragma unroll
  for (int j = 0; j < NG; ++j) LoadGroup(L.g + i + j * kGroupStride, cnt, lv, gv[j]);
  // p: the master weights, else the params.
  if (L.master) {
#pragma unroll
    for (int j = 0; j < NG; ++j) LoadGroup(L.master + i + j * kGroupStride, cnt, sv, pv[j]);
  } else {
#pragma unroll
    for (int j = 0; j < NG; ++j) LoadGroup(L.p + i + j * kGroupStride, cnt, lv, pv[j]);
  }
  if (L.mu) {
#pragma unroll
    for (int j = 0; j < NG; ++j) LoadGroup(L.mu + i + j * kGroupStride, cnt, sv, mv[j]);
  } else {
#pragma unroll
    for (int j = 0; j < NG; ++j)
#pragma unroll
      for (int k = 0; k < kGroup; ++k) mv[j][k] = 0.f;
  }
  if (L.nu) {
#pragma unroll
    for (int j = 0; j < NG; ++j) LoadGroup(L.nu + i + j * kGroupStride, cnt, sv, vv[j]);
  } else {
#pragma unroll
    for (int j = 0; j < NG; ++j)
#pragma unroll
      for (int k = 0; k < kGroup; ++k) vv[j][k] = 0.f;
  }
  // d (the update) into gv, the new p into pv.
#pragma unroll
  for (int j = 0; j < NG; ++j) {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const float d = Step(s, a.algo, a.flags, L.decay, gv[j][k], pv[j][k], mv[j][k], vv[j][k]);
      gv[j][k] = d;
      pv[j][k] = __fadd_rn(pv[j][k], d);
    }
  }
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    const int64_t e = i + j * kGroupStride;
    if (L.mu) StoreGroup(L.mu + e, cnt, sv, mv[j]);
    if (L.nu) StoreGroup(L.nu + e, cnt, sv, vv[j]);
    if (L.master) StoreGroup(L.master + e, cnt, sv, pv[j]);
    if (apply) {
      StoreParamGroup(static_cast<P*>(L.out) + e, cnt, lv, pv[j], sr, L.off + e, key);
    } else {
      if (L.master) {
        // updates = new master - param: the params are read only now (this rare mode pays
        // a second round trip rather than every mode holding them in registers).
        float cur[kGroup];
        LoadGroup(L.p + e, cnt, lv, cur);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) gv[j][k] = __fsub_rn(pv[j][k], cur[k]);
      }
      StoreGroup(static_cast<G*>(L.out) + e, cnt, lv, gv[j]);
    }
  }
}

// Elements [e0, e1) of one leaf (e0 a multiple of kChunk): whole chunks with aligned leaf
// pointers take the vector path, the rest (the leaf's last partial chunk, unaligned
// leaves) goes group by group.
template <typename P, typename G, typename M>
__device__ __forceinline__ void UpdateRange(const LeafTable& t, const StateArgs& a, const Scalars& s,
                                            const SrKey& key, int leaf, int64_t e0, int64_t e1) {
  LeafRef<P, G, M> L;
  L.g = static_cast<const G*>(t.grad[leaf]);
  L.p = static_cast<const P*>(t.param[leaf]);
  L.out = t.out[leaf];
  L.off = t.offset[leaf];
  L.mu = a.mu ? static_cast<M*>(a.mu) + L.off : nullptr;
  L.nu = a.nu ? static_cast<M*>(a.nu) + L.off : nullptr;
  L.master = a.master ? a.master + L.off : nullptr;
  L.decay = t.flags[leaf] & kDecay;
  const bool aligned = ((reinterpret_cast<uintptr_t>(L.g) | reinterpret_cast<uintptr_t>(L.p) |
                         reinterpret_cast<uintptr_t>(L.out)) & 15) == 0;
  for (int64_t c = e0; c < e1; c += kChunk) {
    const int64_t i0 = c + threadIdx.x * kGroup;
    if (aligned && c + kChunk <= e1) {
      UpdateGroups<kGroupsPerChunk, true>(L, a, s, key, i0, kGroup, true);
    } else {
#pragma unroll 1
      for (int j = 0; j < kGroupsPerChunk; ++j) {
        const int64_t i = i0 + j * kGroupStride;
        if (i >= e1) break;
        const int n = static_cast<int>(e1 - i < kGroup ? e1 - i : kGroup);
        UpdateGroups<1, false>(L, a, s, key, i, n, aligned && n == kGroup);
      }
    }
  }
}

// Writes zero updates to elements [e0, e1) (the step was skipped in the standard contract).
template <typename G>
__device__ __forceinline__ void ZeroRange(const LeafTable& t, int leaf, int64_t e0, int64_t e1) {
  G* out = static_cast<G*>(t.out[leaf]);
  for (int64_t i = e0 + threadIdx.x; i < e1; i += kThreads) out[i] = FromFloat<G>(0.f);
}

template <typename M>
__global__ void __launch_bounds__(kThreads, kUpdateMinBlocks) UpdateKernel(const LeafTable t, const StateArgs a) {
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
  const SrKey key = (a.flags & kSr) ? MakeSrKey(a.seed) : SrKey{0u, 0u};
  // This block's chunks [c0, c1).
  const int64_t chunks = t.chunk_start[t.n];
  const int c0 = static_cast<int>(chunks * blockIdx.x / gridDim.x);
  const int c1 = static_cast<int>(chunks * (blockIdx.x + 1) / gridDim.x);
  if (c0 >= c1) return;
  for (int leaf = FindLeaf(t, c0); leaf < t.n && t.chunk_start[leaf] < c1; ++leaf) {
    const int cs = t.chunk_start[leaf];
    const int lo = max(c0, cs), hi = min(c1, t.chunk_start[leaf + 1]);
    if (lo >= hi) continue;  // size-0 leaf
    const int64_t e0 = static_cast<int64_t>(lo - cs) * kChunk;
    const int64_t e1 = min(static_cast<int64_t>(hi - cs) * kChunk, t.size[leaf]);
    if (skip) {
      DispatchType(t.gtype[leaf], [&](auto tag) {
        using G = decltype(tag);
        ZeroRange<G>(t, leaf, e0, e1);
      });
      continue;
    }
    DispatchType(t.ptype[leaf], [&](auto ptag) {
      using P = decltype(ptag);
      DispatchType(t.gtype[leaf], [&](auto gtag) {
        using G = decltype(gtag);
        UpdateRange<P, G, M>(t, a, s, key, leaf, e0, e1);
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

int SmCount() {
  static const int count = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();  // not the caller's error
      n = 0;
    }
    return n > 0 ? n : 132;
  }();
  return count;
}

// One resident wave of UpdateKernel<M> (at most one block per chunk): every block works
// through a contiguous range of chunks.
template <typename M>
void LaunchUpdateKernel(const LeafTable& t, const StateArgs& a, cudaStream_t s) {
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, UpdateKernel<M>, kThreads, 0) != cudaSuccess) {
      cudaGetLastError();
      n = 0;
    }
    return n > 0 ? n : 1;
  }();
  const int64_t resident = static_cast<int64_t>(per_sm) * SmCount();
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t.chunk_start[t.n], resident)));
  UpdateKernel<M><<<grid, kThreads, 0, s>>>(t, a);
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
    LaunchUpdateKernel<__nv_bfloat16>(t, a, s);
  } else {
    LaunchUpdateKernel<float>(t, a, s);
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
