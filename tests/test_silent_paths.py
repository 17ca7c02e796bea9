"""No silent paths: JAX_LS2_IMPL=cuda is an error wherever the kernels cannot run, a
CUDA backend without the kernels warns once, and the package says which
implementation its ops run."""
import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_ls2
from jax_ls2 import _dispatch, _ffi
from jax_ls2.ops import layer_norm, softmax_dropout

BUILT = frozenset({"jax_ls2_layer_norm_fwd", "jax_ls2_layer_norm_bwd"})


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Each test traces the ops afresh, with the warning not yet given."""
    monkeypatch.setattr(_dispatch, "_warned_causes", set())
    monkeypatch.delenv("JAX_LS2_IMPL", raising=False)
    _dispatch.forget_choices()
    yield
    _dispatch.forget_choices()


def _inputs():
    x = jax.random.normal(jax.random.key(0), (3, 16))
    return x, jnp.ones((16,)), jnp.zeros((16,))


def test_impl_cuda_without_the_extension_raises_naming_the_op_and_the_rebuild(monkeypatch):
    monkeypatch.setenv("JAX_LS2_IMPL", "cuda")
    monkeypatch.setattr(_ffi, "_load", lambda: (None, "cannot import name '_C'"))
    with pytest.raises(RuntimeError, match=r"jax_ls2_layer_norm_fwd: CUDA kernels requested but unavailable "
                                            r"\(the extension jax_ls2\._C is not available: cannot import.*"
                                            r"pip install --no-build-isolation --no-deps -e \."):
        layer_norm(*_inputs())


def test_impl_cuda_on_a_cpu_only_machine_raises_even_with_the_kernels_built(monkeypatch):
    # Before, the built targets made the op take platform_dependent's reference branch
    # on the CPU without a word.
    monkeypatch.setenv("JAX_LS2_IMPL", "cuda")
    monkeypatch.setattr(_ffi, "_load", lambda: (BUILT, None))
    monkeypatch.setattr(_ffi, "cuda_backend", lambda: False)
    with pytest.raises(RuntimeError, match=r"jax_ls2_layer_norm_fwd: CUDA kernels requested but unavailable "
                                            r"\(JAX has no CUDA backend.*NVIDIA GPU"):
        layer_norm(*_inputs())
    with pytest.raises(RuntimeError, match=r"jax_ls2\.implementation: CUDA kernels requested"):
        jax_ls2.implementation()


def test_cuda_backend_without_kernels_warns_once(monkeypatch):
    monkeypatch.setattr(_ffi, "_load", lambda: (None, "cannot import name '_C'"))
    monkeypatch.setattr(_ffi, "cuda_backend", lambda: True)
    x, g, b = _inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            jax.grad(lambda x: jnp.sum(layer_norm(x, g, b) ** 2))(x)
            softmax_dropout(x[None])
    ours = [w for w in caught if issubclass(w.category, jax_ls2.KernelsUnavailableWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "reference on a CUDA backend because the extension jax_ls2._C is not available" in message
    assert _ffi.REBUILD_COMMAND in message


def test_cpu_default_mode_is_quiet_and_runs_the_reference(monkeypatch):
    monkeypatch.setattr(_ffi, "cuda_backend", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ls2.KernelsUnavailableWarning)
        layer_norm(*_inputs())
    assert jax_ls2.implementation() == "reference"


def test_cuda_available_means_the_kernels_run_here(monkeypatch):
    monkeypatch.setattr(_ffi, "_load", lambda: (BUILT, None))
    monkeypatch.setattr(_ffi, "cuda_backend", lambda: False)
    assert jax_ls2.kernels_built() and not jax_ls2.cuda_available()
    assert jax_ls2.implementation() == "reference"
    monkeypatch.setattr(_ffi, "cuda_backend", lambda: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert jax_ls2.cuda_available()
    assert jax_ls2.implementation() == "cuda"
    monkeypatch.setenv("JAX_LS2_IMPL", "reference")
    assert jax_ls2.implementation() == "reference"
    monkeypatch.setenv("JAX_LS2_IMPL", "auto")
    monkeypatch.setattr(_ffi, "_load", lambda: (None, "not built"))
    assert not jax_ls2.kernels_built() and not jax_ls2.cuda_available()
    assert jax_ls2.implementation() == "reference"
