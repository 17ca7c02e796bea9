// Rotary position embeddings: q and k of a group of tokens in one block, forward and
// backward.
//
// A head splits into units: with 16-byte accesses, a unit is a pack of the first half of
// the rotated dims and its partner pack of the second half (interleaved: packs holding
// whole pairs), or a pack of the dims that pass through; the same with 2- or 1-element
// packs otherwise. A token's work is laid out as `slots`: a slot is a unit and a group of
// up to kHeadsPerSlot heads of q or of k (of q's G groups, group g takes q heads g, g + G,
// ...; k's groups follow). threadIdx.x walks the slots and threadIdx.y the block's tokens.
//
// The block fills a table of its tokens' (cos, sin) (one sincosf per token and frequency,
// shared by all heads); each thread then issues the loads of its slot's heads before the
// one barrier that publishes the table, so they are in flight while the block waits.
// (sincosf before the loads, not after: its reduction of large angles would otherwise
// hold registers alongside the loaded data.) Every element is read once and written once.
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/rotary.h"

namespace jax_ls2 {
namespace {

constexpr int kThreads = 256;  // most threads a block, and the most a round of slots takes
// Threads a block aims at when its slots leave room for several tokens: five warps, so
// that four blocks of the 16-byte 16-bit kernels fit an SM's registers (PERF_NOTES.md).
constexpr int kTargetThreads = 160;
constexpr int kMaxAngleBytes = 32 * 1024;  // shared memory for the (cos, sin) table
// Heads of a slot: their loads are in flight together, and they share the unit's angles.
constexpr int kHeadsPerSlot = 4;

struct RotaryLayout {
  int units;      // units a head
  int rot_units;  // of which rotate; the rest pass through
  int q_groups;   // head groups of q: ceil(heads / kHeadsPerSlot)
  int groups;     // q_groups and those of k: ceil(kv_heads / kHeadsPerSlot)
  int slots;      // units * groups
};

// Elements of a rotated unit's run: its elements of one half, or its whole pairs when
// interleaved.
template <int VEC, bool INTERLEAVED>
constexpr int kRunElems = INTERLEAVED ? (VEC > 2 ? VEC : 2) : VEC;

// One slot of one token: its heads' packs, where they come from, and which rotate.
template <typename T, int VEC, bool INTERLEAVED>
struct SlotWork {
  static constexpr int kRun = kRunElems<VEC, INTERLEAVED>;
  static constexpr int kPacks = INTERLEAVED ? kRun / VEC : 2;  // packs a head (passing through: the first)
  static constexpr int kFreqs = INTERLEAVED ? kRun / 2 : VEC;
  using P = Pack<T, VEC>;

  P x[kHeadsPerSlot][kPacks];
  int64_t offset;     // of the first head's unit in q or k
  int64_t head_step;  // elements from one of the slot's heads to the next
  int heads_here;     // of the slot's kHeadsPerSlot heads, those that exist (0 past the last token)
  bool is_q, rotate;
  int f0;  // first frequency of a rotated unit

  __device__ __forceinline__ void Load(const RotaryArgs& a, const RotaryLayout& l, int slot, int64_t t, bool token_ok) {
    const int group = slot / l.units, unit = slot - group * l.units;
    rotate = unit < l.rot_units;
    const int e0 = rotate ? unit * kRun : a.rotary_dim + (unit - l.rot_units) * VEC;
    f0 = INTERLEAVED ? unit * (kRun / 2) : e0;
    is_q = group < l.q_groups;
    const int first = is_q ? group : group - l.q_groups;
    const int groups = is_q ? l.q_groups : l.groups - l.q_groups;
    const int count = is_q ? a.heads : a.kv_heads;
    heads_here = token_ok ? min(kHeadsPerSlot, (count - first + groups - 1) / groups) : 0;
    offset = (t * count + first) * a.head_dim + e0;
    head_step = (int64_t)groups * a.head_dim;
    const int packs = rotate ? kPacks : 1;
    const T* __restrict__ src = static_cast<const T*>(is_q ? a.q : a.k) + offset;
    const int stride = PackStride(a);
#pragma unroll
    for (int i = 0; i < kHeadsPerSlot; ++i) {
      if (i < heads_here) {
#pragma unroll
        for (int p = 0; p < kPacks; ++p)
          if (p < packs) x[i][p] = *reinterpret_cast<const P*>(src + i * head_step + p * stride);
      }
    }
  }

  // angles: the token's (cos, +-sin) of every frequency.
  __device__ __forceinline__ void Store(const RotaryArgs& a, const float2* angles) const {
    T* __restrict__ out = static_cast<T*>(is_q ? a.q_out : a.k_out) + offset;
    if (!rotate) {
#pragma unroll
      for (int i = 0; i < kHeadsPerSlot; ++i)
        if (i < heads_here) *reinterpret_cast<P*>(out + i * head_step) = x[i][0];
      return;
    }
    float2 cs[kFreqs];
    if constexpr (kFreqs % 2 == 0) {
      // Two frequencies a 16-byte read; f0 and the table's rows are even then.
#pragma unroll
      for (int f = 0; f < kFreqs; f += 2) {
        const float4 w = *reinterpret_cast<const float4*>(angles + f0 + f);
        cs[f] = make_float2(w.x, w.y);
        cs[f + 1] = make_float2(w.z, w.w);
      }
    } else {
#pragma unroll
      for (int f = 0; f < kFreqs; ++f) cs[f] = angles[f0 + f];
    }
    const int stride = PackStride(a);
#pragma unroll
    for (int i = 0; i < kHeadsPerSlot; ++i) {
      if (i >= heads_here) continue;
      T* dst = out + i * head_step;
      if constexpr (INTERLEAVED) {
        float v[kRun], o[kRun];
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          float pack[VEC];
          UnpackFloats(x[i][p], pack);
#pragma unroll
          for (int e = 0; e < VEC; ++e) v[p * VEC + e] = pack[e];
        }
#pragma unroll
        for (int f = 0; f < kFreqs; ++f) {
          o[2 * f] = v[2 * f] * cs[f].x - v[2 * f + 1] * cs[f].y;
          o[2 * f + 1] = v[2 * f + 1] * cs[f].x + v[2 * f] * cs[f].y;
        }
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          float pack[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) pack[e] = o[p * VEC + e];
          StoreFloats<T, VEC>(dst + p * stride, pack);
        }
      } else {
        float x1[VEC], x2[VEC], o1[VEC], o2[VEC];
        UnpackFloats(x[i][0], x1);
        UnpackFloats(x[i][1], x2);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          o1[e] = x1[e] * cs[e].x - x2[e] * cs[e].y;
          o2[e] = x2[e] * cs[e].x + x1[e] * cs[e].y;
        }
        StoreFloats<T, VEC>(dst, o1);
        StoreFloats<T, VEC>(dst + stride, o2);
      }
    }
  }

  // Elements from a unit's pack to its next.
  static __device__ __forceinline__ int PackStride(const RotaryArgs& a) { return INTERLEAVED ? VEC : a.rotary_dim / 2; }
};

template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kThreads) RotaryKernel(const RotaryArgs a, const RotaryLayout l) {
  extern __shared__ float4 angle_storage[];  // (blockDim.y, half) of (cos, +-sin)
  float2* angles = reinterpret_cast<float2*>(angle_storage);
  const int half = a.rotary_dim / 2;
  const float sign = a.inverse ? -1.f : 1.f;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, block_threads = blockDim.x * blockDim.y;
  for (int64_t t0 = (int64_t)blockIdx.x * blockDim.y; t0 < a.tokens; t0 += (int64_t)gridDim.x * blockDim.y) {
    const int64_t t = t0 + threadIdx.y;
    const bool token_ok = t < a.tokens;
    const int entries = (int)std::min<int64_t>(blockDim.y, a.tokens - t0) * half;
    for (int i = tid; i < entries; i += block_threads) {
      const int row = i / half, f = i - row * half;
      float s, c;
      sincosf((float)a.positions[t0 + row] * a.inv_freq[f], &s, &c);
      angles[i] = make_float2(c, sign * s);
    }
    SlotWork<T, VEC, INTERLEAVED> w;
    w.Load(a, l, threadIdx.x, t, token_ok);  // blockDim.x <= slots
    __syncthreads();
    const float2* token_angles = angles + threadIdx.y * half;
    w.Store(a, token_angles);
    for (int slot = threadIdx.x + blockDim.x; slot < l.slots; slot += blockDim.x) {
      w.Load(a, l, slot, t, token_ok);
      w.Store(a, token_angles);
    }
    __syncthreads();  // before the next tokens' angles overwrite the table
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
cudaError_t Launch(const RotaryArgs& a, cudaStream_t stream) {
  RotaryLayout l;
  const int half = a.rotary_dim / 2;
  l.rot_units = a.interleaved ? a.rotary_dim / std::max(VEC, 2) : half / VEC;
  l.units = l.rot_units + (a.head_dim - a.rotary_dim) / VEC;
  l.q_groups = (a.heads + kHeadsPerSlot - 1) / kHeadsPerSlot;
  l.groups = l.q_groups + (a.kv_heads + kHeadsPerSlot - 1) / kHeadsPerSlot;
  const int64_t slots = (int64_t)l.units * l.groups;
  if (slots > INT32_MAX) return cudaErrorInvalidValue;
  l.slots = (int)slots;
  // Slots over as few rounds of at most kThreads threads as they need, spread evenly over
  // the rounds; tokens up to kTargetThreads threads, as many as the table holds.
  const int rounds = (l.slots + kThreads - 1) / kThreads;
  const int block_x = (l.slots + rounds - 1) / rounds;
  const int angle_row_bytes = half * (int)sizeof(float2);
  const int block_y = std::max(1, std::min(kTargetThreads / block_x, kMaxAngleBytes / angle_row_bytes));
  const int64_t blocks = (a.tokens + block_y - 1) / block_y;
  const unsigned grid = (unsigned)std::min<int64_t>(blocks, INT32_MAX);
  const size_t smem = (size_t)block_y * angle_row_bytes;
  const dim3 block(block_x, block_y);
  if (a.interleaved) {
    RotaryKernel<T, VEC, true><<<grid, block, smem, stream>>>(a, l);
  } else {
    RotaryKernel<T, VEC, false><<<grid, block, smem, stream>>>(a, l);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchRotary(const RotaryArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.heads + a.kv_heads == 0 || a.head_dim == 0) return cudaSuccess;
  if (a.rotary_dim < 2 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim) return cudaErrorInvalidValue;
  if (a.rotary_dim / 2 * (int)sizeof(float2) > kMaxAngleBytes) return cudaErrorInvalidValue;
  const int vec = PickVec<T>(a);
  if (vec == kPack<T>) return Launch<T, kPack<T>>(a, stream);
  if (vec == 2) return Launch<T, 2>(a, stream);
  return Launch<T, 1>(a, stream);
}

template cudaError_t LaunchRotary<float>(const RotaryArgs&, cudaStream_t);
template cudaError_t LaunchRotary<__half>(const RotaryArgs&, cudaStream_t);
template cudaError_t LaunchRotary<__nv_bfloat16>(const RotaryArgs&, cudaStream_t);

}  // namespace jax_ls2
