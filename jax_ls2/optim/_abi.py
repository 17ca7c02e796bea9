"""Constants shared with ``csrc/kernels/optimizer.h``, the only Python copy of them:
the flat layout's padding and per-launch limits, hyper-parameter slots of the ``hp``
vector, mode bits of the ``flags`` attribute and algorithm codes."""

# Layout and launch limits.
PAD = 16            # kPad: flat offsets are multiples of this many elements
MAX_LEAVES = 256    # kMaxLeaves: leaves per kernel launch
NORM_BLOCKS = 512   # kNormBlocks: blocks of the norm pass, per launch
HP_SIZE = 16        # kHpSize: length of the hp vector

# Hp: slots of the (HP_SIZE,) float32 hyper-parameter vector.
LR, B1, B2, ONE_MINUS_B1, ONE_MINUS_B2, EPS, EPS_ROOT, WD, INV_BC1, INV_BC2, INV_SCALE, MAX_NORM, GRAD_MULT = range(13)

# Algo
ADAM, SGD = 0, 1

# Mode bits
APPLY = 1          # write new params in place (else updates)
HAS_MU = 2
HAS_NU = 4
MASTER = 8
CHECK = 16         # skip the step when a gradient is not finite
CLIP = 32          # clip by the global norm
SR = 64            # stochastic rounding of FP16/BF16 params (no master)
NESTEROV = 128
MOMENT_BF16 = 256
FLAT_GRADS = 512   # grads arrive as one flat float32 buffer
REPORT = 1024      # without CHECK/CLIP: the update pass itself flags inf/NaN gradients
