// pybind11 module jax_ls2._C: registrations() -> {target name: PyCapsule(handler)}.
#include <pybind11/pybind11.h>

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
}
