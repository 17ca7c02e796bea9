// XLA FFI handlers of the fused optimizer (kernels in kernels/optimizer.cu).
//
// jax_ls2_optim_update: one call updates every leaf of a pytree.
//   args: grads   L leaves (any shape; f32/f16/bf16), or 1 flat f32 (total,) buffer with kFlatGrads
//         params  L leaves (f32/f16/bf16)
//         mu      (total,) f32|bf16          [kHasMu]
//         nu      (total,) f32|bf16          [kHasNu]
//         master  (total,) f32               [kMaster]
//         hp      (kHpSize,) f32 hyper-parameters (optimizer.h Hp)
//         seed    (4,) u32 stochastic-rounding key words and step
//   rets: out     L leaves: new params (kApply, aliased to params) or updates (aliased to grads)
//         mu, nu, master as above, aliased to their inputs
//         stats   (2,) f32: global grad norm, finite flag   [kCheck or kClip]
//         ws      (launches * kNormBlocks * 2 + 4,) f32 workspace [kCheck or kClip]
//         bad     (1,) i32: 1 if a gradient is inf/NaN, else 0     [kReport, without kCheck/kClip]
//   attrs: algo (Algo), flags (Mode bits), offsets (L,) i64 flat offsets, decay (L,) i32 weight-decay mask.
//
// jax_ls2_optim_accumulate: acc += scale * grads, one flat f32 buffer.
//   args: acc (total,) f32, scale (1,) f32, grads L leaves.  rets: acc (aliased).  attrs: offsets (L,) i64.
#include <algorithm>
#include <cstring>
#include <string>

#include "ffi/common.h"
#include "ffi/registry.h"
#include "kernels/optimizer.h"

namespace jax_ls2 {
namespace {

using optim::LeafTable;
using optim::kFlatGrads;

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

bool TypeCode(ffi::DataType t, uint8_t* code) {
  switch (t) {
    case ffi::DataType::F32: *code = optim::kF32; return true;
    case ffi::DataType::F16: *code = optim::kF16; return true;
    case ffi::DataType::BF16: *code = optim::kBF16; return true;
    default: return false;
  }
}

size_t Width(uint8_t code) { return code == optim::kF32 ? 4 : 2; }

bool Aligned(const void* p, uint8_t code) {
  return reinterpret_cast<uintptr_t>(p) % (Width(code) * optim::kVec) == 0;
}

void FinishTable(LeafTable& t) {
  int32_t chunks = 0;
  for (int i = 0; i < t.n; ++i) {
    t.chunk_start[i] = chunks;
    chunks += static_cast<int32_t>((t.size[i] + optim::kChunk - 1) / optim::kChunk);
  }
  t.chunk_start[t.n] = chunks;
}

// ---------------------------------------------------------------- update
ffi::Error UpdateImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t algo,
                      int32_t flags, ffi::Span<const int64_t> offsets, ffi::Span<const int32_t> decay) {
  const char* op = "jax_ls2_optim_update";
  const int64_t L = static_cast<int64_t>(offsets.size());
  const bool flat = flags & kFlatGrads;
  const bool norm_pass = flags & (optim::kCheck | optim::kClip);
  const bool report = !norm_pass && (flags & optim::kReport);
  const int n_state = !!(flags & optim::kHasMu) + !!(flags & optim::kHasNu) + !!(flags & optim::kMaster);
  const int64_t n_grad = flat ? 1 : L;
  if (static_cast<int64_t>(decay.size()) != L) return Invalid(op, "decay and offsets differ in length");
  if (static_cast<int64_t>(args.size()) != n_grad + L + n_state + 2)
    return Invalid(op, "expected " + std::to_string(n_grad + L + n_state + 2) + " operands, got " +
                           std::to_string(args.size()));
  if (static_cast<int64_t>(rets.size()) != L + n_state + (norm_pass ? 2 : 0) + (report ? 1 : 0))
    return Invalid(op, "unexpected number of results");
  if (algo != optim::kAdam && algo != optim::kSgd) return Invalid(op, "unknown algo");

  // State buffers (args and their aliased results).
  int64_t a = n_grad + L, r = L;
  optim::StateArgs st{};
  st.algo = algo;
  st.flags = flags;
  int64_t total = -1;
  auto take_state = [&](void** dst, int64_t width) -> ffi::Error {
    auto in = args.get<ffi::AnyBuffer>(a++);
    auto out = rets.get<ffi::AnyBuffer>(r++);
    if (!in.has_value() || !out.has_value()) return Invalid(op, "bad state buffer");
    const int64_t n = in->element_count();
    if (total >= 0 && n != total) return Invalid(op, "state buffers differ in size");
    total = n;
    *dst = (*out)->untyped_data();
    if ((*out)->untyped_data() != in->untyped_data())
      cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), n * width, cudaMemcpyDeviceToDevice, stream);
    if (reinterpret_cast<uintptr_t>(*dst) % 16 != 0) return Invalid(op, "state buffer not 16-byte aligned");
    return ffi::Error::Success();
  };
  const int64_t mw = (flags & optim::kMomentBf16) ? 2 : 4;
  if (flags & optim::kHasMu) { if (auto e = take_state(&st.mu, mw); e.failure()) return e; }
  if (flags & optim::kHasNu) { if (auto e = take_state(&st.nu, mw); e.failure()) return e; }
  if (flags & optim::kMaster) {
    void* m = nullptr;
    if (auto e = take_state(&m, 4); e.failure()) return e;
    st.master = static_cast<float*>(m);
  }
  auto hp = args.get<ffi::AnyBuffer>(a++);
  auto seed = args.get<ffi::AnyBuffer>(a++);
  if (!hp.has_value() || hp->element_count() < optim::kHpSize || hp->element_type() != ffi::DataType::F32)
    return Invalid(op, "hp must be float32 of at least 16 elements");
  if (!seed.has_value() || seed->element_count() < 4 || seed->element_type() != ffi::DataType::U32)
    return Invalid(op, "seed must be uint32[4]");
  st.hp = static_cast<const float*>(hp->untyped_data());
  st.seed = static_cast<const uint32_t*>(seed->untyped_data());

  const int launches = static_cast<int>((L + optim::kMaxLeaves - 1) / optim::kMaxLeaves);
  float* stats = nullptr;
  float* ws = nullptr;
  float* ctl = nullptr;
  if (norm_pass) {
    auto s = rets.get<ffi::AnyBuffer>(r++);
    auto w = rets.get<ffi::AnyBuffer>(r++);
    if (!s.has_value() || !w.has_value()) return Invalid(op, "bad stats/workspace results");
    if ((*w)->element_count() < static_cast<int64_t>(launches) * optim::kNormBlocks * 2 + 4)
      return Invalid(op, "workspace too small");
    stats = static_cast<float*>((*s)->untyped_data());
    ws = static_cast<float*>((*w)->untyped_data());
    ctl = ws + static_cast<int64_t>(launches) * optim::kNormBlocks * 2;
    st.ctl = ctl;
  }
  if (report) {
    auto b = rets.get<ffi::AnyBuffer>(r++);
    if (!b.has_value() || (*b)->element_type() != ffi::DataType::S32 || (*b)->element_count() < 1)
      return Invalid(op, "the non-finite flag result must be int32[1]");
    st.bad = static_cast<int32_t*>((*b)->untyped_data());
    cudaMemsetAsync(st.bad, 0, sizeof(int32_t), stream);
  }

  const float* flat_grad = nullptr;
  if (flat) {
    auto g = args.get<ffi::AnyBuffer>(0);
    if (!g.has_value() || g->element_type() != ffi::DataType::F32)
      return Invalid(op, "flat grads must be float32");
    if (g->element_count() < total) return Invalid(op, "flat grads smaller than the state");
    flat_grad = static_cast<const float*>(g->untyped_data());
    if (reinterpret_cast<uintptr_t>(flat_grad) % 16 != 0) return Invalid(op, "flat grads not 16-byte aligned");
  }

  // Leaf tables, kMaxLeaves leaves each.
  static_assert(sizeof(LeafTable) <= 32764, "LeafTable exceeds the kernel parameter limit");
  LeafTable tables_storage;  // filled and launched one table at a time
  auto build = [&](int64_t first, LeafTable& t) -> ffi::Error {
    std::memset(&t, 0, sizeof(t));
    t.n = static_cast<int32_t>(std::min<int64_t>(optim::kMaxLeaves, L - first));
    for (int i = 0; i < t.n; ++i) {
      const int64_t leaf = first + i;
      auto p = args.get<ffi::AnyBuffer>(n_grad + leaf);
      auto o = rets.get<ffi::AnyBuffer>(leaf);
      if (!p.has_value() || !o.has_value()) return Invalid(op, "bad leaf buffer");
      const int64_t size = p->element_count();
      if (offsets[leaf] % optim::kPad != 0 || (total >= 0 && offsets[leaf] + size > total))
        return Invalid(op, "leaf " + std::to_string(leaf) + " does not fit the flat state");
      if (!TypeCode(p->element_type(), &t.ptype[i])) return Invalid(op, "params must be f32, f16 or bf16");
      t.param[i] = p->untyped_data();
      t.out[i] = (*o)->untyped_data();
      t.offset[i] = offsets[leaf];
      t.size[i] = size;
      if (flat) {
        t.gtype[i] = optim::kF32;
        t.grad[i] = flat_grad + offsets[leaf];
      } else {
        auto g = args.get<ffi::AnyBuffer>(leaf);
        if (!g.has_value() || g->element_count() != size) return Invalid(op, "grads and params differ in size");
        if (!TypeCode(g->element_type(), &t.gtype[i])) return Invalid(op, "grads must be f32, f16 or bf16");
        t.grad[i] = g->untyped_data();
      }
      const uint8_t otype = (flags & optim::kApply) ? t.ptype[i] : t.gtype[i];
      const bool aligned = Aligned(t.grad[i], t.gtype[i]) && Aligned(t.param[i], t.ptype[i]) &&
                           Aligned(t.out[i], otype);
      t.flags[i] = (decay[leaf] ? optim::kDecay : 0) | (aligned ? optim::kAligned : 0);
    }
    FinishTable(t);
    return ffi::Error::Success();
  };

  if (norm_pass) {
    for (int l = 0; l < launches; ++l) {
      if (auto e = build(static_cast<int64_t>(l) * optim::kMaxLeaves, tables_storage); e.failure()) return e;
      optim::LaunchGradNorm(tables_storage, st.hp, ws + static_cast<int64_t>(l) * optim::kNormBlocks * 2, stream);
    }
    optim::LaunchNormFinalize(ws, launches, st.hp, flags, stats, ctl, stream);
  }
  for (int l = 0; l < launches; ++l) {
    if (auto e = build(static_cast<int64_t>(l) * optim::kMaxLeaves, tables_storage); e.failure()) return e;
    optim::LaunchUpdate(tables_storage, st, stream);
  }
  return LastCudaError(op);
}

// ---------------------------------------------------------------- accumulate
ffi::Error AccumulateImpl(cudaStream_t stream, ffi::AnyBuffer acc, ffi::AnyBuffer scale, ffi::RemainingArgs grads,
                          ffi::Result<ffi::AnyBuffer> acc_out, ffi::Span<const int64_t> offsets) {
  const char* op = "jax_ls2_optim_accumulate";
  const int64_t L = static_cast<int64_t>(offsets.size());
  if (static_cast<int64_t>(grads.size()) != L) return Invalid(op, "grads and offsets differ in length");
  if (acc.element_type() != ffi::DataType::F32 || scale.element_type() != ffi::DataType::F32)
    return Invalid(op, "acc and scale must be float32");
  const int64_t total = acc.element_count();
  float* dst = static_cast<float*>(acc_out->untyped_data());
  if (dst != acc.untyped_data())
    cudaMemcpyAsync(dst, acc.untyped_data(), total * 4, cudaMemcpyDeviceToDevice, stream);
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) return Invalid(op, "acc not 16-byte aligned");
  LeafTable t;
  for (int64_t first = 0; first < L; first += optim::kMaxLeaves) {
    std::memset(&t, 0, sizeof(t));
    t.n = static_cast<int32_t>(std::min<int64_t>(optim::kMaxLeaves, L - first));
    for (int i = 0; i < t.n; ++i) {
      auto g = grads.get<ffi::AnyBuffer>(first + i);
      if (!g.has_value()) return Invalid(op, "bad grad leaf");
      if (!TypeCode(g->element_type(), &t.gtype[i])) return Invalid(op, "grads must be f32, f16 or bf16");
      const int64_t off = offsets[first + i];
      if (off % optim::kPad != 0 || off + g->element_count() > total)
        return Invalid(op, "leaf " + std::to_string(first + i) + " does not fit the flat buffer");
      t.grad[i] = g->untyped_data();
      t.offset[i] = off;
      t.size[i] = g->element_count();
      t.flags[i] = Aligned(t.grad[i], t.gtype[i]) ? optim::kAligned : 0;
    }
    FinishTable(t);
    optim::LaunchAccumulate(t, dst, static_cast<const float*>(scale.untyped_data()), stream);
  }
  return LastCudaError(op);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptimUpdate, UpdateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()   // grads..., params..., [mu], [nu], [master], hp (16,), seed (4,)
                                  .RemainingRets()   // out..., [mu], [nu], [master], [stats (2,), ws] | [bad (1,)]
                                  .Attr<int32_t>("algo")
                                  .Attr<int32_t>("flags")
                                  .Attr<ffi::Span<const int64_t>>("offsets")  // (L,)
                                  .Attr<ffi::Span<const int32_t>>("decay"),   // (L,)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptimAccumulate, AccumulateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()    // acc (total,) f32
                                  .Arg<ffi::AnyBuffer>()    // scale (1,) f32
                                  .RemainingArgs()          // grads: L leaves, f32/f16/bf16
                                  .Ret<ffi::AnyBuffer>()    // acc (total,) f32, aliased
                                  .Attr<ffi::Span<const int64_t>>("offsets"),  // (L,)
                              {ffi::Traits::kCmdBufferCompatible});

JAX_LS2_REGISTER("jax_ls2_optim_update", OptimUpdate);
JAX_LS2_REGISTER("jax_ls2_optim_accumulate", OptimAccumulate);

}  // namespace jax_ls2
