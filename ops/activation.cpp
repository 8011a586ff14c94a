// CUDA implementations of qops::silu_and_mul_quant and qops::silu_and_mul (torch glue only: checks, allocation, stream,
// dispatch; the math is in csrc/activation/).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "activation/activation.h"
#include "common.h"
#include "fused_quant_glue.h"

namespace {

using namespace qops_glue;

// The checks both ops make; returns I.
int64_t check_gated_input(const char* op, const at::Tensor& input) {
  check_cuda(input, op, "input");
  check_half(input, op, "input");
  QOPS_CHECK_VALUE(input.dim() >= 1 && input.size(-1) > 0 && input.size(-1) % 2 == 0, op,
                   "input's last dimension must be 2*I > 0 (gate then up), got shape ",
                   input.sizes());
  return input.size(-1) / 2;
}

void check_result(cudaError_t err, const char* op, int64_t I, int64_t rows, int64_t stride) {
  QOPS_CHECK_VALUE(err != cudaErrorInvalidValue, op, "unsupported size: I = ", I, " (rows ", rows,
                   ", row stride ", stride, ")");
  check_launch(err, op);
}

at::Tensor silu_and_mul_cuda(const at::Tensor& input, bool enable_pdl) {
  constexpr const char* op = "silu_and_mul";
  const int64_t I = check_gated_input(op, input);
  const int64_t rows = input.numel() / input.size(-1);
  const int64_t stride = qops_glue::row_stride(input, op, "input");
  const qops::FusedQuantTuning tuning = fq_glue::tuning(enable_pdl, 0, 0, op);
  const c10::cuda::CUDAGuard guard(input.device());
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = I;
  auto out = at::empty(out_shape, input.options().memory_format(at::MemoryFormat::Contiguous));
  cudaError_t err;
  if (input.scalar_type() == at::kHalf) {
    err = qops::silu_and_mul<__half>(static_cast<const __half*>(input.data_ptr()), stride,
                                     static_cast<__half*>(out.data_ptr()), rows, I,
                                     c10::cuda::getCurrentCUDAStream(), tuning);
  } else {
    err = qops::silu_and_mul<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(input.data_ptr()),
                                            stride, static_cast<__nv_bfloat16*>(out.data_ptr()),
                                            rows, I, c10::cuda::getCurrentCUDAStream(), tuning);
  }
  check_result(err, op, I, rows, stride);
  return out;
}

std::tuple<at::Tensor, at::Tensor> silu_and_mul_quant_cuda(const at::Tensor& input,
                                                           const std::optional<at::Tensor>& scale,
                                                           bool enable_pdl, int64_t threads_per_row,
                                                           int64_t cluster) {
  constexpr const char* op = "silu_and_mul_quant";
  const int64_t I = check_gated_input(op, input);
  fq_glue::check_scale(scale, input, op);
  const int64_t rows = input.numel() / input.size(-1);
  const int64_t stride = qops_glue::row_stride(input, op, "input");
  const qops::FusedQuantTuning tuning = fq_glue::tuning(enable_pdl, threads_per_row, cluster, op);
  const c10::cuda::CUDAGuard guard(input.device());
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = I;
  auto out = at::empty(out_shape, input.options().dtype(at::kChar));
  auto scales =
      scale ? at::empty({1}, input.options().dtype(at::kFloat))
            : at::empty(input.sizes().slice(0, input.dim() - 1), input.options().dtype(at::kFloat));
  const float* s_in = scale ? scale->data_ptr<float>() : nullptr;
  cudaError_t err;
  if (input.scalar_type() == at::kHalf) {
    err = qops::silu_and_mul_quant<__half>(static_cast<const __half*>(input.data_ptr()), stride,
                                           out.data_ptr<int8_t>(), scales.data_ptr<float>(), s_in,
                                           rows, I, c10::cuda::getCurrentCUDAStream(), tuning);
  } else {
    err = qops::silu_and_mul_quant<__nv_bfloat16>(
        static_cast<const __nv_bfloat16*>(input.data_ptr()), stride, out.data_ptr<int8_t>(),
        scales.data_ptr<float>(), s_in, rows, I, c10::cuda::getCurrentCUDAStream(), tuning);
  }
  check_result(err, op, I, rows, stride);
  return {out, scales};
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("silu_and_mul_quant", &silu_and_mul_quant_cuda);
  m.impl("silu_and_mul", &silu_and_mul_cuda);
}
