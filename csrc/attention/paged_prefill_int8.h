// Prefill / chunked-prefill attention over the paged int8 KV cache (torch-free). docs/kv_cache.md
// describes the layout and the kernel.
//
//   query:        half/bf16 [T, HQ, D], the new tokens of B sequences packed (cu_seqlens_q), last
//                 dim contiguous, token/head strides given; D in {64, 128}
//   k/v_cache:    int8 [num_blocks, HKV, block_size, D], contiguous, block_size a power of two
//                 >= 16; every query's own key and value are already in the cache
//   k/v_scales:   f32 [num_blocks, HKV, block_size] (dynamic) or f32 [1] (static)
//   block_tables: int32 [B, max_blocks] (row stride bt_stride); seq_lens: int32 [B], each
//                 sequence's whole context (cached tokens + its new ones)
//   cu_seqlens_q: int32 [B + 1]: sequence b's queries are rows [cu[b], cu[b + 1]) of query and
//                 out, at positions seq_lens[b] - n_b + j (n_b = cu[b + 1] - cu[b], j < n_b)
//   alibi_slopes: f32 [HQ] or nullptr
//   out:          [T, HQ, D] contiguous, the query's dtype
// Query j of sequence b attends causally to the cached positions 0 .. seq_lens[b] - n_b + j.
// max_query_len sizes the grid (ceil(max_query_len / 64) CTAs per sequence and head, which loop
// over a longer sequence's query tiles): the longest n_b is the fastest choice, any value is correct.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qops {
namespace attention {

struct PagedPrefillInt8Params {
  const void* query;
  int64_t q_stride_t, q_stride_h;  // in elements
  const int8_t* k_cache;
  const int8_t* v_cache;
  const float* k_scales;
  const float* v_scales;
  bool static_scales;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* cu_seqlens_q;
  const float* alibi_slopes;
  void* out;
  int batch, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks;
  int max_query_len;
  float sm_scale;
  bool bf16;
  bool no_pdl;
};

cudaError_t paged_prefill_attention_int8(const PagedPrefillInt8Params& p, cudaStream_t stream);

}  // namespace attention
}  // namespace qops
