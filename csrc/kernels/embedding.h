// Token + position embedding with dropout: forward gather and backward scatter-add.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace jax_ls2 {

enum EmbeddingPos : int { kPosNone = 0, kPosLearned = 1, kPosSinusoidal = 2 };

struct EmbeddingFwdArgs {
  const void* table;         // (vocab, hidden), TT
  const void* pos_table;     // (max_pos, hidden), TT (kPosLearned)
  const float* inv_freq;     // (hidden / 2,) (kPosSinusoidal)
  const int32_t* ids;        // (rows,)
  const int32_t* positions;  // (rows,)
  const uint32_t* seed;      // (4,) = (k0, k1, base_lo, base_hi) (common.cuh); used when threshold > 0
  void* out;                 // (rows, hidden), TO
  int64_t rows, hidden, vocab, max_pos;
  int pos_mode;
  float scale;
  int64_t padding_idx;
  bool has_padding;
  uint32_t threshold;
  float keep_scale;
  MaskRows numbering;        // the rows' global numbering (common.cuh)
};

struct EmbeddingBwdArgs {
  const void* dout;          // (rows, hidden), TO
  const int32_t* ids;        // (rows,)
  const int32_t* positions;  // (rows,)
  const uint32_t* seed;      // (4,), as in EmbeddingFwdArgs
  const int32_t* tok_order;  // (rows,) row indices sorted by id (deterministic mode), else nullptr
  const int32_t* pos_order;  // (rows,) row indices sorted by position (deterministic mode), else nullptr
  float* dtable;             // (vocab, hidden) f32
  float* dpos;               // (max_pos, hidden) f32 (kPosLearned), else nullptr
  int64_t rows, hidden, vocab, max_pos;
  float scale;
  int64_t padding_idx;
  bool has_padding;
  uint32_t threshold;
  float keep_scale;
  MaskRows numbering;        // the rows' global numbering (common.cuh)
};

template <typename TT, typename TO>
cudaError_t LaunchEmbeddingFwd(const EmbeddingFwdArgs& a, cudaStream_t stream);
template <typename TO>
cudaError_t LaunchEmbeddingBwd(const EmbeddingBwdArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
