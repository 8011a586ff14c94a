// CUDA implementations of qops::rms_norm_quant and qops::fused_add_rms_norm_quant (torch glue
// only: checks, allocation, stream, dispatch; the math is in csrc/norm/).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <string>

#include "common.h"
#include "fused_quant_glue.h"
#include "norm/norm.h"

namespace {

using namespace qops_glue;

// Launch tuning of this family (fq_glue::tuning(): QOPS_FQ_TPR / QOPS_FQ_CLUSTER) plus the norm's
// own switches, all read with getenv on every call (~0.1 us; a CUDA graph keeps the choice made at
// capture), so that the benchmark and the tests can switch within one process:
//   QOPS_NORM_VARIANT     = auto (unset) | rowres | pipelined: force the row-resident kernel or the
//                           persistent pipelined one (a forced pipelined variant that does not fit
//                           the input, e.g. unaligned rows or hidden > 8192, runs row-resident);
//   QOPS_NORM_PIPE_STAGES = 2 | 3: the pipelined kernel's ring depth (default: 3 where it costs no
//                           occupancy, else 2).
qops::FusedQuantTuning norm_tuning(const char* op) {
  qops::FusedQuantTuning t = fq_glue::tuning();
  if (const char* v = std::getenv("QOPS_NORM_VARIANT"); v != nullptr && *v != '\0') {
    const std::string s(v);
    if (s == "rowres") {
      t.norm_variant = qops::kNormVariantRowResident;
    } else if (s == "pipelined") {
      t.norm_variant = qops::kNormVariantPipelined;
    } else {
      QOPS_CHECK_VALUE(s == "auto", op,
                       "QOPS_NORM_VARIANT must be auto, rowres or pipelined, got '", s, "'");
    }
  }
  if (const char* v = std::getenv("QOPS_NORM_PIPE_STAGES")) t.pipe_stages = std::atoi(v);
  return t;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> run(const char* op, const at::Tensor& input,
                                       at::Tensor* residual, const at::Tensor& weight,
                                       double epsilon, const std::optional<at::Tensor>& scale) {
  const int64_t H = input.size(-1);
  const int64_t rows = input.numel() / H;
  const int64_t in_stride = qops_glue::row_stride(input, op, "input");
  const int64_t res_stride = residual ? qops_glue::row_stride(*residual, op, "residual") : 0;
  QOPS_CHECK_VALUE(!residual || rows <= 1 || res_stride >= H, op,
                   "residual rows must not overlap (it is written in place), got strides ",
                   residual->strides());
  auto out = at::empty(input.sizes(), input.options().dtype(at::kChar));
  auto scales = scale ? at::empty({1}, input.options().dtype(at::kFloat))
                      : at::empty(input.sizes().slice(0, input.dim() - 1),
                                  input.options().dtype(at::kFloat));
  check_launch(
      qops::rms_norm_quant<T>(
          static_cast<const T*>(input.data_ptr()), in_stride,
          residual ? static_cast<T*>(residual->data_ptr()) : nullptr, res_stride,
          static_cast<const T*>(weight.data_ptr()), out.data_ptr<int8_t>(),
          scales.data_ptr<float>(), scale ? scale->data_ptr<float>() : nullptr, rows, H,
          static_cast<float>(epsilon), c10::cuda::getCurrentCUDAStream(), norm_tuning(op)),
      op);
  return {out, scales};
}

std::tuple<at::Tensor, at::Tensor> norm_common(const char* op, const at::Tensor& input,
                                               at::Tensor* residual, const at::Tensor& weight,
                                               double epsilon,
                                               const std::optional<at::Tensor>& scale) {
  check_cuda(input, op, "input");
  check_half(input, op, "input");
  QOPS_CHECK_VALUE(input.dim() >= 1 && input.size(-1) > 0, op,
                   "input must have a non-empty last dimension, got shape ", input.sizes());
  const int64_t H = input.size(-1);
  check_same_device(weight, input, op, "weight");
  check_dtype(weight, input.scalar_type(), op, "weight");
  QOPS_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == H && weight.stride(0) == 1, op,
                   "weight must have shape [", H, "] (the input's last dimension) and be "
                   "contiguous, got shape ", weight.sizes());
  QOPS_CHECK_VALUE(epsilon >= 0.0, op, "epsilon must be >= 0, got ", epsilon);
  if (residual) {
    check_same_device(*residual, input, op, "residual");
    check_dtype(*residual, input.scalar_type(), op, "residual");
    QOPS_CHECK_VALUE(residual->sizes() == input.sizes(), op,
                     "residual must have the input's shape ", input.sizes(), ", got ",
                     residual->sizes());
  }
  fq_glue::check_scale(scale, input, op);
  QOPS_CHECK_VALUE(H <= (fq_glue::vector_ok(input, 8) ? qops::kRmsNormMaxHiddenVec
                                                      : qops::kRmsNormMaxHiddenScalar),
                   op, "hidden size ", H, " is larger than this kernel supports (",
                   qops::kRmsNormMaxHiddenVec, " with 16-byte aligned rows, ",
                   qops::kRmsNormMaxHiddenScalar, " otherwise)");
  const c10::cuda::CUDAGuard guard(input.device());
  if (input.scalar_type() == at::kHalf)
    return run<__half>(op, input, residual, weight, epsilon, scale);
  return run<__nv_bfloat16>(op, input, residual, weight, epsilon, scale);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quant_cuda(const at::Tensor& input,
                                                       const at::Tensor& weight, double epsilon,
                                                       const std::optional<at::Tensor>& scale) {
  return norm_common("rms_norm_quant", input, nullptr, weight, epsilon, scale);
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_quant_cuda(
    const at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon,
    const std::optional<at::Tensor>& scale) {
  return norm_common("fused_add_rms_norm_quant", input, &residual, weight, epsilon, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("rms_norm_quant", &rms_norm_quant_cuda);
  m.impl("fused_add_rms_norm_quant", &fused_add_rms_norm_quant_cuda);
}
