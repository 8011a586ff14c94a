// CUDA implementations of qops::rms_norm_quant, qops::fused_add_rms_norm_quant and their
// unquantized forms qops::rms_norm, qops::fused_add_rms_norm (torch glue only: checks, allocation, stream, dispatch; the math is in csrc/norm/).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "common.h"
#include "fused_quant_glue.h"
#include "norm/norm.h"

namespace {

using namespace qops_glue;

// The ops' keyword-only launch options (qops.NormTuning): enable_pdl, the kernel variant
// ("auto" = the launcher's rule, "rowres" = one row per CTA, "pipelined" = persistent CTAs with a
// cp.async ring; a forced pipelined variant that does not fit the input, e.g. unaligned rows or
// hidden > 8192, runs row-resident), the pipelined ring depth (0 = choose, 2 or 3) and the
// family's launch-shape hints (fq_glue::tuning).
struct NormOptions {
  bool enable_pdl;
  c10::string_view variant;
  int64_t pipe_stages, threads_per_row, cluster;
};

qops::FusedQuantTuning norm_tuning(const char* op, const NormOptions& o) {
  qops::FusedQuantTuning t = fq_glue::tuning(o.enable_pdl, o.threads_per_row, o.cluster, op);
  if (o.variant == "rowres") {
    t.norm_variant = qops::kNormVariantRowResident;
  } else if (o.variant == "pipelined") {
    t.norm_variant = qops::kNormVariantPipelined;
  } else {
    QOPS_CHECK_VALUE(o.variant == "auto", op, "variant must be auto, rowres or pipelined, got '",
                     std::string(o.variant), "'");
  }
  QOPS_CHECK_VALUE(o.pipe_stages == 0 || o.pipe_stages == 2 || o.pipe_stages == 3, op,
                   "pipe_stages must be 0 (the kernel's choice), 2 or 3, got ", o.pipe_stages);
  t.pipe_stages = static_cast<int>(o.pipe_stages);
  return t;
}

// The rows both forms read: hidden size, row count, input and residual row strides (the residual
// rows, written in place, must not overlap).
struct RowLayout {
  int64_t H, rows, in_stride, res_stride;
};
RowLayout row_layout(const char* op, const at::Tensor& input, const at::Tensor* residual) {
  const int64_t H = input.size(-1);
  const int64_t rows = input.numel() / H;
  const int64_t in_stride = qops_glue::row_stride(input, op, "input");
  const int64_t res_stride = residual ? qops_glue::row_stride(*residual, op, "residual") : 0;
  QOPS_CHECK_VALUE(!residual || rows <= 1 || res_stride >= H, op,
                   "residual rows must not overlap (it is written in place), got strides ",
                   residual->strides());
  return {H, rows, in_stride, res_stride};
}

// The unquantized forms (rms_norm, fused_add_rms_norm): out in the input's dtype.
template <typename T>
at::Tensor run_float(const char* op, const at::Tensor& input, at::Tensor* residual,
                     const at::Tensor& weight, double epsilon,
                     const qops::FusedQuantTuning& tuning) {
  const auto [H, rows, in_stride, res_stride] = row_layout(op, input, residual);
  auto out = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  check_launch(qops::rms_norm<T>(
                   static_cast<const T*>(input.data_ptr()), in_stride,
                   residual ? static_cast<T*>(residual->data_ptr()) : nullptr, res_stride,
                   static_cast<const T*>(weight.data_ptr()), static_cast<T*>(out.data_ptr()), rows,
                   H, static_cast<float>(epsilon), c10::cuda::getCurrentCUDAStream(), tuning),
               op);
  return out;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> run(const char* op, const at::Tensor& input,
                                       at::Tensor* residual, const at::Tensor& weight,
                                       double epsilon, const std::optional<at::Tensor>& scale,
                                       const qops::FusedQuantTuning& tuning) {
  const auto [H, rows, in_stride, res_stride] = row_layout(op, input, residual);
  auto out = at::empty(input.sizes(), input.options().dtype(at::kChar));
  auto scales =
      scale ? at::empty({1}, input.options().dtype(at::kFloat))
            : at::empty(input.sizes().slice(0, input.dim() - 1), input.options().dtype(at::kFloat));
  check_launch(qops::rms_norm_quant<T>(
                   static_cast<const T*>(input.data_ptr()), in_stride,
                   residual ? static_cast<T*>(residual->data_ptr()) : nullptr, res_stride,
                   static_cast<const T*>(weight.data_ptr()), out.data_ptr<int8_t>(),
                   scales.data_ptr<float>(), scale ? scale->data_ptr<float>() : nullptr, rows, H,
                   static_cast<float>(epsilon), c10::cuda::getCurrentCUDAStream(), tuning),
               op);
  return {out, scales};
}

// The checks every form makes.
void check_norm_args(const char* op, const at::Tensor& input, const at::Tensor* residual,
                     const at::Tensor& weight, double epsilon) {
  check_cuda(input, op, "input");
  check_half(input, op, "input");
  QOPS_CHECK_VALUE(input.dim() >= 1 && input.size(-1) > 0, op,
                   "input must have a non-empty last dimension, got shape ", input.sizes());
  const int64_t H = input.size(-1);
  check_same_device(weight, input, op, "weight");
  check_dtype(weight, input.scalar_type(), op, "weight");
  QOPS_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == H && weight.stride(0) == 1, op,
                   "weight must have shape [", H,
                   "] (the input's last dimension) and be "
                   "contiguous, got shape ",
                   weight.sizes());
  QOPS_CHECK_VALUE(epsilon >= 0.0, op, "epsilon must be >= 0, got ", epsilon);
  if (residual) {
    check_same_device(*residual, input, op, "residual");
    check_dtype(*residual, input.scalar_type(), op, "residual");
    QOPS_CHECK_VALUE(residual->sizes() == input.sizes(), op,
                     "residual must have the input's shape ", input.sizes(), ", got ",
                     residual->sizes());
  }
  QOPS_CHECK_VALUE(H <= (fq_glue::vector_ok(input, 8) ? qops::kRmsNormMaxHiddenVec
                                                      : qops::kRmsNormMaxHiddenScalar),
                   op, "hidden size ", H, " is larger than this kernel supports (",
                   qops::kRmsNormMaxHiddenVec, " with 16-byte aligned rows, ",
                   qops::kRmsNormMaxHiddenScalar, " otherwise)");
}

std::tuple<at::Tensor, at::Tensor> norm_common(const char* op, const at::Tensor& input,
                                               at::Tensor* residual, const at::Tensor& weight,
                                               double epsilon,
                                               const std::optional<at::Tensor>& scale,
                                               const NormOptions& options) {
  check_norm_args(op, input, residual, weight, epsilon);
  fq_glue::check_scale(scale, input, op);
  const qops::FusedQuantTuning tuning = norm_tuning(op, options);
  const c10::cuda::CUDAGuard guard(input.device());
  if (input.scalar_type() == at::kHalf)
    return run<__half>(op, input, residual, weight, epsilon, scale, tuning);
  return run<__nv_bfloat16>(op, input, residual, weight, epsilon, scale, tuning);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quant_cuda(const at::Tensor& input,
                                                       const at::Tensor& weight, double epsilon,
                                                       const std::optional<at::Tensor>& scale,
                                                       bool enable_pdl, c10::string_view variant,
                                                       int64_t pipe_stages, int64_t threads_per_row,
                                                       int64_t cluster) {
  return norm_common("rms_norm_quant", input, nullptr, weight, epsilon, scale,
                     {enable_pdl, variant, pipe_stages, threads_per_row, cluster});
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_quant_cuda(
    const at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon,
    const std::optional<at::Tensor>& scale, bool enable_pdl, c10::string_view variant,
    int64_t pipe_stages, int64_t threads_per_row, int64_t cluster) {
  return norm_common("fused_add_rms_norm_quant", input, &residual, weight, epsilon, scale,
                     {enable_pdl, variant, pipe_stages, threads_per_row, cluster});
}

at::Tensor norm_float(const char* op, const at::Tensor& input, at::Tensor* residual,
                      const at::Tensor& weight, double epsilon, bool enable_pdl) {
  check_norm_args(op, input, residual, weight, epsilon);
  const qops::FusedQuantTuning tuning = fq_glue::tuning(enable_pdl, 0, 0, op);
  const c10::cuda::CUDAGuard guard(input.device());
  if (input.scalar_type() == at::kHalf)
    return run_float<__half>(op, input, residual, weight, epsilon, tuning);
  return run_float<__nv_bfloat16>(op, input, residual, weight, epsilon, tuning);
}

at::Tensor rms_norm_cuda(const at::Tensor& input, const at::Tensor& weight, double epsilon,
                         bool enable_pdl) {
  return norm_float("rms_norm", input, nullptr, weight, epsilon, enable_pdl);
}

at::Tensor fused_add_rms_norm_cuda(const at::Tensor& input, at::Tensor& residual,
                                   const at::Tensor& weight, double epsilon, bool enable_pdl) {
  return norm_float("fused_add_rms_norm", input, &residual, weight, epsilon, enable_pdl);
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cuda);
  m.impl("rms_norm_quant", &rms_norm_quant_cuda);
  m.impl("fused_add_rms_norm_quant", &fused_add_rms_norm_quant_cuda);
}
