// The fused update kernel, a template over the moments' dtype; each instantiation is
// compiled in its own translation unit (optimizer_update_f32.cu, _bf16.cu) so the two
// build in parallel.
#pragma once
#include "kernels/optimizer_device.cuh"

namespace jax_ls2 {
namespace optim {
namespace {

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
  float lr, b1, b2, omb1, omb2, eps, eps_root, wd, inv_bc1, inv_bc2, gscale, norm, max_norm;
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
    const float mhat = __fmul_rn(m, s.inv_bc1);
    const float vhat = __fmul_rn(v, s.inv_bc2);
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
// `bad` collects whether a gradient is inf/NaN (loads give 0 past n, so padding is finite).
template <int NG, bool kFull, typename P, typename G, typename M>
__device__ __forceinline__ void UpdateGroups(const LeafRef<P, G, M>& L, const StateArgs& a, const Scalars& s,
                                             const SrKey& key, int64_t i, int n, bool lvec, bool& bad) {
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
      bad |= !isfinite(gv[j][k]);
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
                                            const SrKey& key, int leaf, int64_t e0, int64_t e1, bool& bad) {
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
      UpdateGroups<kGroupsPerChunk, true>(L, a, s, key, i0, kGroup, true, bad);
    } else {
#pragma unroll 1
      for (int j = 0; j < kGroupsPerChunk; ++j) {
        const int64_t i = i0 + j * kGroupStride;
        if (i >= e1) break;
        const int n = static_cast<int>(e1 - i < kGroup ? e1 - i : kGroup);
        UpdateGroups<1, false>(L, a, s, key, i, n, aligned && n == kGroup, bad);
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
  s.eps = hp[kEps]; s.eps_root = hp[kEpsRoot]; s.wd = hp[kWd]; s.inv_bc1 = hp[kInvBc1]; s.inv_bc2 = hp[kInvBc2];
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
  bool bad = false;
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
        UpdateRange<P, G, M>(t, a, s, key, leaf, e0, e1, bad);
      });
    });
  }
  // Every writer stores the same value, so plain stores suffice.
  if (bad && a.bad) *a.bad = 1;
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
}  // namespace optim
}  // namespace jax_ls2
