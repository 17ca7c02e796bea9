"""float32 constants of the GELU activations (exact erf form and tanh approximation),
shared by the reference math of the fused ops."""
from __future__ import annotations

import numpy as np

SQRT_HALF = np.float32(0.7071067811865476)  # 1 / sqrt(2): Phi(v) = (1 + erf(v / sqrt(2))) / 2
INV_SQRT_2PI = np.float32(0.3989422804014327)  # 1 / sqrt(2 pi): Phi'(v) = exp(-v^2 / 2) / sqrt(2 pi)
K_TANH = np.float32(0.7978845608028654)  # sqrt(2 / pi), the tanh form's scale
C_TANH = np.float32(0.044715)  # the tanh form's cubic coefficient
