// Paged int4 KV cache writes (torch-free): the quantizing write of new tokens into their slots
// (reshape_and_cache_int4) and SKVQ's write (sinks and window kept in full precision, tokens that
// leave the window quantized). Layout and rules: docs/int4.md, python/qops/int4_kv.py.
//
//   k_cache, v_cache: uint8 [num_blocks, num_heads, block_size, 4 * num_groups + head_dim / 2]
//   key, value: half/bf16 [num_tokens, num_heads, head_dim], last dim contiguous, any other strides
//   Plain (slot_mapping != nullptr): token t goes to slot slot_mapping[t] (< 0: skipped; past the
//     cache: never written, debug builds trap).
//   SKVQ (slot_mapping == nullptr): sequence b's tokens are [cu_seqlens[b], cu_seqlens[b + 1]), at
//     positions [seq_lens[b] - n_b, seq_lens[b]); k_side, v_side [*, num_heads, sinks + window,
//     head_dim] in key's dtype, row side_slots[b]; block_tables int32 [batch, max_blocks].
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qops {
namespace kv_cache {

struct CacheInt4Params {
  const void* key;
  const void* value;
  int64_t key_stride_t, key_stride_h;      // in elements
  int64_t value_stride_t, value_stride_h;  // in elements
  uint8_t* k_cache;
  uint8_t* v_cache;
  const int64_t* slot_mapping;  // plain write; nullptr: SKVQ
  // SKVQ
  void* k_side;
  void* v_side;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* side_slots;
  const int32_t* seq_lens;
  const int32_t* cu_seqlens;
  int batch, max_blocks, sinks, window;
  int num_tokens, num_heads, head_dim, num_groups, block_size, num_blocks;
  float clip_ratio;
  bool bf16;    // key/value dtype: bfloat16 (true) or float16 (false)
  bool no_pdl;  // launch without programmatic dependent launch (common/launch.cuh)
};

// head_dim 64 or 128, num_groups 1 or 4.
cudaError_t cache_int4_write(const CacheInt4Params& p, cudaStream_t stream);

}  // namespace kv_cache
}  // namespace qops
