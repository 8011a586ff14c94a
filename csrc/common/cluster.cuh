// Thread-block clusters (sm_90): distributed shared-memory addresses, the cluster barrier, and
// the transaction-counting mbarriers and asynchronous remote stores that push data to a peer CTA
// (torch-free).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/cp_async.cuh"  // smem_addr

namespace qops {

// ---- thread-block clusters (sm_90) --------------------------------------------------------------
// (smem_addr, the 32-bit shared-window address of a shared variable: common/cp_async.cuh.)
// The address of shared-window address `smem` of this CTA in the shared memory of cluster rank
// `rank` (for ld/st.shared::cluster, st.async, remote mbarriers). sm_90 only.
__device__ __forceinline__ uint32_t dsmem_addr(uint32_t smem, uint32_t rank) {
  uint32_t r = smem;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem), "r"(rank));
#endif
  return r;
}
// The cluster barrier in its two halves; every thread of every CTA of the cluster arrives, then
// waits until all have arrived (the wait acquires what the arrivals released). cluster_arrive()
// releases the thread's prior writes, shared and global, to the cluster: ptxas implements that as
// MEMBAR.ALL.GPU, which also waits for the thread's outstanding global stores.
// cluster_arrive_relaxed() orders nothing: enough where the barrier only says "every CTA has got
// this far" (peers' mbarriers are initialized; peers have used the values they read from this
// CTA). No-ops below sm_90.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// ---- mbarriers and remote stores (sm_90; defined only when compiling for it) --------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Transaction-counting mbarriers (as TMA pipelines use them) and asynchronous remote stores.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals)
               : "memory");
}
// Makes the initialization visible to the cluster's st.async complete_tx (CUTLASS's
// fence_barrier_init), ahead of a cluster barrier.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Waits for phase `parity` of `bar` to complete; acquires at cluster scope the remote writes that
// completed it.
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// Stores to shared memory of a cluster peer (addresses from dsmem_addr), each counted as its bytes
// on the peer's mbarrier `bar` (a dsmem_addr as well). Fire and forget: the data comes from
// registers, and the peer learns of it through its mbarrier.
__device__ __forceinline__ void st_async4(uint32_t dst, const float4& v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
      "[%5];\n" ::"r"(dst),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void st_async1(uint32_t dst, float v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(dst),
      "r"(__float_as_uint(v)), "r"(bar)
      : "memory");
}
#endif

}  // namespace qops
