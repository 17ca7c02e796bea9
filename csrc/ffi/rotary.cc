// XLA FFI handlers for rotary position embeddings (forward, and the backward's inverse
// rotation: the same kernel with the angle negated).
#include <string>

#include "ffi/common.h"
#include "ffi/registry.h"
#include "kernels/rotary.h"

namespace jax_ls2 {
namespace {

ffi::Error Rotary(cudaStream_t stream, const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                  const ffi::AnyBuffer& positions, const ffi::AnyBuffer& inv_freq, ffi::Result<ffi::AnyBuffer>& q_out,
                  ffi::Result<ffi::AnyBuffer>& k_out, bool interleaved, bool inverse) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() < 2 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument(std::string(op) + ": q and k must be (tokens..., heads, head_dim)");
  const int64_t tokens = static_cast<int64_t>(positions.element_count());
  const int64_t head_dim = qd[qd.size() - 1], heads = qd[qd.size() - 2], kv_heads = kd[kd.size() - 2];
  if (kd[kd.size() - 1] != head_dim || static_cast<int64_t>(q.element_count()) != tokens * heads * head_dim ||
      static_cast<int64_t>(k.element_count()) != tokens * kv_heads * head_dim ||
      k.element_type() != q.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": q, k and positions disagree on tokens, head_dim or dtype");
  if (positions.element_type() != ffi::DataType::S32 || inv_freq.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(op) + ": positions must be int32 and inv_freq float32");
  const int64_t rotary_dim = 2 * static_cast<int64_t>(inv_freq.element_count());
  if (rotary_dim < 2 || rotary_dim > head_dim)
    return ffi::Error::InvalidArgument(std::string(op) + ": inv_freq must have 1 to head_dim / 2 entries");
  RotaryArgs a{q.untyped_data(), k.untyped_data(), static_cast<const int32_t*>(positions.untyped_data()),
               static_cast<const float*>(inv_freq.untyped_data()), q_out->untyped_data(), k_out->untyped_data(),
               tokens, static_cast<int>(heads), static_cast<int>(kv_heads), static_cast<int>(head_dim),
               static_cast<int>(rotary_dim), interleaved, inverse};
  PoisonOutputs(stream, q_out, k_out);
  return DispatchFloat(q.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchRotary<T>(a, stream));
  });
}

// Args: q (tokens..., heads, D), k (tokens..., kv_heads, D), positions (tokens...) int32,
//   inv_freq (rotary_dim / 2,) f32
// Rets: q rotated (tokens..., heads, D), k rotated (tokens..., kv_heads, D)
ffi::Error RotaryFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer positions,
                         ffi::AnyBuffer inv_freq, ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> k_out,
                         bool interleaved) {
  return Rotary(stream, "rotary", q, k, positions, inv_freq, q_out, k_out, interleaved, /*inverse=*/false);
}

// Args: dq_out, dk_out (the cotangents, shaped like q and k), positions, inv_freq
// Rets: dq, dk: the cotangents rotated back (the inverse rotation)
ffi::Error RotaryBwdImpl(cudaStream_t stream, ffi::AnyBuffer dq, ffi::AnyBuffer dk, ffi::AnyBuffer positions,
                         ffi::AnyBuffer inv_freq, ffi::Result<ffi::AnyBuffer> dq_in, ffi::Result<ffi::AnyBuffer> dk_in,
                         bool interleaved) {
  return Rotary(stream, "rotary backward", dq, dk, positions, inv_freq, dq_in, dk_in, interleaved, /*inverse=*/true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RotaryFwd, RotaryFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // positions
                                  .Arg<ffi::AnyBuffer>()  // inv_freq
                                  .Ret<ffi::AnyBuffer>()  // q rotated
                                  .Ret<ffi::AnyBuffer>()  // k rotated
                                  .Attr<bool>("interleaved"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RotaryBwd, RotaryBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // cotangent of q rotated
                                  .Arg<ffi::AnyBuffer>()  // cotangent of k rotated
                                  .Arg<ffi::AnyBuffer>()  // positions
                                  .Arg<ffi::AnyBuffer>()  // inv_freq
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Attr<bool>("interleaved"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_rotary_fwd", RotaryFwd);
JAX_LS2_REGISTER("jax_ls2_rotary_bwd", RotaryBwd);

}  // namespace jax_ls2
