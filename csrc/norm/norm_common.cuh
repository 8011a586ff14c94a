// What the RMSNorm (+ residual add) + int8 quantization kernels and their launcher share (private
// to csrc/norm/; torch-free): the kernels' parameter block, the row's rstd, the pipelined
// kernel's size limits that the launcher's rule needs, and the variants' launchers
// (norm_rowres.cu: the row-resident kernel; norm_pipelined.cu: the persistent pipelined kernel),
// which rms_norm_quant (norm.cu) picks from.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quant/fused_quant_tuning.h"
#include "quant/fused_row_quant.cuh"  // fq::DeviceInfo

namespace qops {
namespace {

// A row's 1 / sqrt(mean(z^2) + eps), with the correctly rounded sqrt and divisions the reference's
// float32 steps take (both kernels). Its dynamic scale is absmax_to_scale(amax|p| * rstd): see the
// top of norm_rowres.cu.
__device__ __forceinline__ float row_rstd(float sumsq, int hidden, float eps) {
  return 1.0f / sqrtf(sumsq / static_cast<float>(hidden) + eps);
}

struct NormParams {
  const void* in;
  int64_t in_stride;
  void* residual;  // nullptr: no residual add
  int64_t res_stride;
  const void* weight;
  int8_t* out;      // int8 output (quantizing kernels)
  void* out_float;  // T output (rms_norm: no quantization; out is then nullptr)
  float* scale_out;
  const float* static_scale;  // nullptr: dynamic per-token scales
  int64_t rows;
  int hidden;
  int cluster;  // CTAs per row (blockIdx.x % cluster is the slice)
  int slice;    // vectors per CTA slice of a row
  float eps;
};

// The pipelined kernel's vectors per thread (norm_pipelined.cu), and the rows it gives one warp:
// those the launcher's rule (norm.cu) sends to it at any size, and above which the row-resident
// launcher's kTight hint (norm_rowres.cu) starts.
constexpr int kPipeMaxNV = 4;  // vectors per thread (32 floats of p at VEC = 8)
constexpr int64_t kPipeOneWarpVectors = 32 * kPipeMaxNV;  // choose_pipe_shape: one warp per row

}  // namespace

namespace norm {

// The arguments of one rms_norm_quant call (norm.h), as the launcher checked them (rows > 0).
template <typename T>
struct RmsNormArgs {
  const T* in;
  int64_t in_row_stride;
  T* residual;  // nullptr: no residual add
  int64_t residual_row_stride;
  const T* weight;
  int8_t* out;   // nullptr: no quantization, the normalized row goes to out_float
  T* out_float;  // [rows, hidden] in T (rms_norm), or nullptr
  float* scale_out;
  const float* static_scale;  // nullptr: dynamic per-token scales
  int64_t rows;
  int64_t hidden;
  float eps;
};

// The pipelined kernel (norm_pipelined.cu), for rows on the 16-byte vector path: launches it when
// its shape fits (*launched = true); otherwise launches nothing and leaves the call to the
// row-resident kernel. Returns the first CUDA error.
template <typename T>
cudaError_t rms_norm_quant_pipelined(const RmsNormArgs<T>& a, const FusedQuantTuning& tuning,
                                     int sms, cudaStream_t stream, bool* launched);

// The row-resident kernel (norm_rowres.cu): picks its launch shape and launches it; vec_ok: the
// rows take the 16-byte vector path. cudaErrorInvalidValue when no shape fits.
template <typename T>
cudaError_t rms_norm_quant_rowres(const RmsNormArgs<T>& a, bool vec_ok, const fq::DeviceInfo& dev,
                                  const FusedQuantTuning& tuning, cudaStream_t stream);

}  // namespace norm
}  // namespace qops
