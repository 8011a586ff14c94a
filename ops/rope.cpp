// CUDA implementation of qops::rotary_embedding (torch glue only: checks, stream, dispatch; the
// kernel is in csrc/rope/).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "rope/rope.h"

namespace {

using namespace qops_glue;

void check_heads(const at::Tensor& x, const at::Tensor& query, const char* op, const char* name) {
  QOPS_CHECK_VALUE(x.dim() == 3, op, name, " must be [T, H, D], got shape ", x.sizes());
  QOPS_CHECK_VALUE(x.size(2) == 1 || x.stride(2) == 1, op, name,
                   "'s last dimension must be contiguous (stride 1), got strides ", x.strides());
  QOPS_CHECK_TYPE(x.scalar_type() == query.scalar_type(), op, name, " must have query's dtype ",
                  query.scalar_type(), ", got ", x.scalar_type());
  check_same_device(x, query, op, name);
}

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           const at::Tensor& cos, const at::Tensor& sin, bool enable_pdl) {
  constexpr const char* op = "rotary_embedding";
  check_cuda(query, op, "query");
  check_half(query, op, "query");
  check_heads(query, query, op, "query");
  check_heads(key, query, op, "key");
  const int64_t T = query.size(0), D = query.size(2);
  QOPS_CHECK_VALUE(key.size(0) == T && key.size(2) == D, op, "key must be [T, H_kv, D] = [", T,
                   ", H_kv, ", D, "] like query, got shape ", key.sizes());
  QOPS_CHECK_VALUE(D % 2 == 0 && D > 0, op, "head_dim must be even, got ", D);
  check_rope_tables(positions, cos, sin, T, D, query, op);
  QOPS_CHECK_VALUE(query.size(1) + key.size(1) <= INT32_MAX / 2, op, "too many heads");
  const c10::cuda::CUDAGuard guard(query.device());
  cudaError_t err;
  if (query.scalar_type() == at::kHalf) {
    err = qops::rotary_embedding<__half>(
        positions.data_ptr<int64_t>(), static_cast<__half*>(query.data_ptr()), query.stride(0),
        query.stride(1), static_cast<int>(query.size(1)), static_cast<__half*>(key.data_ptr()),
        key.stride(0), key.stride(1), static_cast<int>(key.size(1)), cos.data_ptr<float>(),
        sin.data_ptr<float>(), cos.size(0), T, static_cast<int>(D), enable_pdl, current_stream());
  } else {
    err = qops::rotary_embedding<__nv_bfloat16>(
        positions.data_ptr<int64_t>(), static_cast<__nv_bfloat16*>(query.data_ptr()),
        query.stride(0), query.stride(1), static_cast<int>(query.size(1)),
        static_cast<__nv_bfloat16*>(key.data_ptr()), key.stride(0), key.stride(1),
        static_cast<int>(key.size(1)), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0), T,
        static_cast<int>(D), enable_pdl, current_stream());
  }
  check_launch(err, op);
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("rotary_embedding", &rotary_embedding_cuda);
}
