// CUDA implementations of the int4 KV-cache writes: quantize_kv_int4, reshape_and_cache_int4 and
// skvq_cache_write (torch glue only: checks, stream; the kernel is csrc/kv_cache/cache_int4.cu).
// The decode, int4_gqa_decode, is in ops/attention.cpp beside the int8 decode.
#include "common.h"
#include "kv_cache/cache_int4.h"

namespace qops_glue {

// Checks one pair of int4 caches; returns D (from the row bytes 4 * num_groups + D / 2).
int64_t check_int4_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t num_groups,
                          const char* op) {
  check_cuda(k_cache, op, "k_cache");
  check_dtype(k_cache, at::kByte, op, "k_cache");
  check_dtype(v_cache, at::kByte, op, "v_cache");
  QOPS_CHECK_VALUE(k_cache.dim() == 4, op,
                   "k_cache must be uint8 [num_blocks, H_kv, block_size, row_bytes], got shape ",
                   k_cache.sizes());
  QOPS_CHECK_VALUE(v_cache.dim() == 4, op,
                   "v_cache must be uint8 [num_blocks, H_kv, block_size, row_bytes], got shape ",
                   v_cache.sizes());
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  QOPS_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), op, "v_cache must have k_cache's shape ",
                   k_cache.sizes(), ", got ", v_cache.sizes());
  check_same_device(v_cache, k_cache, op, "v_cache");
  QOPS_CHECK_VALUE(num_groups == 1 || num_groups == 4, op, "num_groups must be 1 or 4, got ",
                   num_groups);
  const int64_t bs = k_cache.size(2);
  QOPS_CHECK_VALUE(bs == 16 || bs == 32 || bs == 64 || bs == 128, op,
                   "block_size (k_cache.shape[2]) must be one of (16, 32, 64, 128), got ", bs);
  const int64_t rb = k_cache.size(3);
  const int64_t d = (rb - 4 * num_groups) * 2;
  QOPS_CHECK_VALUE(d == 64 || d == 128, op, "k_cache's row bytes (", rb,
                   ") must be 4 * num_groups + D / 2 for D in (64, 128) ([", 4 * num_groups + 32,
                   ", ", 4 * num_groups + 64, "] with num_groups = ", num_groups, ")");
  QOPS_CHECK_VALUE(k_cache.numel() < (int64_t{1} << 40) && k_cache.size(0) <= INT32_MAX, op,
                   "k_cache is too large");
  return d;
}

}  // namespace qops_glue

namespace {

using namespace qops_glue;

void check_clip(double clip_ratio, const char* op) {
  QOPS_CHECK_VALUE(clip_ratio > 0.0 && clip_ratio <= 1.0, op, "clip_ratio must be in (0, 1], got ",
                   clip_ratio);
}

// key / value [T, H_kv, D] against the cache's H_kv and D
void check_kv_tokens(const at::Tensor& key, const at::Tensor& value, int64_t hkv, int64_t d,
                     const at::Tensor& ref, const char* op) {
  check_half(key, op, "key");
  QOPS_CHECK_TYPE(value.scalar_type() == key.scalar_type(), op, "value must have key's dtype ",
                  key.scalar_type(), ", got ", value.scalar_type());
  QOPS_CHECK_VALUE(key.dim() == 3, op, "key must be [T, H_kv, D], got shape ", key.sizes());
  QOPS_CHECK_VALUE(value.sizes() == key.sizes(), op, "value must have key's shape ", key.sizes(),
                   ", got ", value.sizes());
  QOPS_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1, op,
                   "key and value must have a contiguous last dimension (stride 1)");
  QOPS_CHECK_VALUE(key.size(1) == hkv && key.size(2) == d, op, "key's [H_kv, D] = [", key.size(1),
                   ", ", key.size(2), "] must match the cache's [H_kv, D] = [", hkv, ", ", d, "]");
  check_same_device(key, ref, op, "key");
  check_same_device(value, ref, op, "value");
  QOPS_CHECK_VALUE(key.size(0) <= INT32_MAX, op, "too many tokens");
}

qops::kv_cache::CacheInt4Params base_params(const at::Tensor& key, const at::Tensor& value,
                                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                                            int64_t num_groups, double clip_ratio,
                                            bool enable_pdl) {
  qops::kv_cache::CacheInt4Params p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_stride_t = key.stride(0);
  p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0);
  p.value_stride_h = value.stride(1);
  p.k_cache = k_cache.data_ptr<uint8_t>();
  p.v_cache = v_cache.data_ptr<uint8_t>();
  p.num_tokens = static_cast<int>(key.size(0));
  p.num_heads = static_cast<int>(key.size(1));
  p.head_dim = static_cast<int>(key.size(2));
  p.num_groups = static_cast<int>(num_groups);
  p.block_size = static_cast<int>(k_cache.size(2));
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.clip_ratio = static_cast<float>(clip_ratio);
  p.bf16 = key.scalar_type() == at::kBFloat16;
  p.no_pdl = !enable_pdl;
  return p;
}

void reshape_and_cache_int4_cuda(const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& slot_mapping, int64_t num_groups,
                                 double clip_ratio, bool enable_pdl) {
  constexpr const char* op = "reshape_and_cache_int4";
  const int64_t d = check_int4_caches(k_cache, v_cache, num_groups, op);
  check_kv_tokens(key, value, k_cache.size(1), d, k_cache, op);
  check_clip(clip_ratio, op);
  check_dtype(slot_mapping, at::kLong, op, "slot_mapping");
  QOPS_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), op,
                   "slot_mapping must be int64 [T] with T = ", key.size(0), ", got shape ",
                   slot_mapping.sizes());
  check_contiguous(slot_mapping, op, "slot_mapping");
  check_same_device(slot_mapping, k_cache, op, "slot_mapping");
  const c10::cuda::CUDAGuard guard(key.device());
  auto p = base_params(key, value, k_cache, v_cache, num_groups, clip_ratio, enable_pdl);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  check_launch(qops::kv_cache::cache_int4_write(p, c10::cuda::getCurrentCUDAStream()), op);
}

void skvq_cache_write_cuda(const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& k_side, const at::Tensor& v_side,
                           const at::Tensor& block_tables, const at::Tensor& side_slots,
                           const at::Tensor& seq_lens, const at::Tensor& cu_seqlens,
                           int64_t num_groups, int64_t sinks, int64_t window, double clip_ratio,
                           bool enable_pdl) {
  constexpr const char* op = "skvq_cache_write";
  const int64_t d = check_int4_caches(k_cache, v_cache, num_groups, op);
  const int64_t hkv = k_cache.size(1);
  check_kv_tokens(key, value, hkv, d, k_cache, op);
  check_clip(clip_ratio, op);
  check_dtype(seq_lens, at::kInt, op, "seq_lens");
  QOPS_CHECK_VALUE(seq_lens.dim() == 1, op, "seq_lens must be int32 [B], got ", seq_lens.sizes());
  const int64_t B = seq_lens.size(0);
  check_dtype(block_tables, at::kInt, op, "block_tables");
  QOPS_CHECK_VALUE(
      block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.size(1) >= 1, op,
      "block_tables must be int32 [B, max_blocks] with B = ", B, ", max_blocks >= 1, got shape ",
      block_tables.sizes());
  QOPS_CHECK_VALUE(block_tables.stride(1) == 1, op,
                   "block_tables' last dimension must be contiguous (stride 1)");
  check_contiguous(seq_lens, op, "seq_lens");
  QOPS_CHECK_VALUE(sinks >= 0 && window >= 0, op, "sinks and window must be >= 0, got ", sinks,
                   " and ", window);
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"k_side", &k_side}, {"v_side", &v_side}}) {
    QOPS_CHECK_TYPE(t->scalar_type() == key.scalar_type(), op, name, " must be ", key.scalar_type(),
                    ", got ", t->scalar_type());
    QOPS_CHECK_VALUE(
        t->dim() == 4 && t->size(1) == hkv && t->size(2) == sinks + window && t->size(3) == d, op,
        name, " must be [num_side_slots, H_kv, sinks + window, D] = [*, ", hkv, ", ",
        sinks + window, ", ", d, "], got shape ", t->sizes());
    check_contiguous(*t, op, name);
    check_same_device(*t, k_cache, op, name);
  }
  QOPS_CHECK_VALUE(v_side.sizes() == k_side.sizes(), op, "v_side must have k_side's shape ",
                   k_side.sizes(), ", got ", v_side.sizes());
  check_dtype(side_slots, at::kInt, op, "side_slots");
  QOPS_CHECK_VALUE(side_slots.dim() == 1 && side_slots.size(0) == B, op,
                   "side_slots must be int32 [B] = [", B, "], got ", side_slots.sizes());
  check_dtype(cu_seqlens, at::kInt, op, "cu_seqlens");
  QOPS_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_seqlens.size(0) == B + 1, op,
                   "cu_seqlens must be int32 [B + 1] = [", B + 1, "], got ", cu_seqlens.sizes());
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"block_tables", &block_tables},
        {"side_slots", &side_slots},
        {"seq_lens", &seq_lens},
        {"cu_seqlens", &cu_seqlens}}) {
    check_same_device(*t, k_cache, op, name);
  }
  check_contiguous(side_slots, op, "side_slots");
  check_contiguous(cu_seqlens, op, "cu_seqlens");
  QOPS_CHECK_VALUE(B >= 1 && B <= INT32_MAX && block_tables.size(1) * k_cache.size(2) <= INT32_MAX,
                   op, "B must be >= 1 and block_tables not too wide");
  const c10::cuda::CUDAGuard guard(key.device());
  auto p = base_params(key, value, k_cache, v_cache, num_groups, clip_ratio, enable_pdl);
  p.k_side = k_side.data_ptr();
  p.v_side = v_side.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride = block_tables.stride(0);
  p.side_slots = side_slots.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  p.batch = static_cast<int>(B);
  p.max_blocks = static_cast<int>(block_tables.size(1));
  p.sinks = static_cast<int>(sinks);
  p.window = static_cast<int>(window);
  check_launch(qops::kv_cache::cache_int4_write(p, c10::cuda::getCurrentCUDAStream()), op);
}

at::Tensor quantize_kv_int4_cuda(const at::Tensor& kv, int64_t num_groups, double clip_ratio) {
  constexpr const char* op = "quantize_kv_int4";
  check_half(kv, op, "kv");
  QOPS_CHECK_VALUE(kv.dim() >= 1, op, "kv must have a last dimension (the head dim D)");
  const int64_t d = kv.size(-1);
  QOPS_CHECK_VALUE(d == 64 || d == 128, op,
                   "kv's last dimension (the head dim D) must be 64 or 128, got ", d);
  QOPS_CHECK_VALUE(num_groups == 1 || num_groups == 4, op, "num_groups must be 1 or 4, got ",
                   num_groups);
  QOPS_CHECK_VALUE(kv.stride(-1) == 1, op, "kv's last dimension must be contiguous (stride 1)");
  check_clip(clip_ratio, op);
  const int64_t rb = 4 * num_groups + d / 2;
  std::vector<int64_t> shape(kv.sizes().begin(), kv.sizes().end());
  shape.back() = rb;
  const c10::cuda::CUDAGuard guard(kv.device());
  auto out = at::empty(shape, kv.options().dtype(at::kByte));
  const int64_t n = kv.numel() / d;
  if (n == 0) return out;
  QOPS_CHECK_VALUE(n <= INT32_MAX, op, "too many rows");
  // The write kernel with rows as slots of a cache of one head and blocks of one token.
  const at::Tensor rows = kv.reshape({n, 1, d});
  const at::Tensor slots = at::arange(n, kv.options().dtype(at::kLong));
  const at::Tensor cache = out.view({n, 1, 1, rb});
  auto p = base_params(rows, rows, cache, cache, num_groups, clip_ratio, false);
  p.slot_mapping = slots.data_ptr<int64_t>();
  p.v_cache = nullptr;  // K only
  check_launch(qops::kv_cache::cache_int4_write(p, c10::cuda::getCurrentCUDAStream()), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("quantize_kv_int4", &quantize_kv_int4_cuda);
  m.impl("reshape_and_cache_int4", &reshape_and_cache_int4_cuda);
  m.impl("skvq_cache_write", &skvq_cache_write_cuda);
}
