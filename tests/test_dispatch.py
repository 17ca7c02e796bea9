import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ls2 import _dispatch, _ffi
from jax_ls2._dispatch import PARAM, ROWS, FusedKernel, Role


def _kernel(name):
    ref = lambda x, w, *, k: (x * w * k,)
    return FusedKernel(name, ref, operands=(Role(ROWS, 1), Role(PARAM)), results=(Role(ROWS, 1),),
                       result_types=lambda x, w, *, k: (_dispatch.result_type(x),), vmap_method="sequential")


def test_reference_runs_without_the_target():
    f = _kernel("jax_ls2_not_built")
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(f(x, jnp.ones(3), k=2.0)[0], 2 * x)


def test_demanding_cuda_without_the_kernels_says_how_to_rebuild(monkeypatch):
    monkeypatch.setenv("JAX_LS2_IMPL", "cuda")
    monkeypatch.setattr(_ffi, "_load", lambda: (None, "no extension"))
    f = _kernel("jax_ls2_not_built_either")
    with pytest.raises(RuntimeError, match=r"jax_ls2_not_built_either: CUDA kernels requested but unavailable.*"
                                            r"pip install --no-build-isolation --no-deps -e \."):
        f(jnp.ones((2, 3)), jnp.ones(3), k=1.0)


def test_bad_impl_mode(monkeypatch):
    monkeypatch.setenv("JAX_LS2_IMPL", "fastest")
    with pytest.raises(ValueError, match="JAX_LS2_IMPL must be 'auto', 'cuda' or 'reference', got 'fastest'"):
        _kernel("jax_ls2_mode")(jnp.ones((2, 3)), jnp.ones(3), k=1.0)


def test_vmap_folds_rows_and_maps_over_batched_params():
    f = _kernel("jax_ls2_vmap")
    x = jax.random.normal(jax.random.key(0), (4, 2, 3))
    w = jax.random.normal(jax.random.key(1), (4, 3))
    folded = jax.vmap(lambda x: f(x, w[0], k=3.0)[0])(x)
    np.testing.assert_allclose(folded, x * w[0] * 3.0, rtol=1e-6)
    mapped = jax.vmap(lambda x, w: f(x, w, k=3.0)[0])(x, w)
    np.testing.assert_allclose(mapped, x * w[:, None, :] * 3.0, rtol=1e-6)


def test_kernel_options_name_what_they_set():
    """The benchmark hook: known options take a value (0 restores the built-in choice),
    an unknown name is refused by name."""
    import jax_ls2
    if not jax_ls2.kernels_built():
        pytest.skip("extension not built")
    from jax_ls2 import _C
    _C.set_kernel_option("dropout_rows_in_flight", 2)
    _C.set_kernel_option("dropout_rows_in_flight", 0)
    with pytest.raises(ValueError, match="set_kernel_option: unknown option dropout_rows"):
        _C.set_kernel_option("dropout_rows", 2)
