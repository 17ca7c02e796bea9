// pybind11 module jax_ls2._C: registrations() -> {target name: PyCapsule(handler)}.
#include <pybind11/pybind11.h>

#include <string>
#include <utility>

#include "registry.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "jax_ls2 CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    py::dict out;
    for (const auto& t : jax_ls2::Targets()) {
      out[py::str(t.name)] = py::capsule(t.handler);
    }
    return out;
  });
  m.def("set_kernel_option", [](const std::string& name, int value) {
    static const std::pair<const char*, jax_ls2::KernelOption> names[] = {
        {"dropout_rows_in_flight", jax_ls2::kDropoutRowsInFlight},
        {"dropout_full_grid", jax_ls2::kDropoutFullGrid},
        {"dropout_prefetch", jax_ls2::kDropoutPrefetch},
        {"softmax_elems", jax_ls2::kSoftmaxElems},
        {"layer_norm_bwd_elems", jax_ls2::kLayerNormBwdElems},
        {"layer_norm_bwd_stages", jax_ls2::kLayerNormBwdStages},
        {"cross_entropy_threads", jax_ls2::kCrossEntropyThreads},
        {"cross_entropy_pipeline", jax_ls2::kCrossEntropyPipeline},
    };
    for (const auto& [n, o] : names) {
      if (name == n) {
        jax_ls2::KernelOptions()[o].store(value);
        return;
      }
    }
    throw py::value_error("set_kernel_option: unknown option " + name);
  }, "Benchmark aid: overrides a kernel launch choice (0 restores the built-in one).");
}
