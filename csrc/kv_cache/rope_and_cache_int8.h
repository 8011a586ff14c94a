// RoPE on q and k fused with the paged int8 K/V cache write (torch-free): exactly
// rotary_embedding(positions, q, k, cos, sin) (neox: rotate-half; or interleaved pairs) followed by
// reshape_and_cache_int8(k, v, ...) on the rotated k, in one launch. q and k are rotated in place
// (the prefill attention reads them); each (token, kv head) row of k and v is quantized per row
// (dynamic) or with the static scale and stored in its slot (slot -1: padding, skipped). Layouts:
// rope.h and reshape_and_cache_int8.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qops {
namespace kv_cache {

struct RopeCacheInt8Params {
  const int64_t* positions;  // [T]
  void* q;                   // [T, q_heads, D], last dim contiguous
  int64_t q_ts, q_hs;
  void* k;  // [T, kv_heads, D]
  int64_t k_ts, k_hs;
  const void* v;  // [T, kv_heads, D]
  int64_t v_ts, v_hs;
  int q_heads, kv_heads, head_dim;
  const float* cos;  // [max_pos, D]
  const float* sin;
  int64_t max_pos;
  bool neox;  // rotate-half (true) or interleaved pairs (2i, 2i + 1) with cos[p, i], sin[p, i]
  int8_t* k_cache;  // [num_blocks, kv_heads, block_size, D]
  int8_t* v_cache;
  float* k_scales;  // dynamic: [num_blocks, kv_heads, block_size], written; static: [1], read
  float* v_scales;
  bool static_scales;
  const int64_t* slot_mapping;  // [T]
  int num_tokens, block_size, num_blocks;
  bool bf16;
  bool no_pdl;
};

// head_dim must be a multiple of 16 and at most 256.
cudaError_t rope_and_cache_int8(const RopeCacheInt8Params& p, cudaStream_t stream);

}  // namespace kv_cache
}  // namespace qops
