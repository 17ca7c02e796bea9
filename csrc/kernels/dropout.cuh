// Bias + dropout + residual and bias + activation + dropout, forward and backward.
//
// Layout: a block is (tx, ty) threads; thread x owns one column vector (VEC
// elements, a 16-byte access when hidden and the pointers allow) of column chunk
// blockIdx.y and keeps the bias of those columns in registers; the ty row lanes
// and the grid stride over rows, U rows per thread in flight. The backward keeps
// each thread's dbias column sums in registers, folds the ty lanes in shared
// memory in a fixed order and writes one partial row per block (blockIdx.x); a
// second kernel sums the partial rows (fixed order, so dbias is deterministic).
//
// Dropout: element (row, col) has the global number g = MaskRowStart(row) + col (64-bit,
// kernels/common.cuh: the row map numbers a shard's rows in the whole array, and
// sequence-first rows as their batch-first transpose) and is kept iff its 16-bit draw
// >= threshold (jax_ls2/_random.py); one hash gives the draws of an aligned pair.
// threshold == 0 selects a variant that neither hashes nor scales. The backward
// regenerates the mask from the seed.
//
// The launchers are instantiated one dtype per translation unit (dropout_f32.cu,
// dropout_f16.cu, dropout_bf16.cu), which compile in parallel: in one unit this was the
// slowest source of the build.
#pragma once
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/activation.cuh"
#include "kernels/column_fold.cuh"
#include "kernels/dropout.h"

namespace jax_ls2 {
namespace {

constexpr int kMaxThreads = 512;
// Rows each thread loads before computing (chosen by the dropout_rows_in_flight sweep,
// bench/PERF_NOTES.md): 4 for the kernels streaming two inputs; 2 for the activation
// forward, whose arithmetic (the hash, erf) needs the occupancy more than the bytes in
// flight; 8 for the bias+dropout+residual backward at hidden sizes above 2048 (its
// prefetching kernel then takes 4 rows a step at one block per SM rather than 2 at two),
// 2 at smaller ones (RowsFor).
enum Kind : int { kBdrFwd = 0, kBdrBwd = 1, kActFwd = 2, kActBwd = 3 };
constexpr int RowsInFlight(int kind) { return kind == kBdrBwd ? 8 : kind == kActFwd ? 2 : 4; }

// bfloat16 with 16-byte accesses (the path models take) runs the prefetching kernel
// (PF below; the option dropout_prefetch=2 turns it off), the faster of the two on every
// op and shape benchmarked (bench/PERF_NOTES.md, "Prefetch").
// Its rows per step: half the plain kernel's, so its two sets of packs in registers take
// about what the plain one's one set does; the activation forward (2 rows, 64 registers
// either way) keeps its 2.
constexpr int PrefetchRows(int kind, int u) { return kind == kActFwd ? u : (u / 2 > 1 ? u / 2 : 1); }
// Blocks of 512 threads per SM the prefetching kernel is compiled for: 2 (<= 64
// registers) where its packs fit without spilling (ptxas, sm_90: the
// bias+dropout+residual backward up to 2 rows a step, the activation forward, the
// activation backward (20 bytes spilled) and the bias+dropout+residual forward at 1
// row), else 1 (their 2-row steps take 94-99 registers).
constexpr int PrefetchMinBlocks(int kind, int rows) {
  return (kind == kBdrBwd && rows <= 2) || kind == kActFwd || rows == 1 ? 2 : 1;
}

struct KernelArgs {
  const void* in0;    // x (forward) or dy (backward)
  const void* in1;    // residual (bdr forward), x (act backward), else nullptr
  const void* bias;   // (hidden,) or nullptr
  const uint32_t* seed;
  void* out;          // y or dx
  float* partials;    // backward: (gridDim.x, hidden)
  int64_t rows, hidden;
  uint32_t threshold;
  float scale;
  MaskRows numbering;  // the rows' global numbering (see the top)
};

// PF (prefetch): a thread loads its next U rows before computing the current ones, so
// loads stay in flight through the arithmetic and stores (twice the packs in registers).
template <typename T, int VEC, int KIND, int ACT, bool DROP, int U, bool PF = false>
__global__ void __launch_bounds__(kMaxThreads, PF ? PrefetchMinBlocks(KIND, U) : 1) DropoutKernel(KernelArgs a) {
  constexpr bool kBwd = KIND == kBdrBwd || KIND == kActBwd;
  constexpr bool kIn1 = KIND == kBdrFwd || KIND == kActBwd;
  constexpr bool kBias = KIND != kBdrBwd;
  using PackT = Pack<T, VEC>;
  const int64_t H = a.hidden;
  const int64_t col = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  const bool col_ok = col < H;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;

  if (col_ok) {
    float b[VEC];
    if constexpr (kBias) {
      LoadFloats<T, VEC>(static_cast<const T*>(a.bias) + col, b);
    }
    WideSeed s{0u, 0u, 0u};
    if constexpr (DROP) s = LoadWideSeed(a.seed);
    // The activation kernels' dropout scale, applied inside the activation.
    const float c = DROP ? a.scale : 1.f;
    const float log2_c = DROP ? __log2f(a.scale) : 0.f;
    const T* in0 = static_cast<const T*>(a.in0);
    const T* in1 = static_cast<const T*>(a.in1);
    T* out = static_cast<T*>(a.out);
    const int64_t stride = (int64_t)gridDim.x * blockDim.y;
    const int64_t first = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    // Raw packs in flight (half the registers of floats for 16-bit types).
    // Element offsets advance with the rows (off0 = r0 * H + col, u_off = stride * H)
    // rather than being multiplied out per row.
    const int64_t u_off = stride * H;
    auto load = [&](int64_t r0, int64_t off0, PackT (&p0)[U], PackT (&p1)[U]) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t row = r0 + u * stride;
        if (row < a.rows) {
          const int64_t off = off0 + u * u_off;
          p0[u] = *reinterpret_cast<const PackT*>(in0 + off);
          if constexpr (kIn1) p1[u] = *reinterpret_cast<const PackT*>(in1 + off);
        }
      }
    };
    // Every row's first dropout number has the parity of base + col when the row map's
    // strides are even (rows of even length), so the one-hash-per-pair path is chosen once
    // per thread (pairs = true) instead of per row.
    auto run = [&](auto pairs) {
      auto compute = [&](int64_t r0, int64_t off0, const PackT (&p0)[U], const PackT (&p1)[U]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t row = r0 + u * stride;
          if (row < a.rows) {
            const int64_t off = off0 + u * u_off;
            bool keep[VEC];
            if constexpr (DROP) {
              const uint64_t g0 = MaskRowStart(a.numbering, s.base, row) + (uint64_t)col;
              KeepWide<VEC, decltype(pairs)::value>(g0, s, a.threshold, keep);
            }
            float f0[VEC], f1[VEC];
            UnpackFloats(p0[u], f0);
            if constexpr (kIn1) UnpackFloats(p1[u], f1);
            float o[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              const bool kept = DROP ? keep[j] : true;
              const float x0 = f0[j];
              const float x1 = kIn1 ? f1[j] : 0.f;
              float t;
              if constexpr (KIND == kBdrFwd) {
                t = __fadd_rn(x0, b[j]);
                if (DROP) t = kept ? __fmul_rn(t, a.scale) : 0.f;
                t = __fadd_rn(x1, t);
              } else if constexpr (KIND == kBdrBwd) {
                t = x0;
                if (DROP) t = kept ? __fmul_rn(t, a.scale) : 0.f;
                acc[j] += t;
              } else if constexpr (KIND == kActFwd) {
                t = ActScaled<ACT, T>(__fadd_rn(x0, b[j]), c, log2_c);
                if (DROP) t = kept ? t : 0.f;
              } else {
                t = __fmul_rn(x0, ActGradScaled<ACT, T>(__fadd_rn(x1, b[j]), c, log2_c));
                if (DROP) t = kept ? t : 0.f;
                acc[j] += t;
              }
              o[j] = t;
            }
            StoreFloats<T, VEC>(out + off, o);
          }
        }
      };
      const int64_t row_step = stride * U, off_step = u_off * U;
      int64_t off = first * H + col;
      if constexpr (PF) {
        PackT p0[U], p1[U];
        load(first, off, p0, p1);
        for (int64_t r0 = first; r0 < a.rows; r0 += row_step, off += off_step) {
          PackT q0[U], q1[U];
          load(r0 + row_step, off + off_step, q0, q1);
          compute(r0, off, p0, p1);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            CopyPack(p0[u], q0[u]);
            if constexpr (kIn1) CopyPack(p1[u], q1[u]);
          }
        }
      } else {
        for (int64_t r0 = first; r0 < a.rows; r0 += row_step, off += off_step) {
          PackT p0[U], p1[U];
          load(r0, off, p0, p1);
          compute(r0, off, p0, p1);
        }
      }
    };
    if constexpr (DROP && VEC % 2 == 0) {
      if (((s.base + (uint64_t)col) & 1u) == 0u && a.numbering.even) {
        run(std::true_type{});
      } else {
        run(std::false_type{});
      }
    } else {
      run(std::false_type{});
    }
  }

  if constexpr (kBwd) {
    __shared__ float fold[kMaxThreads * VEC];
    const int slot = (threadIdx.y * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) fold[slot + j] = acc[j];
    __syncthreads();
    // Each of the block's columns summed over the ty lanes in order by its own thread
    // (consecutive threads, consecutive columns: no bank conflicts, coalesced stores).
    const int width = blockDim.x * VEC, nthreads = blockDim.x * blockDim.y;
    const int64_t col0 = (int64_t)blockIdx.y * width;
    float* part = a.partials + (int64_t)blockIdx.x * H + col0;
    for (int lc = threadIdx.y * blockDim.x + threadIdx.x; lc < width && col0 + lc < H; lc += nthreads) {
      float s = fold[lc];
      for (int yy = 1; yy < (int)blockDim.y; ++yy) s += fold[yy * width + lc];
      part[lc] = s;
    }
  }
}

bool Aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct Shape {
  dim3 block, grid;
  int vec;
};

// Rows each thread loads before computing: the kind's default, or the benchmark
// override (bfloat16 with 16-byte accesses only, the variants compiled for it).
template <typename T>
int RowsFor(int kind, int vec, int64_t hidden, const DropoutLaunchOptions& o) {
  if (!std::is_same_v<T, __nv_bfloat16> || vec != kPack<T>) return RowsInFlight(kind);
  const int u = o.rows_in_flight;
  if (u == 2 || u == 4 || u == 8) return u;
  return kind == kBdrBwd && hidden <= 2048 ? 2 : RowsInFlight(kind);
}

// Forward grids are one resident wave (each block strides over rows) unless the
// benchmark override asks for one block per U * ty rows; backward grids always are one
// wave (one partial dbias row per block).
bool FullGrid(int kind, const DropoutLaunchOptions& o) {
  return (kind == kBdrFwd || kind == kActFwd) && o.full_grid == 1;
}

// Column vectors per block in the backward: narrow column chunks (grid.y) leave fewer
// row-blocks in the resident wave, and each row-block writes one partial dbias row that
// the fold reads back (at 8192 x 4096, 512-wide chunks made 132 partial rows, 4.3 MB of
// extra traffic; 128-wide ones make 33). 32 up to 128 vectors (hidden 1024 in 16-bit),
// else 128, so that the chunk count divides the resident blocks of 132 SMs at the
// model widths.
int BwdColumnThreads(int64_t nvec) { return nvec <= 128 ? 32 : 128; }

// Block (tx, ty) with tx covering the column vectors (chunks of <= 512 in grid.y, of
// BwdColumnThreads in the backward); grid.x row-blocks, at most max_blocks.
Shape PickShape(int kind, int64_t rows, int64_t hidden, int vec, int u, int64_t max_blocks,
                const DropoutLaunchOptions& o) {
  const int64_t nvec = hidden / vec;
  const bool bwd = kind == kBdrBwd || kind == kActBwd;
  const int tx = (int)std::min<int64_t>((nvec + 31) / 32 * 32, bwd ? BwdColumnThreads(nvec) : kMaxThreads);
  const int ty = std::max(1, kMaxThreads / tx);
  const int64_t gy = (nvec + tx - 1) / tx;
  const int64_t per_block = (int64_t)ty * u;
  const int64_t need = (rows + per_block - 1) / per_block;
  const int64_t resident =
      FullGrid(kind, o) ? need : std::max<int64_t>(1, (int64_t)SmCount() * (2048 / (tx * ty)) / gy);
  const int64_t gx = std::max<int64_t>(1, std::min({need, resident, max_blocks}));
  return Shape{dim3(tx, ty), dim3((unsigned)gx, (unsigned)gy), vec};
}

template <typename T>
int PickVec(int64_t hidden, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = kPack<T>;
  if (hidden % kVec != 0) return 1;
  for (const void* p : ptrs)
    if (!Aligned16(p)) return 1;
  return kVec;
}

// Caps grid.x at what stays resident (one wave) and launches; sh.grid.x is then
// the number of partial rows the backward writes.
template <typename Kernel>
void LaunchResident(Kernel kernel, int* per_sm_cache, int kind, Shape& sh, const KernelArgs& k,
                    const DropoutLaunchOptions& o, cudaStream_t stream) {
  const int threads = (int)(sh.block.x * sh.block.y);
  int& per_sm = per_sm_cache[threads / 32];  // occupancy depends only on the block size here
  if (per_sm == 0 &&
      (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess || per_sm < 1))
    per_sm = 1;
  if (!FullGrid(kind, o)) {
    const int64_t cap = std::max<int64_t>(1, (int64_t)per_sm * SmCount() / sh.grid.y);
    sh.grid.x = (unsigned)std::min<int64_t>(sh.grid.x, cap);
  }
  kernel<<<sh.grid, sh.block, 0, stream>>>(k);
}

template <typename T, int KIND, int ACT, bool DROP, int U>
void LaunchRows(Shape& sh, const KernelArgs& k, const DropoutLaunchOptions& o, cudaStream_t stream) {
  constexpr int kVec = kPack<T>;
  static int per_sm_vec[kMaxThreads / 32 + 1] = {}, per_sm_scalar[kMaxThreads / 32 + 1] = {};
  if (sh.vec == kVec) {
    if constexpr (std::is_same_v<T, __nv_bfloat16> && (U == RowsInFlight(KIND) || U == 2)) {
      static int per_sm_pf[kMaxThreads / 32 + 1] = {};
      if (o.prefetch != 2)
        return LaunchResident(DropoutKernel<T, kVec, KIND, ACT, DROP, PrefetchRows(KIND, U), true>, per_sm_pf,
                              KIND, sh, k, o, stream);
    }
    LaunchResident(DropoutKernel<T, kVec, KIND, ACT, DROP, U>, per_sm_vec, KIND, sh, k, o, stream);
  } else if constexpr (U == RowsInFlight(KIND)) {  // overrides take the 16-byte path only
    LaunchResident(DropoutKernel<T, 1, KIND, ACT, DROP, U>, per_sm_scalar, KIND, sh, k, o, stream);
  }
}

template <typename T, int KIND, int ACT, bool DROP>
void LaunchOne(Shape& sh, const KernelArgs& k, const DropoutLaunchOptions& o, cudaStream_t stream) {
  constexpr int kDefault = RowsInFlight(KIND);
  const int u = RowsFor<T>(KIND, sh.vec, k.hidden, o);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (u != kDefault) {
      if (u == 2) return LaunchRows<T, KIND, ACT, DROP, 2>(sh, k, o, stream);
      if (u == 4) return LaunchRows<T, KIND, ACT, DROP, 4>(sh, k, o, stream);
      if (u == 8) return LaunchRows<T, KIND, ACT, DROP, 8>(sh, k, o, stream);
    }
  }
  LaunchRows<T, KIND, ACT, DROP, kDefault>(sh, k, o, stream);
}

template <typename T, int KIND, int ACT>
void LaunchDrop(Shape& sh, const KernelArgs& k, const DropoutLaunchOptions& o, cudaStream_t stream) {
  if (k.threshold == 0)
    LaunchOne<T, KIND, ACT, false>(sh, k, o, stream);
  else
    LaunchOne<T, KIND, ACT, true>(sh, k, o, stream);
}

template <typename T, int KIND>
cudaError_t LaunchAct(int act, Shape& sh, const KernelArgs& k, const DropoutLaunchOptions& o, cudaStream_t stream) {
  switch (act) {
    case kActRelu: LaunchDrop<T, KIND, kActRelu>(sh, k, o, stream); break;
    case kActGelu: LaunchDrop<T, KIND, kActGelu>(sh, k, o, stream); break;
    case kActGeluTanh: LaunchDrop<T, KIND, kActGeluTanh>(sh, k, o, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T, int KIND>
cudaError_t Bwd(const DropoutBwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream) {
  if (a.hidden == 0) return cudaSuccess;
  if (a.rows == 0) {
    cudaMemsetAsync(a.dbias, 0, a.hidden * sizeof(float), stream);
    return cudaGetLastError();
  }
  if (a.max_parts < 1) return cudaErrorInvalidValue;
  const int vec = PickVec<T>(a.hidden, {a.dy, a.x, a.bias, a.dx});
  // Row blocks (= partial dbias rows): at most 2 per SM, fewer when the columns take
  // several chunks (LaunchResident).
  Shape sh = PickShape(KIND, a.rows, a.hidden, vec, RowsFor<T>(KIND, vec, a.hidden, o),
                       std::min<int64_t>(a.max_parts, 2 * SmCount()), o);
  KernelArgs k{a.dy, a.x, a.bias, a.seed, a.dx, a.partials, a.rows, a.hidden, a.threshold, a.scale, a.numbering};
  cudaError_t err;
  if constexpr (KIND == kBdrBwd) {
    LaunchDrop<T, KIND, kActRelu>(sh, k, o, stream);
    err = cudaGetLastError();
  } else {
    err = LaunchAct<T, KIND>(a.activation, sh, k, o, stream);
  }
  if (err != cudaSuccess) return err;
  LaunchSumColumnPartials(a.partials, (int)sh.grid.x, a.hidden, a.hidden, a.dbias, nullptr, stream);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchBiasDropoutResidualFwd(const DropoutFwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream) {
  if (a.rows == 0 || a.hidden == 0) return cudaSuccess;
  const int vec = PickVec<T>(a.hidden, {a.x, a.bias, a.residual, a.y});
  Shape sh = PickShape(kBdrFwd, a.rows, a.hidden, vec, RowsFor<T>(kBdrFwd, vec, a.hidden, o), INT32_MAX, o);
  KernelArgs k{a.x, a.residual, a.bias, a.seed, a.y, nullptr, a.rows, a.hidden, a.threshold, a.scale, a.numbering};
  LaunchDrop<T, kBdrFwd, kActRelu>(sh, k, o, stream);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchBiasActDropoutFwd(const DropoutFwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream) {
  if (a.rows == 0 || a.hidden == 0) return cudaSuccess;
  const int vec = PickVec<T>(a.hidden, {a.x, a.bias, a.y});
  Shape sh = PickShape(kActFwd, a.rows, a.hidden, vec, RowsFor<T>(kActFwd, vec, a.hidden, o), INT32_MAX, o);
  KernelArgs k{a.x, nullptr, a.bias, a.seed, a.y, nullptr, a.rows, a.hidden, a.threshold, a.scale, a.numbering};
  return LaunchAct<T, kActFwd>(a.activation, sh, k, o, stream);
}

template <typename T>
cudaError_t LaunchBiasDropoutResidualBwd(const DropoutBwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream) {
  return Bwd<T, kBdrBwd>(a, o, stream);
}

template <typename T>
cudaError_t LaunchBiasActDropoutBwd(const DropoutBwdArgs& a, const DropoutLaunchOptions& o, cudaStream_t stream) {
  return Bwd<T, kActBwd>(a, o, stream);
}

#define JAX_LS2_INSTANTIATE_DROPOUT(T)                                                                             \
  template cudaError_t LaunchBiasDropoutResidualFwd<T>(const DropoutFwdArgs&, const DropoutLaunchOptions&,   \
                                                       cudaStream_t);                                        \
  template cudaError_t LaunchBiasDropoutResidualBwd<T>(const DropoutBwdArgs&, const DropoutLaunchOptions&,   \
                                                       cudaStream_t);                                        \
  template cudaError_t LaunchBiasActDropoutFwd<T>(const DropoutFwdArgs&, const DropoutLaunchOptions&, cudaStream_t); \
  template cudaError_t LaunchBiasActDropoutBwd<T>(const DropoutBwdArgs&, const DropoutLaunchOptions&, cudaStream_t);


}  // namespace jax_ls2
