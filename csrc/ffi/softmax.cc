// XLA FFI handlers for the attention softmax + dropout (forward and backward).
#include <limits>
#include <vector>

#include "ffi/common.h"
#include "ffi/mask_numbering.h"
#include "ffi/registry.h"
#include "kernels/softmax.h"

namespace jax_ls2 {
namespace {

SoftmaxLaunchOptions LaunchOptions() {
  SoftmaxLaunchOptions o;
  o.elems = GetKernelOption(kSoftmaxElems);
  return o;
}

struct Entry {
  int64_t n, b, m;  // size, bias stride, mask stride
};

// Element strides of a row-major buffer broadcast to `dims` (0 along its size-1 dims).
ffi::Error BroadcastStrides(const char* op, const char* name, const ffi::AnyBuffer& buf,
                            const std::vector<int64_t>& dims, std::vector<int64_t>* strides) {
  auto bd = buf.dimensions();
  const size_t r = dims.size();
  if (bd.size() != r)
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must have the rank of scores");
  strides->assign(r, 0);
  int64_t s = 1;
  for (size_t i = r; i-- > 0;) {
    if (bd[i] != 1 && bd[i] != dims[i])
      return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " is not broadcastable to scores");
    (*strides)[i] = bd[i] == 1 ? 0 : s;
    s *= bd[i];
  }
  return ffi::Error::Success();
}

ffi::Error BuildProblem(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias,
                        const ffi::AnyBuffer& mask, const ffi::AnyBuffer& seed, float* stats, float scale,
                        int32_t threshold, float keep_scale, bool causal, bool has_bias, bool has_mask,
                        Int64s row_extents, Int64s row_strides, SoftmaxProblem* p) {
  auto xd = x.dimensions();
  const size_t r = xd.size();
  if (r < 2) return ffi::Error::InvalidArgument(std::string(op) + ": scores must have rank >= 2");
  std::vector<int64_t> dims(xd.begin(), xd.end());
  *p = SoftmaxProblem{};
  p->x = x.untyped_data();
  p->stats = stats;
  p->cols = dims[r - 1];
  p->q_len = dims[r - 2];
  p->rows = 1;
  for (size_t i = 0; i + 1 < r; ++i) p->rows *= dims[i];
  if (p->rows > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument(std::string(op) + ": more than 2^31 - 1 rows are not supported");
  if (p->q_len > 0) p->q_div = MakeFastDiv((uint32_t)p->q_len);
  p->scale = scale;
  if (threshold < 0 || threshold > 65535)
    return ffi::Error::InvalidArgument(std::string(op) + ": dropout threshold must be in [0, 65535]");
  p->threshold = (uint32_t)threshold;
  p->keep_scale = keep_scale;
  p->causal = causal;
  if (seed.element_type() != ffi::DataType::U32 || seed.element_count() != 4)
    return ffi::Error::InvalidArgument(std::string(op) + ": seed must be uint32[4] (k0, k1, base_lo, base_hi)");
  if (auto e = MaskRowsAttr(op, p->rows, row_extents, row_strides, &p->numbering); e.failure()) return e;
  p->seed = static_cast<const uint32_t*>(seed.untyped_data());

  std::vector<int64_t> bs(r, 0), ms(r, 0);
  if (has_bias) {
    if (bias.element_type() == ffi::DataType::F32) {
      p->bias_f32 = true;
    } else if (bias.element_type() != x.element_type()) {
      return ffi::Error::InvalidArgument(std::string(op) + ": bias must be float32 or the dtype of scores");
    }
    if (auto e = BroadcastStrides(op, "bias", bias, dims, &bs); e.failure()) return e;
    p->bias = bias.untyped_data();
    p->bias_k = bs[r - 1];
  }
  if (has_mask) {
    if (mask.element_type() != ffi::DataType::PRED)
      return ffi::Error::InvalidArgument(std::string(op) + ": mask must be bool");
    if (auto e = BroadcastStrides(op, "mask", mask, dims, &ms); e.failure()) return e;
    p->mask = static_cast<const uint8_t*>(mask.untyped_data());
    p->mask_k = ms[r - 1];
  }
  // Leading dims (q_len included), size-1 dims dropped, adjacent dims merged where
  // both strides continue across them.
  std::vector<Entry> es;
  for (size_t i = 0; i + 1 < r; ++i) {
    if (dims[i] == 1) continue;
    Entry e{dims[i], bs[i], ms[i]};
    if (!es.empty() && es.back().b == e.b * e.n && es.back().m == e.m * e.n) {
      es.back() = Entry{es.back().n * e.n, e.b, e.m};
    } else {
      es.push_back(e);
    }
  }
  if (!es.empty() && es.front().b == 0 && es.front().m == 0) es.erase(es.begin());
  if (es.size() > (size_t)kSoftmaxMaxDims)
    return ffi::Error::InvalidArgument(std::string(op) + ": too many broadcast dims in bias/mask");
  p->bc.nd = (int)es.size();
  for (size_t i = 0; i < es.size(); ++i) {
    p->bc.size[i] = MakeFastDiv((uint32_t)es[i].n);
    p->bc.bias[i] = es[i].b;
    p->bc.mask[i] = es[i].m;
  }
  return ffi::Error::Success();
}

// Args: scores (..., q, k) T; bias (same rank, each dim 1 or equal) T or f32 (ignored
//       unless has_bias); mask (same rank) bool (ignored unless has_mask); seed u32[4]
// Rets: y (..., q, k) T; stats (..., q, 2) f32 = (row max of the logits, 1 / row sum)
ffi::Error SoftmaxFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                          ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> stats,
                          float scale, int32_t threshold, float keep_scale, bool causal, bool has_bias,
                          bool has_mask, Int64s row_extents, Int64s row_strides) {
  const char* op = "softmax_dropout";
  SoftmaxFwdArgs a{};
  if (auto e = BuildProblem(op, x, bias, mask, seed, static_cast<float*>(stats->untyped_data()), scale, threshold,
                            keep_scale, causal, has_bias, has_mask, row_extents, row_strides, &a.p);
      e.failure())
    return e;
  if (stats->element_count() != a.p.rows * 2 || stats->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(op) + ": stats must be float32 (..., q, 2)");
  a.y = y->untyped_data();
  PoisonOutputs(stream, y, stats);
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchSoftmaxFwd<T>(a, LaunchOptions(), stream));
  });
}

// Args: dy (..., q, k) T; scores (..., q, k) T; bias; mask; stats (..., q, 2) f32; seed u32[4]
// Rets: dx (..., q, k) T = grad_scale * p * (g - sum(g * p)), g = dy * keep * keep_scale
ffi::Error SoftmaxBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                          ffi::AnyBuffer mask, ffi::AnyBuffer stats, ffi::AnyBuffer seed,
                          ffi::Result<ffi::AnyBuffer> dx, float scale, float grad_scale, int32_t threshold,
                          float keep_scale, bool causal, bool has_bias, bool has_mask, Int64s row_extents,
                          Int64s row_strides) {
  const char* op = "softmax_dropout backward";
  SoftmaxBwdArgs a{};
  if (auto e = BuildProblem(op, x, bias, mask, seed, const_cast<float*>(static_cast<const float*>(stats.untyped_data())),
                            scale, threshold, keep_scale, causal, has_bias, has_mask, row_extents, row_strides,
                            &a.p);
      e.failure())
    return e;
  if (stats.element_count() != a.p.rows * 2 || stats.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(op) + ": stats must be float32 (..., q, 2)");
  if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count())
    return ffi::Error::InvalidArgument(std::string(op) + ": dy must match scores");
  a.dy = dy.untyped_data();
  a.dx = dx->untyped_data();
  PoisonOutputs(stream, dx);
  a.grad_scale = grad_scale;
  return DispatchFloat(x.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchSoftmaxBwd<T>(a, LaunchOptions(), stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxDropoutFwd, SoftmaxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // scores
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // stats
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_mask")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxDropoutBwd, SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // scores
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // stats
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<float>("scale")
                                  .Attr<float>("grad_scale")
                                  .Attr<int32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_mask")
                                  .Attr<Int64s>("row_extents")   // the rows' numbering (common.cuh, MaskRows)
                                  .Attr<Int64s>("row_strides"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_softmax_dropout_fwd", SoftmaxDropoutFwd);
JAX_LS2_REGISTER("jax_ls2_softmax_dropout_bwd", SoftmaxDropoutBwd);

}  // namespace jax_ls2
