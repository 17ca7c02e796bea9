// Fused optimizer kernels: one pass over every leaf of a parameter pytree.
//
// The leaves (params, grads, outputs) stay where XLA put them; the optimizer state
// (moments, optional FP32 master weights) lives in flat buffers in which leaf i
// starts at offset[i] (a multiple of kPad elements). A launch reaches up to
// kMaxLeaves leaves through a LeafTable passed by value as a kernel parameter
// (about 12 KB: CUDA >= 12.1 allows 32 KB of parameters on sm_70+), so a pytree of
// L leaves costs ceil(L / kMaxLeaves) launches per pass, 1 for BERT-base.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {
namespace optim {

constexpr int kMaxLeaves = 256;   // leaves per launch (LeafTable capacity)
constexpr int kPad = 16;          // flat offsets are multiples of this many elements
constexpr int kThreads = 256;     // threads per block
constexpr int kVec = 4;           // elements per vector access (norm and accumulate passes)
constexpr int kChunk = kThreads * kVec * 4;  // elements per chunk (4096); chunks never span leaves
constexpr int kNormBlocks = 512;  // blocks of the norm pass, per launch
constexpr int kMaxUpdateBlocks = 8192;  // grid cap of the accumulate pass (the update runs one resident wave)

enum DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum LeafFlags : uint8_t { kDecay = 1, kAligned = 2 };

// Hyper-parameter slots of the f32 `hp` device vector (written by jax_ls2/optim/_kernels.py).
enum Hp : int {
  kLr = 0, kB1, kB2, kOneMinusB1, kOneMinusB2, kEps, kEpsRoot, kWd, kInvBc1, kInvBc2,
  kInvScale, kMaxNorm, kGradMult, kHpSize = 16
};

enum Algo : int { kAdam = 0, kSgd = 1 };

// Bits of the `flags` attribute.
enum Mode : int {
  kApply = 1,      // out = new params (aliased to params); else out = updates (aliased to grads)
  kHasMu = 2,      // first moment / momentum buffer present
  kHasNu = 4,      // second moment buffer present (Adam)
  kMaster = 8,     // FP32 master weights buffer present
  kCheck = 16,     // norm pass: global grad norm and inf/NaN check, skip on non-finite
  kClip = 32,      // clip by the global norm (hp[kMaxNorm])
  kSr = 64,        // stochastic rounding when writing FP16/BF16 params (no master)
  kNesterov = 128, // Nesterov momentum (SGD)
  kMomentBf16 = 256, // moments stored as bfloat16 (else float32)
  kFlatGrads = 512,  // grads arrive as one flat float32 buffer (read by the FFI handler only)
  kReport = 1024   // without a norm pass: the update pass flags non-finite gradients in *bad
};

struct LeafTable {
  const void* grad[kMaxLeaves];   // leaf i of grads, size[i] elements of gtype[i]
  const void* param[kMaxLeaves];  // leaf i of params, ptype[i]
  void* out[kMaxLeaves];          // new params (ptype) or updates (gtype)
  int64_t offset[kMaxLeaves];     // start of leaf i in the flat state buffers
  int64_t size[kMaxLeaves];
  int32_t chunk_start[kMaxLeaves + 1];  // prefix sum of ceil(size / kChunk)
  uint8_t gtype[kMaxLeaves];
  uint8_t ptype[kMaxLeaves];
  uint8_t flags[kMaxLeaves];      // LeafFlags
  int32_t n;                      // leaves in this table
};

struct StateArgs {
  void* mu;          // (total,) float32 or bfloat16, or null
  void* nu;          // (total,) float32 or bfloat16, or null
  float* master;     // (total,) float32, or null
  const float* hp;   // (kHpSize,) float32
  const uint32_t* seed;  // (4,) uint32: key words k0, k1, step, unused
  const float* ctl;  // (4,) float32 from the norm pass: norm, clip?, skip?, unused; or null
  int32_t* bad;      // kReport: set to 1 when a gradient read by the update is inf/NaN (zeroed before)
  int algo;
  int flags;         // Mode bits
};

// Norm pass over one table: partial[b] = (sum of (g * inv_scale)^2, count of non-finite g)
// for b < kNormBlocks.
cudaError_t LaunchGradNorm(const LeafTable& t, const float* hp, float* partial, cudaStream_t s);
// Reduces `launches` * kNormBlocks partials: stats = (norm, finite), ctl = (norm, clip?, skip?, 0).
cudaError_t LaunchNormFinalize(const float* partial, int launches, const float* hp, int flags,
                               float* stats, float* ctl, cudaStream_t s);
// The fused update of one table.
cudaError_t LaunchUpdate(const LeafTable& t, const StateArgs& a, cudaStream_t s);
// acc[offset[i] + j] += scale[0] * grad[i][j] for one table.
cudaError_t LaunchAccumulate(const LeafTable& t, float* acc, const float* scale, cudaStream_t s);

}  // namespace optim
}  // namespace jax_ls2
