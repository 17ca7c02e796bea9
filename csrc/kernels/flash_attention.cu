// Flash attention on tensor cores (mma.sync m16n8k16, fp16/bf16 in, fp32 accumulate).
//
// Forward, one CTA per (query block, head, batch), each warp 32 query rows (two
// m16 tiles, so each K/V fragment read from shared memory feeds two products); key/value blocks stream through shared memory (cp.async, double
// buffered); S = Q K^T, an online softmax in base 2 (running max m and sum l per row,
// fp32), O += P V with P taken straight from S's accumulator registers. Dropped
// probabilities are zeroed after they enter l, and O is scaled by keep_scale / l at
// the end. Writes O and lse = (m + log2 l) * ln 2 (-inf when l == 0: O is then 0; NaN
// when l is, a NaN logit).
//
// Backward, three launches and no atomics on dq, dk, dv (deterministic):
//   1. delta = rowsum(dO * O) - dlse, one warp per row;
//   2. dq: one CTA per (query block, head, batch), the forward's loop again:
//      P = exp2(S - lse), dP = dO V^T, dS = P (dP z - delta), dq += dS K, where z is
//      the dropout factor (keep * keep_scale or 0); dbias += dS by fp32 atomics into a
//      zeroed buffer of the bias' shape (broadcast dims collide, hence atomics);
//   3. dk, dv: one CTA per (key block, kv head, batch), each warp 16 keys, looping
//      over the query heads of the group and the query blocks: S^T = K Q^T,
//      dP^T = V dO^T, dv += (P z)^T dO, dk += dS^T Q.
// The lse cotangent enters through delta: d lse_i / d s_ij = p_ij adds dlse_i p_ij to dS.
//
// Shared-memory tiles are rows of head_dim elements, their 16-byte chunks XOR-swizzled
// by the row index (chunk c of row r lives at c ^ (r & 7)), so the 8 row addresses of
// an ldmatrix hit 8 different bank groups; head_dim must be a multiple of 64.
// Rows past q_len / kv_len are zero-filled by cp.async and masked to -inf.
//
// Each kernel is compiled per (kBias, kSeg), so the per-element work between the MMAs
// is branch-free (see ToLogits); bounds and causal masking run only in the tiles that
// cross them, and dropout draws a tile's keep flags into a bit mask behind one branch,
// one hash per pair of adjacent keys where the numbering allows (KeepAlongKeys).
#include <cfloat>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/flash_attention.h"

namespace jax_ls2 {
namespace {

constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarpRows = 16;  // rows of one m16n8k16 tile, per warp

// Tile shapes: query rows per CTA and key rows per loop step. The forward's warps
// take kMT row tiles of 16 each, so every K and V fragment read from shared memory
// feeds kMT products. (kBK = 64 at head_dim 128 spills about 100 bytes a thread: the
// output accumulators alone take 128 registers.)
template <int D>
struct FwdTile {
  static constexpr int kWarps = 4, kMT = 2, kBQ = kWarps * kMT * kWarpRows, kBK = D == 128 ? 32 : 64;
};
// The backward's 8 warps per CTA halve how often each query (dk, dv) or key (dq)
// block is streamed from L2 compared with 4.
template <int D>
struct DqTile {
  static constexpr int kWarps = 8, kBQ = kWarps * kWarpRows, kBK = 32;
};
template <int D>
struct DkvTile {
  static constexpr int kWarps = 8, kBK = kWarps * kWarpRows, kBQ = D == 128 ? 32 : 64;
};
constexpr int kDeltaRowsPerBlock = 8;  // one warp per row

// ---------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void Ldsm4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void Ldsm4T(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += a b for one 16x8x16 tile; a: 4 registers (16x16, row-major), b: 2 (16x8, col).
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as a pair of T in one register, lo in the low half.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// ---------------------------------------------------------------- shared tiles
// Element offset of chunk c (8 elements) of row r in a swizzled tile of D columns.
template <int D>
__device__ __forceinline__ int Swz(int r, int c) {
  static_assert(D % 64 == 0, "the swizzle needs at least 8 chunks per row");
  return r * D + ((c ^ (r & 7)) << 3);
}

// ROWS x D tile from global rows g + r * stride (r < valid rows), rows past them zeroed.
// `safe` is any valid global address (the source operand of a zero-fill). Thread t
// copies chunk t % (D / 8) of rows t / (D / 8) + k * kRowStep: a fixed column, so the
// addresses of its copies are one base plus multiples of a step (kRowStep is a multiple
// of 8, so the swizzle's row term is the same for all of them).
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void LoadTile(T* tile, const T* g, int64_t stride, int valid, const T* safe) {
  constexpr int kChunks = D / 8, kRowStep = NT / kChunks;
  static_assert(NT % kChunks == 0 && (ROWS * kChunks) % NT == 0, "whole rows per pass");
  const int r0 = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
  const T* src = g + r0 * stride + c * 8;
  const int64_t step = kRowStep * stride;
#pragma unroll
  for (int k = 0; k < ROWS * kChunks / NT; ++k) {
    const int r = r0 + k * kRowStep;
    const bool ok = r < valid;
    CpAsync16(SmemAddr(tile + Swz<D>(r, c)), ok ? src + k * step : safe, ok);
  }
}

// A operand (16 rows x 16) of the k-chunk kc from a [row][k] tile, rows r0 ...
template <int D, typename T>
__device__ __forceinline__ void LoadA(const T* tile, int r0, int kc, uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31;
  Ldsm4(SmemAddr(tile + Swz<D>(r0 + (lane & 15), 2 * kc + (lane >> 4))), a);
}
// B operands of two n8 tiles (n0 .. n0 + 15), k-chunk kc, from a [n][k] tile:
// b[0], b[1] for n0 and b[2], b[3] for n0 + 8.
template <int D, typename T>
__device__ __forceinline__ void LoadBRows(const T* tile, int n0, int kc, uint32_t (&b)[4]) {
  const int lane = threadIdx.x & 31;
  Ldsm4(SmemAddr(tile + Swz<D>(n0 + (lane & 7) + ((lane >> 4) << 3), 2 * kc + ((lane >> 3) & 1))), b);
}
// B operands of the two n8 tiles of columns 8 * nc .. 8 * nc + 15, k rows k0 .. k0 + 15,
// from a [k][n] tile (transposed by ldmatrix): b[0], b[1] for chunk nc, b[2], b[3] for nc + 1.
template <int D, typename T>
__device__ __forceinline__ void LoadBCols(const T* tile, int k0, int nc, uint32_t (&b)[4]) {
  const int lane = threadIdx.x & 31;
  Ldsm4T(SmemAddr(tile + Swz<D>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), nc + (lane >> 4))), b);
}

// The A operand of a product whose k dimension is the n dimension of accumulator tiles
// c[2 * kc] and c[2 * kc + 1] (16 columns), scaled elementwise beforehand as needed.
template <typename T, int N>
__device__ __forceinline__ void AccToA(const float (&c)[N][4], int kc, uint32_t (&a)[4]) {
  a[0] = PackPair<T>(c[2 * kc][0], c[2 * kc][1]);
  a[1] = PackPair<T>(c[2 * kc][2], c[2 * kc][3]);
  a[2] = PackPair<T>(c[2 * kc + 1][0], c[2 * kc + 1][1]);
  a[3] = PackPair<T>(c[2 * kc + 1][2], c[2 * kc + 1][3]);
}

// ---------------------------------------------------------------- masks and dropout
// What a CTA needs to know about (b, h): pointers and the dropout numbering.
struct RowCtx {
  const float* bias;      // at (b, h), or nullptr
  const int32_t* q_seg;   // at b, or nullptr
  const int32_t* kv_seg;  // at b
  uint64_t drop_row0;     // dropout row of query 0: (b * heads + h) * q_total + q_offset
  uint32_t k0, k1, kv_offset;
};

__device__ __forceinline__ RowCtx MakeRowCtx(const FlashAttentionProblem& p, int b, int h) {
  RowCtx c;
  c.bias = p.bias ? p.bias + b * p.bias_stride[0] + h * p.bias_stride[1] : nullptr;
  c.q_seg = p.q_seg ? p.q_seg + b * p.q_seg_stride[0] : nullptr;
  c.kv_seg = p.kv_seg ? p.kv_seg + b * p.kv_seg_stride[0] : nullptr;
  c.drop_row0 = 0u;
  c.k0 = c.k1 = c.kv_offset = 0u;
  if (p.threshold) {
    c.k0 = p.seed[0];
    c.k1 = p.seed[1];
    c.kv_offset = p.seed[4];
    const uint64_t per_batch = (uint64_t)p.q_len * p.heads * p.head_dim;
    const uint32_t first_batch = p.seed[2] / (uint32_t)(per_batch > 0xffffffffull ? 0xffffffffull : per_batch);
    c.drop_row0 = ((uint64_t)first_batch + b) * p.heads + h;
    c.drop_row0 = c.drop_row0 * (uint64_t)p.drop_q_total + p.seed[3];
  }
  return c;
}

// The dropout numbering of one query row i: key j (of this call) has the 64-bit index
// base + j, base = (drop_row0 + i) * kv_total + kv_offset; its low word is lo0 + j
// (uint32), its high word hi0 for j < wrap and hi0 + 1 from there (rows are shorter
// than 2^32). k1f[s] and c[s] are the hash words of high word hi0 + s.
struct DropRow {
  uint32_t lo0;
  int32_t wrap;
  uint32_t k1f[2], c[2];
};

__device__ __forceinline__ DropRow MakeDropRow(const FlashAttentionProblem& p, const RowCtx& c, int i) {
  const uint64_t base = (c.drop_row0 + (uint64_t)i) * (uint64_t)p.drop_kv_total + c.kv_offset;
  DropRow d;
  d.lo0 = (uint32_t)base;
  const uint64_t to_wrap = (1ull << 32) - d.lo0;
  d.wrap = to_wrap > 0x7fffffffull ? 0x7fffffff : (int32_t)to_wrap;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    d.c[s] = DropoutWideWord((uint32_t)(base >> 32) + (uint32_t)s, c.k1);
    d.k1f[s] = FoldKey(c.k1 ^ d.c[s]);
  }
  return d;
}

// Fills rows[r] for the query rows i0 + r, r < n (shared memory; the caller syncs).
template <int NT>
__device__ __forceinline__ void FillDropRows(DropRow* rows, const FlashAttentionProblem& p, const RowCtx& c,
                                             int i0, int n) {
  for (int r = threadIdx.x; r < n; r += NT) rows[r] = MakeDropRow(p, c, i0 + r);
}

// Keep flag of key j of a row; thr16 = threshold << 16.
__device__ __forceinline__ bool DropKeep(const DropRow& d, uint32_t k0, uint32_t thr16, int j) {
  const uint32_t lo = d.lo0 + (uint32_t)j;
  const int s = j >= d.wrap;
  const uint32_t h = DropoutHashFolded(lo & ~1u, k0, d.k1f[s]) ^ d.c[s];
  return (lo & 1u) ? KeepHigh(h, thr16) : KeepLow(h, thr16);
}
// Keep flags of the accumulator elements of NB n8 tiles whose rows (queries) are rows[e >> 1]
// and keys j0 + 8 n + (e & 1) (j0 even): bit 4 n + e. `pairs`: every row's numbering is
// even at even keys (kv_total and kv_offset even), so keys j, j + 1 share one hash (and a
// high word); else one hash per element. Either way one uniform branch per tile.
template <int NB>
__device__ __forceinline__ uint32_t KeepAlongKeys(const DropRow* const (&rows)[2], uint32_t k0, uint32_t thr16, int j0,
                                                  bool pairs) {
  static_assert(NB * 4 <= 32, "one bit per element");
  uint32_t keep = 0u;
  if (pairs) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const DropRow& d = *rows[r];
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        const int j = j0 + 8 * n;
        const int w = j >= d.wrap;
        const uint32_t h = DropoutHashFolded(d.lo0 + (uint32_t)j, k0, w ? d.k1f[1] : d.k1f[0]) ^ (w ? d.c[1] : d.c[0]);
        keep |= ((uint32_t)KeepLow(h, thr16) | (uint32_t)KeepHigh(h, thr16) << 1) << (4 * n + 2 * r);
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int n = 0; n < NB; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) keep |= (uint32_t)DropKeep(*rows[r], k0, thr16, j0 + 8 * n + e) << (4 * n + 2 * r + e);
      }
    }
  }
  return keep;
}

// Whether every row's dropout numbering is even at even keys.
__device__ __forceinline__ bool PairsAlongKeys(const FlashAttentionProblem& p, const RowCtx& c) {
  return p.drop_kv_total % 2 == 0 && c.kv_offset % 2 == 0;
}

// Whether query i attends key j as far as bounds and causality go.
__device__ __forceinline__ bool Attends(const FlashAttentionProblem& p, int i, int j) {
  return i < p.q_len && j < p.kv_len && (!p.causal || j <= i + (p.kv_len - p.q_len));
}

// The segment id of query i (0 without segment ids); i is clamped into range.
__device__ __forceinline__ int32_t QSeg(const FlashAttentionProblem& p, const RowCtx& c, int i) {
  return c.q_seg ? c.q_seg[(int64_t)min(i, p.q_len - 1) * p.q_seg_stride[1]] : 0;
}

// Whether the scores of a tile stay raw q.k (see ToLogits): no bias, no segment ids and a
// positive scale. Uniform over the CTA.
template <bool kBias, bool kSeg>
__device__ __forceinline__ bool RawScores(float scale2) {
  return !kBias && !kSeg && scale2 > 0.f;
}

// Turns the scores s of a tile (q.k from the MMA) into values v such that v * mul is the
// logit in log2 units, -inf where masked; coords(n, e, i, j, qs) gives element (n, e)'s
// query i, key j and the query's segment id qs.
//   raw (RawScores): v = q.k and mul = scale * log2(e) > 0, so the row max of v times mul
//     is the max of the logits, and exp2 takes one FFMA per element;
//   otherwise v = scale * log2(e) q.k (+ log2(e) bias) (-inf across segments), mul = 1.
// The kernels are compiled for each (kBias, kSeg) and the per-element work is free of
// branches (indices clamped for the loads, masks by selects): branchy per-element code
// splits the loop into small basic blocks that the scheduler cannot overlap with the
// tensor-core work. Only tiles crossing the bounds or the causal diagonal (`check`, a
// per-tile branch) get the bounds/causal selects.
template <bool kBias, bool kSeg, int N, typename Coords>
__device__ __forceinline__ void ToLogits(const FlashAttentionProblem& p, const RowCtx& c, float (&s)[N][4], bool raw,
                                         bool check, float scale2, Coords&& coords) {
  if (!raw) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int i, j;
        int32_t qs;
        coords(n, e, i, j, qs);
        const int64_t ic = min(i, p.q_len - 1), jc = min(j, p.kv_len - 1);
        float x = s[n][e] * scale2;
        if constexpr (kBias) x = fmaf(c.bias[ic * p.bias_stride[2] + jc * p.bias_stride[3]], kLog2e, x);
        if constexpr (kSeg) x = c.kv_seg[jc * p.kv_seg_stride[1]] == qs ? x : -INFINITY;
        s[n][e] = x;
      }
    }
  }
  if (check) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int i, j;
        int32_t qs;
        coords(n, e, i, j, qs);
        if (!Attends(p, i, j)) s[n][e] = -INFINITY;
      }
    }
  }
}

// Keys a query block q0 .. q0 + rows - 1 can attend: [0, end).
__device__ __forceinline__ int KeyEnd(const FlashAttentionProblem& p, int q0, int rows) {
  if (!p.causal) return p.kv_len;
  return max(0, min(p.kv_len, q0 + rows + (p.kv_len - p.q_len)));
}

// The query block of a CTA of the forward or dq pass: under causal masking the last
// blocks attend the most keys, so they are taken first (a shorter tail).
__device__ __forceinline__ int QueryBlock(const FlashAttentionProblem& p) {
  return p.causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
}

// Whether a (query block, key block) tile needs no bounds or causal test.
__device__ __forceinline__ bool Inside(const FlashAttentionProblem& p, int q0, int qrows, int n0, int krows) {
  return q0 + qrows <= p.q_len && n0 + krows <= p.kv_len &&
         (!p.causal || n0 + krows - 1 <= q0 + (p.kv_len - p.q_len));
}

// ---------------------------------------------------------------- forward
template <typename T, int D, bool kBias, bool kSeg>
__global__ void __launch_bounds__(FwdTile<D>::kWarps * 32) FlashFwdKernel(FlashAttentionFwdArgs a) {
  using Tile = FwdTile<D>;
  constexpr int BQ = Tile::kBQ, BK = Tile::kBK, MT = Tile::kMT, NT = Tile::kWarps * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + BQ * D;      // 2 buffers
  T* sV = sK + 2 * BK * D;  // 2 buffers
  DropRow* sDrop = reinterpret_cast<DropRow*>(sV + 2 * BK * D);  // BQ rows
  const FlashAttentionProblem& p = a.p;
  const int q0 = QueryBlock(p) * BQ, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads / p.kv_heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const int64_t q_stride = (int64_t)p.heads * D, kv_stride = (int64_t)p.kv_heads * D;
  const RowCtx ctx = MakeRowCtx(p, b, h);
  if (p.threshold) FillDropRows<NT>(sDrop, p, ctx, q0, BQ);
  const T* gq = Q + ((int64_t)b * p.q_len + q0) * q_stride + (int64_t)h * D;
  const T* gk = K + (int64_t)b * p.kv_len * kv_stride + (int64_t)hk * D;
  const T* gv = V + (int64_t)b * p.kv_len * kv_stride + (int64_t)hk * D;

  const int kv_end = KeyEnd(p, q0, BQ);
  const int nblocks = (kv_end + BK - 1) / BK;
  LoadTile<T, BQ, D, NT>(sQ, gq, q_stride, p.q_len - q0, Q);
  if (nblocks > 0) {
    LoadTile<T, BK, D, NT>(sK, gk, kv_stride, p.kv_len, K);
    LoadTile<T, BK, D, NT>(sV, gv, kv_stride, p.kv_len, V);
  }
  CpAsyncCommit();
  CpAsyncWaitAll();
  __syncthreads();

  // Row tile mt of this warp: tile rows warp_row0 + 16 mt ...; thread rows + g and + g + 8.
  const int warp_row0 = warp * MT * kWarpRows;
  int row[MT][2];
  int32_t qs[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row[mt][r] = q0 + warp_row0 + mt * kWarpRows + g + 8 * r;
      qs[mt][r] = QSeg(p, ctx, row[mt][r]);
    }
  }
  const float scale2 = p.scale * kLog2e;
  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int nb = 0; nb < nblocks; ++nb) {
    const int buf = nb & 1, n0 = nb * BK;
    if (nb + 1 < nblocks) {
      const int next = n0 + BK;
      LoadTile<T, BK, D, NT>(sK + (buf ^ 1) * BK * D, gk + next * kv_stride, kv_stride, p.kv_len - next, K);
      LoadTile<T, BK, D, NT>(sV + (buf ^ 1) * BK * D, gv + next * kv_stride, kv_stride, p.kv_len - next, V);
    }
    CpAsyncCommit();
    const T* cK = sK + buf * BK * D;
    const T* cV = sV + buf * BK * D;

    float s[MT][BK / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) LoadA<D>(sQ, warp_row0 + mt * kWarpRows, kc, qa[mt]);
#pragma unroll
      for (int np = 0; np < BK / 16; ++np) {
        uint32_t bf[4];
        LoadBRows<D>(cK, np * 16, kc, bf);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>(s[mt][2 * np], qa[mt], bf[0], bf[1]);
          Mma<T>(s[mt][2 * np + 1], qa[mt], bf[2], bf[3]);
        }
      }
    }

    const bool check = !Inside(p, q0, BQ, n0, BK);
    const bool raw = RawScores<kBias, kSeg>(scale2);
    const float mul = raw ? scale2 : 1.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      ToLogits<kBias, kSeg>(p, ctx, s[mt], raw, check, scale2, [&](int n, int e, int& i, int& j, int32_t& q_seg) {
        i = row[mt][e >> 1];
        j = n0 + n * 8 + 2 * t4 + (e & 1);
        q_seg = qs[mt][e >> 1];
      });
      // Online softmax: rows g (r = 0) and g + 8 (r = 1) of the tile, spread over a quad;
      // m in log2 units.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][r], mx * mul);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = Exp2Approx(m[mt][r] - m_use);
        m[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
          s[mt][n][2 * r] = Exp2Approx(fmaf(s[mt][n][2 * r], mul, -m_use));
          s[mt][n][2 * r + 1] = Exp2Approx(fmaf(s[mt][n][2 * r + 1], mul, -m_use));
          sum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
        }
        l[mt][r] = l[mt][r] * alpha + sum;
        // Once the row maxima settle, alpha is exactly 1 for most key blocks: skip the
        // D / 4 multiplies then (a warp-uniform branch).
        if (__any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            o[mt][n][2 * r] *= alpha;
            o[mt][n][2 * r + 1] *= alpha;
          }
        }
      }
      if (p.threshold) {
        const DropRow* const rows[2] = {sDrop + (row[mt][0] - q0), sDrop + (row[mt][1] - q0)};
        const uint32_t keep =
            KeepAlongKeys<BK / 8>(rows, ctx.k0, p.threshold << 16, n0 + 2 * t4, PairsAlongKeys(p, ctx));
        // keep_scale is applied with 1 / l at the end.
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = (keep >> (4 * n + e)) & 1u ? s[mt][n][e] : 0.f;
        }
      }
    }
#pragma unroll
    for (int kc = 0; kc < BK / 16; ++kc) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) AccToA<T>(s[mt], kc, pa[mt]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bf[4];
        LoadBCols<D>(cV, kc * 16, 2 * dn, bf);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>(o[mt][2 * dn], pa[mt], bf[0], bf[1]);
          Mma<T>(o[mt][2 * dn + 1], pa[mt], bf[2], bf[3]);
        }
      }
    }
    CpAsyncWaitAll();
    __syncthreads();
  }

  T* out = static_cast<T*>(a.out);
  const float drop_scale = p.threshold ? p.keep_scale : 1.f;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int i = row[mt][r];
      if (i >= p.q_len) continue;
      // sum == 0: no attended key (O = 0, lse = -inf); a NaN sum (a NaN logit) stays NaN
      // in O and lse rather than passing for "no key".
      const float inv = sum != 0.f ? drop_scale / sum : 0.f;
      T* orow = out + ((int64_t)b * p.q_len + i) * q_stride + (int64_t)h * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t4) =
            PackPair<T>(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
      }
      if (t4 == 0) {
        a.lse[((int64_t)b * p.heads + h) * p.q_len + i] =
            sum != 0.f ? (m[mt][r] + __log2f(sum)) * kLn2 : -INFINITY;
      }
    }
  }
}

// ---------------------------------------------------------------- backward: delta
template <typename T, int D>
__global__ void __launch_bounds__(kDeltaRowsPerBlock * 32) FlashDeltaKernel(FlashAttentionBwdArgs a) {
  const FlashAttentionProblem& p = a.p;
  const int64_t rows = (int64_t)p.batch * p.q_len * p.heads;
  const int64_t row = (int64_t)blockIdx.x * kDeltaRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  // row = (b * q_len + i) * heads + h, the layout of out and dout.
  const T* o = static_cast<const T*>(a.out) + row * D;
  const T* d = static_cast<const T*>(a.dout) + row * D;
  constexpr int kPer = D / 32;
  float of[kPer], df[kPer];
  LoadFloats<T, kPer>(o + lane * kPer, of);
  LoadFloats<T, kPer>(d + lane * kPer, df);
  float acc = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) acc += of[e] * df[e];
  acc = WarpSum(acc);
  if (lane == 0) {
    const int h = (int)(row % p.heads);
    const int64_t bi = row / p.heads;
    const int i = (int)(bi % p.q_len);
    const int64_t b = bi / p.q_len;
    const int64_t at = (b * p.heads + h) * p.q_len + i;
    a.delta[at] = acc - a.dlse[at];
  }
}

// Per-row backward statistics in log2 units: lse2 = lse * log2(e) (+inf for a row with
// no attended key, so its probabilities are exp2(-inf) = 0), and delta.
__device__ __forceinline__ float Lse2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// ---------------------------------------------------------------- backward: dq (and dbias)
template <typename T, int D, bool kBias, bool kSeg>
__global__ void __launch_bounds__(DqTile<D>::kWarps * 32) FlashDqKernel(FlashAttentionBwdArgs a) {
  using Tile = DqTile<D>;
  constexpr int BQ = Tile::kBQ, BK = Tile::kBK, NT = Tile::kWarps * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sO = sQ + BQ * D;      // dout
  T* sK = sO + BQ * D;      // 2 buffers
  T* sV = sK + 2 * BK * D;  // 2 buffers
  DropRow* sDrop = reinterpret_cast<DropRow*>(sV + 2 * BK * D);  // BQ rows
  const FlashAttentionProblem& p = a.p;
  const int q0 = QueryBlock(p) * BQ, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads / p.kv_heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const T* DO = static_cast<const T*>(a.dout);
  const int64_t q_stride = (int64_t)p.heads * D, kv_stride = (int64_t)p.kv_heads * D;
  const RowCtx ctx = MakeRowCtx(p, b, h);
  if (p.threshold) FillDropRows<NT>(sDrop, p, ctx, q0, BQ);
  const int64_t q_at = ((int64_t)b * p.q_len + q0) * q_stride + (int64_t)h * D;
  const T* gk = K + (int64_t)b * p.kv_len * kv_stride + (int64_t)hk * D;
  const T* gv = V + (int64_t)b * p.kv_len * kv_stride + (int64_t)hk * D;

  const int kv_end = KeyEnd(p, q0, BQ);
  const int nblocks = (kv_end + BK - 1) / BK;
  LoadTile<T, BQ, D, NT>(sQ, Q + q_at, q_stride, p.q_len - q0, Q);
  LoadTile<T, BQ, D, NT>(sO, DO + q_at, q_stride, p.q_len - q0, DO);
  if (nblocks > 0) {
    LoadTile<T, BK, D, NT>(sK, gk, kv_stride, p.kv_len, K);
    LoadTile<T, BK, D, NT>(sV, gv, kv_stride, p.kv_len, V);
  }
  CpAsyncCommit();
  CpAsyncWaitAll();
  __syncthreads();

  uint32_t qf[D / 16][4], df[D / 16][4];
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    LoadA<D>(sQ, warp * kWarpRows, kc, qf[kc]);
    LoadA<D>(sO, warp * kWarpRows, kc, df[kc]);
  }

  const int row[2] = {q0 + warp * kWarpRows + g, q0 + warp * kWarpRows + g + 8};
  const int32_t qs[2] = {QSeg(p, ctx, row[0]), QSeg(p, ctx, row[1])};
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t at = ((int64_t)b * p.heads + h) * p.q_len + row[r];
    lse2[r] = row[r] < p.q_len ? Lse2(a.lse[at]) : INFINITY;
    delta[r] = row[r] < p.q_len ? a.delta[at] : 0.f;
  }
  const float scale2 = p.scale * kLog2e;
  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;

  for (int nb = 0; nb < nblocks; ++nb) {
    const int buf = nb & 1, n0 = nb * BK;
    if (nb + 1 < nblocks) {
      const int next = n0 + BK;
      LoadTile<T, BK, D, NT>(sK + (buf ^ 1) * BK * D, gk + next * kv_stride, kv_stride, p.kv_len - next, K);
      LoadTile<T, BK, D, NT>(sV + (buf ^ 1) * BK * D, gv + next * kv_stride, kv_stride, p.kv_len - next, V);
    }
    CpAsyncCommit();
    const T* cK = sK + buf * BK * D;
    const T* cV = sV + buf * BK * D;

    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int np = 0; np < BK / 16; ++np) {
        uint32_t bf[4];
        LoadBRows<D>(cK, np * 16, kc, bf);
        Mma<T>(s[2 * np], qf[kc], bf[0], bf[1]);
        Mma<T>(s[2 * np + 1], qf[kc], bf[2], bf[3]);
        LoadBRows<D>(cV, np * 16, kc, bf);
        Mma<T>(dp[2 * np], df[kc], bf[0], bf[1]);
        Mma<T>(dp[2 * np + 1], df[kc], bf[2], bf[3]);
      }
    }
    const bool check = !Inside(p, q0, BQ, n0, BK);
    const bool raw = RawScores<kBias, kSeg>(scale2);
    const float mul = raw ? scale2 : 1.f;
    ToLogits<kBias, kSeg>(p, ctx, s, raw, check, scale2, [&](int n, int e, int& i, int& j, int32_t& q_seg) {
      i = row[e >> 1];
      j = n0 + n * 8 + 2 * t4 + (e & 1);
      q_seg = qs[e >> 1];
    });
    // Keep flags, bit 4 n + e (all set without dropout, where keep_scale is 1).
    uint32_t keep = 0xffffffffu;
    if (p.threshold) {
      const DropRow* const rows[2] = {sDrop + (row[0] - q0), sDrop + (row[1] - q0)};
      keep = KeepAlongKeys<BK / 8>(rows, ctx.k0, p.threshold << 16, n0 + 2 * t4, PairsAlongKeys(p, ctx));
    }
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = row[r], j = n0 + n * 8 + 2 * t4;
        const float z0 = (keep >> (4 * n + 2 * r)) & 1u ? p.keep_scale : 0.f;
        const float z1 = (keep >> (4 * n + 2 * r + 1)) & 1u ? p.keep_scale : 0.f;
        const float p0 = Exp2Approx(fmaf(s[n][2 * r], mul, -lse2[r]));
        const float p1 = Exp2Approx(fmaf(s[n][2 * r + 1], mul, -lse2[r]));
        const float ds0 = p0 * (dp[n][2 * r] * z0 - delta[r]);
        const float ds1 = p1 * (dp[n][2 * r + 1] * z1 - delta[r]);
        s[n][2 * r] = ds0;
        s[n][2 * r + 1] = ds1;
        if (kBias && i < p.q_len) {
          float* db = a.dbias + b * p.bias_stride[0] + h * p.bias_stride[1] + i * p.bias_stride[2];
          if (j < p.kv_len && ds0 != 0.f) atomicAdd(db + j * p.bias_stride[3], ds0);
          if (j + 1 < p.kv_len && ds1 != 0.f) atomicAdd(db + (j + 1) * p.bias_stride[3], ds1);
        }
      }
    }
#pragma unroll
    for (int kc = 0; kc < BK / 16; ++kc) {
      uint32_t pa[4];
      AccToA<T>(s, kc, pa);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bf[4];
        LoadBCols<D>(cK, kc * 16, 2 * dn, bf);
        Mma<T>(dq[2 * dn], pa, bf[0], bf[1]);
        Mma<T>(dq[2 * dn + 1], pa, bf[2], bf[3]);
      }
    }
    CpAsyncWaitAll();
    __syncthreads();
  }

  T* out = static_cast<T*>(a.dq);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row[r];
    if (i >= p.q_len) continue;
    T* orow = out + ((int64_t)b * p.q_len + i) * q_stride + (int64_t)h * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t4) =
          PackPair<T>(dq[n][2 * r] * p.scale, dq[n][2 * r + 1] * p.scale);
    }
  }
}

// ---------------------------------------------------------------- backward: dk, dv
template <typename T, int D, bool kBias, bool kSeg>
__global__ void __launch_bounds__(DkvTile<D>::kWarps * 32) FlashDkvKernel(FlashAttentionBwdArgs a) {
  using Tile = DkvTile<D>;
  constexpr int BK = Tile::kBK, BQ = Tile::kBQ, NT = Tile::kWarps * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + BK * D;
  T* sQ = sV + BK * D;      // 2 buffers
  T* sO = sQ + 2 * BQ * D;  // dout, 2 buffers
  float* sL = reinterpret_cast<float*>(sO + 2 * BQ * D);  // lse2, 2 buffers
  float* sD = sL + 2 * BQ;                                // delta, 2 buffers
  DropRow* sDrop = reinterpret_cast<DropRow*>(sD + 2 * BQ);  // 2 buffers of BQ rows
  const FlashAttentionProblem& p = a.p;
  const int n0 = blockIdx.x * BK, hk = blockIdx.y, b = blockIdx.z;
  const int groups = p.heads / p.kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const T* DO = static_cast<const T*>(a.dout);
  const int64_t q_stride = (int64_t)p.heads * D, kv_stride = (int64_t)p.kv_heads * D;
  const int64_t kv_at = ((int64_t)b * p.kv_len + n0) * kv_stride + (int64_t)hk * D;

  // Queries that can attend this key block: [q_start, q_len).
  const int q_start = p.causal ? max(0, n0 - (p.kv_len - p.q_len)) : 0;
  const int first_qb = q_start / BQ;
  const int qblocks = q_start < p.q_len ? (p.q_len + BQ - 1) / BQ - first_qb : 0;
  const int steps = qblocks * groups;

  // Step s: head hk * groups + s / qblocks, query block first_qb + s % qblocks.
  auto issue = [&](int step, int buf) {
    const int h = hk * groups + step / qblocks;
    const int qq = (first_qb + step % qblocks) * BQ;
    const int64_t q_at = ((int64_t)b * p.q_len + qq) * q_stride + (int64_t)h * D;
    LoadTile<T, BQ, D, NT>(sQ + buf * BQ * D, Q + q_at, q_stride, p.q_len - qq, Q);
    LoadTile<T, BQ, D, NT>(sO + buf * BQ * D, DO + q_at, q_stride, p.q_len - qq, DO);
    for (int r = threadIdx.x; r < BQ; r += NT) {
      const int i = qq + r;
      const int64_t at = ((int64_t)b * p.heads + h) * p.q_len + i;
      sL[buf * BQ + r] = i < p.q_len ? Lse2(a.lse[at]) : INFINITY;
      sD[buf * BQ + r] = i < p.q_len ? a.delta[at] : 0.f;
    }
    if (p.threshold) FillDropRows<NT>(sDrop + buf * BQ, p, MakeRowCtx(p, b, h), qq, BQ);
  };

  LoadTile<T, BK, D, NT>(sK, K + kv_at, kv_stride, p.kv_len - n0, K);
  LoadTile<T, BK, D, NT>(sV, V + kv_at, kv_stride, p.kv_len - n0, V);
  if (steps > 0) issue(0, 0);
  CpAsyncCommit();
  CpAsyncWaitAll();
  __syncthreads();

  const float scale2 = p.scale * kLog2e;
  const int key[2] = {n0 + warp * kWarpRows + g, n0 + warp * kWarpRows + g + 8};
  static_assert(BQ / 8 * 4 <= 32, "keep flags of a step fit in 32 bits");
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;
  }

  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    if (step + 1 < steps) issue(step + 1, buf ^ 1);
    CpAsyncCommit();
    const int h = hk * groups + step / qblocks;
    const int qq = (first_qb + step % qblocks) * BQ;
    const T* cQ = sQ + buf * BQ * D;
    const T* cO = sO + buf * BQ * D;
    const float* cL = sL + buf * BQ;
    const float* cD = sD + buf * BQ;
    const RowCtx ctx = MakeRowCtx(p, b, h);

    // S^T (keys x queries) and dP^T.
    float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
      st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.f;
      dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t ka[4], va[4];
      LoadA<D>(sK, warp * kWarpRows, kc, ka);
      LoadA<D>(sV, warp * kWarpRows, kc, va);
#pragma unroll
      for (int np = 0; np < BQ / 16; ++np) {
        uint32_t bf[4];
        LoadBRows<D>(cQ, np * 16, kc, bf);
        Mma<T>(st[2 * np], ka, bf[0], bf[1]);
        Mma<T>(st[2 * np + 1], ka, bf[2], bf[3]);
        LoadBRows<D>(cO, np * 16, kc, bf);
        Mma<T>(dpt[2 * np], va, bf[0], bf[1]);
        Mma<T>(dpt[2 * np + 1], va, bf[2], bf[3]);
      }
    }
    // Element e of tile n: key key[e >> 1], query qq + 8 n + 2 t4 + (e & 1).
    const bool check = !Inside(p, qq, BQ, n0, BK);
    const bool raw = RawScores<kBias, kSeg>(scale2);
    const float mul = raw ? scale2 : 1.f;
    ToLogits<kBias, kSeg>(p, ctx, st, raw, check, scale2, [&](int n, int e, int& i, int& j, int32_t& q_seg) {
      i = qq + n * 8 + 2 * t4 + (e & 1);
      j = key[e >> 1];
      q_seg = kSeg ? QSeg(p, ctx, i) : 0;
    });
    // Keep flags, bit 4 n + e (all set without dropout, where keep_scale is 1).
    uint32_t keep = 0xffffffffu;
    if (p.threshold) {
      keep = 0u;
      const uint32_t thr16 = p.threshold << 16;
      // Adjacent keys pair (n0 is even).
      if (PairsAlongKeys(p, ctx)) {
        // Keys j and j ^ 1 (lanes g and g ^ 1, i.e. lane ^ 4) share a hash: this lane
        // hashes its two key pairs for one of its two queries (slot g & 1), and takes the
        // other query's hashes from its neighbour.
        const int own = g & 1;
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
          const DropRow& d = sDrop[buf * BQ + n * 8 + 2 * t4 + own];
          uint32_t hash[2], other[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int j = key[r] & ~1;
            const int w = j >= d.wrap;
            hash[r] = DropoutHashFolded(d.lo0 + (uint32_t)j, ctx.k0, d.k1f[w]) ^ d.c[w];
            other[r] = __shfl_xor_sync(0xffffffffu, hash[r], 4);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t hv = (e & 1) == own ? hash[e >> 1] : other[e >> 1];
            const bool kept = own ? KeepHigh(hv, thr16) : KeepLow(hv, thr16);
            keep |= (uint32_t)kept << (4 * n + e);
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = n * 8 + 2 * t4 + (e & 1);
            keep |= (uint32_t)DropKeep(sDrop[buf * BQ + c], ctx.k0, thr16, key[e >> 1]) << (4 * n + e);
          }
        }
      }
    }
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = n * 8 + 2 * t4 + (e & 1);
        const float pr = Exp2Approx(fmaf(st[n][e], mul, -cL[c]));
        const float z = (keep >> (4 * n + e)) & 1u ? p.keep_scale : 0.f;
        st[n][e] = pr * z;                        // (P z)^T, for dv
        dpt[n][e] = pr * (dpt[n][e] * z - cD[c]);  // dS^T, for dk
      }
    }
#pragma unroll
    for (int kc = 0; kc < BQ / 16; ++kc) {
      uint32_t pa[4], sa[4];
      AccToA<T>(st, kc, pa);
      AccToA<T>(dpt, kc, sa);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bf[4];
        LoadBCols<D>(cO, kc * 16, 2 * dn, bf);
        Mma<T>(dv[2 * dn], pa, bf[0], bf[1]);
        Mma<T>(dv[2 * dn + 1], pa, bf[2], bf[3]);
        LoadBCols<D>(cQ, kc * 16, 2 * dn, bf);
        Mma<T>(dk[2 * dn], sa, bf[0], bf[1]);
        Mma<T>(dk[2 * dn + 1], sa, bf[2], bf[3]);
      }
    }
    CpAsyncWaitAll();
    __syncthreads();
  }

  T* gdk = static_cast<T*>(a.dk);
  T* gdv = static_cast<T*>(a.dv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key[r];
    if (j >= p.kv_len) continue;
    const int64_t at = ((int64_t)b * p.kv_len + j) * kv_stride + (int64_t)hk * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(gdk + at + n * 8 + 2 * t4) =
          PackPair<T>(dk[n][2 * r] * p.scale, dk[n][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(gdv + at + n * 8 + 2 * t4) = PackPair<T>(dv[n][2 * r], dv[n][2 * r + 1]);
    }
  }
}

// ---------------------------------------------------------------- launchers
// Opts a kernel in to `smem` bytes of dynamic shared memory (once per kernel) and launches it.
template <typename Args>
cudaError_t LaunchWithSmem(void (*kernel)(Args), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                           const Args& args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, threads, smem, stream>>>(args);
  return cudaGetLastError();
}

// The kernel variant (see ToLogits) for the problem's bias and segment ids.
template <typename Kernel>
Kernel Variant(const FlashAttentionProblem& p, Kernel none, Kernel seg, Kernel bias, Kernel both) {
  return p.bias != nullptr ? (p.kv_seg != nullptr ? both : bias) : (p.kv_seg != nullptr ? seg : none);
}

template <typename T, int D>
cudaError_t Fwd(const FlashAttentionFwdArgs& a, cudaStream_t stream) {
  using Tile = FwdTile<D>;
  const size_t smem = (size_t)(Tile::kBQ + 4 * Tile::kBK) * D * sizeof(T) + Tile::kBQ * sizeof(DropRow);
  const dim3 grid((a.p.q_len + Tile::kBQ - 1) / Tile::kBQ, a.p.heads, a.p.batch);
  const auto kernel = Variant(a.p, FlashFwdKernel<T, D, false, false>, FlashFwdKernel<T, D, false, true>,
                              FlashFwdKernel<T, D, true, false>, FlashFwdKernel<T, D, true, true>);
  return LaunchWithSmem(kernel, grid, Tile::kWarps * 32, smem, stream, a);
}

template <typename T, int D>
cudaError_t Bwd(const FlashAttentionBwdArgs& a, cudaStream_t stream) {
  const FlashAttentionProblem& p = a.p;
  const int64_t rows = (int64_t)p.batch * p.q_len * p.heads;
  const dim3 delta_grid((unsigned)((rows + kDeltaRowsPerBlock - 1) / kDeltaRowsPerBlock));
  cudaError_t err = LaunchWithSmem(FlashDeltaKernel<T, D>, delta_grid, kDeltaRowsPerBlock * 32, 0, stream, a);
  if (err != cudaSuccess) return err;
  if (a.dbias != nullptr && a.dbias_count > 0) {
    err = cudaMemsetAsync(a.dbias, 0, a.dbias_count * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  using DqT = DqTile<D>;
  const size_t dq_smem = (size_t)(2 * DqT::kBQ + 4 * DqT::kBK) * D * sizeof(T) + DqT::kBQ * sizeof(DropRow);
  const dim3 dq_grid((p.q_len + DqT::kBQ - 1) / DqT::kBQ, p.heads, p.batch);
  const auto dq_kernel = Variant(p, FlashDqKernel<T, D, false, false>, FlashDqKernel<T, D, false, true>,
                                 FlashDqKernel<T, D, true, false>, FlashDqKernel<T, D, true, true>);
  err = LaunchWithSmem(dq_kernel, dq_grid, DqT::kWarps * 32, dq_smem, stream, a);
  if (err != cudaSuccess) return err;
  using KvT = DkvTile<D>;
  const size_t kv_smem = (size_t)(2 * KvT::kBK + 4 * KvT::kBQ) * D * sizeof(T) + 4 * KvT::kBQ * sizeof(float) +
                         2 * KvT::kBQ * sizeof(DropRow);
  const dim3 kv_grid((p.kv_len + KvT::kBK - 1) / KvT::kBK, p.kv_heads, p.batch);
  const auto kv_kernel = Variant(p, FlashDkvKernel<T, D, false, false>, FlashDkvKernel<T, D, false, true>,
                                 FlashDkvKernel<T, D, true, false>, FlashDkvKernel<T, D, true, true>);
  return LaunchWithSmem(kv_kernel, kv_grid, KvT::kWarps * 32, kv_smem, stream, a);
}

}  // namespace

bool FlashAttentionSupportsHeadDim(int head_dim) {
  return head_dim == kFlashHeadDimSmall || head_dim == kFlashHeadDimLarge;
}

template <typename T>
cudaError_t LaunchFlashAttentionFwd(const FlashAttentionFwdArgs& a, cudaStream_t stream) {
  if (a.p.head_dim == kFlashHeadDimSmall) return Fwd<T, kFlashHeadDimSmall>(a, stream);
  if (a.p.head_dim == kFlashHeadDimLarge) return Fwd<T, kFlashHeadDimLarge>(a, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t LaunchFlashAttentionBwd(const FlashAttentionBwdArgs& a, cudaStream_t stream) {
  if (a.p.head_dim == kFlashHeadDimSmall) return Bwd<T, kFlashHeadDimSmall>(a, stream);
  if (a.p.head_dim == kFlashHeadDimLarge) return Bwd<T, kFlashHeadDimLarge>(a, stream);
  return cudaErrorInvalidValue;
}

template cudaError_t LaunchFlashAttentionFwd<__half>(const FlashAttentionFwdArgs&, cudaStream_t);
template cudaError_t LaunchFlashAttentionFwd<__nv_bfloat16>(const FlashAttentionFwdArgs&, cudaStream_t);
template cudaError_t LaunchFlashAttentionBwd<__half>(const FlashAttentionBwdArgs&, cudaStream_t);
template cudaError_t LaunchFlashAttentionBwd<__nv_bfloat16>(const FlashAttentionBwdArgs&, cudaStream_t);

}  // namespace jax_ls2
