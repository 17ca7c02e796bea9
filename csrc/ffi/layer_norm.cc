// XLA FFI handlers for LayerNorm (plain and fused with a residual add).
#include <optional>
#include <string>

#include "ffi/common.h"
#include "ffi/registry.h"
#include "kernels/layer_norm.h"

namespace jax_ls2 {
namespace {

LayerNormBwdLaunchOptions LaunchOptions() {
  LayerNormBwdLaunchOptions o;
  o.elems = GetKernelOption(kLayerNormBwdElems);
  o.stages = GetKernelOption(kLayerNormBwdStages);
  return o;
}

const void* Ptr(const ffi::AnyBuffer& b) { return b.untyped_data(); }
void* Ptr(ffi::Result<ffi::AnyBuffer>& b) { return b->untyped_data(); }
float* F32(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<float*>(b->untyped_data()); }

ffi::Error Fwd(cudaStream_t stream, const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
               const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& beta, ffi::Result<ffi::AnyBuffer>& y,
               ffi::Result<ffi::AnyBuffer>* sum, ffi::Result<ffi::AnyBuffer>& mean,
               ffi::Result<ffi::AnyBuffer>& rstd, float eps) {
  LayerNormFwdArgs a{Ptr(x), residual ? Ptr(*residual) : nullptr, Ptr(gamma), Ptr(beta), Ptr(y),
                     sum ? Ptr(*sum) : nullptr, F32(mean), F32(rstd), LeadingCount(x), LastDim(x), eps};
  if (gamma.element_count() != a.hidden || beta.element_count() != a.hidden)
    return ffi::Error::InvalidArgument(std::string(op) + ": gamma/beta size must equal the hidden size");
  PoisonOutputs(stream, y, mean, rstd);
  if (sum != nullptr) PoisonOutputs(stream, *sum);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchLayerNormFwd<T>(a, stream));
  });
}

// Args: x (rows..., H), gamma (H,), beta (H,)
// Rets: y (rows..., H), mean (rows...) f32, rstd (rows...) f32
ffi::Error LayerNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  return Fwd(stream, "layer_norm", x, nullptr, gamma, beta, y, nullptr, mean, rstd, eps);
}

// Args: x (rows..., H), residual (rows..., H), gamma (H,), beta (H,)
// Rets: y (rows..., H), sum = x + residual (rows..., H), mean (rows...) f32, rstd (rows...) f32
ffi::Error AddLayerNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                               ffi::AnyBuffer gamma, ffi::AnyBuffer beta, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> mean,
                               ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  return Fwd(stream, "layer_norm(residual)", x, &residual, gamma, beta, y, &sum, mean, rstd, eps);
}

// more: extra cotangents of y, each shaped and typed like dy (checked here), or null.
ffi::Error Bwd(cudaStream_t stream, const char* op, const ffi::AnyBuffer& dy, const ffi::AnyBuffer* dsum,
               const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& mean,
               const ffi::AnyBuffer& rstd, ffi::Result<ffi::AnyBuffer>& dx, ffi::Result<ffi::AnyBuffer>& dgamma,
               ffi::Result<ffi::AnyBuffer>& dbeta, ffi::Result<ffi::AnyBuffer>& partials,
               const ffi::AnyBuffer* const* more = nullptr, size_t n_more = 0) {
  auto pdims = partials->dimensions();
  LayerNormBwdArgs a{Ptr(dy), dsum ? Ptr(*dsum) : nullptr, Ptr(x), Ptr(gamma),
                     static_cast<const float*>(mean.untyped_data()), static_cast<const float*>(rstd.untyped_data()),
                     Ptr(dx), F32(dgamma), F32(dbeta), F32(partials), pdims.size() > 0 ? pdims[0] : 0,
                     LeadingCount(x), LastDim(x), {nullptr, nullptr, nullptr}, 0};
  if (n_more > static_cast<size_t>(kLayerNormMaxExtraDy))
    return ffi::Error::InvalidArgument(std::string(op) + ": at most " + std::to_string(kLayerNormMaxExtraDy + 1) +
                                       " cotangents of y, got " + std::to_string(n_more + 1));
  for (size_t i = 0; i < n_more; ++i) {
    const ffi::AnyBuffer& d = *more[i];
    if (d.element_type() != dy.element_type() || d.element_count() != dy.element_count())
      return ffi::Error::InvalidArgument(std::string(op) + ": every cotangent of y must match dy's dtype and size");
    a.dy_more[a.n_more++] = Ptr(d);
  }
  if (a.max_parts < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": partials workspace must have >= 1 row");
  PoisonOutputs(stream, dx, dgamma, dbeta);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchLayerNormBwd<T>(a, LaunchOptions(), stream));
  });
}

// Args: dy (rows..., H), x (rows..., H), gamma (H,), mean (rows...) f32, rstd (rows...) f32
// Rets: dx (rows..., H), dgamma (H,) f32, dbeta (H,) f32, partials workspace (parts, 2, H) f32
ffi::Error LayerNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                            ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                            ffi::Result<ffi::AnyBuffer> partials) {
  return Bwd(stream, "layer_norm backward", dy, nullptr, x, gamma, mean, rstd, dx, dgamma, dbeta, partials);
}

// Args: dy (rows..., H), dsum (rows..., H), sum (rows..., H), gamma (H,), mean, rstd (rows...) f32
// Rets: dx (rows..., H) = dsum + d LayerNorm, dgamma (H,) f32, dbeta (H,) f32, partials workspace
ffi::Error AddLayerNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dsum, ffi::AnyBuffer x,
                               ffi::AnyBuffer gamma, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                               ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> partials) {
  return Bwd(stream, "layer_norm(residual) backward", dy, &dsum, x, gamma, mean, rstd, dx, dgamma, dbeta,
             partials);
}

// Args: x (rows..., H), gamma (H,), mean (rows...) f32, rstd (rows...) f32, then the
//   cotangents of y: dy_0 .. dy_k (rows..., H), 2 to 4 of them, and with has_dsum the
//   cotangent of the returned input last.
// Rets: dx (rows..., H) = d LayerNorm(sum of the dy_i) [+ dsum], dgamma, dbeta, partials workspace
ffi::Error LayerNormBwdMultiImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer mean,
                                 ffi::AnyBuffer rstd, ffi::RemainingArgs cts, ffi::Result<ffi::AnyBuffer> dx,
                                 ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                                 ffi::Result<ffi::AnyBuffer> partials, int32_t has_dsum) {
  const char* op = "layer_norm(copies) backward";
  // Fixed-size storage: no host allocation per call.
  constexpr size_t kMaxOperands = kLayerNormMaxExtraDy + 2;  // dy, the extra cotangents, dsum
  const size_t n = cts.size();
  const size_t n_dy = n - (has_dsum && n > 0 ? 1 : 0);
  if (n < (has_dsum ? 2u : 1u) || n_dy < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": expected at least one cotangent of y");
  if (n > kMaxOperands || n_dy > static_cast<size_t>(kLayerNormMaxExtraDy + 1))
    return ffi::Error::InvalidArgument(std::string(op) + ": at most " + std::to_string(kLayerNormMaxExtraDy + 1) +
                                       " cotangents of y, got " + std::to_string(n_dy));
  std::optional<ffi::AnyBuffer> all[kMaxOperands];
  for (size_t i = 0; i < n; ++i) {
    auto b = cts.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument(std::string(op) + ": bad cotangent operand");
    all[i].emplace(*b);
  }
  const ffi::AnyBuffer* dsum = has_dsum ? &*all[n - 1] : nullptr;
  if (dsum != nullptr && (dsum->element_type() != x.element_type() || dsum->element_count() != x.element_count()))
    return ffi::Error::InvalidArgument(std::string(op) + ": dsum must match x's dtype and size");
  const ffi::AnyBuffer* more[kLayerNormMaxExtraDy];
  for (size_t i = 1; i < n_dy; ++i) more[i - 1] = &*all[i];
  return Bwd(stream, op, *all[0], dsum, x, gamma, mean, rstd, dx, dgamma, dbeta, partials, more, n_dy - 1);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormFwd, LayerNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // mean
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddLayerNormFwd, AddLayerNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // sum
                                  .Ret<ffi::AnyBuffer>()  // mean
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBwd, LayerNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // mean
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>(),  // partials
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddLayerNormBwd, AddLayerNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // dsum
                                  .Arg<ffi::AnyBuffer>()  // sum
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // mean
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>(),  // partials
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBwdMulti, LayerNormBwdMultiImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // mean
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .RemainingArgs()        // dy_0 .. dy_k [, dsum]
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>()  // partials
                                  .Attr<int32_t>("has_dsum"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_layer_norm_fwd", LayerNormFwd);
JAX_LS2_REGISTER("jax_ls2_add_layer_norm_fwd", AddLayerNormFwd);
JAX_LS2_REGISTER("jax_ls2_layer_norm_bwd", LayerNormBwd);
JAX_LS2_REGISTER("jax_ls2_add_layer_norm_bwd", AddLayerNormBwd);
JAX_LS2_REGISTER("jax_ls2_layer_norm_bwd_multi", LayerNormBwdMulti);

}  // namespace jax_ls2
