// Shared helpers of the XLA FFI handlers: dtype dispatch, CUDA errors as FFI errors,
// output poisoning for tests, and row counts of buffers. The kernels never see this file.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_ls2 {
namespace ffi = xla::ffi;

// ---------------------------------------------------------------- dispatch
// Calls fn(T{}) with T = float, __half or __nv_bfloat16 for the buffer's dtype,
// or returns InvalidArgument naming the op.
template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32: return fn(float{});
    case ffi::DataType::F16: return fn(__half{});
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    default:
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": unsupported dtype (expected float32, float16 or bfloat16)");
  }
}

// Turns the last CUDA error into an FFI error naming the op.
inline ffi::Error LastCudaError(const char* op) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// Turns a launcher's status into an FFI error naming the op.
inline ffi::Error CudaStatus(const char* op, cudaError_t err) {
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// Test aid: with JAX_LS2_POISON_OUTPUTS=1 in the environment, handlers fill their
// (non-aliased, non-workspace) outputs with all-ones bits, a NaN in every float dtype,
// before launching, so an element a kernel fails to write shows up as NaN.
inline bool PoisonOutputsEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("JAX_LS2_POISON_OUTPUTS");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}
inline void PoisonOutputs(cudaStream_t) {}
template <typename... Rest>
inline void PoisonOutputs(cudaStream_t stream, ffi::Result<ffi::AnyBuffer>& out, Rest&... rest) {
  if (!PoisonOutputsEnabled()) return;
  if (out->size_bytes() > 0) cudaMemsetAsync(out->untyped_data(), 0xFF, out->size_bytes(), stream);
  PoisonOutputs(stream, rest...);
}

// Number of rows when the last dimension is the row length.
inline int64_t LeadingCount(const ffi::AnyBuffer& buf) {
  auto dims = buf.dimensions();
  int64_t n = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) n *= dims[i];
  return n;
}
inline int64_t LastDim(const ffi::AnyBuffer& buf) {
  auto dims = buf.dimensions();
  return dims.size() == 0 ? 1 : dims[dims.size() - 1];
}

}  // namespace jax_ls2
