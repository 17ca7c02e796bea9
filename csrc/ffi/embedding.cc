// XLA FFI handlers for the token + position embedding with dropout.
#include "ffi/common.h"
#include "ffi/mask_numbering.h"
#include "ffi/registry.h"
#include "kernels/embedding.h"

namespace jax_ls2 {
namespace {

const int32_t* I32(const ffi::AnyBuffer& b) { return static_cast<const int32_t*>(b.untyped_data()); }

ffi::Error CheckSeed(const char* op, const ffi::AnyBuffer& seed) {
  if (seed.element_type() != ffi::DataType::U32 || seed.element_count() != 4)
    return ffi::Error::InvalidArgument(std::string(op) + ": seed must be uint32[4] (k0, k1, base_lo, base_hi)");
  return ffi::Error::Success();
}

ffi::Error CheckInt(const char* op, const char* name, const ffi::AnyBuffer& b, int64_t n) {
  if (b.element_type() != ffi::DataType::S32 || (int64_t)b.element_count() != n)
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be int32 with one entry per row");
  return ffi::Error::Success();
}

// Args: ids (rows...) s32, positions (rows...) s32, table (V, H), pos_table (P, H) (same dtype as
//       table), inv_freq (H/2 or 1,) f32, seed (4,) u32
// Rets: out (rows..., H) in the output dtype
ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer ids, ffi::AnyBuffer positions, ffi::AnyBuffer table,
                   ffi::AnyBuffer pos_table, ffi::AnyBuffer inv_freq, ffi::AnyBuffer seed,
                   ffi::Result<ffi::AnyBuffer> out, float scale, int64_t pos_mode, int64_t padding_idx,
                   bool has_padding, int64_t threshold, float keep_scale, Int64s row_extents,
                   Int64s row_strides) {
  const char* op = "embedding";
  const int64_t rows = ids.element_count();
  MaskRows numbering;
  if (auto e = CheckSeed(op, seed); e.failure()) return e;
  if (auto e = MaskRowsAttr(op, rows, row_extents, row_strides, &numbering); e.failure()) return e;
  auto tdims = table.dimensions();
  auto pdims = pos_table.dimensions();
  if (tdims.size() != 2 || pdims.size() != 2 || pdims[1] != tdims[1])
    return ffi::Error::InvalidArgument(std::string(op) + ": table and pos_table must be (n, hidden)");
  if (pos_table.element_type() != table.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": pos_table must have the table's dtype");
  if (auto e = CheckInt(op, "ids", ids, rows); e.failure()) return e;
  if (auto e = CheckInt(op, "positions", positions, rows); e.failure()) return e;
  if (LastDim(*out) != tdims[1] || (int64_t)out->element_count() != rows * tdims[1])
    return ffi::Error::InvalidArgument(std::string(op) + ": output must be (rows..., hidden)");
  if (pos_mode == kPosSinusoidal && (int64_t)inv_freq.element_count() < tdims[1] / 2)
    return ffi::Error::InvalidArgument(std::string(op) + ": inv_freq must have hidden / 2 entries");
  EmbeddingFwdArgs a{table.untyped_data(), pos_table.untyped_data(),
                     static_cast<const float*>(inv_freq.untyped_data()), I32(ids), I32(positions),
                     static_cast<const uint32_t*>(seed.untyped_data()), out->untyped_data(), rows, tdims[1],
                     tdims[0], pdims[0], (int)pos_mode, scale, padding_idx, has_padding,
                     (uint32_t)threshold, keep_scale, numbering};
  PoisonOutputs(stream, out);
  return DispatchFloat(table.element_type(), op, [&](auto tt) -> ffi::Error {
    using TT = decltype(tt);
    return DispatchFloat(out->element_type(), op, [&](auto to) -> ffi::Error {
      using TO = decltype(to);
      return CudaStatus(op, LaunchEmbeddingFwd<TT, TO>(a, stream));
    });
  });
}

// Args: dout (rows..., H), ids (rows...) s32, positions (rows...) s32, seed (4,) u32,
//       tok_order (rows...) s32, pos_order (rows...) s32 (row indices sorted by id / position;
//       read only when deterministic)
// Rets: dtable (V, H) f32, dpos (P, H) f32 (written when pos_mode is learned)
ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer ids, ffi::AnyBuffer positions,
                   ffi::AnyBuffer seed, ffi::AnyBuffer tok_order, ffi::AnyBuffer pos_order,
                   ffi::Result<ffi::AnyBuffer> dtable, ffi::Result<ffi::AnyBuffer> dpos, float scale,
                   int64_t pos_mode, int64_t padding_idx, bool has_padding, int64_t threshold, float keep_scale,
                   bool deterministic, Int64s row_extents, Int64s row_strides) {
  const char* op = "embedding backward";
  const int64_t rows = ids.element_count();
  MaskRows numbering;
  if (auto e = CheckSeed(op, seed); e.failure()) return e;
  if (auto e = MaskRowsAttr(op, rows, row_extents, row_strides, &numbering); e.failure()) return e;
  auto tdims = dtable->dimensions();
  auto pdims = dpos->dimensions();
  if (tdims.size() != 2 || pdims.size() != 2 || dtable->element_type() != ffi::DataType::F32 ||
      dpos->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(op) + ": dtable and dpos must be float32 (n, hidden)");
  if (auto e = CheckInt(op, "ids", ids, rows); e.failure()) return e;
  if (auto e = CheckInt(op, "positions", positions, rows); e.failure()) return e;
  if (auto e = CheckInt(op, "tok_order", tok_order, rows); e.failure()) return e;
  if (auto e = CheckInt(op, "pos_order", pos_order, rows); e.failure()) return e;
  if (LastDim(dout) != tdims[1] || (int64_t)dout.element_count() != rows * tdims[1])
    return ffi::Error::InvalidArgument(std::string(op) + ": dout must be (rows..., hidden)");
  const bool learned = pos_mode == kPosLearned;
  EmbeddingBwdArgs a{dout.untyped_data(), I32(ids), I32(positions),
                     static_cast<const uint32_t*>(seed.untyped_data()),
                     deterministic ? I32(tok_order) : nullptr, deterministic ? I32(pos_order) : nullptr,
                     static_cast<float*>(dtable->untyped_data()),
                     learned ? static_cast<float*>(dpos->untyped_data()) : nullptr, rows, tdims[1], tdims[0],
                     pdims[0], scale, padding_idx, has_padding, (uint32_t)threshold, keep_scale, numbering};
  if (!learned) {  // keep the (unused) dpos defined
    cudaError_t err = cudaMemsetAsync(dpos->untyped_data(), 0, dpos->element_count() * sizeof(float), stream);
    if (err != cudaSuccess) return CudaStatus(op, err);
  }
  return DispatchFloat(dout.element_type(), op, [&](auto to) -> ffi::Error {
    using TO = decltype(to);
    return CudaStatus(op, LaunchEmbeddingBwd<TO>(a, stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbeddingFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // ids
                                  .Arg<ffi::AnyBuffer>()  // positions
                                  .Arg<ffi::AnyBuffer>()  // table
                                  .Arg<ffi::AnyBuffer>()  // pos_table
                                  .Arg<ffi::AnyBuffer>()  // inv_freq
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("pos_mode")
                                  .Attr<int64_t>("padding_idx")
                                  .Attr<bool>("has_padding")
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbeddingBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // ids
                                  .Arg<ffi::AnyBuffer>()  // positions
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Arg<ffi::AnyBuffer>()  // tok_order
                                  .Arg<ffi::AnyBuffer>()  // pos_order
                                  .Ret<ffi::AnyBuffer>()  // dtable
                                  .Ret<ffi::AnyBuffer>()  // dpos
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("pos_mode")
                                  .Attr<int64_t>("padding_idx")
                                  .Attr<bool>("has_padding")
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<bool>("deterministic")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_embedding_fwd", EmbeddingFwd);
JAX_LS2_REGISTER("jax_ls2_embedding_bwd", EmbeddingBwd);

}  // namespace jax_ls2
