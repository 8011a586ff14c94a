// Global-memory access: predicated 16-byte loads with cache hints (device) and the alignment test
// that picks a kernel's vector path (host) (torch-free).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace qops {

// 16 bytes of global memory, or zeros when !pred (then `ptr` is not read; `safe` is any readable
// address: the load is always issued, so that the scheduler can batch all of a step's loads
// before the MMAs that consume them). Both go through the non-coherent (read-only) path: the data
// must not be written while the kernel runs. load_stream is for data streamed once (no L1
// allocation; L2 fetches the 256-byte sector group: the GEMV's weights); load_cached for data
// re-read by every CTA (L1/L2 hits: the GEMV's activations).
__device__ __forceinline__ uint4 load_stream(const int8_t* ptr, const int8_t* safe, bool pred) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(pred ? ptr : safe));
  return pred ? v : make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ uint4 load_cached(const int8_t* ptr, const int8_t* safe, bool pred) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(pred ? ptr : safe));
  return pred ? v : make_uint4(0, 0, 0, 0);
}

// Whether `p` is a multiple of `bytes` (host side: the vector path of a launch needs 16-byte or
// 8-byte aligned rows).
inline bool is_aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

}  // namespace qops
