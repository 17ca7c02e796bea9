// Decoding of a dropout mask's row map, the FFI attributes row_extents and row_strides
// (jax_ls2/_random.py, kernel_row_attrs) shared by the handlers of the dropout ops, the
// softmax and the embedding.
#pragma once
#include <string>

#include "ffi/common.h"
#include "kernels/common.cuh"

namespace jax_ls2 {

using Int64s = ffi::Span<const int64_t>;

// The row map of a buffer of `rows` rows, or InvalidArgument naming the op.
inline ffi::Error MaskRowsAttr(const char* op, int64_t rows, Int64s extents, Int64s strides, MaskRows* out) {
  if (extents.size() == 0 || extents.size() != strides.size() ||
      !MakeMaskRows(&extents[0], &strides[0], extents.size(), rows, out))
    return ffi::Error::InvalidArgument(std::string(op) + ": row_extents and row_strides must be 1 to " +
                                       std::to_string(kMaskMaxRowDims) + " entries whose extents multiply to the " +
                                       std::to_string(rows) + " rows (at most 2^32 - 1 over several dims)");
  return ffi::Error::Success();
}

}  // namespace jax_ls2
