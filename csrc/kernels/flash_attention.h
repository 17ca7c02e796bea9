// Flash attention (tiled, online softmax, fp32 accumulation): forward and backward
// launchers. See flash_attention.cu for the algorithm.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

// The head dims the kernels are compiled for (jax_ls2/ops/flash_attention.py,
// KERNEL_HEAD_DIMS, repeats them).
constexpr int kFlashHeadDimSmall = 64;
constexpr int kFlashHeadDimLarge = 128;

struct FlashAttentionProblem {
  const void* q;  // (batch, q_len, heads, head_dim) T
  const void* k;  // (batch, kv_len, kv_heads, head_dim) T
  const void* v;  // (batch, kv_len, kv_heads, head_dim) T
  // Additive bias broadcast to (batch, heads, q_len, kv_len), float32, or nullptr;
  // element strides along those dims (0 along a broadcast dim).
  const float* bias;
  int64_t bias_stride[4];
  // Segment ids (query i attends key j iff q_seg == kv_seg), int32, or nullptr:
  // q_seg broadcast to (batch, q_len), kv_seg to (batch, kv_len); element strides
  // (batch, position), 0 along a broadcast dim.
  const int32_t* q_seg;
  const int32_t* kv_seg;
  int64_t q_seg_stride[2], kv_seg_stride[2];
  // uint32[5] dropout seed (k0, k1, shard_offset, q_offset, kv_offset). shard_offset
  // counts the query elements of the batch shards before this one, so the first batch
  // index is shard_offset / (q_len * heads * head_dim). Element (b, h, i, j) of the
  // probabilities has the 64-bit dropout index
  // ((b * heads + h) * drop_q_total + q_offset + i) * drop_kv_total + kv_offset + j:
  // this call is the block at (q_offset, kv_offset) of a drop_q_total x drop_kv_total
  // attention whose masks it draws.
  const uint32_t* seed;
  int64_t drop_q_total, drop_kv_total;
  int batch, q_len, kv_len, heads, kv_heads, head_dim;
  float scale;         // logits = scale * q.k + bias
  uint32_t threshold;  // 16-bit dropout threshold (0: no dropout)
  float keep_scale;    // 1 / kept fraction
  bool causal;         // key j attends query i iff j <= i + kv_len - q_len
};

struct FlashAttentionFwdArgs {
  FlashAttentionProblem p;
  void* out;   // (batch, q_len, heads, head_dim) T
  float* lse;  // (batch, heads, q_len) float32; -inf for rows with no attended key
};

struct FlashAttentionBwdArgs {
  FlashAttentionProblem p;
  const void* dout;   // (batch, q_len, heads, head_dim) T
  const float* dlse;  // (batch, heads, q_len) float32
  const void* out;    // (batch, q_len, heads, head_dim) T
  const float* lse;   // (batch, heads, q_len) float32
  void* dq;           // like q
  void* dk;           // like k
  void* dv;           // like v
  float* dbias;       // the bias' shape, float32 (summed over its broadcast dims), or nullptr
  int64_t dbias_count;
  float* delta;       // workspace (batch, heads, q_len) float32: rowsum(dout * out) - dlse
};

bool FlashAttentionSupportsHeadDim(int head_dim);

// T = __half or __nv_bfloat16.
template <typename T>
cudaError_t LaunchFlashAttentionFwd(const FlashAttentionFwdArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchFlashAttentionBwd(const FlashAttentionBwdArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
