// Warp- and block-wide float32 reductions (sum, max) over shuffles and shared memory
// (torch-free).
#pragma once

#include <cuda_runtime.h>

namespace qops {

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide max; every thread gets the result. `smem` holds at least 32 floats.
__device__ __forceinline__ float block_reduce_max(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_reduce_max(v);
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.0f;
  return warp_reduce_max(v);
}

__device__ __forceinline__ float block_reduce_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_reduce_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.0f;
  return warp_reduce_sum(v);
}

}  // namespace qops
