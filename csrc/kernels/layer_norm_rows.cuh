// Row reductions shared by the row-wise kernels (LayerNorm, RMSNorm, the FP8 LayerNorm): a
// block of blockDim.y "row groups", each of blockDim.x threads owning one row.
#pragma once
#include "kernels/common.cuh"

namespace jax_ls2 {

// v rounded to T and back, as a value stored in T reads.
template <typename T>
__device__ __forceinline__ float RoundTo(float v) { return ToFloat(FromFloat<T>(v)); }

// Sums a over the blockDim.x threads of this row group. All threads of the block must
// call it. scratch: >= 64 * blockDim.y floats (the layout of RowSum2).
__device__ __forceinline__ void RowSum(float& a, float* scratch) {
  const int tpr = blockDim.x;
  if (tpr <= 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      if (o < tpr) a += __shfl_xor_sync(0xffffffffu, a, o);
    }
    return;
  }
  a = WarpSum(a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = tpr >> 5;
  float* s = scratch + threadIdx.y * 64;
  __syncthreads();
  if (lane == 0) s[warp] = a;
  __syncthreads();
  a = WarpSum(lane < nw ? s[lane] : 0.f);
}

// Sums (a, b) over the blockDim.x threads of this row group. All threads of the
// block must call it. scratch: >= 64 * blockDim.y floats.
__device__ __forceinline__ void RowSum2(float& a, float& b, float* scratch) {
  const int tpr = blockDim.x;
  if (tpr <= 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      if (o < tpr) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
      }
    }
    return;
  }
  a = WarpSum(a);
  b = WarpSum(b);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = tpr >> 5;
  float* s = scratch + threadIdx.y * 64;
  __syncthreads();
  if (lane == 0) {
    s[warp] = a;
    s[32 + warp] = b;
  }
  __syncthreads();
  a = WarpSum(lane < nw ? s[lane] : 0.f);
  b = WarpSum(lane < nw ? s[32 + lane] : 0.f);
}


// The backward's per-thread column state: whether this thread's columns
// (i * blockDim.x + threadIdx.x) * VEC + j lie in the row (has_col[i]), gamma there (zero
// past the row's H), and zeroed dgamma/dbeta partial sums.
template <typename T, int ITEMS, int VEC>
__device__ __forceinline__ void InitBwdColumns(const void* gamma, int H, bool (&has_col)[ITEMS],
                                               float (&gam)[ITEMS][VEC], float (&dg)[ITEMS][VEC],
                                               float (&db)[ITEMS][VEC]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = (i * blockDim.x + threadIdx.x) * VEC;
    has_col[i] = col < H;
    if (has_col[i]) {
      LoadFloats<T, VEC>(static_cast<const T*>(gamma) + col, gam[i]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) gam[i][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) dg[i][j] = db[i][j] = 0.f;
  }
}

// Folds the row groups' dgamma/dbeta partial sums (this thread's columns are
// (i * blockDim.x + threadIdx.x) * VEC + j) in a fixed order through `fold` (2 * H floats
// of shared memory) and writes the block's partial row `part` (2, H) f32. All threads of
// the block must call it.
template <int ITEMS, int VEC>
__device__ __forceinline__ void StoreBlockPartials(const float (&dg)[ITEMS][VEC], const float (&db)[ITEMS][VEC],
                                                   float* fold, int H, float* part) {
  for (int yy = 0; yy < (int)blockDim.y; ++yy) {
    if ((int)threadIdx.y == yy) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * blockDim.x + threadIdx.x) * VEC;
        if (col < H) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            fold[col + j] = yy == 0 ? dg[i][j] : fold[col + j] + dg[i][j];
            fold[H + col + j] = yy == 0 ? db[i][j] : fold[H + col + j] + db[i][j];
          }
        }
      }
    }
    __syncthreads();
  }
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  for (int c = tid; c < 2 * H; c += nthreads) part[c] = fold[c];
}

}  // namespace jax_ls2
