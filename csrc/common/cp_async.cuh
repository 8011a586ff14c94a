// cp.async (sm_80+) global -> shared copies, and the shared-window addresses they take
// (torch-free).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace qops {

// The 32-bit shared-window address of a shared variable (what PTX shared-memory operands take).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async (sm_80+): global -> shared copies that hold no registers while in flight ---------
// `smem` is a shared-memory address (smem_addr). The 16-byte form bypasses L1 (.cg); the 4-byte
// form must go through it (.ca: .cg takes only 16 bytes). Commit groups complete in issue order.
// (The fused row-quant kernels have their own variant with a pre-sm_80 fallback and memory
// clobbers: fq::cp_async16 in quant/fused_row_quant.cuh.)
__device__ __forceinline__ void cp_async16(unsigned smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(unsigned smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace qops
