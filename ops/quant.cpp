// CUDA implementations of qops::quant_per_token and qops::quant_per_tensor (torch glue only:
// checks, allocation, stream, dispatch; the math is in csrc/quant/).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "quant/quant.h"

namespace {

using namespace qops_glue;

template <typename F>
void dispatch_float(const at::Tensor& t, const char* op, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat:
      f(static_cast<const float*>(nullptr));
      break;
    case at::kHalf:
      f(static_cast<const __half*>(nullptr));
      break;
    case at::kBFloat16:
      f(static_cast<const __nv_bfloat16*>(nullptr));
      break;
    default:
      QOPS_CHECK_TYPE(false, op, "input must be float16, bfloat16 or float32, got ",
                      t.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> quant_per_token_cuda(const at::Tensor& input, bool enable_pdl) {
  constexpr const char* op = "quant_per_token";
  check_cuda(input, op, "input");
  const int64_t stride = row_stride(input, op, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  auto out = at::empty(input.sizes(), input.options().dtype(at::kChar));
  auto scales =
      at::empty(input.sizes().slice(0, input.dim() - 1), input.options().dtype(at::kFloat));
  const int64_t cols = input.size(-1);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  dispatch_float(input, op, [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    check_launch(qops::quant_per_token<T>(static_cast<const T*>(input.data_ptr()), stride,
                                          out.data_ptr<int8_t>(), scales.data_ptr<float>(), rows,
                                          cols, c10::cuda::getCurrentCUDAStream(), enable_pdl),
                 op);
  });
  return {out, scales};
}

at::Tensor quant_per_tensor_cuda(const at::Tensor& input, const at::Tensor& scale,
                                 bool enable_pdl) {
  constexpr const char* op = "quant_per_tensor";
  check_cuda(input, op, "input");
  check_same_device(scale, input, op, "scale");
  check_dtype(scale, at::kFloat, op, "scale");
  QOPS_CHECK_VALUE(scale.numel() == 1, op, "scale must hold one element, got shape ",
                   scale.sizes());
  const int64_t stride = row_stride(input, op, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  auto out = at::empty(input.sizes(), input.options().dtype(at::kChar));
  const int64_t cols = input.size(-1);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  dispatch_float(input, op, [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    check_launch(qops::quant_per_tensor<T>(static_cast<const T*>(input.data_ptr()), stride,
                                           out.data_ptr<int8_t>(), scale.data_ptr<float>(), rows,
                                           cols, c10::cuda::getCurrentCUDAStream(), enable_pdl),
                 op);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("quant_per_token", &quant_per_token_cuda);
  m.impl("quant_per_tensor", &quant_per_tensor_cuda);
}
