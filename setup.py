"""Build and install jax_ls2.

The CUDA kernels (``csrc/kernels/*.cu``, compiled with nvcc and CUDA's headers alone:
no XLA header may reach them) and their XLA FFI handlers (``csrc/ffi/*.cc``, compiled
against ``jax.ffi.include_dir()``) are linked into one pybind11 module, ``jax_ls2._C``.
Without it the package still installs, and every op runs through its pure-JAX reference.

Whether the kernels are built:
  * ``JAX_LS2_SKIP_CUDA=1``: never.
  * ``JAX_LS2_BUILD_CUDA=1``: always (the install fails when nvcc is missing or a
    source does not compile), for ``JAX_LS2_CUDA_ARCHS`` or else the GPUs found, or
    else sm_80 and sm_90.
  * otherwise: where ``nvidia-smi`` reports an NVIDIA GPU and nvcc is found, for that
    GPU's architecture; on a machine without a GPU the install skips them (in seconds)
    and says how to build them.

Environment:
  JAX_LS2_BUILD_CUDA   "1" to build the kernels whether or not a GPU is present
  JAX_LS2_SKIP_CUDA    "1" to skip the CUDA build
  JAX_LS2_CUDA_ARCHS   semicolon/comma separated compute capabilities, e.g. "90" or "80;90"
                       (default: those of the GPUs nvidia-smi lists, else "80;90"); the
                       newest also goes in as PTX, so later GPUs can JIT it
  JAX_LS2_PTX_ONLY     "1" to embed PTX alone, no machine code: every source still goes
                       through nvcc's front end, but ptxas never runs (about half the
                       compile time; CI, which runs no kernel, builds so). A GPU then
                       compiles the PTX when the module loads, which is slow: not for use.
  JAX_LS2_BUILD_JOBS   parallel nvcc processes (default: CPU count)
  NVCC                 the nvcc to use (default: found on PATH or in $CUDA_HOME/bin)

pip shows a build's output only with ``-v``: ``pip install -v -e .`` prints one line per
source as it compiles ("[3/20] csrc/kernels/softmax.cu") and the message saying whether
the kernels were built or skipped. To add the kernels to an installed checkout (no
network needed, pybind11 installed): ``JAX_LS2_BUILD_CUDA=1 pip install
--no-build-isolation --no-deps -e .``
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "80;90"
HOW_TO_BUILD = "JAX_LS2_BUILD_CUDA=1 pip install --no-build-isolation --no-deps -e ."


def _log(msg):
    print(f"jax_ls2: {msg}", file=sys.stderr, flush=True)


def _env_flag(name):
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise SystemExit(f"jax_ls2: {name} must be 0 or 1, got {value!r}")
    return value == "1"


def _find_nvcc():
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _gpu_archs():
    """Compute capabilities of the visible NVIDIA GPUs ("90", ...), [] when there are none
    or nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    caps = [line.strip().replace(".", "") for line in out.stdout.splitlines()]
    return sorted({c for c in caps if c.isdigit()}, key=int)


def _archs():
    """The compute capabilities to build for, in increasing order."""
    raw = os.environ.get("JAX_LS2_CUDA_ARCHS")
    if raw is None:
        found = _gpu_archs()
        raw = ";".join(found) if found else DEFAULT_ARCHS
    archs = [a.strip().replace(".", "") for a in raw.replace(",", ";").split(";") if a.strip()]
    if not archs or not all(a.isdigit() for a in archs):
        raise SystemExit(f"jax_ls2: JAX_LS2_CUDA_ARCHS must list compute capabilities such as '90' or '80;90', "
                         f"got {raw!r}")
    return sorted(set(archs), key=int)


def _gencode(archs):
    if _env_flag("JAX_LS2_PTX_ONLY"):
        return [f"-gencode=arch=compute_{a},code=compute_{a}" for a in archs]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # PTX of the newest arch so later GPUs can JIT it (the same compile as its SASS).
    flags += [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


def _build_decision():
    """(build?, why): whether to compile the kernels here, and the reason in words."""
    if _env_flag("JAX_LS2_SKIP_CUDA"):
        return False, "JAX_LS2_SKIP_CUDA=1"
    nvcc = _find_nvcc()
    if _env_flag("JAX_LS2_BUILD_CUDA"):
        if nvcc is None:
            raise SystemExit("jax_ls2: JAX_LS2_BUILD_CUDA=1 but nvcc was found neither on PATH, in $NVCC nor in "
                             "$CUDA_HOME/bin")
        return True, "JAX_LS2_BUILD_CUDA=1"
    if not _gpu_archs():
        return False, "no NVIDIA GPU found (nvidia-smi)"
    if nvcc is None:
        return False, "an NVIDIA GPU is present but nvcc was not found (install the CUDA toolkit or set NVCC)"
    return True, "an NVIDIA GPU is present"


class NvccBuildExt(build_ext):
    """Compiles csrc/kernels/*.cu and csrc/ffi/*.cc with nvcc and links them into jax_ls2._C."""

    def run(self):
        build, why = _build_decision()
        if not build:
            _log(f"CUDA kernels skipped: {why}. Every op runs through its pure-JAX reference. "
                 f"To build the kernels: {HOW_TO_BUILD}")
            self.extensions = []
        else:
            _log(f"building the CUDA kernels ({why}) for sm_{', sm_'.join(_archs())}")
        super().run()

    def build_extension(self, ext):
        nvcc = _find_nvcc()
        import jax.ffi
        import pybind11

        out_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        tmp = os.path.join(self.build_temp, "jax_ls2_objs")
        os.makedirs(tmp, exist_ok=True)
        gencode = _gencode(_archs())
        csrc = [f"-I{os.path.join(ROOT, 'csrc')}"]
        # The kernels see csrc/ and CUDA's headers only, so an XLA header included under
        # csrc/kernels/ fails the build; the handlers and the module see XLA and pybind11.
        ffi_includes = csrc + [
            f"-I{jax.ffi.include_dir()}",
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
        ]
        host = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
        # .cu: kernels, for every target arch; .cc: host code only (the FFI handlers and the
        # module, which launch nothing themselves), compiled as plain C++ without device passes.
        device = host + ["--expt-relaxed-constexpr", "-lineinfo"] + gencode
        # The kernels first: the host-only files are quick and fill the last gaps of the pool.
        sources = sorted(ext.sources, key=lambda src: (not src.endswith(".cu"), src))
        deps = glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True) \
            + glob.glob(os.path.join(ROOT, "csrc", "**", "*.cuh"), recursive=True)
        newest_dep = max((os.path.getmtime(d) for d in deps), default=0.0)
        jobs = max(1, int(os.environ.get("JAX_LS2_BUILD_JOBS", os.cpu_count() or 1)))
        _log(f"nvcc {' '.join(device)} ({jobs} jobs)")
        t0 = time.monotonic()
        done, lock = [0], threading.Lock()

        def progress(rel, what):
            with lock:
                done[0] += 1
                _log(f"[{done[0]}/{len(sources)}] {rel} ({what})")

        def compile_one(src):
            rel = os.path.relpath(src, ROOT)
            obj = os.path.join(tmp, rel.replace(os.sep, "_") + ".o")
            if os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_dep):
                progress(rel, "up to date")
                return obj
            kernel = src.endswith(".cu")
            lang = ["-x", "cu"] + device if kernel else ["-x", "c++"] + host
            cmd = [nvcc] + lang + ["-c", src, "-o", obj] + (csrc if kernel else ffi_includes)
            start = time.monotonic()
            subprocess.check_call(cmd)
            progress(rel, f"{time.monotonic() - start:.0f} s")
            return obj

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            objs = list(pool.map(compile_one, sources))
        link = [nvcc, "-shared", "-o", out_path] + objs + gencode + ["-cudart=static"]
        subprocess.check_call(link)
        _log(f"built {os.path.relpath(out_path, ROOT)} in {time.monotonic() - t0:.0f} s")


def _sources():
    files = []
    for pattern in ("csrc/kernels/*.cu", "csrc/ffi/*.cc"):
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
    extras_require={"test": ["pytest", "pytest-xdist", "ruff"]},
    ext_modules=[Extension("jax_ls2._C", sources=_sources())],
    cmdclass={"build_ext": NvccBuildExt},
    zip_safe=False,
)
