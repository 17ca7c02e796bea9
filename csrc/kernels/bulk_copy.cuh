// Global -> shared bulk copies (sm_90 cp.async.bulk) completed on shared-memory
// mbarriers, for kernels that stage rows ahead of the threads using them. On older
// architectures the device functions compile to nothing: callers check
// BuiltForHopper(kernel) on the host before launching.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ls2 {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Makes `bar` a barrier that one arrival (with its expected bytes) completes a phase of.
// Called by one thread; a __syncthreads() must follow before others use the barrier.
__device__ __forceinline__ void MbarInit(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// This thread's arrival on `bar`, expecting `bytes` of bulk copies to complete the phase.
__device__ __forceinline__ void MbarArriveExpect(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)), "r"(bytes)
               : "memory");
#endif
}

// One 16-byte aligned global -> shared copy of `bytes` (a multiple of 16) counted on `bar`.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bytes > 0) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     SmemAddr(dst)),
                 "l"(src), "r"(bytes), "r"(SmemAddr(bar))
                 : "memory");
  }
#endif
}

// The arrival and the copy together: a phase that one copy completes.
__device__ __forceinline__ void BulkLoadArrive(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  MbarArriveExpect(bar, bytes);
  BulkLoad(dst, src, bytes, bar);
}

// Spins until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// Whether the code of `kernel` that runs on this device was built for sm_90 or newer (an
// sm_80-only build runs the empty bodies above). Evaluated once per kernel by the caller.
template <typename Kernel>
inline bool BuiltForHopper(Kernel kernel) {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    cudaGetLastError();  // not the caller's error
    return false;
  }
  return attr.binaryVersion >= 90;
}

}  // namespace jax_ls2
