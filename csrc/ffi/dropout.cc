// XLA FFI handlers for bias + dropout + residual and bias + activation + dropout.
#include "ffi/common.h"
#include "ffi/mask_numbering.h"
#include "ffi/registry.h"
#include "kernels/dropout.h"

namespace jax_ls2 {
namespace {

const void* Ptr(const ffi::AnyBuffer& b) { return b.untyped_data(); }
void* Ptr(ffi::Result<ffi::AnyBuffer>& b) { return b->untyped_data(); }
float* F32(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<float*>(b->untyped_data()); }
const uint32_t* Seed(const ffi::AnyBuffer& b) { return static_cast<const uint32_t*>(b.untyped_data()); }

DropoutLaunchOptions LaunchOptions() {
  DropoutLaunchOptions o;
  o.rows_in_flight = GetKernelOption(kDropoutRowsInFlight);
  o.full_grid = GetKernelOption(kDropoutFullGrid);
  o.prefetch = GetKernelOption(kDropoutPrefetch);
  return o;
}

ffi::Error CheckCommon(const char* op, const ffi::AnyBuffer& rows_like, const ffi::AnyBuffer* bias,
                       const ffi::AnyBuffer& seed, int64_t threshold) {
  if (bias != nullptr && (bias->element_count() != LastDim(rows_like) ||
                          bias->element_type() != rows_like.element_type()))
    return ffi::Error::InvalidArgument(std::string(op) + ": bias must be (hidden,) in the input's dtype");
  if (seed.element_type() != ffi::DataType::U32 || seed.element_count() != 4)
    return ffi::Error::InvalidArgument(std::string(op) + ": seed must be uint32[4] (k0, k1, base_lo, base_hi)");
  if (threshold < 0 || threshold > 65535)
    return ffi::Error::InvalidArgument(std::string(op) + ": threshold must be in [0, 65535]");
  return ffi::Error::Success();
}

// Args: x (rows..., H), bias (H,), residual (rows..., H), seed uint32[4]
// Rets: y (rows..., H) = residual + dropout(x + bias)
ffi::Error BiasDropoutResidualFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                      ffi::AnyBuffer residual, ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> y,
                                      int64_t threshold, float scale, Int64s row_extents, Int64s row_strides) {
  const char* op = "bias_dropout_residual";
  if (auto e = CheckCommon(op, x, &bias, seed, threshold); e.failure()) return e;
  MaskRows numbering;
  if (auto e = MaskRowsAttr(op, LeadingCount(x), row_extents, row_strides, &numbering); e.failure()) return e;
  if (residual.element_count() != x.element_count())
    return ffi::Error::InvalidArgument(std::string(op) + ": residual must have x's shape");
  DropoutFwdArgs a{Ptr(x), Ptr(bias), Ptr(residual), Seed(seed), Ptr(y), LeadingCount(x), LastDim(x),
                   (uint32_t)threshold, scale, 0, numbering};
  PoisonOutputs(stream, y);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchBiasDropoutResidualFwd<T>(a, LaunchOptions(), stream));
  });
}

// Args: dy (rows..., H), seed uint32[4]
// Rets: dx (rows..., H) = mask * scale * dy, dbias (H,) f32, partials workspace (parts, H) f32
ffi::Error BiasDropoutResidualBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer seed,
                                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                                      ffi::Result<ffi::AnyBuffer> partials, int64_t threshold, float scale,
                                      Int64s row_extents, Int64s row_strides) {
  const char* op = "bias_dropout_residual backward";
  if (auto e = CheckCommon(op, dy, nullptr, seed, threshold); e.failure()) return e;
  MaskRows numbering;
  if (auto e = MaskRowsAttr(op, LeadingCount(dy), row_extents, row_strides, &numbering); e.failure()) return e;
  auto pdims = partials->dimensions();
  DropoutBwdArgs a{Ptr(dy), nullptr, nullptr, Seed(seed), Ptr(dx), F32(dbias), F32(partials),
                   pdims.size() > 0 ? pdims[0] : 0, LeadingCount(dy), LastDim(dy), (uint32_t)threshold, scale, 0,
                   numbering};
  if (a.max_parts < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": partials workspace must have >= 1 row");
  PoisonOutputs(stream, dx, dbias);
  return DispatchFloat(dy.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchBiasDropoutResidualBwd<T>(a, LaunchOptions(), stream));
  });
}

// Args: x (rows..., H), bias (H,), seed uint32[4]
// Rets: y (rows..., H) = dropout(act(x + bias))
ffi::Error BiasActDropoutFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer seed,
                                 ffi::Result<ffi::AnyBuffer> y, int64_t activation, int64_t threshold,
                                 float scale, Int64s row_extents, Int64s row_strides) {
  const char* op = "bias_act_dropout";
  if (auto e = CheckCommon(op, x, &bias, seed, threshold); e.failure()) return e;
  MaskRows numbering;
  if (auto e = MaskRowsAttr(op, LeadingCount(x), row_extents, row_strides, &numbering); e.failure()) return e;
  if (activation < kActRelu || activation > kActGeluTanh)
    return ffi::Error::InvalidArgument(std::string(op) + ": unknown activation code");
  DropoutFwdArgs a{Ptr(x), Ptr(bias), nullptr, Seed(seed), Ptr(y), LeadingCount(x), LastDim(x),
                   (uint32_t)threshold, scale, (int)activation, numbering};
  PoisonOutputs(stream, y);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchBiasActDropoutFwd<T>(a, LaunchOptions(), stream));
  });
}

// Args: dy (rows..., H), x (rows..., H), bias (H,), seed uint32[4]
// Rets: dx (rows..., H) = mask * scale * dy * act'(x + bias), dbias (H,) f32, partials (parts, H) f32
ffi::Error BiasActDropoutBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                 ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> dx,
                                 ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> partials,
                                 int64_t activation, int64_t threshold, float scale, Int64s row_extents,
                                 Int64s row_strides) {
  const char* op = "bias_act_dropout backward";
  if (auto e = CheckCommon(op, x, &bias, seed, threshold); e.failure()) return e;
  MaskRows numbering;
  if (auto e = MaskRowsAttr(op, LeadingCount(x), row_extents, row_strides, &numbering); e.failure()) return e;
  if (activation < kActRelu || activation > kActGeluTanh)
    return ffi::Error::InvalidArgument(std::string(op) + ": unknown activation code");
  if (dy.element_count() != x.element_count() || dy.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": dy must have x's shape and dtype");
  auto pdims = partials->dimensions();
  DropoutBwdArgs a{Ptr(dy), Ptr(x), Ptr(bias), Seed(seed), Ptr(dx), F32(dbias), F32(partials),
                   pdims.size() > 0 ? pdims[0] : 0, LeadingCount(x), LastDim(x), (uint32_t)threshold, scale,
                   (int)activation, numbering};
  if (a.max_parts < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": partials workspace must have >= 1 row");
  PoisonOutputs(stream, dx, dbias);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchBiasActDropoutBwd<T>(a, LaunchOptions(), stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BiasDropoutResidualFwd, BiasDropoutResidualFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("scale")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BiasDropoutResidualBwd, BiasDropoutResidualBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::AnyBuffer>()  // partials
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("scale")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BiasActDropoutFwd, BiasActDropoutFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("scale")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BiasActDropoutBwd, BiasActDropoutBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::AnyBuffer>()  // partials
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("scale")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_bias_dropout_residual_fwd", BiasDropoutResidualFwd);
JAX_LS2_REGISTER("jax_ls2_bias_dropout_residual_bwd", BiasDropoutResidualBwd);
JAX_LS2_REGISTER("jax_ls2_bias_act_dropout_fwd", BiasActDropoutFwd);
JAX_LS2_REGISTER("jax_ls2_bias_act_dropout_bwd", BiasActDropoutBwd);

}  // namespace jax_ls2
