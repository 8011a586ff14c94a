// SiLU-and-mul fused with int8 quantization (torch-free). Contract: docs/ops.md
// (silu_and_mul_quant); design: docs/norm_activation.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "quant/fused_quant_tuning.h"

namespace qops {

// For each of `rows` rows of `2 * inter` elements (gate then up; T = __half or __nv_bfloat16):
//   y = silu(g) * u = g / (1 + exp(-g)) * u              (float32; fast exp and division)
//   static (static_scale != nullptr): s = *static_scale, scale_out[0] = s
//   dynamic:                          s = max(amax|y| / 127, 1e-10), scale_out[row] = s
//   out[row, :] = clamp(round_half_even(y / s), -128, 127)  (IEEE division; NaN -> 0)
// `in` rows are `in_row_stride` elements apart (last dim contiguous); `out` is contiguous
// [rows, inter]. The 16-byte path needs inter % 8 == 0 and 16-byte aligned rows; other inputs
// take a scalar path (inter <= 16384 there). On sm_90 long rows, or few rows, are split over a
// thread-block cluster of up to 8 CTAs (the dynamic scale is reduced through distributed shared
// memory). Returns cudaErrorInvalidValue for an unsupported size, else the launch's error.
template <typename T>
cudaError_t silu_and_mul_quant(const T* in, int64_t in_row_stride, int8_t* out, float* scale_out,
                               const float* static_scale, int64_t rows, int64_t inter,
                               cudaStream_t stream, FusedQuantTuning tuning = {});

// The same SiLU-and-mul without the quantization (the activation-dtype input of a W4A16 GEMM):
//   out[row, :] = T(silu(g) * u)   (float32 as above, one rounding to T)
// into `out` contiguous [rows, inter] (16-byte aligned for the vector path).
template <typename T>
cudaError_t silu_and_mul(const T* in, int64_t in_row_stride, T* out, int64_t rows, int64_t inter,
                         cudaStream_t stream, FusedQuantTuning tuning = {});

}  // namespace qops
