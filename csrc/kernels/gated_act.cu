// Gated activation + dropout, forward and backward, on x = [gate | up] (rows, 2 * ffn).
//
// Layout: a block is (tx, ty) threads; thread x owns one pack of output columns (16
// bytes when ffn and the pointers allow) of column chunk blockIdx.x; the ty row lanes
// and the grid stride over rows. Each element is read once and written once.
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
constexpr int kBlocksPerSm = 2048 / kThreads;

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
  // At +-inf the formulas give inf * 0 = NaN; take the limits (act(-inf) = 0, act(inf) =
  // inf, act' 0 and 1), as the reference does.
  if (isinf(v)) {
    act = v > 0.f ? v : 0.f;
    grad = v > 0.f ? 1.f : 0.f;
  }
}

template <typename T, int VEC, int ACT, bool DROP, bool BWD>
__global__ void __launch_bounds__(kThreads) GatedActKernel(GatedActArgs a) {
  const int64_t F = a.ffn;
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (c >= F) return;
  WideSeed s{0u, 0u, 0u};
  if constexpr (DROP) s = LoadWideSeed(a.seed);
  // Every row's first number has the parity of the base when the row map's strides are
  // even, and c is even with packs of an even size: then each pair takes one hash.
  const bool pairs = VEC % 2 == 0 && a.numbering.even && (s.base & 1u) == 0;
  const int64_t step = (int64_t)gridDim.y * blockDim.y;
  for (int64_t row = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; row < a.rows; row += step) {
    const T* gate = static_cast<const T*>(a.x) + row * 2 * F + c;
    float g[VEC], u[VEC], d[VEC];
    LoadFloats<T, VEC>(gate, g);
    LoadFloats<T, VEC>(gate + F, u);
    if constexpr (BWD) LoadFloats<T, VEC>(static_cast<const T*>(a.dy) + row * F + c, d);
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
        // A dropped element is 0 even where act * up is infinite (as the reference's select).
        o1[j] = DROP && !keep[j] ? 0.f : act * u[j] * m;
      }
    }
    if constexpr (BWD) {
      T* dx = static_cast<T*>(a.out) + row * 2 * F + c;
      StoreFloats<T, VEC>(dx, o1);
      StoreFloats<T, VEC>(dx + F, o2);
    } else {
      StoreFloats<T, VEC>(static_cast<T*>(a.out) + row * F + c, o1);
    }
  }
}

template <typename T, int VEC, bool BWD>
cudaError_t LaunchVec(const GatedActArgs& a, cudaStream_t stream) {
  const int64_t packs = (a.ffn + VEC - 1) / VEC;
  int tx = 32;
  while (tx < packs && tx < kThreads) tx <<= 1;
  const int ty = kThreads / tx;
  const int64_t gx = (packs + tx - 1) / tx;
  const int64_t want_y = std::max<int64_t>(1, (int64_t)SmCount() * kBlocksPerSm / gx);
  const unsigned gy = (unsigned)std::min<int64_t>({(a.rows + ty - 1) / ty, want_y, 65535});
  const dim3 grid((unsigned)gx, gy), block(tx, ty);
  const bool drop = a.threshold != 0;
#define JAX_LS2_GATED_LAUNCH(ACT)                                                                 \
  (drop ? GatedActKernel<T, VEC, ACT, true, BWD> : GatedActKernel<T, VEC, ACT, false, BWD>)<<<grid, block, 0, \
                                                                                             stream>>>(a)
  switch (a.activation) {
    case kGatedSwiglu: JAX_LS2_GATED_LAUNCH(kGatedSwiglu); break;
    case kGatedGeglu: JAX_LS2_GATED_LAUNCH(kGatedGeglu); break;
    case kGatedGegluTanh: JAX_LS2_GATED_LAUNCH(kGatedGegluTanh); break;
    default: return cudaErrorInvalidValue;
  }
#undef JAX_LS2_GATED_LAUNCH
  return cudaGetLastError();
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
