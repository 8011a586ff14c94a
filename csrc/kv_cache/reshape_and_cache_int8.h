// Paged int8 KV cache write (torch-free). Layout: docs/kv_cache.md.
//
//   k_cache, v_cache: int8  [num_blocks, num_heads, block_size, head_dim]   (contiguous)
//   k_scales, v_scales: f32 [num_blocks, num_heads, block_size] (dynamic, written here)
//                       or f32 [1] (static, read here)
//   key, value: half/bf16 [num_tokens, num_heads, head_dim], last dim contiguous, any other strides
//   slot_mapping: int64 [num_tokens]; slot < 0 is padding (skipped). A slot >= num_blocks *
//   block_size is never written; debug builds (NDEBUG undefined or QOPS_DEBUG) trap on it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qops {
namespace kv_cache {

struct ReshapeAndCacheInt8Params {
  const void* key;
  const void* value;
  int64_t key_stride_t, key_stride_h;      // in elements
  int64_t value_stride_t, value_stride_h;  // in elements
  int8_t* k_cache;
  int8_t* v_cache;
  float* k_scales;  // dynamic: written; static: read (one element)
  float* v_scales;
  bool static_scales;
  const int64_t* slot_mapping;
  int num_tokens, num_heads, head_dim, block_size, num_blocks;
  bool bf16;    // key/value dtype: bfloat16 (true) or float16 (false)
  bool no_pdl;  // launch without programmatic dependent launch (common/launch.cuh)
};

// head_dim must be a multiple of 16 and at most 256.
cudaError_t reshape_and_cache_int8(const ReshapeAndCacheInt8Params& p, cudaStream_t stream);

}  // namespace kv_cache
}  // namespace qops
