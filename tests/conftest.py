"""Test setup: 8 simulated CPU devices for the sharding tests, the `gpu` marker
(skipped without a GPU and the compiled kernels), and NaN-filled kernel outputs
(JAX_LS2_POISON_OUTPUTS=1: the FFI handlers fill their outputs with NaN before each
launch, so an element a kernel fails to write fails the GPU tests).

Two switches for bench/gpu_tests.py, which runs the GPU tests in several processes:
JAX_LS2_TEST_SHARD=i/n keeps the i-th of every n GPU tests (where pytest-xdist is
missing), and JAX_LS2_TEST_PROFILE=DIR makes each process write DIR/<name>.json with where
its time went: start-up (from JAX_LS2_TEST_T0, the runner's clock), collection, JAX's
tracing and lowering, XLA's backend compiles (their number and seconds), and the rest."""
import json
import os
import time

def _cuda_plugin_installed() -> bool:
    """Whether jax could reach a CUDA GPU here (its CUDA plugin is installed)."""
    import importlib.util
    import pkgutil

    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return True
    try:
        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


os.environ.setdefault("JAX_LS2_POISON_OUTPUTS", "1")
os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Where jax has only the CPU, XLA's LLVM code generation runs unoptimised: the suite is
# bound by thousands of small compiles, not by running the programs (tests/test_layers.py
# took 42 s instead of 60 s on 2 cores), and the arithmetic is the same IEEE arithmetic
# (no fast-math either way). Set by the environment, so the tests' subprocesses get it
# too; left alone where a GPU may run, whose kernels XLA compiles with the same flag.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] and not _cuda_plugin_installed():
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

_T_CONFTEST = time.time()

import jax  # noqa: E402
import pytest  # noqa: E402

# Tests marked `optimized_cpu_code` spend their time running programs (training runs),
# not compiling them: for them XLA optimises its CPU code after all (the SR convergence
# run of tests/test_optim.py took 37 s instead of 59 s). The option reaches XLA through
# the compile options of each program, since XLA reads XLA_FLAGS once per process.
_OPTIMIZED_CPU_CODE = {"on": False}


def _wrap_compile_options():
    from jax._src import compiler
    plain = getattr(compiler, "get_compile_options", None)
    if plain is None:
        return

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        if _OPTIMIZED_CPU_CODE["on"]:
            env_options_overrides = dict(env_options_overrides or {})
            env_options_overrides.setdefault("xla_backend_optimization_level", 2)
        return plain(*args, env_options_overrides=env_options_overrides, **kwargs)
    compiler.get_compile_options = get_compile_options


if "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]:
    _wrap_compile_options()


@pytest.fixture(autouse=True)
def _optimized_cpu_code(request, monkeypatch):
    """Turns XLA's CPU optimisations back on for an `optimized_cpu_code` test, in this
    process and in the subprocesses it starts (they read XLA_FLAGS)."""
    if request.node.get_closest_marker("optimized_cpu_code") is None:
        yield
        return
    flags = os.environ["XLA_FLAGS"].replace("--xla_backend_optimization_level=0", "--xla_backend_optimization_level=2")
    monkeypatch.setenv("XLA_FLAGS", flags)
    _OPTIMIZED_CPU_CODE["on"] = True
    try:
        yield
    finally:
        _OPTIMIZED_CPU_CODE["on"] = False

_PROFILE_DIR = os.environ.get("JAX_LS2_TEST_PROFILE")
_PROFILE = {"compiles": 0, "backend_compile_s": 0.0, "trace_s": 0.0, "lower_s": 0.0}
_EVENTS = {"/jax/core/compile/backend_compile_duration": "backend_compile_s",
           "/jax/core/compile/jaxpr_trace_duration": "trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s"}


def _on_duration(event, duration, **_):
    key = _EVENTS.get(event)
    if key is not None:
        _PROFILE[key] += duration
        _PROFILE["compiles"] += key == "backend_compile_s"


if _PROFILE_DIR:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


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
    shard = os.environ.get("JAX_LS2_TEST_SHARD")
    if shard:
        i, n = (int(v) for v in shard.split("/"))
        gpu = [item for item in items if "gpu" in item.keywords]
        keep = set(gpu[i::n])
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = [item for item in items if item in keep]
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and the compiled jax_ls2 CUDA kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection(session):
    _PROFILE["collect_t0"] = time.time()


def pytest_collection_finish(session):
    _PROFILE["collect_s"] = time.time() - _PROFILE.pop("collect_t0", time.time())


def pytest_sessionfinish(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not _PROFILE_DIR or (worker is None and getattr(session.config.option, "numprocesses", None)):
        return  # off, or the xdist controller (its workers write their own)
    name = worker or "shard" + os.environ.get("JAX_LS2_TEST_SHARD", "0/1").replace("/", "of")
    t0 = float(os.environ.get("JAX_LS2_TEST_T0", _T_CONFTEST))
    record = dict(_PROFILE, name=name, startup_s=_T_CONFTEST - t0, wall_s=time.time() - t0)
    os.makedirs(_PROFILE_DIR, exist_ok=True)
    with open(os.path.join(_PROFILE_DIR, f"{name}.json"), "w") as f:
        json.dump(record, f)
