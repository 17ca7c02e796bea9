// pybind11 module jax_ls2._C: registrations() -> {target name: PyCapsule(handler)},
// the constants the Python side mirrors, and the benchmark launch options.
#include <pybind11/pybind11.h>

#include <string>
#include <utility>

#include "ffi/registry.h"
#include "kernels/common.cuh"
#include "kernels/dropout.h"
#include "kernels/flash_attention.h"
#include "kernels/gated_act.h"
#include "kernels/layer_norm.h"
#include "kernels/optimizer.h"
#include "kernels/rms_norm.h"

namespace py = pybind11;

namespace {

// Every constant the Python side writes down again, by its C++ name (optimizer ones
// qualified with optim::); tests/test_contracts.py compares them with the Python values.
py::dict Constants() {
  using namespace jax_ls2;
  py::dict d;
  d["kMaxPartialRows"] = kMaxPartialRows;
  d["kMaskMaxRowDims"] = kMaskMaxRowDims;
  d["kDropoutIndexMul"] = kDropoutIndexMul;
  d["kMix32Mul1"] = kMix32Mul1;
  d["kMix32Mul2"] = kMix32Mul2;
  d["kLayerNormMaxExtraDy"] = kLayerNormMaxExtraDy;
  d["kActRelu"] = static_cast<int>(kActRelu);
  d["kActGelu"] = static_cast<int>(kActGelu);
  d["kActGeluTanh"] = static_cast<int>(kActGeluTanh);
  d["kFlashHeadDimSmall"] = kFlashHeadDimSmall;
  d["kFlashHeadDimLarge"] = kFlashHeadDimLarge;
  d["kRmsNormMaxExtraDy"] = kRmsNormMaxExtraDy;
  d["kGatedSwiglu"] = static_cast<int>(kGatedSwiglu);
  d["kGatedGeglu"] = static_cast<int>(kGatedGeglu);
  d["kGatedGegluTanh"] = static_cast<int>(kGatedGegluTanh);
  const std::pair<const char*, int> optim_constants[] = {
      {"kMaxLeaves", optim::kMaxLeaves}, {"kPad", optim::kPad}, {"kNormBlocks", optim::kNormBlocks},
      {"kLr", optim::kLr}, {"kB1", optim::kB1}, {"kB2", optim::kB2}, {"kOneMinusB1", optim::kOneMinusB1},
      {"kOneMinusB2", optim::kOneMinusB2}, {"kEps", optim::kEps}, {"kEpsRoot", optim::kEpsRoot},
      {"kWd", optim::kWd}, {"kInvBc1", optim::kInvBc1}, {"kInvBc2", optim::kInvBc2},
      {"kInvScale", optim::kInvScale}, {"kMaxNorm", optim::kMaxNorm}, {"kGradMult", optim::kGradMult},
      {"kHpSize", optim::kHpSize}, {"kAdam", optim::kAdam}, {"kSgd", optim::kSgd},
      {"kApply", optim::kApply}, {"kHasMu", optim::kHasMu}, {"kHasNu", optim::kHasNu},
      {"kMaster", optim::kMaster}, {"kCheck", optim::kCheck}, {"kClip", optim::kClip}, {"kSr", optim::kSr},
      {"kNesterov", optim::kNesterov}, {"kMomentBf16", optim::kMomentBf16},
      {"kFlatGrads", optim::kFlatGrads}, {"kReport", optim::kReport},
  };
  for (const auto& [name, value] : optim_constants) d[py::str(std::string("optim::") + name)] = value;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "jax_ls2 CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    py::dict out;
    for (const auto& t : jax_ls2::Targets()) {
      out[py::str(t.name)] = py::capsule(t.handler);
    }
    return out;
  });
  m.def("constants", &Constants,
        "The constants the Python side mirrors, {C++ name: value} (optimizer ones as optim::kName).");
  m.def("kernel_options", []() {
    py::list names;
    for (const char* n : jax_ls2::kKernelOptionNames) names.append(py::str(n));
    return names;
  }, "The names set_kernel_option accepts.");
  m.def("set_kernel_option", [](const std::string& name, int value) {
    for (int o = 0; o < jax_ls2::kNumKernelOptions; ++o) {
      if (name == jax_ls2::kKernelOptionNames[o]) {
        jax_ls2::KernelOptions()[o].store(value);
        return;
      }
    }
    throw py::value_error("set_kernel_option: unknown option " + name);
  }, "Benchmark aid: overrides a kernel launch choice (0 restores the built-in one).");
}
