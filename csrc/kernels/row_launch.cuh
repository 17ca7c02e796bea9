// Host-side launch shapes shared by the LayerNorm and RMSNorm kernels: the access width
// and the threads per row group.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "kernels/common.cuh"

namespace jax_ls2 {

// Threads per row group covering `hidden` with `elems` elements per thread (`vec` per
// access): a power of two; with warp_multiple, whole warps once a row needs more than one
// warp (the row reductions take either). 0 when more than max_threads would be needed.
inline int ThreadsPerRow(int64_t hidden, int vec, int elems, int max_threads, bool warp_multiple = false) {
  const int64_t vecs = (hidden + vec - 1) / vec;
  const int items = elems / vec > 0 ? elems / vec : 1;
  const int64_t need = (vecs + items - 1) / items;
  int tpr = 1;
  while (tpr < need) tpr <<= 1;
  if (warp_multiple && tpr > 32) tpr = (int)((need + 31) / 32 * 32);
  return tpr <= max_threads ? tpr : 0;
}

// kPack<T> (16-byte accesses) where `hidden` and every non-null pointer allow, else 1.
template <typename T>
int PickVec(int64_t hidden, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = kPack<T>;
  if (hidden % kVec != 0) return 1;
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return kVec;
}

}  // namespace jax_ls2
