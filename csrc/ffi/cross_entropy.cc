// XLA FFI handlers for the fused softmax cross entropy.
#include "ffi/common.h"
#include "ffi/registry.h"
#include "kernels/cross_entropy.h"

namespace jax_ls2 {
namespace {

CrossEntropyLaunchOptions LaunchOptions() {
  CrossEntropyLaunchOptions o;
  o.threads = GetKernelOption(kCrossEntropyThreads);
  o.pipeline = GetKernelOption(kCrossEntropyPipeline);
  return o;
}

struct CeAttrs {
  float smoothing, z_loss;
  int64_t ignore_index;
  bool has_ignore;
};

ffi::Error Run(cudaStream_t stream, const char* op, const ffi::AnyBuffer& logits, const ffi::AnyBuffer& labels,
               const ffi::AnyBuffer* scale, bool scale_per_row, float* loss, void* grad, const CeAttrs& at,
               int64_t valid_vocab = 0) {
  if (labels.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument(std::string(op) + ": labels must be int32");
  const int64_t rows = LeadingCount(logits);
  if (labels.element_count() != rows)
    return ffi::Error::InvalidArgument(std::string(op) + ": labels must have one entry per row of logits");
  if (scale != nullptr && scale->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(op) + ": scale must be float32");
  if (scale != nullptr && (int64_t)scale->element_count() != (scale_per_row ? rows : 1))
    return ffi::Error::InvalidArgument(std::string(op) + ": scale has the wrong size");
  const int64_t width = LastDim(logits);
  if (valid_vocab < 0 || valid_vocab > width)
    return ffi::Error::InvalidArgument(std::string(op) + ": valid_vocab must be in [0, " +
                                       std::to_string(width) + "], got " + std::to_string(valid_vocab));
  CrossEntropyArgs a{logits.untyped_data(), static_cast<const int32_t*>(labels.untyped_data()),
                     scale ? static_cast<const float*>(scale->untyped_data()) : nullptr, scale_per_row,
                     loss, grad, rows, valid_vocab > 0 ? valid_vocab : width, width, at.smoothing, at.z_loss,
                     at.ignore_index, at.has_ignore};
  return DispatchFloat(logits.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchCrossEntropy<T>(a, LaunchOptions(), stream));
  });
}

float* F32(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<float*>(b->untyped_data()); }

// Args: logits (rows..., V), labels (rows...) s32
// Rets: loss (rows...) f32
ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                   ffi::Result<ffi::AnyBuffer> loss, float smoothing, float z_loss, int64_t ignore_index,
                   bool has_ignore) {
  PoisonOutputs(stream, loss);
  return Run(stream, "cross_entropy", logits, labels, nullptr, false, F32(loss), nullptr,
             {smoothing, z_loss, ignore_index, has_ignore});
}

// Args: logits (rows..., W), labels (rows...) s32, scale () f32
// Rets: loss (rows...) f32, grad (rows..., W) = scale * dloss/dlogits in the logits dtype
// Attr valid_vocab: the first valid_vocab columns are logits, the rest padding (grad 0).
ffi::Error FwdGradImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer scale,
                       ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> grad, float smoothing,
                       float z_loss, int64_t ignore_index, bool has_ignore, int64_t valid_vocab) {
  PoisonOutputs(stream, loss, grad);
  return Run(stream, "cross_entropy(grad)", logits, labels, &scale, false, F32(loss), grad->untyped_data(),
             {smoothing, z_loss, ignore_index, has_ignore}, valid_vocab);
}

// Args: logits (rows..., V), labels (rows...) s32, dloss (rows...) f32
// Rets: dlogits (rows..., V) in the logits dtype
ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer dloss,
                   ffi::Result<ffi::AnyBuffer> dlogits, float smoothing, float z_loss, int64_t ignore_index,
                   bool has_ignore) {
  PoisonOutputs(stream, dlogits);
  return Run(stream, "cross_entropy backward", logits, labels, &dloss, true, nullptr, dlogits->untyped_data(),
             {smoothing, z_loss, ignore_index, has_ignore});
}

// Args: x (n...), scale () f32
// Rets: y = x * scale (n...), same dtype; meant to alias x (then a unit scale is free)
ffi::Error ScaleImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "cross_entropy(scale)";
  if (scale.element_type() != ffi::DataType::F32 || scale.element_count() != 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": scale must be a float32 scalar");
  ScaleArgs a{x.untyped_data(), y->untyped_data(), static_cast<const float*>(scale.untyped_data()),
              (int64_t)x.element_count()};
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchScale<T>(a, stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossEntropyFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels
                                  .Ret<ffi::AnyBuffer>()  // loss
                                  .Attr<float>("smoothing")
                                  .Attr<float>("z_loss")
                                  .Attr<int64_t>("ignore_index")
                                  .Attr<bool>("has_ignore"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossEntropyFwdGrad, FwdGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>()  // loss
                                  .Ret<ffi::AnyBuffer>()  // grad
                                  .Attr<float>("smoothing")
                                  .Attr<float>("z_loss")
                                  .Attr<int64_t>("ignore_index")
                                  .Attr<bool>("has_ignore")
                                  .Attr<int64_t>("valid_vocab"),  // 0: every column
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossEntropyBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels
                                  .Arg<ffi::AnyBuffer>()  // dloss
                                  .Ret<ffi::AnyBuffer>()  // dlogits
                                  .Attr<float>("smoothing")
                                  .Attr<float>("z_loss")
                                  .Attr<int64_t>("ignore_index")
                                  .Attr<bool>("has_ignore"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossEntropyScale, ScaleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_cross_entropy_fwd", CrossEntropyFwd);
JAX_LS2_REGISTER("jax_ls2_cross_entropy_fwd_grad", CrossEntropyFwdGrad);
JAX_LS2_REGISTER("jax_ls2_cross_entropy_bwd", CrossEntropyBwd);
JAX_LS2_REGISTER("jax_ls2_cross_entropy_scale", CrossEntropyScale);

}  // namespace jax_ls2
