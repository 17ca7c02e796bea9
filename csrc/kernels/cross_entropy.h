// Fused softmax cross entropy over the last axis: loss, and the gradient with
// respect to the logits, in one kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

struct CrossEntropyArgs {
  const void* logits;     // (rows, ld), T
  const int32_t* labels;  // (rows,)
  const float* scale;     // gradient scale: (,) or (rows,) when scale_per_row; nullptr means 1
  bool scale_per_row;
  float* loss;            // (rows,) f32, or nullptr
  void* grad;             // (rows, ld), T, or nullptr (no gradient)
  int64_t rows, vocab;    // vocab: the columns that are logits
  int64_t ld;             // row stride (>= vocab); grad columns [vocab, ld) are set to 0
  float smoothing;        // eps: target = (1 - eps) * onehot + eps / vocab
  float z_loss;           // + z_loss * lse^2 per counted row
  int64_t ignore_index;
  bool has_ignore;
};

// out = in * scale[0], elementwise; when out == in and scale[0] == 1 nothing is read
// or written (the common case of an in-place rescale by the unit cotangent).
struct ScaleArgs {
  const void* in;     // (n,), T
  void* out;          // (n,), T (may alias in)
  const float* scale; // (,)
  int64_t n;
};

// Launch choices a benchmark may override (the FFI handlers fill them from the options
// set through jax_ls2._C.set_kernel_option); 0 keeps the built-in choice.
struct CrossEntropyLaunchOptions {
  int threads = 0;   // 256 or 1024 threads per row instead of up to 512 (1024: bfloat16, 16-byte path);
                     // also turns row-staging off
  int pipeline = 0;  // 1: row-staging off (the row-per-block kernel)
};

template <typename T>
cudaError_t LaunchCrossEntropy(const CrossEntropyArgs& a, const CrossEntropyLaunchOptions& o, cudaStream_t stream);
// The row-staging loss+gradient kernel (cross_entropy_staged.cu): 16-bit logits with
// 16k to 56k columns on sm_90+. Returns false, launching nothing, where it does not
// apply; else true with the launch status in *err.
template <typename T>
bool LaunchCrossEntropyStaged(const CrossEntropyArgs& a, const CrossEntropyLaunchOptions& o, cudaStream_t stream,
                              cudaError_t* err);
template <typename T>
cudaError_t LaunchScale(const ScaleArgs& a, cudaStream_t stream);

}  // namespace jax_ls2
