// What the standalone probes (tools/probes/probe_*.cu) share: a CUDA return-code check, the copy
// bandwidth they divide by, the mbarrier / PDL device helpers of their bulk-copy readers, and the
// benchmarks' timing -- a CUDA graph of many calls (rotating over
// input sets that spill L2, which the caller's launches arrange), replayed, median per call.
// CUDA runtime only; each probe includes it and still compiles alone (see its header).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                         \
  do {                                                                                \
    const cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                          \
      printf("CUDA error %s at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

// ---- device helpers of the bulk-copy (TMA engine) readers --------------------------------------
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{\n.reg .pred d;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n"
      "@!d bra W_%=;\n}\n" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bar_expect(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)),
               "r"(bytes)
               : "memory");
}
// As the GEMVs do under PDL: let the next kernel launch, then wait for the previous one.
__device__ __forceinline__ void pdl_start() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Milliseconds of each of `reps` runs of `run` on `s` (CUDA events), sorted.
template <typename Run>
std::vector<float> probe_times_ms(cudaStream_t s, int reps, Run&& run) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, s));
    run();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(t.begin(), t.end());
  return t;
}

// A 1 GiB device-to-device copy, counting bytes read + written (as
// qops.testing.copy_bandwidth_gbps): the ceiling the benchmarks' "of copy" divides by.
inline double probe_copy_gbps(cudaStream_t s) {
  const size_t bytes = 1ull << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemset(src, 1, bytes));
  const std::vector<float> t = probe_times_ms(
      s, 12, [&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); });
  CK(cudaFree(src));
  CK(cudaFree(dst));
  return 2.0 * bytes / (t[t.size() / 2] * 1e-3) / 1e9;
}

// Microseconds per call: `calls` launches (launch(i), i = 0 .. calls - 1, on `s`) captured in one
// CUDA graph, 3 warm-up replays, then the median of `replays` replays over `calls`.
template <typename Launch>
double probe_graph_us(cudaStream_t s, int calls, int replays, Launch&& launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) launch(i);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, s));
  const std::vector<float> t = probe_times_ms(s, replays, [&] { CK(cudaGraphLaunch(ge, s)); });
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return t[t.size() / 2] * 1e3 / calls;
}
