"""The wall between the kernels and XLA: csrc/kernels/ includes no XLA header, and every
kernel source preprocesses with nvcc and CUDA's headers alone (as setup.py compiles it)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ROOT / "csrc" / "kernels"


def _nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for c in (os.environ.get("NVCC"), shutil.which("nvcc"), os.path.join(cuda_home, "bin", "nvcc")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def test_kernels_mention_no_xla_header():
    files = sorted(p for p in KERNELS.rglob("*") if p.is_file())
    assert files, f"no kernel sources under {KERNELS}"
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
                 for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if "xla/" in line]
    assert not offenders, "csrc/kernels/ must not include XLA headers:\n" + "\n".join(offenders)


KERNEL_SOURCES = sorted(KERNELS.glob("*.cu"))


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("src", KERNEL_SOURCES, ids=[p.name for p in KERNEL_SOURCES])
def test_kernel_preprocesses_without_xla(src):
    cmd = [_nvcc(), "-E", "-x", "cu", "-std=c++17", f"-I{ROOT / 'csrc'}", str(src), "-o", os.devnull]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{src.relative_to(ROOT)} does not preprocess with nvcc alone:\n{out.stderr[-2000:]}"
