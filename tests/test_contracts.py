"""Constants written down on both sides of the Python/C++ boundary agree.

Each Python constant that mirrors a C++ one is compared with the value parsed from the
C++ header (on any machine, extension or not) and, where ``jax_ls2._C`` imports, with
``_C.constants()``, the values the compiled module was built with.
"""
from __future__ import annotations

import importlib
import pathlib
import re

import numpy as np
import pytest

from jax_ls2 import _random
from jax_ls2.ops import _limits
from jax_ls2.optim import _abi

# The modules (jax_ls2.ops re-exports functions of the same names).
dropout_ops = importlib.import_module("jax_ls2.ops.dropout")
flash_ops = importlib.import_module("jax_ls2.ops.flash_attention")
gated_act_ops = importlib.import_module("jax_ls2.ops.gated_act")

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ROOT / "csrc" / "kernels"
REGISTRY = ROOT / "csrc" / "ffi" / "registry.h"


# ---------------------------------------------------------------- header parsing
def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _int(literal: str, known: dict) -> int:
    """Value of a constant expression of integer literals and names already known."""
    expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b", r"\1", literal.strip())
    return int(eval(expr, {"__builtins__": {}}, dict(known)))  # noqa: S307 (our own headers)


def parse_constants(path: pathlib.Path, prefix: str = "") -> dict:
    """{name: value} of every `constexpr <int type> kName = ...;` and every enumerator
    (explicit or implicit values) in a header, names prefixed with `prefix`."""
    text = _strip_comments(path.read_text())
    out: dict = {}
    for m in re.finditer(r"constexpr\s+(?:int|int64_t|uint32_t|size_t)\s+([^;]+);", text):
        for decl in m.group(1).split(","):
            if "=" in decl and "(" not in decl.split("=")[0]:
                name, value = (s.strip() for s in decl.split("=", 1))
                try:
                    if re.fullmatch(r"k\w+", name):
                        out[name] = _int(value, out)
                except (NameError, SyntaxError, TypeError):
                    pass  # a template or an expression of non-integers: not a mirrored value
    for m in re.finditer(r"enum\s+\w+\s*(?::\s*\w+)?\s*\{([^}]*)\}", text):
        nxt = 0
        for item in (i.strip() for i in m.group(1).split(",")):
            if not item:
                continue
            name, _, value = (s.strip() for s in item.partition("="))
            nxt = _int(value, out) if value else nxt
            out[name] = nxt
            nxt += 1
    return {prefix + k: v for k, v in out.items()}


@pytest.fixture(scope="module")
def header():
    consts = {}
    for name in ("common.cuh", "dropout.h", "flash_attention.h", "layer_norm.h", "rms_norm.h", "gated_act.h"):
        consts.update(parse_constants(KERNELS / name))
    consts.update(parse_constants(KERNELS / "optimizer.h", prefix="optim::"))
    return consts


def header_option_names() -> list:
    text = _strip_comments(REGISTRY.read_text())
    body = re.search(r"kKernelOptionNames\[kNumKernelOptions\]\s*=\s*\{([^}]*)\}", text).group(1)
    return re.findall(r'"([a-z_0-9]+)"', body)


# ---------------------------------------------------------------- the mirrors
# (where the Python value lives, its value, the C++ constant it mirrors, C++ value -> Python value)
def _mirrors():
    same = lambda v: v  # noqa: E731
    rows = []
    hp = ["LR", "B1", "B2", "ONE_MINUS_B1", "ONE_MINUS_B2", "EPS", "EPS_ROOT", "WD", "INV_BC1", "INV_BC2",
          "INV_SCALE", "MAX_NORM", "GRAD_MULT"]
    cpp_hp = ["kLr", "kB1", "kB2", "kOneMinusB1", "kOneMinusB2", "kEps", "kEpsRoot", "kWd", "kInvBc1", "kInvBc2",
              "kInvScale", "kMaxNorm", "kGradMult"]
    modes = {"APPLY": "kApply", "HAS_MU": "kHasMu", "HAS_NU": "kHasNu", "MASTER": "kMaster", "CHECK": "kCheck",
             "CLIP": "kClip", "SR": "kSr", "NESTEROV": "kNesterov", "MOMENT_BF16": "kMomentBf16",
             "FLAT_GRADS": "kFlatGrads", "REPORT": "kReport", "ADAM": "kAdam", "SGD": "kSgd"}
    for py, cpp in list(zip(hp, cpp_hp)) + list(modes.items()):
        rows.append((f"optim._abi.{py}", getattr(_abi, py), f"optim::{cpp}", same))
    for py, cpp in {"PAD": "kPad", "MAX_LEAVES": "kMaxLeaves", "NORM_BLOCKS": "kNormBlocks",
                    "HP_SIZE": "kHpSize"}.items():
        rows.append((f"optim._abi.{py}", getattr(_abi, py), f"optim::{cpp}", same))
    rows.append(("ops._limits.MAX_PARTS", _limits.MAX_PARTS, "kMaxPartialRows", same))
    rows.append(("_random.MAX_ROW_DIMS", _random.MAX_ROW_DIMS, "kMaskMaxRowDims", same))
    # MAX_COPIES: y and the extra cotangents each norm's backward kernel adds to it.
    rows.append(("ops._limits.MAX_COPIES[layer_norm]", _limits.MAX_COPIES, "kLayerNormMaxExtraDy", lambda v: v + 1))
    rows.append(("ops._limits.MAX_COPIES[rms_norm]", _limits.MAX_COPIES, "kRmsNormMaxExtraDy", lambda v: v + 1))
    acts = {"relu": "kActRelu", "gelu": "kActGelu", "gelu_tanh": "kActGeluTanh"}
    for name, code in dropout_ops._ACT_CODE.items():
        rows.append((f"ops.dropout._ACT_CODE[{name!r}]", code, acts[name], same))
    gated = {"swiglu": "kGatedSwiglu", "geglu": "kGatedGeglu", "geglu_tanh": "kGatedGegluTanh"}
    for name, code in gated_act_ops._ACT_CODE.items():
        rows.append((f"ops.gated_act._ACT_CODE[{name!r}]", code, gated[name], same))
    for i, cpp in enumerate(("kFlashHeadDimSmall", "kFlashHeadDimLarge")):
        rows.append((f"ops.flash_attention.KERNEL_HEAD_DIMS[{i}]", flash_ops.KERNEL_HEAD_DIMS[i], cpp, same))
    return rows


MIRRORS = _mirrors()
# C++ constants that Python does not name but repeats in its arithmetic (_random.py):
# checked by recomputing the generator from the header's values.
HASH_CONSTANTS = ("kDropoutIndexMul", "kMix32Mul1", "kMix32Mul2")


@pytest.mark.parametrize("where,value,cpp,convert", MIRRORS, ids=[m[0] for m in MIRRORS])
def test_python_constant_matches_the_header(header, where, value, cpp, convert):
    assert cpp in header, f"{cpp} not found in the headers under csrc/kernels (renamed?)"
    assert value == convert(header[cpp]), f"{where} = {value}, but the C++ side ({cpp} = {header[cpp]}) implies " \
                                          f"{convert(header[cpp])}"


def test_every_activation_has_a_code(header):
    codes = sorted(v for k, v in header.items() if re.fullmatch(r"kAct(?!Fwd|Bwd)[A-Z]\w*", k))
    assert len(dropout_ops.ACTIVATIONS) == len(codes) == 3, (dropout_ops.ACTIVATIONS, codes)
    assert sorted(dropout_ops._ACT_CODE.values()) == codes


def _mix32(x, m1, m2):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(m1)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(m2)
    return x ^ (x >> np.uint32(16))


def test_dropout_generator_uses_the_header_multipliers(header):
    """_random's mix32 and keep_mask equal the hash rebuilt from the header's multipliers."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        want = _mix32(x, header["kMix32Mul1"], header["kMix32Mul2"])
    np.testing.assert_array_equal(np.asarray(_random.mix32(x)), want)

    k0, k1, offset, threshold = 0x12345678, 0x9ABCDEF0, 7, 19661
    seed = np.array([k0, k1, offset], np.uint32)
    got = np.asarray(_random.keep_mask(seed, (8, 129), threshold)).reshape(-1)
    g = np.arange(8 * 129, dtype=np.uint32) + np.uint32(offset)
    with np.errstate(over="ignore"):
        w = ((g & np.uint32(0xFFFFFFFE)) * np.uint32(header["kDropoutIndexMul"]) + np.uint32(k0)) ^ np.uint32(k1)
        h = _mix32(w, header["kMix32Mul1"], header["kMix32Mul2"])
    u = np.where(g & 1, h >> 16, h & 0xFFFF)
    np.testing.assert_array_equal(got, u >= threshold)


def _names_used_outside():
    """Launch-option names the GPU tests that set kernel options (("name", value) pairs
    and {"name": value} dicts) and bench/gpu_check.sh's sweeps (name=value) pass to the
    module."""
    used = set()
    name = r"((?:dropout|softmax|layer_norm|cross_entropy)_[a-z_0-9]+)"  # options are named by op family
    pattern = rf"\(\"{name}\", \d+\)|\"{name}\": \d+"
    for path in (ROOT / "tests").glob("test_*.py"):
        text = path.read_text()
        # Files that set launch options; test_dispatch.py also passes an unknown name on
        # purpose, and other files hold op names in dicts of their own (call counts).
        if path.name != "test_dispatch.py" and "kernel_option" in text:
            used.update(a or b for a, b in re.findall(pattern, text))
    for line in (ROOT / "bench" / "gpu_check.sh").read_text().splitlines():
        if "variants" in line.lower():
            used.update(re.findall(r"\b([a-z][a-z_0-9]*)=\d", line))
    return used


def test_launch_option_names_are_known():
    names = header_option_names()
    enum = parse_constants(REGISTRY)
    assert len(names) == enum["kNumKernelOptions"] == len(set(names)), names
    used = _names_used_outside()
    assert used, "found no launch option used by the tests or bench/gpu_check.sh"
    assert used <= set(names), f"unknown launch options used: {sorted(used - set(names))}"


# ---------------------------------------------------------------- the compiled module
@pytest.fixture(scope="module")
def compiled():
    try:
        from jax_ls2 import _C  # type: ignore[attr-defined]
    except ImportError:
        pytest.skip("extension not built")
    return _C


def test_module_exports_the_header_values(compiled, header):
    exported = compiled.constants()
    wanted = {cpp for _, _, cpp, _ in MIRRORS} | set(HASH_CONSTANTS)
    assert set(exported) == wanted, (f"exported but not mirrored: {sorted(set(exported) - wanted)}; "
                                     f"mirrored but not exported: {sorted(wanted - set(exported))}")
    for name, value in exported.items():
        assert value == header[name], f"_C.constants()[{name!r}] = {value}, the header says {header[name]}"


@pytest.mark.parametrize("where,value,cpp,convert", MIRRORS, ids=[m[0] for m in MIRRORS])
def test_python_constant_matches_the_module(compiled, where, value, cpp, convert):
    exported = compiled.constants()[cpp]
    assert value == convert(exported), f"{where} = {value}, the compiled module has {cpp} = {exported}"


def test_module_knows_the_launch_option_names(compiled):
    assert list(compiled.kernel_options()) == header_option_names()
    for name in compiled.kernel_options():
        compiled.set_kernel_option(name, 0)  # every listed name is accepted (0: the built-in choice)
