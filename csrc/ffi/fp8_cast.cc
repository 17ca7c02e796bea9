// XLA FFI handlers for the fused FP8 casts: LayerNorm, bias + activation, cast +
// transpose, and the activation's backward + cast + transpose + dbias. The FP8 format
// of each is that of its FP8 results (float8_e4m3fn or float8_e5m2).
#include <string>

#include "ffi/common.h"
#include "ffi/registry.h"
#include "kernels/dropout.h"
#include "kernels/fp8_cast.h"

namespace jax_ls2 {
namespace {

const void* Ptr(const ffi::AnyBuffer& b) { return b.untyped_data(); }
void* Ptr(ffi::Result<ffi::AnyBuffer>& b) { return b->untyped_data(); }
float* F32(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<float*>(b->untyped_data()); }

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// The format of an FP8 result, or an error naming the op and the result.
ffi::Error FormatOf(const char* op, const char* name, ffi::DataType t, Fp8Format* f) {
  if (t == ffi::DataType::F8E4M3FN) {
    *f = kFp8E4M3;
  } else if (t == ffi::DataType::F8E5M2) {
    *f = kFp8E5M2;
  } else {
    return Invalid(op, std::string(name) + " must be float8_e4m3fn or float8_e5m2");
  }
  return ffi::Error::Success();
}

// scale: a float32 scalar operand; amax: a float32 scalar result.
ffi::Error CheckScalars(const char* op, const ffi::AnyBuffer& scale, ffi::Result<ffi::AnyBuffer>& amax) {
  if (scale.element_type() != ffi::DataType::F32 || scale.element_count() != 1)
    return Invalid(op, "scale must be a float32 scalar");
  if (amax->element_type() != ffi::DataType::F32 || amax->element_count() != 1)
    return Invalid(op, "amax must be a float32 scalar");
  return ffi::Error::Success();
}

ffi::Error CheckActivation(const char* op, int32_t activation) {
  if (activation < kActRelu || activation > kActGeluTanh) return Invalid(op, "unknown activation code");
  return ffi::Error::Success();
}

// Args: x (rows..., H), gamma (H,), beta (H,), scale () f32
// Rets: y (rows..., H) FP8, amax () f32, mean (rows...) f32, rstd (rows...) f32
ffi::Error LayerNormFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                            ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> amax,
                            ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  const char* op = "layer_norm_fp8";
  Fp8Format f;
  if (auto e = FormatOf(op, "y", y->element_type(), &f); e.failure()) return e;
  if (auto e = CheckScalars(op, scale, amax); e.failure()) return e;
  LayerNormFp8Args a{Ptr(x), Ptr(gamma), Ptr(beta), static_cast<const float*>(Ptr(scale)), Ptr(y), F32(amax),
                     F32(mean), F32(rstd), LeadingCount(x), LastDim(x), eps};
  if (gamma.element_type() != x.element_type() || beta.element_type() != x.element_type())
    return Invalid(op, "gamma and beta must have x's dtype");
  if (gamma.element_count() != a.hidden || beta.element_count() != a.hidden)
    return Invalid(op, "gamma/beta size must equal the hidden size");
  if (y->element_count() != x.element_count() || mean->element_count() != a.rows || rstd->element_count() != a.rows)
    return Invalid(op, "result sizes do not match x");
  PoisonOutputs(stream, y, mean, rstd);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchLayerNormFp8<T>(a, f, stream));
  });
}

// Args: x (rows..., N), bias (N,), scale () f32
// Rets: y (rows..., N) FP8 = act(x + bias) * scale, amax () f32
ffi::Error BiasActFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> amax, int32_t activation) {
  const char* op = "bias_gelu_fp8";
  Fp8Format f;
  if (auto e = FormatOf(op, "y", y->element_type(), &f); e.failure()) return e;
  if (auto e = CheckScalars(op, scale, amax); e.failure()) return e;
  if (auto e = CheckActivation(op, activation); e.failure()) return e;
  BiasActFp8Args a{Ptr(x), Ptr(bias), static_cast<const float*>(Ptr(scale)), Ptr(y), F32(amax),
                   LeadingCount(x), LastDim(x), activation};
  if (bias.element_type() != x.element_type() || bias.element_count() != a.cols)
    return Invalid(op, "bias must have x's dtype and its last dimension's size");
  if (y->element_count() != x.element_count()) return Invalid(op, "y's size does not match x");
  PoisonOutputs(stream, y);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchBiasActFp8<T>(a, f, stream));
  });
}

ffi::Error CastTransposeCommon(cudaStream_t stream, const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer* grad,
                               const ffi::AnyBuffer& scale, ffi::Result<ffi::AnyBuffer>& out,
                               ffi::Result<ffi::AnyBuffer>& out_t, ffi::Result<ffi::AnyBuffer>& amax,
                               ffi::Result<ffi::AnyBuffer>* dbias, ffi::Result<ffi::AnyBuffer>* partials,
                               int32_t activation) {
  Fp8Format f, ft;
  if (auto e = FormatOf(op, "the cast", out->element_type(), &f); e.failure()) return e;
  if (auto e = FormatOf(op, "the transposed cast", out_t->element_type(), &ft); e.failure()) return e;
  if (f != ft) return Invalid(op, "both casts must have the same FP8 dtype");
  if (auto e = CheckScalars(op, scale, amax); e.failure()) return e;
  const int64_t rows = LeadingCount(x), cols = LastDim(x);
  if (out->element_count() != x.element_count() || out_t->element_count() != x.element_count())
    return Invalid(op, "the casts' sizes must equal the input's");
  CastTransposeArgs a{Ptr(x), nullptr, static_cast<const float*>(Ptr(scale)), Ptr(out), Ptr(out_t), F32(amax),
                      nullptr, nullptr, 0, rows, cols, activation};
  if (grad != nullptr) {
    if (auto e = CheckActivation(op, activation); e.failure()) return e;
    if (grad->element_type() != x.element_type() || grad->element_count() != x.element_count())
      return Invalid(op, "the gradient must have the activation input's dtype and shape");
    auto pdims = (*partials)->dimensions();
    if ((*dbias)->element_type() != ffi::DataType::F32 || (*dbias)->element_count() != cols ||
        (*partials)->element_type() != ffi::DataType::F32 || pdims.size() != 2 || pdims[0] < 1 || pdims[1] != cols)
      return Invalid(op, "dbias must be (N,) and the partials workspace (parts >= 1, N) float32");
    a.grad = Ptr(*grad);
    a.dbias = F32(*dbias);
    a.partials = F32(*partials);
    a.max_parts = pdims[0];
    PoisonOutputs(stream, out, out_t, *dbias);
  } else {
    PoisonOutputs(stream, out, out_t);
  }
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchCastTranspose<T>(a, f, stream));
  });
}

// Args: x (rows..., K), scale () f32
// Rets: out (rows..., K) FP8, out_t (K, rows...) FP8, amax () f32
ffi::Error CastTransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_t,
                             ffi::Result<ffi::AnyBuffer> amax) {
  return CastTransposeCommon(stream, "cast_transpose", x, nullptr, scale, out, out_t, amax, nullptr, nullptr, 0);
}

// Args: grad (rows..., N), x (rows..., N) the activation's input, scale () f32
// Rets: out (rows..., N) FP8 of grad * act'(x), out_t (N, rows...) FP8, amax () f32,
//   dbias (N,) f32, partials workspace (parts, N) f32
ffi::Error DActCastTransposeDbiasImpl(cudaStream_t stream, ffi::AnyBuffer grad, ffi::AnyBuffer x,
                                      ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out,
                                      ffi::Result<ffi::AnyBuffer> out_t, ffi::Result<ffi::AnyBuffer> amax,
                                      ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> partials,
                                      int32_t activation) {
  return CastTransposeCommon(stream, "dgelu_cast_transpose_dbias", x, &grad, scale, out, out_t, amax, &dbias,
                             &partials, activation);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormFp8, LayerNormFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>()  // y (FP8)
                                  .Ret<ffi::AnyBuffer>()  // amax
                                  .Ret<ffi::AnyBuffer>()  // mean
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BiasActFp8, BiasActFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>()  // y (FP8)
                                  .Ret<ffi::AnyBuffer>()  // amax
                                  .Attr<int32_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastTranspose, CastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>()  // out (FP8)
                                  .Ret<ffi::AnyBuffer>()  // out_t (FP8)
                                  .Ret<ffi::AnyBuffer>(),  // amax
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DActCastTransposeDbias, DActCastTransposeDbiasImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // grad
                                  .Arg<ffi::AnyBuffer>()  // x (the activation's input)
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>()  // out (FP8)
                                  .Ret<ffi::AnyBuffer>()  // out_t (FP8)
                                  .Ret<ffi::AnyBuffer>()  // amax
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::AnyBuffer>()  // partials
                                  .Attr<int32_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_layer_norm_fp8_fwd", LayerNormFp8);
JAX_LS2_REGISTER("jax_ls2_bias_act_fp8", BiasActFp8);
JAX_LS2_REGISTER("jax_ls2_cast_transpose_fp8", CastTranspose);
JAX_LS2_REGISTER("jax_ls2_dact_cast_transpose_dbias_fp8", DActCastTransposeDbias);

}  // namespace jax_ls2
