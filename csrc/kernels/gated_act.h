// Gated activation + dropout of a gated MLP (SwiGLU, GEGLU) on [gate | up], forward and
// backward.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace jax_ls2 {

// Codes of gated_act_dropout's `activation` attribute, in the order of
// jax_ls2.ops.gated_act.ACTIVATIONS.
enum GatedActivation : int { kGatedSwiglu = 0, kGatedGeglu = 1, kGatedGegluTanh = 2 };

struct GatedActArgs {
  const void* x;         // (rows, 2 * ffn), T: the gate then the up projection
  const void* dy;        // (rows, ffn), T: the backward's cotangent; nullptr in the forward
  const uint32_t* seed;  // (4,) uint32 on the device: k0, k1, base_lo, base_hi (common.cuh, MaskRows)
  void* out;             // forward: y (rows, ffn); backward: dx (rows, 2 * ffn), T
  int64_t rows, ffn;
  uint32_t threshold;    // drop iff the 16-bit draw < threshold; 0 = no dropout
  float scale;           // 1 / kept fraction
  int activation;        // GatedActivation
  MaskRows numbering;    // the output rows' global numbering
};

template <typename T>
cudaError_t LaunchGatedActFwd(const GatedActArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchGatedActBwd(const GatedActArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
