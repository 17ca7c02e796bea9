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
// Read when a handler runs. XLA may capture custom calls into a CUDA graph on a
// program's first run and replay it without calling the handler again, so a setting
// reaches the programs first run after it is set: compile a fresh one per setting.
enum KernelOption : int {
  kDropoutRowsInFlight = 0,  // "dropout_rows_in_flight": 2, 4 or 8 (bfloat16, 16-byte path)
  kDropoutFullGrid,          // "dropout_full_grid": 1 = forward grids cover every row once
  kSoftmaxElems,             // "softmax_elems": 16 or 32 elements per thread (bfloat16, 16-byte path)
  kLayerNormBwdElems,        // "layer_norm_bwd_elems": elements per thread of the backward: 8 or 16 for the
                             // staged kernel, 16 or 32 for the register kernel (bfloat16, 16-byte path)
  kLayerNormBwdStages,       // "layer_norm_bwd_stages": 1 = the register kernel instead of the staged one
                             // (16-bit, 16-byte path, sm_90); 2..8 = the staged kernel's stages
  kCrossEntropyThreads,      // "cross_entropy_threads": 256 or 1024 threads per row instead of up to 512
  kCrossEntropyPipeline,     // "cross_entropy_pipeline": 1 = row-staging off (the row-per-block kernel)
  kDropoutPrefetch,          // "dropout_prefetch": 2 = the kernel that does not load the next rows before computing
                             // the current ones (bfloat16, 16-byte path; prefetching is the built-in choice)
  kNumKernelOptions
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
