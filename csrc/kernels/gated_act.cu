// Gated activation + dropout, forward and backward, on x = [gate | up] (rows, 2 * ffn).
//
// Layout: a block is (tx, ty) threads; thread x owns one pack of output columns (16
// bytes when ffn and the pointers allow) of column chunk blockIdx.x; the ty row lanes
// and the grid stride over rows, kRowsPerStep rows at a time. Each element is read once
// and written once.
//
// Dropout: output (row, c) has the global number g = MaskRowStart(row) + c (64-bit; the
// output's flat row-major index in the whole array, kernels/common.cuh,
// jax_ls2/_random.py); threshold == 0 selects a variant that neither hashes nor scales.
// The backward regenerates the mask.
#include <algorithm>
#include <type_traits>

#include "kernels/activation.cuh"
#include "kernels/common.cuh"
#include "kernels/gated_act.h"

namespace jax_ls2 {
namespace {

constexpr int kThreads = 256;
// Rows a thread loads before it stores any: the compiler cannot rule out aliasing, so it
// never moves a row's loads above the previous row's store, and one forward row's loads
// alone (32 bytes a thread) are too few bytes in flight for the copy bandwidth. Two rows
// keep the bfloat16 SwiGLU forward at 32 registers (8 blocks an SM); the backward loads
// three packs a row and takes one (bench/PERF_NOTES.md).
template <bool BWD>
constexpr int kRowsPerStep = BWD ? 1 : 2;

// act(v) and act'(v) in float32. SiLU's logistic by the hardware exp2 and reciprocal for
// bfloat16 (its error far below bfloat16's 2^-8), by expf and a division otherwise.
template <int ACT, typename T>
__device__ __forceinline__ void ActAndGrad(float v, float& act, float& grad) {
  if constexpr (ACT == kGatedSwiglu) {
    float sig;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      sig = RcpApprox(1.f + ExpApprox(-v));
    } else {
      sig = 1.f / (1.f + expf(-v));
    }
    act = v * sig;
    grad = sig * (1.f + v * (1.f - sig));
  } else {
    constexpr int kAct = ACT == kGatedGeglu ? kActGelu : kActGeluTanh;
    act = ActScaled<kAct, T>(v, 1.f, 0.f);
    grad = ActGradScaled<kAct, T>(v, 1.f, 0.f);
  }
}

// One pack through the read-only data path (ld.global.nc): the kernel never writes x or dy.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> LoadReadOnly(const T* p) {
  Pack<T, N> pk;
  if constexpr (sizeof(Pack<T, N>) == sizeof(uint4)) {
    *reinterpret_cast<uint4*>(pk.v) = __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    static_assert(N == 1, "packs are 16 bytes or one element");
    pk.v[0] = __ldg(p);
  }
  return pk;
}

template <typename T, int VEC, int ACT, bool DROP, bool BWD>
__global__ void __launch_bounds__(kThreads) GatedActKernel(GatedActArgs a) {
  const int64_t F = a.ffn;
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (c >= F) return;
  const T* __restrict__ x = static_cast<const T*>(a.x) + c;
  const T* __restrict__ dy = BWD ? static_cast<const T*>(a.dy) + c : nullptr;
  T* __restrict__ out = static_cast<T*>(a.out) + c;
  WideSeed s{0u, 0u, 0u};
  if constexpr (DROP) s = LoadWideSeed(a.seed);
  // Every row's first number has the parity of the base when the row map's strides are
  // even, and c is even with packs of an even size: then each pair takes one hash.
  const bool pairs = VEC % 2 == 0 && a.numbering.even && (s.base & 1u) == 0;
  // A step takes rows first, first + step, ...: the same rows, in the same lane, as one row
  // at a time would.
  const int64_t step = (int64_t)gridDim.y * blockDim.y;
  for (int64_t first = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; first < a.rows;
       first += kRowsPerStep<BWD> * step) {
    Pack<T, VEC> gate[kRowsPerStep<BWD>], up[kRowsPerStep<BWD>], dout[kRowsPerStep<BWD>];
#pragma unroll
    for (int k = 0; k < kRowsPerStep<BWD>; ++k) {
      const int64_t row = first + k * step;
      if (k == 0 || row < a.rows) {
        gate[k] = LoadReadOnly<T, VEC>(x + row * 2 * F);
        up[k] = LoadReadOnly<T, VEC>(x + row * 2 * F + F);
        if constexpr (BWD) dout[k] = LoadReadOnly<T, VEC>(dy + row * F);
      }
    }
#pragma unroll
    for (int k = 0; k < kRowsPerStep<BWD>; ++k) {
      const int64_t row = first + k * step;
      if (k > 0 && row >= a.rows) break;
      float g[VEC], u[VEC], d[VEC];
      UnpackFloats(gate[k], g);
      UnpackFloats(up[k], u);
      if constexpr (BWD) UnpackFloats(dout[k], d);
      bool keep[VEC];
      if constexpr (DROP) {
        const uint64_t g0 = MaskRowStart(a.numbering, s.base, row) + (uint64_t)c;
        if (pairs) {
          KeepWide<VEC, true>(g0, s, a.threshold, keep);
        } else {
          KeepWide<VEC, false>(g0, s, a.threshold, keep);
        }
      }
      float o1[VEC], o2[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float act, grad;
        ActAndGrad<ACT, T>(g[j], act, grad);
        float m = 1.f;
        if constexpr (DROP) m = keep[j] ? a.scale : 0.f;
        if constexpr (BWD) {
          const float dd = d[j] * m;
          o1[j] = dd * u[j] * grad;
          o2[j] = dd * act;
        } else {
          o1[j] = act * u[j] * m;
        }
      }
      if constexpr (BWD) {
        StoreFloats<T, VEC>(out + row * 2 * F, o1);
        StoreFloats<T, VEC>(out + row * 2 * F + F, o2);
      } else {
        StoreFloats<T, VEC>(out + row * F, o1);
      }
    }
  }
}

// Threads of a block across the columns: the width in {32, ..., kThreads} that leaves the
// fewest lanes past the last pack idle, the widest among equals.
inline int ColumnThreads(int64_t packs) {
  int best = kThreads;
  int64_t best_idle = -1;
  for (int tx = kThreads; tx >= 32; tx /= 2) {
    const int64_t idle = (packs + tx - 1) / tx * tx - packs;
    if (best_idle < 0 || idle < best_idle) best = tx, best_idle = idle;
  }
  return best;
}

// Blocks of the kernel resident on one SM (1 when it cannot be queried): the grid is one
// wave of them, each striding over rows.
template <typename T, int VEC, int ACT, bool DROP, bool BWD>
int ResidentBlocksPerSm() {
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, GatedActKernel<T, VEC, ACT, DROP, BWD>, kThreads, 0) !=
            cudaSuccess ||
        n < 1) {
      cudaGetLastError();  // not the caller's error
      n = 1;
    }
    return n;
  }();
  return per_sm;
}

template <typename T, int VEC, int ACT, bool DROP, bool BWD>
cudaError_t LaunchKernel(const GatedActArgs& a, cudaStream_t stream) {
  const int64_t packs = (a.ffn + VEC - 1) / VEC;
  const int tx = ColumnThreads(packs);
  const int ty = kThreads / tx;
  const int64_t gx = (packs + tx - 1) / tx;
  const int64_t resident = (int64_t)SmCount() * ResidentBlocksPerSm<T, VEC, ACT, DROP, BWD>();
  const int64_t want_y = std::max<int64_t>(1, resident / gx);
  const unsigned gy = (unsigned)std::min<int64_t>({(a.rows + ty - 1) / ty, want_y, 65535});
  GatedActKernel<T, VEC, ACT, DROP, BWD><<<dim3((unsigned)gx, gy), dim3(tx, ty), 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int VEC, int ACT, bool BWD>
cudaError_t LaunchAct(const GatedActArgs& a, cudaStream_t stream) {
  return a.threshold != 0 ? LaunchKernel<T, VEC, ACT, true, BWD>(a, stream)
                          : LaunchKernel<T, VEC, ACT, false, BWD>(a, stream);
}

template <typename T, int VEC, bool BWD>
cudaError_t LaunchVec(const GatedActArgs& a, cudaStream_t stream) {
  switch (a.activation) {
    case kGatedSwiglu: return LaunchAct<T, VEC, kGatedSwiglu, BWD>(a, stream);
    case kGatedGeglu: return LaunchAct<T, VEC, kGatedGeglu, BWD>(a, stream);
    case kGatedGegluTanh: return LaunchAct<T, VEC, kGatedGegluTanh, BWD>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, bool BWD>
cudaError_t LaunchGatedAct(const GatedActArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.ffn == 0) return cudaSuccess;
  constexpr int kVec = kPack<T>;
  const void* buffers[3] = {a.x, a.dy, a.out};
  bool wide = a.ffn % kVec == 0;
  for (const void* p : buffers) wide = wide && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return wide ? LaunchVec<T, kVec, BWD>(a, stream) : LaunchVec<T, 1, BWD>(a, stream);
}

}  // namespace

template <typename T>
cudaError_t LaunchGatedActFwd(const GatedActArgs& a, cudaStream_t stream) {
  return LaunchGatedAct<T, false>(a, stream);
}
template <typename T>
cudaError_t LaunchGatedActBwd(const GatedActArgs& a, cudaStream_t stream) {
  return LaunchGatedAct<T, true>(a, stream);
}

#define JAX_LS2_INSTANTIATE(T)                                                           \
  template cudaError_t LaunchGatedActFwd<T>(const GatedActArgs&, cudaStream_t); \
  template cudaError_t LaunchGatedActBwd<T>(const GatedActArgs&, cudaStream_t);
JAX_LS2_INSTANTIATE(float)
JAX_LS2_INSTANTIATE(__half)
JAX_LS2_INSTANTIATE(__nv_bfloat16)
#undef JAX_LS2_INSTANTIATE

}  // namespace jax_ls2
