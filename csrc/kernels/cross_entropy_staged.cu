// Fused softmax cross entropy, loss and gradient, for 16-bit logits whose rows fit twice
// in shared memory (up to about 56k columns): the row-staging kernel (sm_90+).
//
// One persistent block per SM. Each block walks rows r, r + grid, ... and keeps two row
// buffers in shared memory: while it reduces row k and writes its gradient, the bulk-copy
// engine (cp.async.bulk, completion on an mbarrier) already loads row k + 1 into the other
// buffer, so every logit crosses DRAM once and the loads of the next row overlap the
// arithmetic and the stores of this one. The row's 16-byte-aligned body is staged; the
// few elements before and after it are read and written directly; the gradient is
// stored directly too (the alternatives tried: bench/PERF_NOTES.md, "Kernel design
// history").
//
// Per row: max over the row; d = sum exp2(x * log2e - m * log2e) (and sum x when label
// smoothing needs it); then
//   grad = s * (p * (1 + 2 z lse) - (1 - eps) * onehot - eps / vocab),  p = exp(x - m) / d
// in the logits dtype, and loss = lse - (1 - eps) x[label] - eps mean(x) + z lse^2, as in
// cross_entropy.cu (same conventions for ignored rows and labels outside the vocabulary).
#include <algorithm>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/bulk_copy.cuh"
#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_reduce.cuh"

namespace jax_ls2 {
namespace {

constexpr int kStagedThreads = 1024;
// Shared memory a block may use (sm_90: 227 KB opt-in), less the static part.
constexpr size_t kStagedSmemBytes = 227 * 1024 - 1024;

// Where the 16-byte aligned body of a row starts (in elements) and how many packs it holds.
template <typename T>
struct RowSplit {
  int head;   // elements before the body (0..7)
  int nvec;   // packs of kPack<T> elements in the body
  int tail;   // elements after the body
};
template <typename T>
__device__ __forceinline__ RowSplit<T> SplitRow(const T* x, int vocab) {
  constexpr int kW = kPack<T>;
  const int head = min(vocab, static_cast<int>(((16 - (reinterpret_cast<uintptr_t>(x) & 15)) & 15) / sizeof(T)));
  const int nvec = (vocab - head) / kW;
  return {head, nvec, vocab - head - nvec * kW};
}

// This thread's max over packs i = tid, tid + bd, ... of the staged row, taken on pairs
// of the 16-bit logits (one instruction per two elements) and widened once at the end.
template <typename T>
__device__ __forceinline__ float RowMaxPacked(const Pack<T, kPack<T>>* buf, int nvec, int tid, int bd) {
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  constexpr int kPairs = kPack<T> / 2;
  const T lowest = FromFloat<T>(-INFINITY);
  Pair m2[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) m2[j] = Pair{lowest, lowest};
#pragma unroll 4
  for (int i = tid; i < nvec; i += bd) {
    const Pack<T, kPack<T>> pk = buf[i];
    const Pair* p = reinterpret_cast<const Pair*>(&pk);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) m2[j] = __hmax2(m2[j], p[j]);
  }
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) m = fmaxf(m, fmaxf(ToFloat(m2[j].x), ToFloat(m2[j].y)));
  return m;
}

// Adds exp2(x log2e - mb) over this thread's packs to d, and x to sx when kSumX.
template <bool kSumX, typename T>
__device__ __forceinline__ void SumExp(const Pack<T, kPack<T>>* buf, int nvec, int tid, int bd, float mb,
                                       float& d, float& sx) {
#pragma unroll 2
  for (int i = tid; i < nvec; i += bd) {
    const Pack<T, kPack<T>> pk = buf[i];
#pragma unroll
    for (int j = 0; j < kPack<T>; ++j) {
      const float v = ToFloat(pk.v[j]);
      d += Exp2Approx(fmaf(v, kLog2e, -mb));
      if constexpr (kSumX) sx += v;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kStagedThreads, 1) CrossEntropyStagedKernel(CrossEntropyArgs a, int buf_packs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kW = kPack<T>;
  using PackT = Pack<T, kW>;
  extern __shared__ __align__(16) unsigned char staged_raw[];
  __shared__ __align__(8) uint64_t bars[2];
  __shared__ float scratch[32];
  PackT* const staged = reinterpret_cast<PackT*>(staged_raw);  // buffer b at staged + b * buf_packs
  const int tid = threadIdx.x, bd = blockDim.x;
  const int vocab = static_cast<int>(a.vocab);
  const int64_t stride = gridDim.x;

  auto issue = [&](int64_t row, int b) {
    const T* x = static_cast<const T*>(a.logits) + row * a.ld;
    const RowSplit<T> sp = SplitRow(x, vocab);
    BulkLoadArrive(staged + b * buf_packs, x + sp.head, static_cast<uint32_t>(sp.nvec) * 16u, &bars[b]);
  };
  if (tid == 0) {
    MbarInit(&bars[0]);
    MbarInit(&bars[1]);
  }
  __syncthreads();
  int64_t row = blockIdx.x;
  if (tid == 0 && row < a.rows) issue(row, 0);

  const float eps = a.smoothing;
  const float off = eps / static_cast<float>(vocab), on = 1.f - eps;
  for (int k = 0; row < a.rows; ++k, row += stride) {
    const int b = k & 1;
    // The other buffer was last read by row k - 1, which every thread finished before
    // the barrier that ended the previous iteration.
    if (tid == 0 && row + stride < a.rows) issue(row + stride, b ^ 1);

    const T* x = static_cast<const T*>(a.logits) + row * a.ld;
    T* g = static_cast<T*>(a.grad) + row * a.ld;
    for (int64_t c = vocab + tid; c < a.ld; c += bd) g[c] = FromFloat<T>(0.f);
    const RowSplit<T> sp = SplitRow(x, vocab);
    const int body_end = sp.head + sp.nvec * kW;
    const int64_t label = a.labels[row];
    const bool ignored = a.has_ignore && label == a.ignore_index;
    // Head and tail elements: at most 2 * (kW - 1), one per thread.
    const int edge = sp.head + sp.tail;
    const int edge_col = tid < sp.head ? tid : body_end + (tid - sp.head);
    const float edge_x = tid < edge ? ToFloat(x[edge_col]) : -INFINITY;

    MbarWait(&bars[b], static_cast<uint32_t>(k >> 1) & 1u);
    const PackT* buf = staged + b * buf_packs;

    if (ignored) {
      if (tid == 0 && a.loss != nullptr) a.loss[row] = 0.f;
      if (tid < edge) g[edge_col] = FromFloat<T>(0.f);
      PackT z;
#pragma unroll
      for (int j = 0; j < kW; ++j) z.v[j] = FromFloat<T>(0.f);
      PackT* gb = reinterpret_cast<PackT*>(g + sp.head);
      for (int i = tid; i < sp.nvec; i += bd) gb[i] = z;
      __syncthreads();
      continue;
    }

    // ---- max, on packed pairs (exact in the logits dtype; NaN-ignoring like fmaxf)
    float m = fmaxf(edge_x, RowMaxPacked(buf, sp.nvec, tid, bd));
    m = BlockMax(m, scratch);
    // ---- sum of exp, and of the logits where label smoothing needs them
    const float mb = m == -INFINITY ? 0.f : m * kLog2e;  // all -inf: d = 0 and lse = -inf
    float d = 0.f, sx = 0.f;
    if (tid < edge) {
      d = Exp2Approx(fmaf(edge_x, kLog2e, -mb));
      sx = edge_x;
    }
    if (eps != 0.f) {
      SumExp<true>(buf, sp.nvec, tid, bd, mb, d, sx);
      sx = BlockSum(sx, scratch);
    } else {
      SumExp<false>(buf, sp.nvec, tid, bd, mb, d, sx);
    }
    d = BlockSum(d, scratch);
    const float lse = m + logf(d);
    const bool valid = label >= 0 && label < vocab;
    if (tid == 0 && a.loss != nullptr) {
      const float xl = valid ? ToFloat(x[label]) : NAN;
      const float smooth = eps != 0.f ? eps * (sx / static_cast<float>(vocab)) : 0.f;
      a.loss[row] = lse - on * xl - smooth + a.z_loss * lse * lse;
    }
    // ---- gradient: g = q * exp2(x log2e - m log2e) - s * off, minus s * on at the label
    float s = 1.f;
    if (a.scale != nullptr) s = a.scale_per_row ? a.scale[row] : a.scale[0];
    if (!valid) s = NAN;
    const float q = s * (1.f + 2.f * a.z_loss * lse) / d;
    const float soff = s * off, son = s * on;
    const int lab = valid ? static_cast<int>(label) : -1;
    if (tid < edge) {
      const float gv = fmaf(q, Exp2Approx(fmaf(edge_x, kLog2e, -mb)), -soff) - (edge_col == lab ? son : 0.f);
      g[edge_col] = FromFloat<T>(gv);
    }
    PackT* gb = reinterpret_cast<PackT*>(g + sp.head);
#pragma unroll 2
    for (int i = tid; i < sp.nvec; i += bd) {
      const PackT pk = buf[i];
      float gv[kW];
#pragma unroll
      for (int j = 0; j < kW; ++j) gv[j] = fmaf(q, Exp2Approx(fmaf(ToFloat(pk.v[j]), kLog2e, -mb)), -soff);
      // The label's pack (one thread of the row) takes the one-hot term.
      const unsigned at = static_cast<unsigned>(lab - (sp.head + i * kW));
      if (at < static_cast<unsigned>(kW)) {
#pragma unroll
        for (int j = 0; j < kW; ++j) gv[j] -= j == static_cast<int>(at) ? son : 0.f;
      }
      PackT o;
#pragma unroll
      for (int j = 0; j < kW; ++j) o.v[j] = FromFloat<T>(gv[j]);
      gb[i] = o;
    }
    __syncthreads();
  }
#endif
}

}  // namespace

template <typename T>
bool LaunchCrossEntropyStaged(const CrossEntropyArgs& a, const CrossEntropyLaunchOptions& o, cudaStream_t stream,
                              cudaError_t* err) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    *err = cudaSuccess;
    // Off (the row-per-block kernel runs) when asked (1), or when a thread count is asked
    // of the row-per-block kernel.
    if (o.pipeline == 1 || o.threads != 0) return false;
    if (a.grad == nullptr || a.rows == 0) return false;
    // Rows short enough that many blocks per SM do better, or too long to stage twice.
    const size_t buf_packs = static_cast<size_t>(a.vocab) / kPack<T> + 1;
    if (a.vocab * (int64_t)sizeof(T) < 32 * 1024 || 2 * buf_packs * 16 > kStagedSmemBytes) return false;
    // The row stride keeps the body of every row and of its gradient 16-byte aligned alike.
    const uintptr_t xa = reinterpret_cast<uintptr_t>(a.logits), ga = reinterpret_cast<uintptr_t>(a.grad);
    if ((xa & 15) != (ga & 15)) return false;
    auto kernel = CrossEntropyStagedKernel<T>;
    // The code that runs must be built for sm_90+ (an sm_80-only build JITs an empty body).
    static const bool hopper = BuiltForHopper(kernel);
    if (!hopper) return false;
    const size_t smem = 2 * buf_packs * 16;
    *err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (*err != cudaSuccess) return true;
    const int64_t grid = std::min<int64_t>(a.rows, SmCount());
    kernel<<<static_cast<unsigned>(grid), kStagedThreads, smem, stream>>>(a, static_cast<int>(buf_packs));
    *err = cudaGetLastError();
    return true;
  }
}

template bool LaunchCrossEntropyStaged<float>(const CrossEntropyArgs&, const CrossEntropyLaunchOptions&,
                                              cudaStream_t, cudaError_t*);
template bool LaunchCrossEntropyStaged<__half>(const CrossEntropyArgs&, const CrossEntropyLaunchOptions&,
                                               cudaStream_t, cudaError_t*);
template bool LaunchCrossEntropyStaged<__nv_bfloat16>(const CrossEntropyArgs&, const CrossEntropyLaunchOptions&,
                                                      cudaStream_t, cudaError_t*);

}  // namespace jax_ls2
