// Kernel launches with programmatic dependent launch (PDL, sm_90+): the device-side wait and
// release, and the host-side launch attribute (torch-free).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace qops {

// ---- programmatic dependent launch (PDL, sm_90+) -----------------------------------------------
// A kernel launched with the attribute append_pdl_attribute adds may be dispatched while the
// previous kernel in the stream is still running (in a CUDA graph: a programmatic edge). It must
// call pdl_wait() before touching memory that kernel may have written -- pdl_wait() returns once
// the previous grid has completed and its writes are visible -- and may call
// pdl_launch_dependents() to let the next PDL kernel be dispatched before this one ends (without
// the call that happens when it ends). Both are no-ops below sm_90 and when the launch did not
// allow PDL. QOPS_PDL=0 launches every qops kernel without the attribute (qops_glue::pdl_enabled).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Appends the programmatic-stream-serialization attribute to `cfg`, whose attributes live in
// `attrs` (room for one more entry). Harmless on devices without PDL (the runtime ignores it).
inline void append_pdl_attribute(cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attrs) {
  cfg->attrs = attrs;
  cudaLaunchAttribute& a = attrs[cfg->numAttrs++];
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch when `pdl`.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel_smem(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl) append_pdl_attribute(&cfg, attr);
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, 0, stream>>>(args...), with programmatic dependent launch when `pdl`.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  return launch_kernel_smem(kernel, grid, block, 0, stream, pdl, std::forward<Args>(args)...);
}

}  // namespace qops
