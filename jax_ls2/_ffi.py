"""Loads the compiled extension ``jax_ls2._C`` and registers its FFI targets for CUDA.

Two questions, asked apart:

* ``kernels_built()``: the extension was compiled, imported, and its targets
  registered (lowering for CUDA then reaches the kernels, even on a machine without a
  GPU);
* ``cuda_available()``: the kernels will run here, i.e. they are built AND JAX has a
  CUDA backend.

``require_cuda()`` raises, naming the op, the cause and how to mend it, when the
kernels cannot run here.
"""
from __future__ import annotations

import functools
import os

import jax

REBUILD_COMMAND = "JAX_LS2_BUILD_CUDA=1 pip install --no-build-isolation --no-deps -e ."
REBUILD_HINT = (
    "jax_ls2 was installed without its CUDA kernels. Rebuild on a machine with nvcc: "
    f"`{REBUILD_COMMAND}` (set JAX_LS2_CUDA_ARCHS, e.g. '80;90', for the target GPUs)."
)
NO_CUDA_BACKEND_HINT = (
    "Run on a machine with an NVIDIA GPU and JAX's CUDA plugin (`pip install 'jax[cuda13]'`), "
    "or leave JAX_LS2_IMPL unset to run the pure-JAX reference."
)


@functools.lru_cache(maxsize=None)
def _load():
    if os.environ.get("JAX_LS2_DISABLE_CUDA") == "1":
        return None, "disabled by JAX_LS2_DISABLE_CUDA=1"
    try:
        from jax_ls2 import _C  # type: ignore[attr-defined]
    except ImportError as e:  # built without nvcc
        return None, str(e)
    targets = _C.registrations()
    for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return frozenset(targets), None


@functools.lru_cache(maxsize=None)
def cuda_backend() -> bool:
    """True when JAX has a CUDA backend with at least one device."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # no such platform, or it failed to initialise
        return False


def kernels_built() -> bool:
    """True when the CUDA kernels were compiled, and the extension imported and registered."""
    return _load()[0] is not None


def cuda_available() -> bool:
    """True when the CUDA kernels will run here: built and a CUDA backend present."""
    return kernels_built() and cuda_backend()


def registered_targets() -> frozenset:
    """Names of the FFI targets registered for CUDA (empty without the extension)."""
    return _load()[0] or frozenset()


def has_target(name: str) -> bool:
    return name in registered_targets()


def unavailable_reason() -> str:
    """Why the kernels cannot run here ("" when they can)."""
    reasons = []
    if not kernels_built():
        reasons.append(f"the extension jax_ls2._C is not available: {_load()[1]}")
    if not cuda_backend():
        reasons.append(f"JAX has no CUDA backend (its default backend is {jax.default_backend()!r})")
    return "; ".join(reasons)


def require_cuda(op: str) -> None:
    """Raises RuntimeError naming `op`, the cause and the remedy, unless the kernels run here."""
    if cuda_available():
        return
    hints = ([REBUILD_HINT] if not kernels_built() else []) + ([NO_CUDA_BACKEND_HINT] if not cuda_backend() else [])
    raise RuntimeError(f"{op}: CUDA kernels requested but unavailable ({unavailable_reason()}). "
                       + " ".join(hints))
