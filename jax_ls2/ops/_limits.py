"""Sizes fixed by the CUDA kernels, written once on the Python side; tests/test_contracts.py
checks each against the C++ headers (and the compiled module where it is built)."""
from __future__ import annotations

# Rows of partial column sums (dgamma, dbeta, dbias) in a backward workspace: at most one
# per CUDA block (kMaxPartialRows, csrc/kernels/common.cuh).
MAX_PARTS = 264
# Most copies of y a norm's backward kernel sums: 1 + kLayerNormMaxExtraDy
# (csrc/kernels/layer_norm.h) and 1 + kRmsNormMaxExtraDy (csrc/kernels/rms_norm.h).
MAX_COPIES = 4
