"""Test setup: 8 simulated CPU devices for the sharding tests, the `gpu` marker
(skipped without a GPU and the compiled kernels), and NaN-filled kernel outputs
(JAX_LS2_POISON_OUTPUTS=1: the FFI handlers fill their outputs with NaN before each
launch, so an element a kernel fails to write fails the GPU tests)."""
import os

os.environ.setdefault("JAX_LS2_POISON_OUTPUTS", "1")
os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402


def _have_gpu() -> bool:
    try:
        import jax_ls2
        return jax.default_backend() == "gpu" and jax_ls2.cuda_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    # The long training runs (marker `slow`) first, so that with several xdist workers
    # the short tests fill in around them instead of one long run finishing last.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and the compiled jax_ls2 CUDA kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
