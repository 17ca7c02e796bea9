"""Shared test helpers: float64 truths, the 2x error rule, HLO inspection, meshes."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def f64(x) -> np.ndarray:
    return np.asarray(jax.device_get(x)).astype(np.float64)


def rel_err(x, truth) -> float:
    x, truth = f64(x), f64(truth)
    assert np.all(np.isfinite(x)), "non-finite values in output"
    return float(np.linalg.norm((x - truth).ravel()) / max(np.linalg.norm(truth.ravel()), 1e-30))


def assert_close(a, b, tol: float):
    """Elementwise equal within ``tol``, absolute and relative (compared in float64)."""
    np.testing.assert_allclose(f64(a), f64(b), rtol=tol, atol=tol)


def assert_within_2x(name: str, out, xla_out, truth, floor: float = 1e-7):
    """The kernel's error against the float64 truth is at most twice the error of the
    XLA reference computed in the same dtype (plus a tiny floor for exact cases)."""
    e_kernel, e_xla = rel_err(out, truth), rel_err(xla_out, truth)
    assert e_kernel <= 2.0 * e_xla + floor, f"{name}: kernel error {e_kernel:.3e} > 2 x XLA error {e_xla:.3e}"


def mesh8(*axes: str, shape: tuple = (8,)) -> Mesh:
    """The 8 (simulated) devices as a mesh of ``shape`` named ``axes`` (default: one
    "data" axis of 8)."""
    devices = np.array(jax.devices()[:8])
    assert devices.size == 8, "needs --xla_force_host_platform_device_count=8"
    return Mesh(devices.reshape(shape), axes or ("data",))


def shard(x, mesh, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def compiled_text(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def cuda_lowering_text(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def under_kernel_option(name: str, value: int, fn, *args):
    """fn(*args) through a freshly compiled program run to completion with the launch
    option `name` set to `value` (jax_ls2._C.set_kernel_option), then the built-in
    choice restored. Fresh, because a program replays the CUDA graph of its first run."""
    return under_kernel_options({name: value}, fn, *args)


def under_kernel_options(options: dict, fn, *args):
    """under_kernel_option with several launch options set together."""
    from jax_ls2 import _C
    try:
        for name, value in options.items():
            _C.set_kernel_option(name, value)
        return jax.block_until_ready(jax.jit(lambda *a: fn(*a))(*args))
    finally:
        for name in options:
            _C.set_kernel_option(name, 0)


def assert_bf16_close(a, b, ulps: int = 1, floor: float = 2.0 ** -16):
    """Equal within `ulps` bfloat16 ulps of b (relative), elementwise, or within
    floor * max|b| where a sum in another order meets cancellation (a - b near 0)."""
    a, b = f64(a), f64(b)
    np.testing.assert_allclose(a, b, rtol=ulps * 2.0 ** -7, atol=floor * max(np.abs(b).max(), 1e-30))


def xla_flags_with_devices(n: int) -> str:
    """This process's XLA_FLAGS (the conftest's, e.g. its CPU code-generation level) with
    `n` simulated host devices instead of 8: for the tests' subprocesses."""
    import os
    import re
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return f"{flags.strip()} --xla_force_host_platform_device_count={n}".strip()


def assert_renamed_keyword(call_old, call_new, owner, old, new):
    """`call_old()` (the old spelling of a renamed keyword) warns once, a DeprecationWarning
    naming the new keyword, then works silently; both give what `call_new()` gives, and
    giving both spellings is a TypeError. Returns the result."""
    import warnings

    import pytest

    from jax_ls2 import _deprecation
    _deprecation._warned.discard((owner, old))
    with pytest.warns(DeprecationWarning, match=rf"^{owner}: the keyword {old}= is deprecated, renamed {new}="):
        first = call_old()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = call_old()
    want = call_new()
    for got in (first, second):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return first
