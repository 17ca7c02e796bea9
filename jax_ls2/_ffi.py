"""Loads the compiled extension ``jax_ls2._C`` and registers its FFI targets for CUDA.

``cuda_available()`` says whether the kernels can be used: the extension was built
and imported. Ops consult it at trace time; when it is False, the CUDA branch of
every op falls back to the pure-JAX reference (on a GPU without the extension,
``require_cuda()`` raises with rebuild instructions when kernels are demanded).
"""
from __future__ import annotations

import functools
import os

import jax

REBUILD_HINT = (
    "jax_ls2 was installed without its CUDA kernels. Rebuild on a machine with nvcc: "
    "`pip install --no-build-isolation --no-deps -e .` (set JAX_LS2_CUDA_ARCHS, e.g. '80;90', "
    "for the target GPUs)."
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


def cuda_available() -> bool:
    """True when the CUDA kernels were compiled and registered."""
    return _load()[0] is not None


def registered_targets() -> frozenset:
    """Names of the FFI targets registered for CUDA (empty without the extension)."""
    return _load()[0] or frozenset()


def has_target(name: str) -> bool:
    return name in registered_targets()


def require_cuda(op: str) -> None:
    """Raises RuntimeError naming `op` when the CUDA kernels are not built."""
    if not cuda_available():
        raise RuntimeError(f"{op}: CUDA kernels requested but unavailable ({_load()[1]}). {REBUILD_HINT}")
