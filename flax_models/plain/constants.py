"""The defaults the plain twins share with jax_ls2 (copied, so that the twins import no
jax_ls2 code; tests/test_plain_copies.py checks that they agree)."""

# LayerNorm's epsilon (jax_ls2.nn.config.EPSILON).
EPSILON = 1e-5
# RMSNorm's epsilon (jax_ls2.ops.rms_norm.RMS_EPSILON).
RMS_EPSILON = 1e-6
# Standard deviation of the decoder layer's normal kernel init (jax_ls2.nn.decoder.INIT_STDDEV).
INIT_STDDEV = 0.02
