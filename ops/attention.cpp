// CUDA implementation of qops::paged_decode_attention_int8 (torch glue only: checks, workspace,
// split-K choice, stream; the kernels are in csrc/attention/).
#include <algorithm>

#include "attention/paged_decode_int8.h"
#include "common.h"

namespace qops_glue {
// Defined in ops/kv_cache.cpp: checks one layer's cache tensors; true for static scales.
bool check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scales,
                    const at::Tensor& v_scales, const char* op);
}  // namespace qops_glue

namespace {

using namespace qops_glue;

at::Tensor paged_decode_attention_int8_cuda(const at::Tensor& query, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& k_scales,
                                            const at::Tensor& v_scales,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double sm_scale,
                                            const std::optional<at::Tensor>& alibi_slopes,
                                            int64_t num_splits) {
  constexpr const char* op = "paged_decode_attention_int8";
  check_half(query, op, "query");
  QOPS_CHECK_VALUE(query.dim() == 3, op, "query must be [B, HQ, D], got shape ", query.sizes());
  QOPS_CHECK_VALUE(query.stride(2) == 1, op,
                   "query's last dimension must be contiguous (stride 1)");
  const bool is_static = check_kv_cache(k_cache, v_cache, k_scales, v_scales, op);
  check_same_device(query, k_cache, op, "query");
  const int64_t B = query.size(0), HQ = query.size(1), D = query.size(2);
  const int64_t HKV = k_cache.size(1);
  QOPS_CHECK_VALUE(D == k_cache.size(3), op, "query's D = ", D, " must match k_cache's D = ",
                   k_cache.size(3));
  QOPS_CHECK_VALUE(D == 64 || D == 128, op, "head dim D must be one of (64, 128), got ", D);
  QOPS_CHECK_VALUE(HQ > 0 && HQ % HKV == 0, op, "the number of query heads (", HQ,
                   ") must be a multiple of the number of kv heads (", HKV, ")");
  check_dtype(block_tables, at::kInt, op, "block_tables");
  QOPS_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == B &&
                       block_tables.size(1) >= 1,
                   op, "block_tables must be int32 [B, max_blocks] with B = ", B,
                   ", max_blocks >= 1, got shape ", block_tables.sizes());
  QOPS_CHECK_VALUE(block_tables.stride(1) == 1, op,
                   "block_tables' last dimension must be contiguous (stride 1)");
  check_same_device(block_tables, k_cache, op, "block_tables");
  check_dtype(seq_lens, at::kInt, op, "seq_lens");
  QOPS_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == B, op,
                   "seq_lens must be int32 [B] = [", B, "], got ", seq_lens.sizes());
  check_contiguous(seq_lens, op, "seq_lens");
  check_same_device(seq_lens, k_cache, op, "seq_lens");
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    check_dtype(a, at::kFloat, op, "alibi_slopes");
    QOPS_CHECK_VALUE(a.dim() == 1 && a.size(0) == HQ, op, "alibi_slopes must be float32 [HQ] = [",
                     HQ, "], got ", a.sizes());
    check_contiguous(a, op, "alibi_slopes");
    check_same_device(a, k_cache, op, "alibi_slopes");
  }
  QOPS_CHECK_VALUE(num_splits >= 0, op, "num_splits must be >= 0 (0: heuristic), got ", num_splits);
  QOPS_CHECK_VALUE(B <= 65535, op, "at most 65535 sequences per call on CUDA, got ", B);
  const int64_t bs = k_cache.size(2), max_blocks = block_tables.size(1);
  QOPS_CHECK_VALUE(max_blocks * bs <= INT32_MAX && k_cache.size(0) <= INT32_MAX, op,
                   "block_tables is too wide");

  const c10::cuda::CUDAGuard guard(query.device());
  auto out = at::empty({B, HQ, D}, query.options());
  if (B == 0) return out;
  // The kernel loads 16-byte vectors of each query row.
  at::Tensor q = query;
  const bool q_aligned = reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 &&
                         q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0;
  if (!q_aligned) q = query.contiguous();

  const int max_context = static_cast<int>(max_blocks * bs);
  int splits = static_cast<int>(num_splits);
  if (splits == 0) {
    int sms = 0;
    check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        query.device().index()),
                 op);
    splits = qops::attention::paged_decode_int8_num_splits(
        static_cast<int>(B), static_cast<int>(HQ), static_cast<int>(HKV), static_cast<int>(D),
        max_context, sms);
  }
  splits = std::min(splits, qops::attention::kPagedDecodeMaxSplits);
  splits = std::max(1, std::min<int>(splits, static_cast<int>((max_context + 15) / 16)));
  at::Tensor workspace;
  const int64_t ws = qops::attention::paged_decode_int8_workspace_floats(
      static_cast<int>(B), static_cast<int>(HQ), static_cast<int>(D), splits);
  if (ws > 0) workspace = at::empty({ws}, query.options().dtype(at::kFloat));

  qops::attention::PagedDecodeInt8Params p{};
  p.query = q.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_cache = k_cache.data_ptr<int8_t>();
  p.v_cache = v_cache.data_ptr<int8_t>();
  p.k_scales = k_scales.data_ptr<float>();
  p.v_scales = v_scales.data_ptr<float>();
  p.static_scales = is_static;
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  if (ws > 0) {
    p.partial_out = workspace.data_ptr<float>();
    p.partial_lse = p.partial_out + B * HQ * splits * D;
  }
  p.batch = static_cast<int>(B);
  p.num_q_heads = static_cast<int>(HQ);
  p.num_kv_heads = static_cast<int>(HKV);
  p.head_dim = static_cast<int>(D);
  p.block_size = static_cast<int>(bs);
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.max_blocks = static_cast<int>(max_blocks);
  p.num_splits = splits;
  p.sm_scale = static_cast<float>(sm_scale);
  p.bf16 = query.scalar_type() == at::kBFloat16;
  check_launch(qops::attention::paged_decode_attention_int8(p, c10::cuda::getCurrentCUDAStream()), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8_cuda);
}
