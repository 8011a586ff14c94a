// RMSNorm (+ residual add) + int8 quantization: the launcher, rms_norm_quant, which picks one of
// the two kernels (norm_rowres.cu: row-resident, one row per CTA, registers only;
// norm_pipelined.cu: persistent CTAs streaming rows through a cp.async ring). See norm.h for the
// contract and docs/norm_activation.md for the design.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/memory.cuh"  // is_aligned
#include "norm/norm.h"
#include "norm/norm_common.cuh"
#include "quant/fused_quant_tuning.h"
#include "quant/fused_row_quant.cuh"  // fq::DeviceInfo, fq::device_info

namespace qops {
namespace {

// Auto selection (tuning point; bench/bench_norm_act.py prints both variants side by side):
// pipelined for RMSNorm + quant without a residual when there are at least kPipeMinRowsPerSm rows
// per SM, a row of input is at most kPipeMaxRowBytes (hidden * sizeof(T)), on the 16-byte vector
// path, and either the input exceeds kPipeMinBytesPerSm per SM or a row is one warp's (<= 128
// vectors: the pipelined kernel packs 4 such rows per CTA, each with its own ring). Measured on
// H100 (bf16, interleaved CUDA-graph replays), pipelined against the row-resident kernel (with its
// L1::no_allocate loads and the kTight build):
//   - wins from ~256 KB of input per SM: 8192 x 4096 39.0 vs 42.1 us, 16384 x 2048 39.0 vs 40.9,
//     4096 x 8192 40.3 vs 44.7, 4096 x 5120 26.7 vs 29.0, 16384 x 1536 29.7 vs 30.8;
//   - ties at 6144 x 4096 (31.0 vs 31.4 us);
//   - loses below: 4096 x 4096 22.1 vs 20.7 us, 8192 x 2048 21.4 vs 19.8, 4096 x 2048 11.8 vs
//     11.4, 4096 x 1536 10.1 vs 9.4;
//   - wins at H = 576 at every row count (4096 x 576: 5.6 vs 6.2 us).
// With a residual it was 0.92-0.99x (the row-resident kernel already reaches 0.94-0.99 of copy at
// 16384 rows); the 2-stage ring beat the 3-stage one in 10 of 12 cases. Everything else (the fused
// add, decode and small batches, long rows, unaligned rows) stays row-resident.
constexpr int64_t kPipeMinRowsPerSm = 16;
constexpr int64_t kPipeMaxRowBytes = 16 << 10;
constexpr int64_t kPipeMinBytesPerSm = 256 << 10;

bool pipelined_by_default(int64_t rows, int64_t row_bytes, int sms, bool residual) {
  const int64_t nvec = row_bytes / 16;
  return !residual && rows >= kPipeMinRowsPerSm * sms && row_bytes <= kPipeMaxRowBytes &&
         (nvec <= kPipeOneWarpVectors || rows * row_bytes > kPipeMinBytesPerSm * sms);
}

// The 16-byte vector path: hidden a multiple of the vector, 16-byte aligned input, weight and
// residual rows, and the output aligned to `out_align` bytes (8 for int8 rows, 16 for T rows).
template <typename T>
bool rows_vec_ok(const T* in, int64_t in_row_stride, const T* residual, int64_t residual_row_stride,
                 const T* weight, int64_t hidden, const void* out, size_t out_align) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int64_t kBytes = sizeof(T);
  return hidden % VEC == 0 && is_aligned(in, 16) && (in_row_stride * kBytes) % 16 == 0 &&
         is_aligned(weight, 16) &&
         (residual == nullptr ||
          (is_aligned(residual, 16) && (residual_row_stride * kBytes) % 16 == 0)) &&
         is_aligned(out, out_align);
}

}  // namespace

template <typename T>
cudaError_t rms_norm_quant(const T* in, int64_t in_row_stride, T* residual,
                           int64_t residual_row_stride, const T* weight, int8_t* out,
                           float* scale_out, const float* static_scale, int64_t rows,
                           int64_t hidden, float eps, cudaStream_t stream,
                           FusedQuantTuning tuning) {
  if (hidden <= 0 || rows < 0 || hidden > (1 << 30)) return cudaErrorInvalidValue;
  if (rows == 0) {
    if (static_scale == nullptr) return cudaSuccess;
    return cudaMemcpyAsync(scale_out, static_scale, sizeof(float), cudaMemcpyDeviceToDevice,
                           stream);
  }
  constexpr int64_t kBytes = sizeof(T);
  const bool vec_ok =
      rows_vec_ok(in, in_row_stride, residual, residual_row_stride, weight, hidden, out, 8);
  const fq::DeviceInfo dev = fq::device_info();
  const norm::RmsNormArgs<T> args{in,           in_row_stride, residual, residual_row_stride,
                                  weight,       out,           nullptr,  scale_out,
                                  static_scale, rows,          hidden,   eps};
  if (vec_ok && tuning.norm_variant != kNormVariantRowResident &&
      (tuning.norm_variant == kNormVariantPipelined ||
       pipelined_by_default(rows, hidden * kBytes, dev.sms, residual != nullptr))) {
    bool launched = false;
    const cudaError_t e =
        norm::rms_norm_quant_pipelined<T>(args, tuning, dev.sms, stream, &launched);
    if (e != cudaSuccess || launched) return e;
  }
  return norm::rms_norm_quant_rowres<T>(args, vec_ok, dev, tuning, stream);
}

template <typename T>
cudaError_t rms_norm(const T* in, int64_t in_row_stride, T* residual, int64_t residual_row_stride,
                     const T* weight, T* out, int64_t rows, int64_t hidden, float eps,
                     cudaStream_t stream, FusedQuantTuning tuning) {
  if (hidden <= 0 || rows < 0 || hidden > (1 << 30)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec_ok =
      rows_vec_ok(in, in_row_stride, residual, residual_row_stride, weight, hidden, out, 16);
  const norm::RmsNormArgs<T> args{in,      in_row_stride, residual, residual_row_stride,
                                  weight,  nullptr,       out,      nullptr,
                                  nullptr, rows,          hidden,   eps};
  return norm::rms_norm_quant_rowres<T>(args, vec_ok, fq::device_info(), tuning, stream);
}

#define QOPS_INSTANTIATE(T)                                                                        \
  template cudaError_t rms_norm<T>(const T*, int64_t, T*, int64_t, const T*, T*, int64_t, int64_t, \
                                   float, cudaStream_t, FusedQuantTuning);                         \
  template cudaError_t rms_norm_quant<T>(const T*, int64_t, T*, int64_t, const T*, int8_t*,        \
                                         float*, const float*, int64_t, int64_t, float,            \
                                         cudaStream_t, FusedQuantTuning);
QOPS_INSTANTIATE(__half)
QOPS_INSTANTIATE(__nv_bfloat16)
#undef QOPS_INSTANTIATE

}  // namespace qops
