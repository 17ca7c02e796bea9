// XLA FFI handlers for the gated activation + dropout of gated MLPs (SwiGLU, GEGLU).
#include <string>

#include "ffi/common.h"
#include "ffi/mask_numbering.h"
#include "ffi/registry.h"
#include "kernels/gated_act.h"

namespace jax_ls2 {
namespace {

ffi::Error GatedAct(cudaStream_t stream, const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer* dy,
                    const ffi::AnyBuffer& seed, ffi::Result<ffi::AnyBuffer>& out, int32_t activation,
                    int32_t threshold, float scale, Int64s row_extents, Int64s row_strides) {
  const int64_t width = LastDim(x);
  if (width % 2 != 0) return ffi::Error::InvalidArgument(std::string(op) + ": x's last dim must be 2 * ffn");
  if (seed.element_type() != ffi::DataType::U32 || static_cast<int64_t>(seed.element_count()) != 4)
    return ffi::Error::InvalidArgument(std::string(op) + ": seed must be uint32[4]");
  if (activation < kGatedSwiglu || activation > kGatedGegluTanh)
    return ffi::Error::InvalidArgument(std::string(op) + ": unknown activation code " + std::to_string(activation));
  if (threshold < 0 || threshold > 65535)
    return ffi::Error::InvalidArgument(std::string(op) + ": threshold must be in [0, 65535]");
  const int64_t rows = LeadingCount(x), ffn = width / 2;
  if (dy != nullptr &&
      (dy->element_type() != x.element_type() || static_cast<int64_t>(dy->element_count()) != rows * ffn))
    return ffi::Error::InvalidArgument(std::string(op) + ": dy must be (rows, ffn) in x's dtype");
  MaskRows numbering;
  if (auto e = MaskRowsAttr(op, rows, row_extents, row_strides, &numbering); e.failure()) return e;
  GatedActArgs a{x.untyped_data(), dy ? dy->untyped_data() : nullptr, static_cast<const uint32_t*>(seed.untyped_data()),
                 out->untyped_data(), rows, ffn, static_cast<uint32_t>(threshold), scale, activation, numbering};
  PoisonOutputs(stream, out);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, dy ? LaunchGatedActBwd<T>(a, stream) : LaunchGatedActFwd<T>(a, stream));
  });
}

// Args: x (rows..., 2 F), seed uint32[4] (k0, k1, 64-bit base of the mask numbering)
// Rets: y (rows..., F)
ffi::Error GatedActFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> y,
                           int32_t activation, int32_t threshold, float scale, Int64s row_extents,
                           Int64s row_strides) {
  return GatedAct(stream, "gated_act_dropout", x, nullptr, seed, y, activation, threshold, scale, row_extents,
                  row_strides);
}

// Args: x (rows..., 2 F), dy (rows..., F), seed uint32[4]
// Rets: dx (rows..., 2 F): d gate then d up
ffi::Error GatedActBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer seed,
                           ffi::Result<ffi::AnyBuffer> dx, int32_t activation, int32_t threshold, float scale,
                           Int64s row_extents, Int64s row_strides) {
  return GatedAct(stream, "gated_act_dropout backward", x, &dy, seed, dx, activation, threshold, scale, row_extents,
                  row_strides);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatedActFwd, GatedActFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int32_t>("activation")
                                  .Attr<int32_t>("threshold")
                                  .Attr<float>("scale")
                                  .Attr<Int64s>("row_extents")   // the output rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatedActBwd, GatedActBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<int32_t>("activation")
                                  .Attr<int32_t>("threshold")
                                  .Attr<float>("scale")
                                  .Attr<Int64s>("row_extents")   // the output rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_gated_act_dropout_fwd", GatedActFwd);
JAX_LS2_REGISTER("jax_ls2_gated_act_dropout_bwd", GatedActBwd);

}  // namespace jax_ls2
