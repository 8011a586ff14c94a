// Fast math on the special-function unit (torch-free).
#pragma once

#include <cuda_runtime.h>

namespace qops {

// 2^x with the hardware's approximation (ex2.approx: relative error ~2^-22, the same MUFU.EX2 as
// exp2f), flushing results below 2^-126 to 0 (exp2f spends two more instructions per call keeping
// those subnormal; a softmax weight that small is 0 to f32 sums anyway). -inf -> 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace qops
