// Rotary position embeddings: q and k of a group of tokens in one block.
//
// A block takes `tps` tokens at a time: its threads first write the tokens' (cos, sin)
// of every frequency to shared memory (one sincosf per token and frequency, shared by all
// heads), then walk the tokens' heads in units: with 16-byte accesses, a unit is a pack
// of the first half of the rotated dims and its partner pack of the second half
// (interleaved: one pack holding whole pairs), or a pack of the dims that pass through;
// element by element otherwise. Every element is read once and written once.
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/rotary.h"

namespace jax_ls2 {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxTokensPerStep = 32;
constexpr int kMaxAngleBytes = 32 * 1024;  // shared memory for the (cos, sin) table

template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kThreads) RotaryKernel(RotaryArgs a, int tps) {
  extern __shared__ float2 angles[];  // (tps, half): (cos, +-sin)
  const int half = a.rotary_dim / 2, d = a.head_dim, rd = a.rotary_dim;
  // Units a head: rotated ones, then those passing through.
  const int rot_units = VEC == 1 ? rd : (INTERLEAVED ? rd / VEC : half / VEC);
  const int per_head = rot_units + (d - rd) / VEC;
  const int per_token = (a.heads + a.kv_heads) * per_head;
  const float sign = a.inverse ? -1.f : 1.f;
  for (int64_t t0 = (int64_t)blockIdx.x * tps; t0 < a.tokens; t0 += (int64_t)gridDim.x * tps) {
    const int nt = (int)std::min<int64_t>(tps, a.tokens - t0);
    for (int i = threadIdx.x; i < nt * half; i += blockDim.x) {
      const int tt = i / half, f = i - tt * half;
      float s, c;
      sincosf((float)a.positions[t0 + tt] * a.inv_freq[f], &s, &c);
      angles[i] = make_float2(c, sign * s);
    }
    __syncthreads();
    for (int u = threadIdx.x; u < nt * per_token; u += blockDim.x) {
      const int tt = u / per_token, rem = u - tt * per_token;
      const int h = rem / per_head, j = rem - h * per_head;
      const int64_t tok = t0 + tt;
      const bool is_q = h < a.heads;
      const int64_t base = is_q ? (tok * a.heads + h) * d : (tok * a.kv_heads + (h - a.heads)) * d;
      const T* src = static_cast<const T*>(is_q ? a.q : a.k) + base;
      T* dst = static_cast<T*>(is_q ? a.q_out : a.k_out) + base;
      const float2* cs = angles + tt * half;
      if (j >= rot_units) {  // passes through
        const int e = rd + (j - rot_units) * VEC;
        *reinterpret_cast<Pack<T, VEC>*>(dst + e) = *reinterpret_cast<const Pack<T, VEC>*>(src + e);
      } else if constexpr (VEC == 1) {
        // Element e and its partner: o = x[e] cos + sg x[partner] sin, sg = -1 for the
        // first element of a pair.
        const int e = j;
        const bool first = INTERLEAVED ? (e & 1) == 0 : e < half;
        const int partner = INTERLEAVED ? (e ^ 1) : (first ? e + half : e - half);
        const float2 c = cs[INTERLEAVED ? e / 2 : (first ? e : e - half)];
        const float x = ToFloat(src[e]), p = ToFloat(src[partner]);
        dst[e] = FromFloat<T>(first ? x * c.x - p * c.y : x * c.x + p * c.y);
      } else if constexpr (INTERLEAVED) {
        const int e0 = j * VEC;
        float v[VEC], o[VEC];
        LoadFloats<T, VEC>(src + e0, v);
#pragma unroll
        for (int p = 0; p < VEC / 2; ++p) {
          const float2 c = cs[e0 / 2 + p];
          o[2 * p] = v[2 * p] * c.x - v[2 * p + 1] * c.y;
          o[2 * p + 1] = v[2 * p + 1] * c.x + v[2 * p] * c.y;
        }
        StoreFloats<T, VEC>(dst + e0, o);
      } else {
        const int e0 = j * VEC;
        float x1[VEC], x2[VEC], o1[VEC], o2[VEC];
        LoadFloats<T, VEC>(src + e0, x1);
        LoadFloats<T, VEC>(src + e0 + half, x2);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float2 c = cs[e0 + i];
          o1[i] = x1[i] * c.x - x2[i] * c.y;
          o2[i] = x2[i] * c.x + x1[i] * c.y;
        }
        StoreFloats<T, VEC>(dst + e0, o1);
        StoreFloats<T, VEC>(dst + e0 + half, o2);
      }
    }
    __syncthreads();
  }
}

// The widest pack (kPack<T>, 2 or 1 elements) that every head's rotated halves (or pairs)
// and passed-through dims split into, with 16-byte-aligned buffers.
template <typename T>
int PickVec(const RotaryArgs& a) {
  const int half = a.rotary_dim / 2;
  const int candidates[2] = {kPack<T>, 2};
  for (int vec : candidates) {
    const bool fits = a.head_dim % vec == 0 && (a.head_dim - a.rotary_dim) % vec == 0 &&
                      (a.interleaved ? a.rotary_dim % vec == 0 : half % vec == 0);
    const void* buffers[4] = {a.q, a.k, a.q_out, a.k_out};
    bool aligned = true;
    for (const void* p : buffers) aligned = aligned && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    if (fits && aligned) return vec;
  }
  return 1;
}

template <typename T, int VEC>
void Launch(const RotaryArgs& a, int tps, unsigned grid, size_t smem, cudaStream_t stream) {
  auto k = a.interleaved ? RotaryKernel<T, VEC, true> : RotaryKernel<T, VEC, false>;
  k<<<grid, kThreads, smem, stream>>>(a, tps);
}

}  // namespace

template <typename T>
cudaError_t LaunchRotary(const RotaryArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.heads + a.kv_heads == 0 || a.head_dim == 0) return cudaSuccess;
  if (a.rotary_dim < 2 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim) return cudaErrorInvalidValue;
  const int half = a.rotary_dim / 2;
  if (half * (int)sizeof(float2) > kMaxAngleBytes) return cudaErrorInvalidValue;
  const int vec = PickVec<T>(a);
  const int rot_units = vec == 1 ? a.rotary_dim : (a.interleaved ? a.rotary_dim / vec : half / vec);
  const int64_t per_token = (int64_t)(a.heads + a.kv_heads) * (rot_units + (a.head_dim - a.rotary_dim) / vec);
  // Enough tokens a step that the units fill about four rounds of the block's threads.
  int tps = (int)std::min<int64_t>(kMaxTokensPerStep, std::max<int64_t>(1, (4 * kThreads + per_token - 1) / per_token));
  tps = std::min(tps, std::max(1, kMaxAngleBytes / (half * (int)sizeof(float2))));
  const int64_t steps = (a.tokens + tps - 1) / tps;
  const unsigned grid = (unsigned)std::min<int64_t>(steps, (int64_t)SmCount() * (2048 / kThreads));
  const size_t smem = (size_t)tps * half * sizeof(float2);
  if (vec == kPack<T>) {
    Launch<T, kPack<T>>(a, tps, grid, smem, stream);
  } else if (vec == 2) {
    Launch<T, 2>(a, tps, grid, smem, stream);
  } else {
    Launch<T, 1>(a, tps, grid, smem, stream);
  }
  return cudaGetLastError();
}

template cudaError_t LaunchRotary<float>(const RotaryArgs&, cudaStream_t);
template cudaError_t LaunchRotary<__half>(const RotaryArgs&, cudaStream_t);
template cudaError_t LaunchRotary<__nv_bfloat16>(const RotaryArgs&, cudaStream_t);

}  // namespace jax_ls2
