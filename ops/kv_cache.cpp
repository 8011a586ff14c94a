// CUDA implementation of qops::reshape_and_cache_int8 (torch glue only: checks, stream, dispatch;
// the kernel is in csrc/kv_cache/). Also defines check_kv_cache(), which ops/attention.cpp uses
// for the same cache tensors.
#include "common.h"
#include "kv_cache/reshape_and_cache_int8.h"
#include "kv_cache/rope_and_cache_int8.h"

namespace qops_glue {

// Checks one layer's paged cache tensors (docs/ops.md "Paged int8 KV cache") on `op`'s behalf;
// returns true for static (per-tensor) scales, false for dynamic per-(token, head) scales.
bool check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& k_scales, const at::Tensor& v_scales, const char* op) {
  check_cuda(k_cache, op, "k_cache");
  check_dtype(k_cache, at::kChar, op, "k_cache");
  check_dtype(v_cache, at::kChar, op, "v_cache");
  QOPS_CHECK_VALUE(k_cache.dim() == 4, op,
                   "k_cache must be int8 [num_blocks, H_kv, block_size, D], got shape ",
                   k_cache.sizes());
  QOPS_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), op, "v_cache must have k_cache's shape ",
                   k_cache.sizes(), ", got ", v_cache.sizes());
  check_same_device(v_cache, k_cache, op, "v_cache");
  QOPS_CHECK_VALUE(k_cache.size(1) >= 1 && k_cache.size(3) >= 1, op,
                   "k_cache must have H_kv >= 1 and D >= 1, got shape ", k_cache.sizes());
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  const int64_t bs = k_cache.size(2);
  QOPS_CHECK_VALUE(bs == 16 || bs == 32 || bs == 64 || bs == 128, op,
                   "block_size (k_cache.shape[2]) must be one of (16, 32, 64, 128), got ", bs);
  QOPS_CHECK_VALUE(k_cache.numel() < (int64_t{1} << 40), op, "k_cache is too large");
  bool is_static[2];
  const at::Tensor* scales[2] = {&k_scales, &v_scales};
  const char* names[2] = {"k_scales", "v_scales"};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& s = *scales[i];
    check_dtype(s, at::kFloat, op, names[i]);
    check_same_device(s, k_cache, op, names[i]);
    const bool dyn = s.dim() == 3 && s.size(0) == k_cache.size(0) && s.size(1) == k_cache.size(1) &&
                     s.size(2) == bs;
    const bool stat = s.dim() == 1 && s.size(0) == 1;
    QOPS_CHECK_VALUE(
        dyn || stat, op, names[i], " must be float32 [num_blocks, H_kv, block_size] = [",
        k_cache.size(0), ", ", k_cache.size(1), ", ", bs,
        "] (dynamic per-token scales) or [1] (a static per-tensor scale), got shape ", s.sizes());
    check_contiguous(s, op, names[i]);
    is_static[i] = stat;
  }
  QOPS_CHECK_VALUE(is_static[0] == is_static[1], op,
                   "k_scales and v_scales must both be dynamic or both static, got k_scales ",
                   is_static[0] ? "static" : "dynamic", " and v_scales ",
                   is_static[1] ? "static" : "dynamic");
  return is_static[0];
}

}  // namespace qops_glue

namespace {

using namespace qops_glue;

void reshape_and_cache_int8_cuda(const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& k_scales, const at::Tensor& v_scales,
                                 const at::Tensor& slot_mapping, bool enable_pdl) {
  constexpr const char* op = "reshape_and_cache_int8";
  check_half(key, op, "key");
  QOPS_CHECK_TYPE(value.scalar_type() == key.scalar_type(), op, "value must have key's dtype ",
                  key.scalar_type(), ", got ", value.scalar_type());
  QOPS_CHECK_VALUE(key.dim() == 3, op, "key must be [T, H_kv, D], got shape ", key.sizes());
  QOPS_CHECK_VALUE(value.sizes() == key.sizes(), op, "value must have key's shape ", key.sizes(),
                   ", got ", value.sizes());
  QOPS_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1, op,
                   "key and value must have a contiguous last dimension (stride 1)");
  const bool is_static = check_kv_cache(k_cache, v_cache, k_scales, v_scales, op);
  QOPS_CHECK_VALUE(key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(3), op,
                   "key's [H_kv, D] = [", key.size(1), ", ", key.size(2),
                   "] must match k_cache's [H_kv, D] = [", k_cache.size(1), ", ", k_cache.size(3),
                   "]");
  const int64_t D = k_cache.size(3);
  QOPS_CHECK_VALUE(D % 16 == 0 && D <= 256, op,
                   "D must be a multiple of 16 and at most 256 on CUDA, got ", D);
  check_dtype(slot_mapping, at::kLong, op, "slot_mapping");
  QOPS_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), op,
                   "slot_mapping must be int64 [T] with T = ", key.size(0), ", got shape ",
                   slot_mapping.sizes());
  check_contiguous(slot_mapping, op, "slot_mapping");
  check_same_device(key, k_cache, op, "key");
  check_same_device(value, k_cache, op, "value");
  check_same_device(slot_mapping, k_cache, op, "slot_mapping");
  QOPS_CHECK_VALUE(key.size(0) <= INT32_MAX && k_cache.size(0) <= INT32_MAX, op,
                   "too many tokens or blocks");

  const c10::cuda::CUDAGuard guard(key.device());
  qops::kv_cache::ReshapeAndCacheInt8Params p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_stride_t = key.stride(0);
  p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0);
  p.value_stride_h = value.stride(1);
  p.k_cache = k_cache.data_ptr<int8_t>();
  p.v_cache = v_cache.data_ptr<int8_t>();
  p.k_scales = k_scales.data_ptr<float>();
  p.v_scales = v_scales.data_ptr<float>();
  p.static_scales = is_static;
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = static_cast<int>(key.size(0));
  p.num_heads = static_cast<int>(key.size(1));
  p.head_dim = static_cast<int>(D);
  p.block_size = static_cast<int>(k_cache.size(2));
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.bf16 = key.scalar_type() == at::kBFloat16;
  p.no_pdl = !enable_pdl;
  check_launch(qops::kv_cache::reshape_and_cache_int8(p, c10::cuda::getCurrentCUDAStream()), op);
}

void rope_and_cache_int8_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& k_scales, const at::Tensor& v_scales,
                              const at::Tensor& slot_mapping, bool is_neox, bool enable_pdl) {
  constexpr const char* op = "rope_and_cache_int8";
  check_cuda(key, op, "key");
  check_half(key, op, "key");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{query, "query"},
                                std::pair<const at::Tensor&, const char*>{key, "key"},
                                std::pair<const at::Tensor&, const char*>{value, "value"}}) {
    QOPS_CHECK_TYPE(t.scalar_type() == key.scalar_type(), op, name, " must have key's dtype ",
                    key.scalar_type(), ", got ", t.scalar_type());
    QOPS_CHECK_VALUE(t.dim() == 3 && t.stride(2) == 1, op, name,
                     " must be [T, H, D] with a contiguous last dimension, got shape ", t.sizes(),
                     " and strides ", t.strides());
    check_same_device(t, key, op, name);
  }
  const int64_t T = key.size(0), D = key.size(2);
  QOPS_CHECK_VALUE(query.size(0) == T && query.size(2) == D, op, "query must be [T, H_q, D] = [", T,
                   ", H_q, ", D, "], got shape ", query.sizes());
  QOPS_CHECK_VALUE(value.sizes() == key.sizes(), op, "value must have key's shape ", key.sizes(),
                   ", got ", value.sizes());
  const bool is_static = check_kv_cache(k_cache, v_cache, k_scales, v_scales, op);
  QOPS_CHECK_VALUE(key.size(1) == k_cache.size(1) && D == k_cache.size(3), op,
                   "key's [H_kv, D] = [", key.size(1), ", ", D,
                   "] must match k_cache's [H_kv, D] = [", k_cache.size(1), ", ", k_cache.size(3),
                   "]");
  QOPS_CHECK_VALUE(D % 16 == 0 && D <= 256, op,
                   "D must be a multiple of 16 and at most 256 on CUDA, got ", D);
  check_rope_tables(positions, cos, sin, T, D, key, op);
  check_dtype(slot_mapping, at::kLong, op, "slot_mapping");
  QOPS_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == T, op,
                   "slot_mapping must be int64 [T] with T = ", T, ", got shape ",
                   slot_mapping.sizes());
  check_contiguous(slot_mapping, op, "slot_mapping");
  check_same_device(slot_mapping, key, op, "slot_mapping");
  check_same_device(k_cache, key, op, "k_cache");
  QOPS_CHECK_VALUE(T <= INT32_MAX && k_cache.size(0) <= INT32_MAX &&
                       query.size(1) + key.size(1) <= INT32_MAX / 2,
                   op, "too many tokens, heads or blocks");

  const c10::cuda::CUDAGuard guard(key.device());
  qops::kv_cache::RopeCacheInt8Params p{};
  p.positions = positions.data_ptr<int64_t>();
  p.q = query.data_ptr();
  p.q_ts = query.stride(0);
  p.q_hs = query.stride(1);
  p.k = key.data_ptr();
  p.k_ts = key.stride(0);
  p.k_hs = key.stride(1);
  p.v = value.data_ptr();
  p.v_ts = value.stride(0);
  p.v_hs = value.stride(1);
  p.q_heads = static_cast<int>(query.size(1));
  p.kv_heads = static_cast<int>(key.size(1));
  p.head_dim = static_cast<int>(D);
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.max_pos = cos.size(0);
  p.neox = is_neox;
  p.k_cache = k_cache.data_ptr<int8_t>();
  p.v_cache = v_cache.data_ptr<int8_t>();
  p.k_scales = k_scales.data_ptr<float>();
  p.v_scales = v_scales.data_ptr<float>();
  p.static_scales = is_static;
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = static_cast<int>(T);
  p.block_size = static_cast<int>(k_cache.size(2));
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.bf16 = key.scalar_type() == at::kBFloat16;
  p.no_pdl = !enable_pdl;
  check_launch(qops::kv_cache::rope_and_cache_int8(p, c10::cuda::getCurrentCUDAStream()), op);
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("reshape_and_cache_int8", &reshape_and_cache_int8_cuda);
  m.impl("rope_and_cache_int8", &rope_and_cache_int8_cuda);
}
