"""Build and install jax_ls2.

The CUDA kernels and their XLA FFI handlers in ``csrc/`` are compiled with nvcc
against ``jax.ffi.include_dir()`` into one pybind11 module, ``jax_ls2._C``.
Where nvcc is missing (or ``JAX_LS2_SKIP_CUDA=1``) the package installs without
it, and every op runs through its pure-JAX reference.

Environment:
  JAX_LS2_CUDA_ARCHS   semicolon/comma separated compute capabilities, default "80;90"
  JAX_LS2_SKIP_CUDA    "1" to skip the CUDA build
  JAX_LS2_BUILD_JOBS   parallel nvcc processes (default: CPU count)
  NVCC                 the nvcc to use (default: found on PATH or in $CUDA_HOME/bin)
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _find_nvcc():
    if os.environ.get("JAX_LS2_SKIP_CUDA") == "1":
        return None
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _archs():
    raw = os.environ.get("JAX_LS2_CUDA_ARCHS", "80;90")
    archs = [a.strip().replace(".", "") for a in raw.replace(",", ";").split(";") if a.strip()]
    flags = []
    for a in archs:
        flags += [f"-gencode=arch=compute_{a},code=sm_{a}"]
    # PTX of the newest arch so later GPUs can JIT it.
    flags += [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


class NvccBuildExt(build_ext):
    """Compiles every csrc/**/*.cu|.cc with nvcc and links them into jax_ls2/_C."""

    def run(self):
        if _find_nvcc() is None:
            print("jax_ls2: nvcc not found or JAX_LS2_SKIP_CUDA=1; installing without CUDA kernels "
                  "(ops run through their pure-JAX references)", file=sys.stderr)
            self.extensions = []
        super().run()

    def build_extension(self, ext):
        nvcc = _find_nvcc()
        import jax.ffi
        import pybind11

        out_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        tmp = os.path.join(self.build_temp, "jax_ls2_objs")
        os.makedirs(tmp, exist_ok=True)
        includes = [
            f"-I{jax.ffi.include_dir()}",
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{os.path.join(ROOT, 'csrc')}",
        ]
        host = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
        # .cu: kernels, for every target arch; .cc: host code only (the FFI handlers and the
        # module, which launch nothing themselves), compiled as plain C++ without device passes.
        device = host + ["--expt-relaxed-constexpr", "-lineinfo"] + _archs()
        # The kernels first: the host-only files are quick and fill the last gaps of the pool.
        sources = sorted(ext.sources, key=lambda src: (not src.endswith(".cu"), src))

        def compile_one(src):
            rel = os.path.relpath(src, ROOT).replace(os.sep, "_")
            obj = os.path.join(tmp, rel + ".o")
            deps = [src] + glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True) \
                + glob.glob(os.path.join(ROOT, "csrc", "**", "*.cuh"), recursive=True)
            if os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(d) for d in deps):
                return obj
            lang = ["-x", "cu"] + device if src.endswith(".cu") else ["-x", "c++"] + host
            cmd = [nvcc] + lang + ["-c", src, "-o", obj] + includes
            print(" ".join(cmd), file=sys.stderr)
            subprocess.check_call(cmd)
            return obj

        jobs = int(os.environ.get("JAX_LS2_BUILD_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objs = list(pool.map(compile_one, sources))
        link = [nvcc, "-shared", "-o", out_path] + objs + _archs() + ["-cudart=static"]
        print(" ".join(link), file=sys.stderr)
        subprocess.check_call(link)


def _sources():
    files = []
    for pattern in ("csrc/*.cc", "csrc/kernels/*.cu", "csrc/ffi/*.cc", "csrc/ffi/*.cu"):
        files += glob.glob(os.path.join(ROOT, pattern))
    return sorted(files)


setup(
    name="jax_ls2",
    version="0.1.0",
    description="LightSeq2-style fused Transformer training kernels for JAX on NVIDIA GPUs",
    packages=find_packages(include=["jax_ls2", "jax_ls2.*", "flax_models", "flax_models.*"]),
    python_requires=">=3.12",
    install_requires=["jax==0.11.2", "jaxlib==0.11.2", "flax==0.12.10", "optax==0.2.8", "numpy",
                      "orbax-checkpoint>=0.11", "safetensors>=0.4"],
    extras_require={"test": ["pytest", "pytest-xdist"]},
    ext_modules=[Extension("jax_ls2._C", sources=_sources())],
    cmdclass={"build_ext": NvccBuildExt},
    zip_safe=False,
)
