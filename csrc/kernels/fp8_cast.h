// Fused casts to FP8 with the amax reduced in the same pass: LayerNorm, bias +
// activation, cast + transpose, and the activation's backward + cast + transpose + dbias.
//
// Every cast is q = fp8(clip(v * scale, -fp8_max, fp8_max)) of the float32 value v,
// rounded to nearest even (the hardware's saturating conversion), NaN staying NaN; amax
// is max |v| over the un-scaled float32 values (NaN if any is NaN), reduced by
// max over the bits of |v| (ordered as unsigned integers for non-negative floats, NaN
// above infinity) into a float32 the launchers zero first, so it does not depend on the
// order the blocks finish in.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

enum Fp8Format : int { kFp8E4M3 = 0, kFp8E5M2 = 1 };

struct LayerNormFp8Args {
  const void* x;       // (rows, hidden), T
  const void* gamma;   // (hidden,), T
  const void* beta;    // (hidden,), T
  const float* scale;  // (), float32
  void* y;             // (rows, hidden), FP8
  float* amax;         // (), float32: max |LayerNorm(x)| before scaling
  float* mean;         // (rows,)
  float* rstd;         // (rows,)
  int64_t rows, hidden;
  float eps;
};

struct BiasActFp8Args {
  const void* x;       // (rows, cols), T
  const void* bias;    // (cols,), T
  const float* scale;  // (), float32
  void* y;             // (rows, cols), FP8: act(x + bias) scaled
  float* amax;         // (), float32
  int64_t rows, cols;
  int activation;      // kActRelu, kActGelu or kActGeluTanh (kernels/dropout.h)
};

// Cast + transpose, and with grad != nullptr the activation's backward first:
// v = grad * act'(x) (x the activation's input), dbias = column sums of v.
struct CastTransposeArgs {
  const void* x;       // (rows, cols), T
  const void* grad;    // (rows, cols), T, or nullptr (plain cast + transpose)
  const float* scale;  // (), float32
  void* out;           // (rows, cols), FP8
  void* out_t;         // (cols, rows), FP8
  float* amax;         // (), float32
  float* dbias;        // (cols,), float32 (with grad)
  float* partials;     // (max_parts, cols) workspace (with grad)
  int64_t max_parts;
  int64_t rows, cols;
  int activation;      // with grad: kActRelu, kActGelu or kActGeluTanh
};

template <typename T>
cudaError_t LaunchLayerNormFp8(const LayerNormFp8Args& a, Fp8Format f, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBiasActFp8(const BiasActFp8Args& a, Fp8Format f, cudaStream_t stream);
template <typename T>
cudaError_t LaunchCastTranspose(const CastTransposeArgs& a, Fp8Format f, cudaStream_t stream);

}  // namespace jax_ls2
