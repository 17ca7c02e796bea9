// Rotary position embeddings of q and k in one launch, forward and backward.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

struct RotaryArgs {
  const void* q;             // (tokens, heads, head_dim), T
  const void* k;             // (tokens, kv_heads, head_dim), T
  const int32_t* positions;  // (tokens,)
  const float* inv_freq;     // (rotary_dim / 2,)
  void* q_out;               // like q
  void* k_out;               // like k
  int64_t tokens;
  int heads, kv_heads, head_dim, rotary_dim;
  bool interleaved;          // pairs (2i, 2i + 1) instead of (i, i + rotary_dim / 2)
  bool inverse;              // rotate by minus the angle (the backward)
};

template <typename T>
cudaError_t LaunchRotary(const RotaryArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
