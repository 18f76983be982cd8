// Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
// kernel before it on the stream is still running, so its CTAs are resident and its prologue done
// when that kernel ends (in a CUDA graph as on a stream).
//
// The contract every kernel launched this way keeps (and the Triton kernels keep the same, with
// tl.extra.cuda.gdc_wait / gdc_launch_dependents):
//   * before await_previous_grid() it reads only what no kernel writes (weights, scales) and
//     writes nothing;
//   * every CTA calls await_previous_grid(): it returns once the previous kernel has completed
//     and its writes are visible. Since that kernel kept the same rule, every earlier kernel has
//     completed too, so the order of the stream holds for everything after the wait;
//   * allow_dependent_grid() right after it lets the next kernel start its own prologue.
// Both are no-ops in a kernel launched without PDL, and compile to nothing below sm_90.

#pragma once

#include <cuda_runtime_api.h>

namespace pagedserve_pdl {

__device__ __forceinline__ void await_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The launch attribute that makes a cudaLaunchKernelEx launch a programmatic dependent.
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

}  // namespace pagedserve_pdl
