// Token + position embedding with dropout.
//
// Forward: out[r, c] = dropout(scale * table[id_r, c] + P[pos_r, c]), with P a learned
// table or sin/cos(pos * inv_freq) computed in place; rows whose id is the padding
// index are zero. A row group of blockDim.x threads owns one row (8 columns per
// thread per step), blockDim.y rows per block. Ids and positions are clamped into
// their tables. The dropout mask is the shared counter-based one (common.cuh): output
// element (r, c) is numbered MaskRowStart(r) + c in the whole output (64-bit).
//
// Backward: the same mask is regenerated and dout * mask * keep_scale accumulated in
// float32 into dtable (times scale) and dpos, either with atomics (fast; the order
// of additions varies) or, in the deterministic mode, by segments of rows sorted by
// id (resp. position), each segment summed by one row group in a fixed order.
// Padding rows give no gradient to either table.
#include "kernels/common.cuh"
#include "kernels/embedding.h"

namespace jax_ls2 {
namespace {

constexpr int kBlock = 256;

__device__ __forceinline__ int64_t Clamp(int64_t v, int64_t n) { return v < 0 ? 0 : (v >= n ? n - 1 : v); }

template <int VEC>
__device__ __forceinline__ void KeepFlags(uint64_t g0, const WideSeed& s, uint32_t threshold,
                                          float keep_scale, float (&m)[VEC]) {
  bool keep[VEC];
  KeepWide<VEC, false>(g0, s, threshold, keep);
#pragma unroll
  for (int j = 0; j < VEC; ++j) m[j] = keep[j] ? keep_scale : 0.f;
}

__device__ __forceinline__ WideSeed LoadSeed(const uint32_t* seed) {
  WideSeed s{0u, 0u, 0u};
  if (seed != nullptr) s = LoadWideSeed(seed);
  return s;
}

template <typename TT, typename TO, int VEC>
__global__ void __launch_bounds__(kBlock) EmbeddingFwdKernel(EmbeddingFwdArgs a) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= a.rows) return;
  const int64_t H = a.hidden;
  TO* out = static_cast<TO*>(a.out) + row * H;
  const int64_t raw = a.ids[row];
  const bool pad = a.has_padding && Clamp(raw, a.vocab) == a.padding_idx;
  const int64_t id = Clamp(raw, a.vocab);
  if (pad) {
    float z[VEC] = {};
    for (int64_t c = threadIdx.x * VEC; c < H; c += (int64_t)blockDim.x * VEC) StoreFloats<TO, VEC>(out + c, z);
    return;
  }
  const TT* tok = static_cast<const TT*>(a.table) + id * H;
  int64_t p = 0;
  float pf = 0.f;
  if (a.pos_mode == kPosLearned) p = Clamp(a.positions[row], a.max_pos);
  if (a.pos_mode == kPosSinusoidal) pf = (float)a.positions[row];
  const TT* ptab = a.pos_mode == kPosLearned ? static_cast<const TT*>(a.pos_table) + p * H : nullptr;
  const WideSeed s = LoadSeed(a.threshold > 0 ? a.seed : nullptr);
  const uint64_t gbase = MaskRowStart(a.numbering, s.base, row);
  const int64_t half = H / 2;
  for (int64_t c = threadIdx.x * VEC; c < H; c += (int64_t)blockDim.x * VEC) {
    float v[VEC];
    LoadFloats<TT, VEC>(tok + c, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] *= a.scale;
    if (a.pos_mode == kPosLearned) {
      float q[VEC];
      LoadFloats<TT, VEC>(ptab + c, q);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] += q[j];
    } else if (a.pos_mode == kPosSinusoidal) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int64_t cc = c + j;
        if (cc < half) v[j] += sinf(pf * a.inv_freq[cc]);
        else if (cc < 2 * half) v[j] += cosf(pf * a.inv_freq[cc - half]);
      }
    }
    if (a.threshold > 0) {
      float m[VEC];
      KeepFlags<VEC>(gbase + (uint64_t)c, s, a.threshold, a.keep_scale, m);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] *= m[j];
    }
    StoreFloats<TO, VEC>(out + c, v);
  }
}

__device__ __forceinline__ void AtomicAddVec(float* p, const float* v, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (n % 4 == 0) {
    for (int j = 0; j < n; j += 4)
      atomicAdd(reinterpret_cast<float4*>(p + j), make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]));
    return;
  }
#endif
  for (int j = 0; j < n; ++j) atomicAdd(p + j, v[j]);
}

// dout row r, column tile c: g = dout * mask * keep_scale (float32).
template <typename TO, int VEC>
__device__ __forceinline__ void RowGrad(const EmbeddingBwdArgs& a, const WideSeed& s, int64_t r, int64_t c,
                                        float (&g)[VEC]) {
  LoadFloats<TO, VEC>(static_cast<const TO*>(a.dout) + r * a.hidden + c, g);
  if (a.threshold > 0) {
    float m[VEC];
    KeepFlags<VEC>(MaskRowStart(a.numbering, s.base, r) + (uint64_t)c, s, a.threshold, a.keep_scale, m);
#pragma unroll
    for (int j = 0; j < VEC; ++j) g[j] *= m[j];
  }
}

template <typename TO, int VEC>
__global__ void __launch_bounds__(kBlock) EmbeddingBwdAtomicKernel(EmbeddingBwdArgs a) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= a.rows) return;
  const int64_t id = Clamp(a.ids[row], a.vocab);
  if (a.has_padding && id == a.padding_idx) return;
  const int64_t H = a.hidden;
  const int64_t p = a.dpos != nullptr ? Clamp(a.positions[row], a.max_pos) : 0;
  const WideSeed s = LoadSeed(a.threshold > 0 ? a.seed : nullptr);
  for (int64_t c = threadIdx.x * VEC; c < H; c += (int64_t)blockDim.x * VEC) {
    float g[VEC], t[VEC];
    RowGrad<TO, VEC>(a, s, row, c, g);
#pragma unroll
    for (int j = 0; j < VEC; ++j) t[j] = g[j] * a.scale;
    AtomicAddVec(a.dtable + id * H + c, t, VEC);
    if (a.dpos != nullptr) AtomicAddVec(a.dpos + p * H + c, g, VEC);
  }
}

// Deterministic: order lists the rows sorted by key (ids or positions, clamped to
// [0, nkeys)); the row group at sorted index i starts a segment when its key differs
// from the previous one and then sums the segment's rows in sorted order.
template <typename TO, int VEC>
__global__ void __launch_bounds__(kBlock) EmbeddingBwdSegmentKernel(EmbeddingBwdArgs a, const int32_t* keys,
                                                                   const int32_t* order, int64_t nkeys,
                                                                   float mult, float* dst) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (i >= a.rows) return;
  const int64_t key = Clamp(keys[order[i]], nkeys);
  if (i > 0 && Clamp(keys[order[i - 1]], nkeys) == key) return;
  const int64_t H = a.hidden;
  const WideSeed s = LoadSeed(a.threshold > 0 ? a.seed : nullptr);
  for (int64_t c = threadIdx.x * VEC; c < H; c += (int64_t)blockDim.x * VEC) {
    float acc[VEC] = {};
    bool any = false;
    for (int64_t k = i; k < a.rows; ++k) {
      const int64_t r = order[k];
      if (Clamp(keys[r], nkeys) != key) break;
      if (a.has_padding && Clamp(a.ids[r], a.vocab) == a.padding_idx) continue;
      float g[VEC];
      RowGrad<TO, VEC>(a, s, r, c, g);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += g[j];
      any = true;
    }
    if (any) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dst[key * H + c + j] = acc[j] * mult;
    }
  }
}

// A row group covers the row with VEC columns per thread (a power of two, <= kBlock).
dim3 BlockFor(int64_t hidden, int vec) {
  int tpr = 1;
  while (tpr < kBlock && (int64_t)tpr * vec < hidden) tpr <<= 1;
  return dim3(tpr, kBlock / tpr);
}

bool Aligned(const void* p, int bytes) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

template <typename TT, typename TO>
cudaError_t LaunchEmbeddingFwd(const EmbeddingFwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.hidden == 0) return cudaSuccess;
  const bool vec = a.hidden % 8 == 0 && Aligned(a.table, 8 * sizeof(TT)) && Aligned(a.pos_table, 8 * sizeof(TT)) &&
                   Aligned(a.out, 8 * sizeof(TO));
  const dim3 block = BlockFor(a.hidden, vec ? 8 : 1);
  const unsigned grid = (unsigned)((a.rows + block.y - 1) / block.y);
  if (vec) EmbeddingFwdKernel<TT, TO, 8><<<grid, block, 0, stream>>>(a);
  else EmbeddingFwdKernel<TT, TO, 1><<<grid, block, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename TO>
cudaError_t LaunchEmbeddingBwd(const EmbeddingBwdArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.dtable, 0, (size_t)a.vocab * a.hidden * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (a.dpos != nullptr) {
    err = cudaMemsetAsync(a.dpos, 0, (size_t)a.max_pos * a.hidden * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  if (a.rows == 0 || a.hidden == 0) return cudaGetLastError();
  const bool vec = a.hidden % 8 == 0 && Aligned(a.dout, 8 * sizeof(TO)) && Aligned(a.dtable, 32) &&
                   Aligned(a.dpos, 32);
  const dim3 block = BlockFor(a.hidden, vec ? 8 : 1);
  const unsigned grid = (unsigned)((a.rows + block.y - 1) / block.y);
  if (a.tok_order == nullptr) {
    if (vec) EmbeddingBwdAtomicKernel<TO, 8><<<grid, block, 0, stream>>>(a);
    else EmbeddingBwdAtomicKernel<TO, 1><<<grid, block, 0, stream>>>(a);
    return cudaGetLastError();
  }
  auto k = vec ? EmbeddingBwdSegmentKernel<TO, 8> : EmbeddingBwdSegmentKernel<TO, 1>;
  k<<<grid, block, 0, stream>>>(a, a.ids, a.tok_order, a.vocab, a.scale, a.dtable);
  if (a.dpos != nullptr) k<<<grid, block, 0, stream>>>(a, a.positions, a.pos_order, a.max_pos, 1.f, a.dpos);
  return cudaGetLastError();
}

#define JAX_LS2_INSTANTIATE_FWD(TT, TO) \
  template cudaError_t LaunchEmbeddingFwd<TT, TO>(const EmbeddingFwdArgs&, cudaStream_t);
#define JAX_LS2_INSTANTIATE(TO)                                                  \
  JAX_LS2_INSTANTIATE_FWD(float, TO)                                             \
  JAX_LS2_INSTANTIATE_FWD(__half, TO)                                            \
  JAX_LS2_INSTANTIATE_FWD(__nv_bfloat16, TO)                                     \
  template cudaError_t LaunchEmbeddingBwd<TO>(const EmbeddingBwdArgs&, cudaStream_t);
JAX_LS2_INSTANTIATE(float)
JAX_LS2_INSTANTIATE(__half)
JAX_LS2_INSTANTIATE(__nv_bfloat16)
#undef JAX_LS2_INSTANTIATE
#undef JAX_LS2_INSTANTIATE_FWD

}  // namespace jax_ls2
