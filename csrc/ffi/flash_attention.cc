// XLA FFI handlers for flash attention (forward and backward).
#include <climits>
#include <string>

#include "ffi/common.h"
#include "ffi/registry.h"
#include "kernels/flash_attention.h"

namespace jax_ls2 {
namespace {

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// Calls fn(T{}) for float16 / bfloat16, the dtypes the kernels take.
template <typename Fn>
ffi::Error DispatchHalf(ffi::DataType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F16: return fn(__half{});
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    default: return Invalid(op, "unsupported dtype (expected float16 or bfloat16)");
  }
}

// Element strides of a row-major buffer broadcast to `full` (0 along its size-1 dims).
template <size_t N>
ffi::Error BroadcastStrides(const char* op, const char* name, const ffi::AnyBuffer& buf, const int64_t (&full)[N],
                            int64_t (&strides)[N]) {
  auto d = buf.dimensions();
  if (d.size() != N) return Invalid(op, std::string(name) + " has the wrong rank");
  int64_t s = 1;
  for (size_t i = N; i-- > 0;) {
    if (d[i] != 1 && d[i] != full[i]) return Invalid(op, std::string(name) + " is not broadcastable");
    strides[i] = d[i] == 1 ? 0 : s;
    s *= d[i];
  }
  return ffi::Error::Success();
}

ffi::Error BuildProblem(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& bias, const ffi::AnyBuffer& q_seg, const ffi::AnyBuffer& kv_seg,
                        const ffi::AnyBuffer& seed, float scale, bool causal, int32_t threshold, float keep_scale,
                        bool has_bias, bool has_seg, int64_t q_total, int64_t kv_total, FlashAttentionProblem* p) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return Invalid(op, "q, k and v must have rank 4");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return Invalid(op, "k and v must have q's dtype");
  if (v.dimensions().size() != 4 || v.element_count() != k.element_count()) return Invalid(op, "v must match k");
  *p = FlashAttentionProblem{};
  p->batch = (int)qd[0];
  p->q_len = (int)qd[1];
  p->heads = (int)qd[2];
  p->head_dim = (int)qd[3];
  p->kv_len = (int)kd[1];
  p->kv_heads = (int)kd[2];
  if (kd[0] != qd[0] || kd[3] != qd[3]) return Invalid(op, "k must have q's batch and head_dim");
  if (p->kv_heads < 1 || p->heads % p->kv_heads != 0) return Invalid(op, "kv_heads must divide heads");
  if (!FlashAttentionSupportsHeadDim(p->head_dim))
    return Invalid(op, "head_dim " + std::to_string(p->head_dim) + " is not supported (64 or 128)");
  if (p->batch > 65535 || p->heads > 65535) return Invalid(op, "batch and heads must be at most 65535");
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->scale = scale;
  p->causal = causal;
  if (threshold < 0 || threshold > 65535) return Invalid(op, "dropout threshold must be in [0, 65535]");
  p->threshold = (uint32_t)threshold;
  p->keep_scale = keep_scale;
  if (seed.element_type() != ffi::DataType::U32 || seed.element_count() != 5)
    return Invalid(op, "seed must be uint32[5] (k0, k1, shard offset, q_offset, kv_offset)");
  p->seed = static_cast<const uint32_t*>(seed.untyped_data());
  if (q_total < p->q_len || kv_total < p->kv_len || q_total > INT32_MAX || kv_total > INT32_MAX)
    return Invalid(op, "q_total and kv_total must be at least q_len and kv_len and below 2^31");
  p->drop_q_total = q_total;
  p->drop_kv_total = kv_total;
  if (has_bias) {
    if (bias.element_type() != ffi::DataType::F32) return Invalid(op, "bias must be float32");
    const int64_t full[4] = {p->batch, p->heads, p->q_len, p->kv_len};
    if (auto e = BroadcastStrides(op, "bias", bias, full, p->bias_stride); e.failure()) return e;
    p->bias = static_cast<const float*>(bias.untyped_data());
  }
  if (has_seg) {
    if (q_seg.element_type() != ffi::DataType::S32 || kv_seg.element_type() != ffi::DataType::S32)
      return Invalid(op, "segment ids must be int32");
    const int64_t fq[2] = {p->batch, p->q_len}, fk[2] = {p->batch, p->kv_len};
    if (auto e = BroadcastStrides(op, "q segment ids", q_seg, fq, p->q_seg_stride); e.failure()) return e;
    if (auto e = BroadcastStrides(op, "kv segment ids", kv_seg, fk, p->kv_seg_stride); e.failure()) return e;
    p->q_seg = static_cast<const int32_t*>(q_seg.untyped_data());
    p->kv_seg = static_cast<const int32_t*>(kv_seg.untyped_data());
  }
  return ffi::Error::Success();
}

ffi::Error CheckRows(const char* op, const char* name, const ffi::AnyBuffer& buf, const FlashAttentionProblem& p) {
  if (buf.element_type() != ffi::DataType::F32 || buf.element_count() != (int64_t)p.batch * p.heads * p.q_len)
    return Invalid(op, std::string(name) + " must be float32 (batch, heads, q_len)");
  return ffi::Error::Success();
}

// Args: q (batch, q_len, heads, head_dim) T; k, v (batch, kv_len, kv_heads, head_dim) T;
//       bias (batch|1, heads|1, q_len|1, kv_len|1) f32 (ignored unless has_bias);
//       q_seg (batch|1, q_len|1) s32, kv_seg (batch|1, kv_len|1) s32 (ignored unless
//       has_seg); seed u32[5] (k0, k1, shard offset, q_offset, kv_offset)
// Rets: out (batch, q_len, heads, head_dim) T; lse (batch, heads, q_len) f32
ffi::Error FlashFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer seed,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, float scale, bool causal,
                        int32_t threshold, float keep_scale, bool has_bias, bool has_seg, int64_t q_total,
                        int64_t kv_total) {
  const char* op = "flash_attention";
  FlashAttentionFwdArgs a{};
  if (auto e = BuildProblem(op, q, k, v, bias, q_seg, kv_seg, seed, scale, causal, threshold, keep_scale, has_bias,
                            has_seg, q_total, kv_total, &a.p);
      e.failure())
    return e;
  if (out->element_type() != q.element_type() || out->element_count() != q.element_count())
    return Invalid(op, "out must match q");
  if (auto e = CheckRows(op, "lse", *lse, a.p); e.failure()) return e;
  a.out = out->untyped_data();
  a.lse = static_cast<float*>(lse->untyped_data());
  PoisonOutputs(stream, out, lse);
  return DispatchHalf(q.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchFlashAttentionFwd<T>(a, stream));
  });
}

// Args: dout (batch, q_len, heads, head_dim) T; dlse (batch, heads, q_len) f32; q; k; v;
//       out (like q) T; lse (batch, heads, q_len) f32; bias; q_seg; kv_seg; seed (as the forward)
// Rets: dq, dk, dv (like q, k, v) T; dbias (bias' shape) f32 (zeros unless has_bias);
//       delta (batch, heads, q_len) f32 workspace = rowsum(dout * out) - dlse
ffi::Error FlashBwdImpl(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer bias, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer seed,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> delta, float scale, bool causal, int32_t threshold,
                        float keep_scale, bool has_bias, bool has_seg, int64_t q_total, int64_t kv_total) {
  const char* op = "flash_attention backward";
  FlashAttentionBwdArgs a{};
  if (auto e = BuildProblem(op, q, k, v, bias, q_seg, kv_seg, seed, scale, causal, threshold, keep_scale, has_bias,
                            has_seg, q_total, kv_total, &a.p);
      e.failure())
    return e;
  for (const ffi::AnyBuffer* b : {&dout, &out})
    if (b->element_type() != q.element_type() || b->element_count() != q.element_count())
      return Invalid(op, "dout and out must match q");
  if (auto e = CheckRows(op, "dlse", dlse, a.p); e.failure()) return e;
  if (auto e = CheckRows(op, "lse", lse, a.p); e.failure()) return e;
  if (auto e = CheckRows(op, "delta", *delta, a.p); e.failure()) return e;
  if (dbias->element_type() != ffi::DataType::F32 || dbias->element_count() != bias.element_count())
    return Invalid(op, "dbias must be float32 of the bias' shape");
  a.dout = dout.untyped_data();
  a.dlse = static_cast<const float*>(dlse.untyped_data());
  a.out = out.untyped_data();
  a.lse = static_cast<const float*>(lse.untyped_data());
  a.dq = dq->untyped_data();
  a.dk = dk->untyped_data();
  a.dv = dv->untyped_data();
  a.delta = static_cast<float*>(delta->untyped_data());
  PoisonOutputs(stream, dq, dk, dv, dbias);
  if (has_bias) {
    a.dbias = static_cast<float*>(dbias->untyped_data());
    a.dbias_count = dbias->element_count();
  } else if (dbias->size_bytes() > 0) {
    cudaMemsetAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream);
  }
  return DispatchHalf(q.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaStatus(op, LaunchFlashAttentionBwd<T>(a, stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashAttentionFwd, FlashFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // q_seg
                                  .Arg<ffi::AnyBuffer>()  // kv_seg
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_seg")
                                  .Attr<int64_t>("q_total")
                                  .Attr<int64_t>("kv_total"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashAttentionBwd, FlashBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // q_seg
                                  .Arg<ffi::AnyBuffer>()  // kv_seg
                                  .Arg<ffi::AnyBuffer>()  // seed
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::AnyBuffer>()  // delta (workspace)
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_seg")
                                  .Attr<int64_t>("q_total")
                                  .Attr<int64_t>("kv_total"),
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_flash_attention_fwd", FlashAttentionFwd);
JAX_LS2_REGISTER("jax_ls2_flash_attention_bwd", FlashAttentionBwd);

}  // namespace jax_ls2
