// RMSNorm (+ residual add) fused with int8 quantization (torch-free). Contract: docs/ops.md
// (rms_norm_quant, fused_add_rms_norm_quant); design: docs/norm_activation.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "quant/fused_quant_tuning.h"

namespace qops {

// For each of `rows` rows of `hidden` elements (T = __half or __nv_bfloat16):
//   if residual: z = T(float(in) + float(residual)); residual <- z   (in place)
//   else:        z = in
//   y = float(z) * w * rstd,  rstd = 1 / sqrt(sum(float(z)^2) / hidden + eps)      (float32)
//   static (static_scale != nullptr): s = *static_scale, scale_out[0] = s
//   dynamic:                          s = max(amax|y| / 127, 1e-10), scale_out[row] = s
//   out[row, :] = clamp(round_half_even(y / s), -128, 127)  (IEEE division; NaN -> 0)
// `in` and `residual` rows are `*_row_stride` elements apart (last dim contiguous); `out` is
// contiguous [rows, hidden]; `weight` is [hidden]. The 16-byte vector path needs hidden % 8 == 0
// and 16-byte aligned rows; other inputs take a scalar path (hidden <= 16384 there). On sm_90 a
// long row (or a few large rows) is split over a thread-block cluster of up to 8 CTAs.
// Two kernels (docs/norm_activation.md): row-resident (one row per CTA, registers only) and, on the
// vector path for many rows (>= 16 per SM) of hidden <= 8192, a persistent pipelined kernel that
// streams rows through a cp.async ring in shared memory; tuning.norm_variant forces either (a
// forced pipelined variant that does not fit runs row-resident). The results are the same up to
// the float32 order of sum(z^2).
// Returns cudaErrorInvalidValue for an unsupported size, else the first CUDA error.
template <typename T>
cudaError_t rms_norm_quant(const T* in, int64_t in_row_stride, T* residual,
                           int64_t residual_row_stride, const T* weight, int8_t* out,
                           float* scale_out, const float* static_scale, int64_t rows,
                           int64_t hidden, float eps, cudaStream_t stream,
                           FusedQuantTuning tuning = {});

// The same RMSNorm (+ residual add) without the quantization (the activation-dtype input of a
// W4A16 GEMM): residual handling and rstd as above, then
//   out[row, :] = T(float(z) * w * rstd)      (float32 products, one rounding to T)
// into `out` contiguous [rows, hidden] (16-byte aligned for the vector path). The row-resident
// kernel only (the pipelined one quantizes). Returns cudaErrorInvalidValue for an unsupported size,
// else the first CUDA error.
template <typename T>
cudaError_t rms_norm(const T* in, int64_t in_row_stride, T* residual, int64_t residual_row_stride,
                     const T* weight, T* out, int64_t rows, int64_t hidden, float eps,
                     cudaStream_t stream, FusedQuantTuning tuning = {});

// Largest hidden size on the 16-byte path (2-byte T; 8 CTAs x 256 threads x 8 vectors of 8;
// without clusters, 16384) and on the scalar path.
constexpr int64_t kRmsNormMaxHiddenVec = 8 * 256 * 8 * 8;
constexpr int64_t kRmsNormMaxHiddenScalar = 16 * 1024;

}  // namespace qops
