// CUDA implementation of qops::allreduce_add_rms_norm(_quant) (torch glue only: checks, stream,
// dispatch; the kernel is in csrc/comm/).
#include "comm/allreduce_norm.h"
#include "common.h"

namespace {

using namespace qops_glue;
namespace cm = qops::comm;

struct Common {
  int64_t T, H;
};

Common check_common(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                    const at::Tensor& buffers, int64_t rank, int64_t buffer_bytes, const char* op) {
  check_cuda(input, op, "input");
  check_half(input, op, "input");
  QOPS_CHECK_VALUE(input.dim() == 2, op, "input must be [T, H], got shape ", input.sizes());
  const int64_t T = input.size(0), H = input.size(1);
  QOPS_CHECK_VALUE(H % 8 == 0 && H > 0 && H <= cm::kMaxHidden, op,
                   "H must be a positive multiple of 8 up to ", cm::kMaxHidden, ", got ", H);
  QOPS_CHECK_VALUE(input.stride(1) == 1 && (T <= 1 || input.stride(0) % 8 == 0), op,
                   "input must have contiguous rows with a row stride that is a multiple of 8, got "
                   "strides ",
                   input.strides());
  QOPS_CHECK_TYPE(residual.scalar_type() == input.scalar_type(), op, "residual must be ",
                  input.scalar_type(), ", got ", residual.scalar_type());
  QOPS_CHECK_VALUE(residual.sizes() == input.sizes() && residual.stride(1) == 1 &&
                       (T <= 1 || residual.stride(0) % 8 == 0),
                   op, "residual must be [T, H] like input with contiguous rows, got shape ",
                   residual.sizes(), " and strides ", residual.strides());
  check_same_device(residual, input, op, "residual");
  QOPS_CHECK_TYPE(weight.scalar_type() == input.scalar_type(), op, "weight must be ",
                  input.scalar_type(), ", got ", weight.scalar_type());
  QOPS_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == H, op, "weight must be [", H,
                   "], got shape ", weight.sizes());
  check_contiguous(weight, op, "weight");
  check_same_device(weight, input, op, "weight");
  check_dtype(buffers, at::kLong, op, "buffers");
  QOPS_CHECK_VALUE(buffers.dim() == 1 && buffers.size(0) >= 1 && buffers.size(0) <= cm::kMaxRanks,
                   op, "buffers must be int64 [world] (world 1 to ", cm::kMaxRanks, "), got shape ",
                   buffers.sizes());
  check_contiguous(buffers, op, "buffers");
  check_same_device(buffers, input, op, "buffers");
  QOPS_CHECK_VALUE(rank >= 0 && rank < buffers.size(0), op, "rank must be in [0, ", buffers.size(0),
                   "), got ", rank);
  QOPS_CHECK_VALUE(static_cast<int64_t>(cm::kFlagsBytes) + T * H * 2 <= buffer_bytes, op, "T = ", T,
                   " rows of H = ", H, " do not fit the workspace buffers (", buffer_bytes,
                   " bytes, of which ", cm::kFlagsBytes, " are flags)");
  QOPS_CHECK_VALUE(T <= INT32_MAX, op, "too many rows");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{input, "input"},
                                std::pair<const at::Tensor&, const char*>{residual, "residual"},
                                std::pair<const at::Tensor&, const char*>{weight, "weight"}}) {
    QOPS_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, name,
                     " must start at a 16-byte aligned address (16-byte loads)");
  }
  return {T, H};
}

cm::ArNormProblem problem(const at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                          double epsilon, const at::Tensor& buffers, int64_t rank,
                          int64_t buffer_bytes) {
  cm::ArNormProblem p;
  p.buffers = reinterpret_cast<const uint64_t*>(buffers.data_ptr<int64_t>());
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(buffers.size(0));
  p.buffer_bytes = static_cast<size_t>(buffer_bytes);
  p.input = input.data_ptr();
  p.in_stride = input.size(0) > 1 ? input.stride(0) : input.size(1);
  p.residual = residual.data_ptr();
  p.res_stride = residual.size(0) > 1 ? residual.stride(0) : residual.size(1);
  p.weight = weight.data_ptr();
  p.eps = static_cast<float>(epsilon);
  p.t = static_cast<int>(input.size(0));
  p.h = static_cast<int>(input.size(1));
  p.dtype = input.scalar_type() == at::kHalf ? cm::Dtype::kFloat16 : cm::Dtype::kBFloat16;
  return p;
}

std::tuple<at::Tensor, at::Tensor> allreduce_add_rms_norm_quant_cuda(
    const at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon,
    const std::optional<at::Tensor>& scale, const at::Tensor& buffers, int64_t rank,
    int64_t buffer_bytes) {
  constexpr const char* op = "allreduce_add_rms_norm_quant";
  const Common c = check_common(input, residual, weight, buffers, rank, buffer_bytes, op);
  if (scale.has_value()) {
    check_dtype(*scale, at::kFloat, op, "scale");
    QOPS_CHECK_VALUE(scale->numel() == 1, op, "scale must hold one float32, got shape ",
                     scale->sizes());
    check_same_device(*scale, input, op, "scale");
  }
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty({c.T, c.H}, input.options().dtype(at::kChar));
  at::Tensor s = scale.has_value() ? scale->reshape({1}).clone()
                                   : at::empty({c.T}, input.options().dtype(at::kFloat));
  cm::ArNormProblem p = problem(input, residual, weight, epsilon, buffers, rank, buffer_bytes);
  p.out_q = out.data_ptr<int8_t>();
  p.out_scale = scale.has_value() ? nullptr : s.data_ptr<float>();
  p.static_scale = scale.has_value() ? s.data_ptr<float>() : nullptr;
  check_launch(cm::allreduce_add_rms_norm(p, current_stream()), op);
  return {out, s};
}

at::Tensor allreduce_add_rms_norm_cuda(const at::Tensor& input, at::Tensor& residual,
                                       const at::Tensor& weight, double epsilon,
                                       const at::Tensor& buffers, int64_t rank,
                                       int64_t buffer_bytes) {
  constexpr const char* op = "allreduce_add_rms_norm";
  const Common c = check_common(input, residual, weight, buffers, rank, buffer_bytes, op);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty({c.T, c.H}, input.options());
  cm::ArNormProblem p = problem(input, residual, weight, epsilon, buffers, rank, buffer_bytes);
  p.out_f = out.data_ptr();
  check_launch(cm::allreduce_add_rms_norm(p, current_stream()), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("allreduce_add_rms_norm_quant", &allreduce_add_rms_norm_quant_cuda);
  m.impl("allreduce_add_rms_norm", &allreduce_add_rms_norm_cuda);
}
