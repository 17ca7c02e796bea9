// Attention softmax + dropout over the last axis (k_len), fp32 max and sum.
//
//   logits = scale * scores + bias   (bias broadcast, T or float32)
//   masked where mask == 0, or causal and k > q + k_len - q_len, set to -inf
//   p = exp(logits - max) / sum      (fully masked rows: p = 0)
//   y = p * keep * keep_scale        (keep: the counter-based mask of common.cuh)
//
// The forward writes y and per-row stats (max, 1 / sum); it does not write p.
// The backward re-reads the scores, recomputes p bit for bit from the stats and
// regenerates the keep mask from the seed (element (row, col) numbered
// MaskRowStart(row) + col in the whole array, kernels/common.cuh):
//   g = dy * keep * keep_scale,  dx = grad_scale * p * (g - sum(g * p)).
//
// Register path (k_len <= 8192): a row group of blockDim.x threads (a power of
// two, <= 512) holds one row in registers, 16 elements per thread (the forward of
// fp16/bf16 rows with 16-byte accesses: 32), 16-byte accesses when k_len allows;
// blockDim.y row groups per block. Where a row group is at most a warp (k_len <= 512
// in bf16/fp16) the reductions are shuffles only.
// Looped path (larger k_len): one block per row, an online max/sum pass and a
// write pass that re-reads the row (from L2).
#include <algorithm>
#include <type_traits>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/softmax.h"

namespace jax_ls2 {
namespace {

constexpr int kElemsPerThread = 16;  // the scalar path, fp32 and the backward
// The forward of 16-bit vector rows holds 32 elements per thread: its per-thread work
// (row setup, two reductions, the reciprocal) is then spread over twice the elements.
template <typename T>
constexpr int kFwdVecElems = sizeof(T) == 2 ? 32 : kElemsPerThread;
constexpr int kMaxRowThreads = 512;  // register path: k_len <= 512 * 16
constexpr int kLoopThreads = 512;

// exp(x - m). fp32 uses the accurate expf; fp16/bf16 the hardware exp2 (its error
// is far below their rounding). The backward uses the same function, so p is
// recomputed exactly.
template <typename T>
__device__ __forceinline__ float ExpShift(float x, float m) {
  if constexpr (std::is_same_v<T, float>) {
    return expf(x - m);
  } else {
    return Exp2Approx(__fmaf_rn(x, kLog2e, -m * kLog2e));
  }
}

// Loads VEC elements of T as floats in 16-byte (or smaller) aligned pieces.
template <typename T, int VEC>
__device__ __forceinline__ void LoadVec(const T* p, float (&out)[VEC]) {
  constexpr int C = (VEC * (int)sizeof(T) > 16) ? 16 / (int)sizeof(T) : VEC;
#pragma unroll
  for (int c = 0; c < VEC; c += C) {
    float part[C];
    UnpackFloats(*reinterpret_cast<const Pack<T, C>*>(p + c), part);
#pragma unroll
    for (int i = 0; i < C; ++i) out[c + i] = part[i];
  }
}

// Which of VEC consecutive columns take part: byte j % 4 of word j / 4 is non-zero
// iff column j is attended (before the row's limit) and not masked. Bytes, not bits, so
// the mask's bytes are used as loaded and each test is one instruction (a masked AND
// into a predicate).
template <int VEC>
struct ColumnFlags {
  static constexpr int kWords = (VEC + 3) / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ bool operator[](int j) const { return (w[j / 4] >> (8 * (j % 4))) & 0xffu; }
};

// attended: columns from col on that are <= the row's limit (larger than VEC counts as
// VEC, <= 0 as none). m: the mask bytes of these columns, read when masked.
template <int VEC>
__device__ __forceinline__ ColumnFlags<VEC> LoadColumnFlags(int attended, const uint8_t* m, bool masked) {
  ColumnFlags<VEC> f;
  const int att = min(attended, VEC);
#pragma unroll
  for (int c = 0; c < f.kWords; ++c) {
    // The low 8n bits for the n = clamp(att - 4c, 0, 4) attended columns of this word
    // (a clamping funnel shift: 32 and more give all ones).
    const int n = max(att - 4 * c, 0);
    f.w[c] = __funnelshift_lc(0xffffffffu, 0u, 8 * (uint32_t)n);
    if (masked) {
      if constexpr (VEC == 1) {
        f.w[c] &= m[0];
      } else if constexpr (VEC == 2) {
        f.w[c] &= *reinterpret_cast<const uint16_t*>(m);
      } else {
        f.w[c] &= *reinterpret_cast<const uint32_t*>(m + 4 * c);
      }
    }
  }
  return f;
}

__device__ __forceinline__ uint32_t Div(uint32_t n, const FastDiv& f) {
  return f.d == 1 ? n : __umulhi(n, f.mul) >> f.shr;
}

struct Row {
  int64_t off;    // row * cols
  int64_t limit;  // last attended column; < 0 when none
  int64_t boff, moff;
  float bconst;   // the row's bias when it is broadcast along k (else unused), 0 without bias
};

template <typename BT>
__device__ __forceinline__ Row RowSetup(const SoftmaxProblem& p, int64_t row) {
  Row r;
  r.off = row * p.cols;
  r.limit = p.cols - 1;
  if (p.causal) {
    const uint32_t rr = (uint32_t)row;
    const int64_t q = (int64_t)(rr - Div(rr, p.q_div) * (uint32_t)p.q_len);
    r.limit = min(r.limit, q + p.cols - p.q_len);
  }
  r.boff = 0;
  r.moff = 0;
  uint32_t rem = (uint32_t)row;
#pragma unroll
  for (int d = kSoftmaxMaxDims - 1; d >= 0; --d) {
    if (d < p.bc.nd) {
      const uint32_t quo = Div(rem, p.bc.size[d]);
      const uint32_t i = rem - quo * p.bc.size[d].d;
      rem = quo;
      r.boff += (int64_t)i * p.bc.bias[d];
      r.moff += (int64_t)i * p.bc.mask[d];
    }
  }
  r.bconst = 0.f;
  if (p.bias != nullptr && p.bias_k == 0) r.bconst = ToFloat(static_cast<const BT*>(p.bias)[r.boff]);
  if (p.mask != nullptr && p.mask_k == 0 && p.mask[r.moff] == 0) r.limit = -1;
  return r;
}

// Logits of columns col .. col + VEC - 1 (-inf where masked). col <= r.limit.
// BIASK = false: compiled for problems without a bias along k (none, or one value per
// row), whose arithmetic is then free of the per-element bias selects.
template <typename T, typename BT, int VEC, bool BIASK = true>
__device__ __forceinline__ void LoadLogits(const SoftmaxProblem& p, const Row& r, int64_t col,
                                           float (&v)[VEC]) {
  LoadVec<T, VEC>(static_cast<const T*>(p.x) + r.off + col, v);
  float b[VEC];
  if (BIASK && p.bias != nullptr && p.bias_k != 0) {
    LoadVec<BT, VEC>(static_cast<const BT*>(p.bias) + r.boff + col, b);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) b[j] = r.bconst;
  }
  const bool masked = p.mask != nullptr && p.mask_k != 0;
  const ColumnFlags<VEC> ok = LoadColumnFlags<VEC>((int)(r.limit - col + 1 < VEC ? r.limit - col + 1 : VEC),
                                                   p.mask + (masked ? r.moff + col : 0), masked);
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] = ok[j] ? __fmaf_rn(v[j], p.scale, b[j]) : -INFINITY;
}

// The register kernels' view of a row: base pointers and the limit in 32 bits (k_len
// <= 8192 there), so per-element addressing and the limit tests stay 32-bit.
template <typename T, typename BT>
struct RegRow {
  const T* x;          // the row's scores
  const BT* bias;      // the row's bias along k, nullptr when there is none
  const uint8_t* mask; // the row's mask along k, nullptr when there is none
  int limit;           // last attended column, -1 when none (or the row is past the end)
  float bconst;        // the row's bias when it is not along k (0 without bias)
  uint64_t g;          // dropout number of the row's first element (MaskRowStart)
};

template <typename T, typename BT, bool BIASK>
__device__ __forceinline__ RegRow<T, BT> RegRowSetup(const SoftmaxProblem& p, int64_t row, bool valid,
                                                     const WideSeed& seed) {
  const Row r = RowSetup<BT>(p, valid ? row : 0);
  RegRow<T, BT> rr;
  rr.x = static_cast<const T*>(p.x) + r.off;
  rr.bias = BIASK && p.bias != nullptr && p.bias_k != 0 ? static_cast<const BT*>(p.bias) + r.boff : nullptr;
  rr.mask = p.mask != nullptr && p.mask_k != 0 ? p.mask + r.moff : nullptr;
  rr.limit = valid ? (int)r.limit : -1;
  rr.bconst = r.bconst;
  rr.g = MaskRowStart(p.numbering, seed.base, valid ? row : 0);
  return rr;
}

// Logits of columns col .. col + VEC - 1 of a register-kernel row, -inf where masked
// or past the row's limit (any col). The loads read from at = min(col, k_len - VEC),
// always inside the row, and the flags discard what lies past the limit: no branch,
// and masked columns cost a select rather than a predicated multiply-add and a fill.
template <typename T, typename BT, int VEC, bool BIASK>
__device__ __forceinline__ void RegLogits(const RegRow<T, BT>& rr, int col, uint32_t at, float scale,
                                          float (&v)[VEC]) {
  LoadVec<T, VEC>(rr.x + at, v);
  const ColumnFlags<VEC> ok = LoadColumnFlags<VEC>(rr.limit - col + 1, rr.mask + at, rr.mask != nullptr);
  if (BIASK && rr.bias != nullptr) {
    float b[VEC];
    LoadVec<BT, VEC>(rr.bias + at, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float t = __fmaf_rn(v[j], scale, b[j]);
      v[j] = ok[j] ? t : -INFINITY;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float t = __fmaf_rn(v[j], scale, rr.bconst);
      v[j] = ok[j] ? t : -INFINITY;
    }
  }
}

__device__ __forceinline__ WideSeed LoadSeed(const SoftmaxProblem& p) {
  WideSeed s{0u, 0u, 0u};
  if (p.threshold != 0) s = LoadWideSeed(p.seed);
  return s;
}

// Max (MAX) or sum over the blockDim.x threads of this row group; every thread of
// the block must call it. scratch: >= 32 * blockDim.y floats.
template <bool MAX>
__device__ __forceinline__ float RowReduce(float v, float* scratch) {
  const int tpr = blockDim.x;
  auto op = [](float a, float b) { return MAX ? fmaxf(a, b) : a + b; };
  if (tpr <= 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      if (o < tpr) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = tpr >> 5;
  float* s = scratch + threadIdx.y * 32;
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < nw ? s[lane] : (MAX ? -INFINITY : 0.f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ------------------------------------------------------------------ forward
// Vectorised: <= 40 registers (no spills), so 6 blocks of 256 threads fit an SM and
// more loads are in flight.
template <typename T, typename BT, int VEC, int ITEMS, bool BIASK = true>
__global__ void __launch_bounds__(kMaxRowThreads, VEC == 1 ? 1 : sizeof(T) == 2 && ITEMS * VEC <= kElemsPerThread ? 3 : 2)
    SoftmaxFwdKernel(SoftmaxFwdArgs a) {
  __shared__ float scratch[32 * 32];
  const SoftmaxProblem& p = a.p;
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid = row < p.rows;
  const WideSeed seed = LoadSeed(p);
  const RegRow<T, BT> rr = RegRowSetup<T, BT, BIASK>(p, row, valid, seed);
  const float scale = p.scale;
  const int c0 = threadIdx.x * VEC, cstep = blockDim.x * VEC;

  const int cols = (int)p.cols;

  float v[ITEMS][VEC];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = c0 + i * cstep;
    RegLogits<T, BT, VEC, BIASK>(rr, col, (uint32_t)min(col, cols - VEC), scale, v[i]);
#pragma unroll
    for (int j = 0; j < VEC; ++j) mx = fmaxf(mx, v[i][j]);
  }
  mx = RowReduce<true>(mx, scratch);
  if (mx == -INFINITY) mx = 0.f;  // fully masked: every exp is 0
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      v[i][j] = ExpShift<T>(v[i][j], mx);
      sum += v[i][j];
    }
  }
  sum = RowReduce<false>(sum, scratch);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (!valid) return;
  const uint32_t thr = p.threshold;
  const float kept = inv * p.keep_scale;
  T* y = static_cast<T*>(a.y) + (rr.x - static_cast<const T*>(p.x));
  // Three copies of the store loop, the choice made once per thread: no dropout, the
  // row's dropout indices even (one hash per pair, the usual case), or any.
  auto store = [&](auto keep_of) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = c0 + i * cstep;
      if (col < cols) {
        bool keep[VEC];
        keep_of(rr.g + (uint64_t)col, keep);
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = keep[j] ? v[i][j] * kept : 0.f;
        StoreFloats<T, VEC>(y + col, o);
      }
    }
  };
  if (thr == 0) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = c0 + i * cstep;
      if (col < cols) {
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = v[i][j] * inv;
        StoreFloats<T, VEC>(y + col, o);
      }
    }
  } else {
    WithWideKeepFlags<VEC>((rr.g & 1u) == 0u, seed, thr, store);
  }
  if (threadIdx.x == 0) reinterpret_cast<float2*>(p.stats)[row] = make_float2(mx, inv);
}

template <typename T, typename BT, int VEC>
__global__ void __launch_bounds__(kLoopThreads) SoftmaxFwdLoopKernel(SoftmaxFwdArgs a) {
  __shared__ float scratch[32];
  const SoftmaxProblem& p = a.p;
  const int64_t row = blockIdx.x;
  const Row r = RowSetup<BT>(p, row);
  const int64_t step = (int64_t)blockDim.x * VEC;
  float m = -INFINITY, s = 0.f;
  for (int64_t col = (int64_t)threadIdx.x * VEC; col <= r.limit; col += step) {
    float v[VEC];
    LoadLogits<T, BT, VEC>(p, r, col, v);
    float pm = -INFINITY;
#pragma unroll
    for (int j = 0; j < VEC; ++j) pm = fmaxf(pm, v[j]);
    if (pm == -INFINITY) continue;
    if (pm > m) {
      s = m == -INFINITY ? 0.f : s * ExpShift<T>(m, pm);
      m = pm;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += ExpShift<T>(v[j], m);
  }
  float mx = BlockMax(m, scratch);
  if (mx == -INFINITY) mx = 0.f;
  const float sum = BlockSum(m == -INFINITY ? 0.f : s * ExpShift<T>(m, mx), scratch);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const uint32_t thr = p.threshold;
  const WideSeed seed = LoadSeed(p);
  const uint64_t grow = MaskRowStart(p.numbering, seed.base, row);
  const float kept = inv * p.keep_scale;
  T* y = static_cast<T*>(a.y) + r.off;
  for (int64_t col = (int64_t)threadIdx.x * VEC; col < p.cols; col += step) {
    float v[VEC], o[VEC];
    if (col <= r.limit) {
      LoadLogits<T, BT, VEC>(p, r, col, v);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = -INFINITY;
    }
    if (thr != 0) {
      bool keep[VEC];
      KeepWide<VEC, false>(grow + (uint64_t)col, seed, thr, keep);
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = keep[j] ? ExpShift<T>(v[j], mx) * kept : 0.f;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = ExpShift<T>(v[j], mx) * inv;
    }
    StoreFloats<T, VEC>(y + col, o);
  }
  if (threadIdx.x == 0) reinterpret_cast<float2*>(p.stats)[row] = make_float2(mx, inv);
}

// ------------------------------------------------------------------ backward
// p and g of columns col .. col + VEC - 1 (col <= r.limit).
template <typename T, typename BT, int VEC, bool BIASK = true>
__device__ __forceinline__ void LoadPG(const SoftmaxBwdArgs& a, const Row& r, int64_t col, float2 st,
                                       const WideSeed& seed, uint64_t grow, float (&pv)[VEC], float (&g)[VEC]) {
  const SoftmaxProblem& p = a.p;
  LoadLogits<T, BT, VEC, BIASK>(p, r, col, pv);
  LoadVec<T, VEC>(static_cast<const T*>(a.dy) + r.off + col, g);
#pragma unroll
  for (int j = 0; j < VEC; ++j) pv[j] = ExpShift<T>(pv[j], st.x) * st.y;
  if (p.threshold != 0) {
    bool keep[VEC];
    KeepWide<VEC, false>(grow + (uint64_t)col, seed, p.threshold, keep);
#pragma unroll
    for (int j = 0; j < VEC; ++j) g[j] = keep[j] ? g[j] * p.keep_scale : 0.f;
  }
}

template <typename T, typename BT, int VEC, int ITEMS, bool BIASK = true>
__global__ void __launch_bounds__(kMaxRowThreads) SoftmaxBwdKernel(SoftmaxBwdArgs a) {
  __shared__ float scratch[32 * 32];
  const SoftmaxProblem& p = a.p;
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid = row < p.rows;
  const WideSeed seed = LoadSeed(p);
  const RegRow<T, BT> rr = RegRowSetup<T, BT, BIASK>(p, row, valid, seed);
  const float2 st = valid ? reinterpret_cast<const float2*>(p.stats)[row] : make_float2(0.f, 0.f);
  const int64_t row_off = rr.x - static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(a.dy) + row_off;
  const float scale = p.scale;
  const int c0 = threadIdx.x * VEC, cstep = blockDim.x * VEC;
  const int cols = (int)p.cols;

  // p recomputed (0 past the limit), g = dy (0 past the limit, so an inf or NaN there
  // cannot reach the sum).
  float pv[ITEMS][VEC], g[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = c0 + i * cstep;
    const uint32_t at = (uint32_t)min(col, cols - VEC);
    RegLogits<T, BT, VEC, BIASK>(rr, col, at, scale, pv[i]);
    LoadVec<T, VEC>(dy + at, g[i]);
    if (col > rr.limit) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[i][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) pv[i][j] = ExpShift<T>(pv[i][j], st.x) * st.y;
  }
  // Dropout on g, the choice made once per thread: the row's indices even (one hash
  // per pair, the usual case) or any.
  const uint32_t thr = p.threshold;
  auto drop = [&](auto keep_of) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      bool keep[VEC];
      keep_of(rr.g + (uint64_t)(c0 + i * cstep), keep);
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[i][j] = keep[j] ? g[i][j] * p.keep_scale : 0.f;
    }
  };
  if (thr != 0) WithWideKeepFlags<VEC>((rr.g & 1u) == 0u, seed, thr, drop);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc = fmaf(g[i][j], pv[i][j], acc);
  }
  acc = RowReduce<false>(acc, scratch);
  if (!valid) return;
  T* dx = static_cast<T*>(a.dx) + row_off;
  const float gs = a.grad_scale;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = c0 + i * cstep;
    if (col < cols) {
      float o[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = gs * pv[i][j] * (g[i][j] - acc);
      StoreFloats<T, VEC>(dx + col, o);
    }
  }
}

template <typename T, typename BT, int VEC>
__global__ void __launch_bounds__(kLoopThreads) SoftmaxBwdLoopKernel(SoftmaxBwdArgs a) {
  __shared__ float scratch[32];
  const SoftmaxProblem& p = a.p;
  const int64_t row = blockIdx.x;
  const Row r = RowSetup<BT>(p, row);
  const float2 st = reinterpret_cast<const float2*>(p.stats)[row];
  const WideSeed seed = LoadSeed(p);
  const uint64_t grow = MaskRowStart(p.numbering, seed.base, row);
  const int64_t step = (int64_t)blockDim.x * VEC;
  float acc = 0.f;
  for (int64_t col = (int64_t)threadIdx.x * VEC; col <= r.limit; col += step) {
    float pv[VEC], g[VEC];
    LoadPG<T, BT, VEC>(a, r, col, st, seed, grow, pv, g);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc += g[j] * pv[j];
  }
  acc = BlockSum(acc, scratch);
  T* dx = static_cast<T*>(a.dx) + r.off;
  const float gs = a.grad_scale;
  for (int64_t col = (int64_t)threadIdx.x * VEC; col < p.cols; col += step) {
    float pv[VEC], g[VEC], o[VEC];
    if (col <= r.limit) {
      LoadPG<T, BT, VEC>(a, r, col, st, seed, grow, pv, g);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) pv[j] = g[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = gs * pv[j] * (g[j] - acc);
    StoreFloats<T, VEC>(dx + col, o);
  }
}

// ------------------------------------------------------------------ launch
bool AlignedTo(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// 16-byte packs when k_len and every pointer allow, else 1 element per access.
template <typename T>
int PickVec(const SoftmaxProblem& p, const void* a, const void* b) {
  constexpr int kVec = kPack<T>;
  if (p.cols % kVec != 0 || !AlignedTo(p.x, 16) || !AlignedTo(a, 16) || !AlignedTo(b, 16)) return 1;
  if (p.bias != nullptr && p.bias_k != 0 &&
      !AlignedTo(p.bias, std::min<size_t>(16, kVec * (p.bias_f32 ? 4 : sizeof(T)))))
    return 1;
  if (p.mask != nullptr && p.mask_k != 0 && !AlignedTo(p.mask, kVec)) return 1;
  return kVec;
}

// Elements per thread of the 16-byte register path: the default (kDefault), or the
// other of 16 / 32 where a benchmark asks for it with softmax_elems (bfloat16 only).
template <typename T, int kDefault>
int VecElems(const SoftmaxLaunchOptions& o) {
  const int opt = o.elems;
  return std::is_same_v<T, __nv_bfloat16> && (opt == 16 || opt == 32) ? opt : kDefault;
}

// Threads per row for the register path (a power of two), 0 when the row is too long
// (k_len > 8192 takes the looped kernels whatever the element count).
int ThreadsPerRow(int64_t cols, int vec, int elems) {
  if (cols > (int64_t)kMaxRowThreads * kElemsPerThread) return 0;
  const int64_t vecs = (cols + vec - 1) / vec;
  const int items = elems / vec;
  const int64_t need = (vecs + items - 1) / items;
  int tpr = 1;
  while (tpr < need) tpr <<= 1;
  return tpr <= kMaxRowThreads ? tpr : 0;
}

template <typename Args, typename RegK, typename LoopK>
cudaError_t Launch(const Args& a, int tpr, RegK reg, LoopK loop, cudaStream_t stream) {
  if (tpr == 0) {
    loop<<<(unsigned)a.p.rows, kLoopThreads, 0, stream>>>(a);
  } else {
    const int ry = tpr >= 256 ? 1 : 256 / tpr;
    const unsigned grid = (unsigned)((a.p.rows + ry - 1) / ry);
    reg<<<grid, dim3(tpr, ry), 0, stream>>>(a);
  }
  return cudaGetLastError();
}

// Picks elements per thread and threads per row, then launches the register kernel
// kernels(vec, items, biask).first or the looped kernel .second; vec, items and biask
// come as std::integral_constant so one dispatch serves the forward and the backward.
// The 16-byte register kernel with kVecElems elements per thread is also compiled
// without the bias-along-k path (biask = false), taken when the problem has no such
// bias; the other element count (bfloat16, on request) only with it.
template <typename T, int kVecElems, typename Args, typename Kernels>
cudaError_t LaunchTyped(const Args& a, int vec, Kernels kernels, const SoftmaxLaunchOptions& o, cudaStream_t stream) {
  using std::integral_constant;
  constexpr int kVec = kPack<T>;
  using Generic = std::true_type;
  if (vec != kVec) {
    const int tpr = ThreadsPerRow(a.p.cols, 1, kElemsPerThread);
    const auto k = kernels(integral_constant<int, 1>{}, integral_constant<int, kElemsPerThread>{}, Generic{});
    return Launch(a, tpr, k.first, k.second, stream);
  }
  const int elems = VecElems<T, kVecElems>(o);
  const int tpr = ThreadsPerRow(a.p.cols, vec, elems);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    constexpr int kOther = kVecElems == 32 ? 16 : 32;
    if (elems == kOther) {
      const auto k = kernels(integral_constant<int, kVec>{}, integral_constant<int, kOther / kVec>{}, Generic{});
      return Launch(a, tpr, k.first, k.second, stream);
    }
  }
  using Items = integral_constant<int, kVecElems / kVec>;
  if (a.p.bias == nullptr || a.p.bias_k == 0) {
    const auto k = kernels(integral_constant<int, kVec>{}, Items{}, std::false_type{});
    return Launch(a, tpr, k.first, k.second, stream);
  }
  const auto k = kernels(integral_constant<int, kVec>{}, Items{}, Generic{});
  return Launch(a, tpr, k.first, k.second, stream);
}

template <typename T, typename BT>
cudaError_t FwdTyped(const SoftmaxFwdArgs& a, const SoftmaxLaunchOptions& o, cudaStream_t stream) {
  return LaunchTyped<T, kFwdVecElems<T>>(a, PickVec<T>(a.p, a.y, nullptr), [](auto vec, auto items, auto biask) {
    return std::make_pair(SoftmaxFwdKernel<T, BT, vec(), items(), biask()>, SoftmaxFwdLoopKernel<T, BT, vec()>);
  }, o, stream);
}

template <typename T, typename BT>
cudaError_t BwdTyped(const SoftmaxBwdArgs& a, const SoftmaxLaunchOptions& o, cudaStream_t stream) {
  return LaunchTyped<T, kElemsPerThread>(a, PickVec<T>(a.p, a.dy, a.dx), [](auto vec, auto items, auto biask) {
    return std::make_pair(SoftmaxBwdKernel<T, BT, vec(), items(), biask()>, SoftmaxBwdLoopKernel<T, BT, vec()>);
  }, o, stream);
}

}  // namespace

template <typename T>
cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdArgs& a, const SoftmaxLaunchOptions& o, cudaStream_t stream) {
  if (a.p.rows == 0 || a.p.cols == 0) return cudaSuccess;
  if (a.p.bias_f32 && !std::is_same_v<T, float>) return FwdTyped<T, float>(a, o, stream);
  return FwdTyped<T, T>(a, o, stream);
}

template <typename T>
cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdArgs& a, const SoftmaxLaunchOptions& o, cudaStream_t stream) {
  if (a.p.rows == 0 || a.p.cols == 0) return cudaSuccess;
  if (a.p.bias_f32 && !std::is_same_v<T, float>) return BwdTyped<T, float>(a, o, stream);
  return BwdTyped<T, T>(a, o, stream);
}

#define JAX_LS2_INSTANTIATE(T)                                                                              \
  template cudaError_t LaunchSoftmaxFwd<T>(const SoftmaxFwdArgs&, const SoftmaxLaunchOptions&, cudaStream_t); \
  template cudaError_t LaunchSoftmaxBwd<T>(const SoftmaxBwdArgs&, const SoftmaxLaunchOptions&, cudaStream_t);
JAX_LS2_INSTANTIATE(float)
JAX_LS2_INSTANTIATE(__half)
JAX_LS2_INSTANTIATE(__nv_bfloat16)
#undef JAX_LS2_INSTANTIATE

}  // namespace jax_ls2
