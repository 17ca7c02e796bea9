// Target registry: every FFI handler file registers its targets with
// JAX_LS2_REGISTER at static-initialisation time; module.cc exposes the table.
#pragma once
#include <atomic>
#include <string>
#include <utility>
#include <vector>

namespace jax_ls2 {

struct Target {
  std::string name;
  void* handler;  // XLA_FFI_Handler*
};

inline std::vector<Target>& Targets() {
  static std::vector<Target> targets;
  return targets;
}

struct Registrar {
  Registrar(const char* name, void* handler) { Targets().push_back({name, handler}); }
};

// Launch choices a benchmark may override from Python, through
// jax_ls2._C.set_kernel_option(name, value); 0 everywhere means the built-in choice.
// Read when a handler runs, which passes them to its launcher (the kernels'
// *LaunchOptions structs, whose fields say what each value selects). XLA may capture
// custom calls into a CUDA graph on a program's first run and replay it without calling
// the handler again, so a setting reaches the programs first run after it is set:
// compile a fresh one per setting.
enum KernelOption : int {
  kDropoutRowsInFlight = 0,  // DropoutLaunchOptions::rows_in_flight
  kDropoutFullGrid,          // DropoutLaunchOptions::full_grid
  kSoftmaxElems,             // SoftmaxLaunchOptions::elems
  kLayerNormBwdElems,        // LayerNormBwdLaunchOptions::elems
  kLayerNormBwdStages,       // LayerNormBwdLaunchOptions::stages
  kCrossEntropyThreads,      // CrossEntropyLaunchOptions::threads
  kCrossEntropyPipeline,     // CrossEntropyLaunchOptions::pipeline
  kDropoutPrefetch,          // DropoutLaunchOptions::prefetch
  kNumKernelOptions
};
// The Python names of the options, indexed by KernelOption.
inline constexpr const char* kKernelOptionNames[kNumKernelOptions] = {
    "dropout_rows_in_flight", "dropout_full_grid",     "softmax_elems",          "layer_norm_bwd_elems",
    "layer_norm_bwd_stages",  "cross_entropy_threads", "cross_entropy_pipeline", "dropout_prefetch",
};
inline std::atomic<int>* KernelOptions() {
  static std::atomic<int> values[kNumKernelOptions] = {};
  return values;
}
inline int GetKernelOption(KernelOption o) { return KernelOptions()[o].load(std::memory_order_relaxed); }

}  // namespace jax_ls2

#define JAX_LS2_CONCAT_INNER(a, b) a##b
#define JAX_LS2_CONCAT(a, b) JAX_LS2_CONCAT_INNER(a, b)
// JAX_LS2_REGISTER("jax_ls2_layer_norm_fwd", LayerNormFwd) where LayerNormFwd was
// defined with XLA_FFI_DEFINE_HANDLER_SYMBOL.
#define JAX_LS2_REGISTER(target_name, symbol)                                   \
  static ::jax_ls2::Registrar JAX_LS2_CONCAT(jax_ls2_registrar_, __LINE__)(      \
      target_name, reinterpret_cast<void*>(symbol))
