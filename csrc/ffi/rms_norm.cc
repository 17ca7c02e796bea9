// XLA FFI handlers for RMSNorm (plain and fused with a residual add).
#include <string>

#include "ffi/common.h"
#include "ffi/registry.h"
#include "kernels/rms_norm.h"

namespace jax_ls2 {
namespace {

ffi::Error Fwd(cudaStream_t stream, const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
               const ffi::AnyBuffer& gamma, ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>* sum,
               ffi::Result<ffi::AnyBuffer>& rstd, float eps, bool unit_offset) {
  RmsNormFwdArgs a{x.untyped_data(), residual ? residual->untyped_data() : nullptr, gamma.untyped_data(),
                   y->untyped_data(), sum ? (*sum)->untyped_data() : nullptr,
                   static_cast<float*>(rstd->untyped_data()), LeadingCount(x), LastDim(x), eps, unit_offset};
  if (static_cast<int64_t>(gamma.element_count()) != a.hidden || gamma.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": gamma must be (hidden,) in x's dtype");
  if (residual != nullptr &&
      (residual->element_type() != x.element_type() || residual->element_count() != x.element_count()))
    return ffi::Error::InvalidArgument(std::string(op) + ": residual must match x's dtype and size");
  PoisonOutputs(stream, y, rstd);
  if (sum != nullptr) PoisonOutputs(stream, *sum);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchRmsNormFwd<T>(a, stream));
  });
}

// Args: x (rows..., H), gamma (H,)
// Rets: y (rows..., H), rstd (rows...) f32
ffi::Error RmsNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> rstd, float eps, bool unit_offset) {
  return Fwd(stream, "rms_norm", x, nullptr, gamma, y, nullptr, rstd, eps, unit_offset);
}

// Args: x (rows..., H), residual (rows..., H), gamma (H,)
// Rets: y (rows..., H), sum = x + residual (rows..., H), rstd (rows...) f32
ffi::Error AddRmsNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer gamma,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                             ffi::Result<ffi::AnyBuffer> rstd, float eps, bool unit_offset) {
  return Fwd(stream, "rms_norm(residual)", x, &residual, gamma, y, &sum, rstd, eps, unit_offset);
}

// Args: x (rows..., H), gamma (H,), rstd (rows...) f32, then the cotangents of y: dy_0 ..
//   dy_k (rows..., H), 1 to 4 of them, and with has_dsum that of the input's other use
//   (rows..., H) last.
// Rets: dx (rows..., H), dgamma (H,) f32, partials workspace (parts, H) f32
ffi::Error RmsNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer rstd,
                          ffi::RemainingArgs cts, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                          ffi::Result<ffi::AnyBuffer> partials, bool has_dsum, bool unit_offset) {
  const char* op = "rms_norm backward";
  constexpr int kMaxDy = kRmsNormMaxExtraDy + 1;
  const int n = static_cast<int>(cts.size());
  const int n_dy = n - (has_dsum ? 1 : 0);
  if (n_dy < 1 || n_dy > kMaxDy)
    return ffi::Error::InvalidArgument(std::string(op) + ": expected 1 to " + std::to_string(kMaxDy) +
                                       " cotangents of y, got " + std::to_string(n_dy));
  auto pdims = partials->dimensions();
  RmsNormBwdArgs a{{nullptr, nullptr, nullptr, nullptr}, n_dy, nullptr, x.untyped_data(), gamma.untyped_data(),
                   static_cast<const float*>(rstd.untyped_data()), dx->untyped_data(),
                   static_cast<float*>(dgamma->untyped_data()), static_cast<float*>(partials->untyped_data()),
                   pdims.size() > 0 ? pdims[0] : 0, LeadingCount(x), LastDim(x), unit_offset};
  for (int i = 0; i < n; ++i) {
    auto b = cts.get<ffi::AnyBuffer>(i);
    if (!b.has_value() || b->element_type() != x.element_type() || b->element_count() != x.element_count())
      return ffi::Error::InvalidArgument(std::string(op) + ": every cotangent must match x's dtype and size");
    if (i < n_dy) {
      a.dy[i] = b->untyped_data();
    } else {
      a.dsum = b->untyped_data();
    }
  }
  if (static_cast<int64_t>(gamma.element_count()) != a.hidden || static_cast<int64_t>(rstd.element_count()) != a.rows)
    return ffi::Error::InvalidArgument(std::string(op) + ": gamma must be (hidden,) and rstd (rows,)");
  if (partials->element_type() != ffi::DataType::F32 || pdims.size() != 2 || pdims[0] < 1 || pdims[1] != a.hidden)
    return ffi::Error::InvalidArgument(std::string(op) + ": the partials workspace must be (parts >= 1, hidden) float32");
  PoisonOutputs(stream, dx, dgamma);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchRmsNormBwd<T>(a, stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFwd, RmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps")
                                  .Attr<bool>("unit_offset"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormFwd, AddRmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // sum
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps")
                                  .Attr<bool>("unit_offset"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBwd, RmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .RemainingArgs()        // dy_0 .. dy_k [, dsum]
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // partials
                                  .Attr<bool>("has_dsum")
                                  .Attr<bool>("unit_offset"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_rms_norm_fwd", RmsNormFwd);
JAX_LS2_REGISTER("jax_ls2_add_rms_norm_fwd", AddRmsNormFwd);
JAX_LS2_REGISTER("jax_ls2_rms_norm_bwd", RmsNormBwd);

}  // namespace jax_ls2
