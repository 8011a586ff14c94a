// CUDA implementations of qops::paged_decode_attention_int8, int4_gqa_decode and
// paged_prefill_attention_int8 (torch glue only: checks, workspace, split-K choice, the fused
// merge's counters, stream; the kernels are in csrc/attention/).
#include <algorithm>
#include <string>
#include <utility>

#include "attention/paged_decode_int8.h"  // also skvq_side_decode
#include "attention/paged_prefill_int8.h"
#include "common/device_cache.h"
#include "common.h"

namespace qops_glue {
// Defined in ops/kv_cache.cpp: checks one layer's cache tensors; true for static scales.
bool check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& k_scales, const at::Tensor& v_scales, const char* op);
// Defined in ops/int4_kv.cpp: checks a pair of paged int4 caches; returns D.
int64_t check_int4_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t num_groups,
                          const char* op);
}  // namespace qops_glue

namespace {

using namespace qops_glue;

// The block tables and sequence lengths of B sequences of a paged cache on ref's device.
void check_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t B,
                  const at::Tensor& ref, const char* op) {
  check_dtype(block_tables, at::kInt, op, "block_tables");
  QOPS_CHECK_VALUE(
      block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.size(1) >= 1, op,
      "block_tables must be int32 [B, max_blocks] with B = ", B, ", max_blocks >= 1, got shape ",
      block_tables.sizes());
  QOPS_CHECK_VALUE(block_tables.stride(1) == 1, op,
                   "block_tables' last dimension must be contiguous (stride 1)");
  check_same_device(block_tables, ref, op, "block_tables");
  check_dtype(seq_lens, at::kInt, op, "seq_lens");
  QOPS_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == B, op,
                   "seq_lens must be int32 [B] = [", B, "], got ", seq_lens.sizes());
  check_contiguous(seq_lens, op, "seq_lens");
  check_same_device(seq_lens, ref, op, "seq_lens");
}

// A half query [rows, HQ, D] (last dimension contiguous, D in {64, 128}, HQ a multiple of H_kv)
// over one layer's int8 cache on its device; true for static scales (check_kv_cache).
bool check_query_and_cache(const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& k_scales,
                           const at::Tensor& v_scales, const char* rows, const char* op) {
  check_half(query, op, "query");
  QOPS_CHECK_VALUE(query.dim() == 3, op, "query must be [", rows, ", HQ, D], got shape ",
                   query.sizes());
  QOPS_CHECK_VALUE(query.stride(2) == 1, op,
                   "query's last dimension must be contiguous (stride 1)");
  const bool is_static = check_kv_cache(k_cache, v_cache, k_scales, v_scales, op);
  check_same_device(query, k_cache, op, "query");
  const int64_t HQ = query.size(1), D = query.size(2), HKV = k_cache.size(1);
  QOPS_CHECK_VALUE(D == k_cache.size(3), op, "query's D = ", D,
                   " must match k_cache's D = ", k_cache.size(3));
  QOPS_CHECK_VALUE(D == 64 || D == 128, op, "head dim D must be one of (64, 128), got ", D);
  QOPS_CHECK_VALUE(HQ > 0 && HQ % HKV == 0, op, "the number of query heads (", HQ,
                   ") must be a multiple of the number of kv heads (", HKV, ")");
  return is_static;
}

// The query as the kernels load it, in vectors of `bytes` bytes per row: `query` itself when its
// address and its row and head strides allow that, else a copy in a fresh (aligned) allocation.
// (contiguous() would not do: a contiguous tensor at a misaligned address is returned as it is.)
at::Tensor vector_aligned(const at::Tensor& query, int bytes) {
  const int64_t elems = bytes / static_cast<int64_t>(query.element_size());
  const bool ok = reinterpret_cast<uintptr_t>(query.data_ptr()) % bytes == 0 &&
                  query.stride(0) % elems == 0 && query.stride(1) % elems == 0;
  return ok ? query : query.clone(at::MemoryFormat::Contiguous);
}

// Optional ALiBi slopes: float32 [HQ] on ref's device.
void check_alibi(const std::optional<at::Tensor>& alibi_slopes, int64_t HQ, const at::Tensor& ref,
                 const char* op) {
  if (!alibi_slopes.has_value()) return;
  const at::Tensor& a = *alibi_slopes;
  check_dtype(a, at::kFloat, op, "alibi_slopes");
  QOPS_CHECK_VALUE(a.dim() == 1 && a.size(0) == HQ, op, "alibi_slopes must be float32 [HQ] = [", HQ,
                   "], got ", a.sizes());
  check_contiguous(a, op, "alibi_slopes");
  check_same_device(a, ref, op, "alibi_slopes");
}

// How the splits are merged (the op's `merge` argument, qops.DecodeTuning):
//   "auto"     the cluster merge (distributed shared memory, sm_90) where the split count fits a
//              cluster and the device can co-schedule the grid's clusters; else the fused merge
//              (counters) where it measured faster (H100, bench/bench_decode_attention.py,
//              docs/kv_cache.md): head_dim 128 with contexts of 4096 tokens and more (6-7% at B=1
//              for Llama-3-8B GQA; with head_dim 64 and short contexts the last CTA's serial merge
//              costs more than the second launch saves, up to 17%); else the separate merge kernel;
//   "cluster"  the cluster merge where it fits, else the separate merge kernel;
//   "fused"    never the cluster merge; the fused merge;
//   "separate" never the cluster merge; the second kernel.
// The three merges of the same splits give bit-identical outputs.
enum class Merge { kAuto, kCluster, kFused, kSeparate };

Merge parse_merge(c10::string_view merge, const char* op) {
  if (merge == "auto") return Merge::kAuto;
  if (merge == "cluster") return Merge::kCluster;
  if (merge == "fused") return Merge::kFused;
  QOPS_CHECK_VALUE(merge == "separate", op, "merge must be auto, cluster, fused or separate, got '",
                   std::string(merge), "'");
  return Merge::kSeparate;
}

bool fused_merge(Merge merge, int head_dim, int max_context) {
  if (merge == Merge::kFused) return true;
  if (merge == Merge::kAuto) return head_dim == 128 && max_context >= 4096;
  return false;
}

// Chooses the split count (num_splits, 0: the heuristic at `heuristic_context` tokens), how the
// splits are merged, allocates the workspace and launches p's decode (int8 or int4) on the current
// stream. p holds everything but num_splits, the workspace and the merge fields.
void launch_decode(qops::attention::PagedDecodeInt8Params& p, const at::Tensor& query, Merge merge,
                   int64_t num_splits, int max_context, int heuristic_context, const char* op) {
  const int64_t B = p.batch, HQ = p.num_q_heads, HKV = p.num_kv_heads, D = p.head_dim;
  int splits = static_cast<int>(num_splits);
  // The heuristic's count depends on the device only, not on `merge`, which chooses how the
  // splits are merged: the three merges of the same splits give bit-identical outputs.
  qops::DeviceProps props;  // the guard made the query's device current
  check_launch(qops::current_device_props(&props), op);
  const int major = props.cc_major;
  if (splits == 0) {
    splits = p.kv_format == qops::attention::KvFormat::kInt4
                 ? qops::attention::paged_decode_int4_num_splits(
                       static_cast<int>(B), static_cast<int>(HQ), static_cast<int>(HKV),
                       static_cast<int>(D), p.num_groups, max_context, props.sms, major >= 9)
                 : qops::attention::paged_decode_int8_num_splits(
                       static_cast<int>(B), static_cast<int>(HQ), static_cast<int>(HKV),
                       static_cast<int>(D), heuristic_context, props.sms, major >= 9);
  }
  splits = std::min(splits, qops::attention::kPagedDecodeMaxSplits);
  splits = std::max(1, std::min<int>(splits, static_cast<int>((max_context + 15) / 16)));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  p.num_splits = splits;
  // How the splits are merged: in a thread-block cluster (no workspace), else fused into the
  // split kernel through a workspace and counters, else by a second kernel. Whether the clusters
  // fit is asked once; where the heuristic's don't, a few splits fewer may (the count must not
  // depend on `merge`, so this runs whether or not the cluster merge is allowed).
  const bool cluster_enabled = merge == Merge::kAuto || merge == Merge::kCluster;
  const bool auto_sm90 = num_splits == 0 && major >= 9;
  bool fits = splits > 1 && (cluster_enabled || auto_sm90) &&
              qops::attention::paged_decode_int8_cluster_merge_fits(p);
  if (auto_sm90 && splits > 1 && !fits) {
    const int fitted = qops::attention::paged_decode_int8_fit_cluster_splits(p, heuristic_context);
    fits = fitted != splits;
    splits = fitted;
    p.num_splits = splits;
  }
  at::Tensor workspace;
  p.cluster_merge = fits && cluster_enabled;
  const int64_t ws =
      p.cluster_merge ? 0
                      : qops::attention::paged_decode_int8_workspace_floats(
                            static_cast<int>(B), static_cast<int>(HQ), static_cast<int>(D), splits);
  // The fused merge's counters: the shared zeroed buffer, or (see shared_split_counters) zeroed
  // int32s after the workspace's floats.
  int32_t* counters = nullptr;
  int64_t ws_counters = 0;
  if (ws > 0 && fused_merge(merge, static_cast<int>(D), heuristic_context)) {
    const int64_t n = qops::attention::paged_decode_int8_num_counters(
        static_cast<int>(B), static_cast<int>(HQ), static_cast<int>(HKV));
    counters = shared_split_counters(query.device().index(), stream, n, op);
    if (counters == nullptr) ws_counters = n;
  }
  if (ws > 0) workspace = at::empty({ws + ws_counters}, query.options().dtype(at::kFloat));
  if (ws_counters > 0) {
    counters = reinterpret_cast<int32_t*>(workspace.data_ptr<float>() + ws);
    check_launch(cudaMemsetAsync(counters, 0, ws_counters * sizeof(int32_t), stream), op);
  }
  if (ws > 0) {
    p.partial_out = workspace.data_ptr<float>();
    p.partial_lse = p.partial_out + B * HQ * splits * D;
  }
  p.split_counters = counters;
  check_launch(qops::attention::paged_decode_attention_int8(p, stream), op);
}

at::Tensor paged_decode_attention_int8_cuda(
    const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, double sm_scale, const std::optional<at::Tensor>& alibi_slopes,
    int64_t num_splits, bool overlap_prologue, bool enable_pdl, c10::string_view merge_name,
    int64_t warps) {
  constexpr const char* op = "paged_decode_attention_int8";
  const Merge merge = parse_merge(merge_name, op);
  QOPS_CHECK_VALUE(warps == 0 || warps == 4 || warps == 8, op,
                   "warps must be 0 (the kernel's choice), 4 or 8, got ", warps);
  const bool is_static =
      check_query_and_cache(query, k_cache, v_cache, k_scales, v_scales, "B", op);
  const int64_t B = query.size(0), HQ = query.size(1), D = query.size(2);
  const int64_t HKV = k_cache.size(1);
  check_tables(block_tables, seq_lens, B, k_cache, op);
  check_alibi(alibi_slopes, HQ, k_cache, op);
  QOPS_CHECK_VALUE(num_splits >= 0, op, "num_splits must be >= 0 (0: heuristic), got ", num_splits);
  QOPS_CHECK_VALUE(B <= 65535, op, "at most 65535 sequences per call on CUDA, got ", B);
  const int64_t bs = k_cache.size(2), max_blocks = block_tables.size(1);
  QOPS_CHECK_VALUE(max_blocks * bs <= INT32_MAX && k_cache.size(0) <= INT32_MAX, op,
                   "block_tables is too wide");

  const int max_context = static_cast<int>(max_blocks * bs);
  const c10::cuda::CUDAGuard guard(query.device());
  auto out = at::empty({B, HQ, D}, query.options());
  if (B == 0) return out;
  const at::Tensor q = vector_aligned(query, 16);  // the kernel loads 16-byte vectors of a row
  const bool q_aligned = q.is_same(query);

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
  p.batch = static_cast<int>(B);
  p.num_q_heads = static_cast<int>(HQ);
  p.num_kv_heads = static_cast<int>(HKV);
  p.head_dim = static_cast<int>(D);
  p.block_size = static_cast<int>(bs);
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.max_blocks = static_cast<int>(max_blocks);
  p.sm_scale = static_cast<float>(sm_scale);
  p.bf16 = query.scalar_type() == at::kBFloat16;
  p.warps = static_cast<int>(warps);  // 0: the launcher's rule
  p.no_pdl = !enable_pdl;
  // The caller's promise covers its own query tensor, not the aligned copy made just above.
  p.overlap_prologue = overlap_prologue && q_aligned;

  launch_decode(p, query, merge, num_splits, max_context, max_context, op);
  return out;
}

// ---- int4_gqa_decode: the paged int4 cache (+ SKVQ's full-precision sinks and window) ----------
at::Tensor int4_gqa_decode_cuda(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double sm_scale, int64_t num_groups,
                                const std::optional<at::Tensor>& k_side,
                                const std::optional<at::Tensor>& v_side,
                                const std::optional<at::Tensor>& side_slots, int64_t sinks,
                                int64_t window, int64_t num_splits, bool enable_pdl,
                                c10::string_view merge_name, int64_t warps) {
  constexpr const char* op = "int4_gqa_decode";
  check_half(query, op, "query");
  QOPS_CHECK_VALUE(query.dim() == 3, op, "query must be [B, HQ, D], got shape ", query.sizes());
  QOPS_CHECK_VALUE(query.stride(2) == 1, op,
                   "query's last dimension must be contiguous (stride 1)");
  const int64_t D = check_int4_caches(k_cache, v_cache, num_groups, op);
  const int64_t B = query.size(0), HQ = query.size(1), HKV = k_cache.size(1);
  QOPS_CHECK_VALUE(query.size(2) == D, op, "query's D = ", query.size(2),
                   " must match the cache's D = ", D, " (row bytes ", k_cache.size(3), ")");
  QOPS_CHECK_VALUE(HQ > 0 && HQ % HKV == 0, op, "the number of query heads (", HQ,
                   ") must be a multiple of the number of kv heads (", HKV, ")");
  check_same_device(query, k_cache, op, "query");
  check_tables(block_tables, seq_lens, B, k_cache, op);
  QOPS_CHECK_VALUE(sinks >= 0 && window >= 0, op, "sinks and window must be >= 0, got ", sinks,
                   " and ", window);
  const bool any_side = k_side.has_value() || v_side.has_value() || side_slots.has_value();
  if (!any_side) {
    QOPS_CHECK_VALUE(sinks == 0 && window == 0, op,
                     "sinks and window need the side buffers k_side, v_side and side_slots");
  } else {
    QOPS_CHECK_VALUE(k_side.has_value() && v_side.has_value() && side_slots.has_value(), op,
                     "k_side, v_side and side_slots go together (all or none)");
    QOPS_CHECK_VALUE(sinks + window > 0, op, "side buffers were given with sinks = window = 0");
    for (const auto& [name, t] :
         {std::pair<const char*, const at::Tensor*>{"k_side", &*k_side}, {"v_side", &*v_side}}) {
      QOPS_CHECK_TYPE(t->scalar_type() == query.scalar_type(), op, name, " must be ",
                      query.scalar_type(), ", got ", t->scalar_type());
      QOPS_CHECK_VALUE(
          t->dim() == 4 && t->size(1) == HKV && t->size(2) == sinks + window && t->size(3) == D, op,
          name, " must be [num_side_slots, H_kv, sinks + window, D] = [*, ", HKV, ", ",
          sinks + window, ", ", D, "], got shape ", t->sizes());
      check_contiguous(*t, op, name);
      check_same_device(*t, k_cache, op, name);
    }
    QOPS_CHECK_VALUE(v_side->sizes() == k_side->sizes(), op, "v_side must have k_side's shape ",
                     k_side->sizes(), ", got ", v_side->sizes());
    check_dtype(*side_slots, at::kInt, op, "side_slots");
    QOPS_CHECK_VALUE(side_slots->dim() == 1 && side_slots->size(0) == B, op,
                     "side_slots must be int32 [B] = [", B, "], got ", side_slots->sizes());
    check_same_device(*side_slots, k_cache, op, "side_slots");
  }
  QOPS_CHECK_VALUE(num_splits >= 0, op, "num_splits must be >= 0 (0: the kernel chooses), got ",
                   num_splits);
  const Merge merge = parse_merge(merge_name, op);
  QOPS_CHECK_VALUE(warps == 0 || warps == 4 || warps == 8, op,
                   "warps must be 0 (the kernel's choice), 4 or 8, got ", warps);
  QOPS_CHECK_VALUE(B <= 65535, op, "at most 65535 sequences per call on CUDA, got ", B);
  const int64_t bs = k_cache.size(2), max_blocks = block_tables.size(1);
  QOPS_CHECK_VALUE(max_blocks * bs <= INT32_MAX, op, "block_tables is too wide");

  const c10::cuda::CUDAGuard guard(query.device());
  auto out = at::empty({B, HQ, D}, query.options());
  if (B == 0) return out;
  const at::Tensor q = vector_aligned(query, 16);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int max_context = static_cast<int>(max_blocks * bs);

  // SKVQ: the side tokens first (their partial, one more split, is folded in by the split kernel)
  at::Tensor side_part;
  int parts = 0;
  if (any_side) {
    qops::DeviceProps props;
    check_launch(qops::current_device_props(&props), op);
    const int64_t smem = qops::attention::skvq_side_smem_bytes(
        static_cast<int>(D), static_cast<int>(sinks + window), static_cast<int>(HQ / HKV));
    QOPS_CHECK_VALUE(
        smem <= props.smem_per_block, op, "sinks + window and the query heads per kv head need ",
        smem, " bytes of shared memory on CUDA, more than the device's ", props.smem_per_block);
    // Parts: enough CTAs for the SMs where the batch has few (sequence, kv head) pairs, each part
    // at least 16 tokens.
    const int64_t pairs = B * HKV;
    parts = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>({(props.sms + pairs - 1) / pairs, (sinks + window + 15) / 16, 16})));
    side_part = at::empty({parts * B * HQ * (D + 1)}, query.options().dtype(at::kFloat));
    qops::attention::SkvqSideParams sp{};
    sp.query = q.data_ptr();
    sp.q_stride_b = q.stride(0);
    sp.q_stride_h = q.stride(1);
    sp.k_side = k_side->data_ptr();
    sp.v_side = v_side->data_ptr();
    sp.side_slots = side_slots->data_ptr<int32_t>();
    sp.seq_lens = seq_lens.data_ptr<int32_t>();
    sp.out = side_part.data_ptr<float>();
    sp.lse = sp.out + parts * B * HQ * D;
    sp.parts = parts;
    sp.batch = static_cast<int>(B);
    sp.num_q_heads = static_cast<int>(HQ);
    sp.num_kv_heads = static_cast<int>(HKV);
    sp.head_dim = static_cast<int>(D);
    sp.sinks = static_cast<int>(sinks);
    sp.window = static_cast<int>(window);
    sp.sm_scale = static_cast<float>(sm_scale);
    sp.bf16 = query.scalar_type() == at::kBFloat16;
    sp.no_pdl = !enable_pdl;
    check_launch(qops::attention::skvq_side_decode(sp, stream), op);
  }

  qops::attention::PagedDecodeInt8Params p{};
  p.query = q.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_cache = reinterpret_cast<const int8_t*>(k_cache.data_ptr<uint8_t>());
  p.v_cache = reinterpret_cast<const int8_t*>(v_cache.data_ptr<uint8_t>());
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.batch = static_cast<int>(B);
  p.num_q_heads = static_cast<int>(HQ);
  p.num_kv_heads = static_cast<int>(HKV);
  p.head_dim = static_cast<int>(D);
  p.block_size = static_cast<int>(bs);
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.max_blocks = static_cast<int>(max_blocks);
  p.sm_scale = static_cast<float>(sm_scale);
  p.bf16 = query.scalar_type() == at::kBFloat16;
  p.warps = static_cast<int>(warps);
  p.no_pdl = !enable_pdl;
  p.kv_format = qops::attention::KvFormat::kInt4;
  p.num_groups = static_cast<int>(num_groups);
  p.sinks = static_cast<int>(sinks);
  p.window = static_cast<int>(window);
  if (any_side) {
    p.extra_out = side_part.data_ptr<float>();
    p.extra_lse = p.extra_out + parts * B * HQ * D;
    p.extra_parts = parts;
  }
  // The split heuristic counts int8 tokens (D + 4 bytes of K per token): an int4 context of the
  // same bytes is (D + 4) / row_bytes times longer.
  const int64_t rb = k_cache.size(3);
  const int heuristic_context =
      static_cast<int>(std::max<int64_t>(1, static_cast<int64_t>(max_context) * rb / (D + 4)));
  launch_decode(p, query, merge, num_splits, max_context, heuristic_context, op);
  return out;
}

// ---- paged_prefill_attention_int8: packed queries over the paged int8 cache ---------------------
at::Tensor paged_prefill_attention_int8_cuda(
    const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q, int64_t max_query_len,
    double sm_scale, const std::optional<at::Tensor>& alibi_slopes, bool enable_pdl) {
  constexpr const char* op = "paged_prefill_attention_int8";
  const bool is_static =
      check_query_and_cache(query, k_cache, v_cache, k_scales, v_scales, "T", op);
  const int64_t T = query.size(0), HQ = query.size(1), D = query.size(2);
  const int64_t HKV = k_cache.size(1);
  const int64_t B = seq_lens.dim() == 1 ? seq_lens.size(0) : -1;
  check_tables(block_tables, seq_lens, B, k_cache, op);
  check_dtype(cu_seqlens_q, at::kInt, op, "cu_seqlens_q");
  QOPS_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == B + 1, op,
                   "cu_seqlens_q must be int32 [B + 1] = [", B + 1, "], got ",
                   cu_seqlens_q.sizes());
  check_contiguous(cu_seqlens_q, op, "cu_seqlens_q");
  check_same_device(cu_seqlens_q, k_cache, op, "cu_seqlens_q");
  check_alibi(alibi_slopes, HQ, k_cache, op);
  QOPS_CHECK_VALUE(max_query_len >= 0 && max_query_len <= T, op,
                   "max_query_len must be in [0, T = ", T, "], got ", max_query_len);
  // (max_query_len only sizes the grid: the kernel's CTAs loop over a longer sequence's tiles)
  QOPS_CHECK_VALUE(B <= 65535 && HQ <= 65535, op,
                   "at most 65535 sequences and 65535 query heads per call on CUDA, got ", B,
                   " and ", HQ);
  const int64_t bs = k_cache.size(2), max_blocks = block_tables.size(1);
  QOPS_CHECK_VALUE(max_blocks * bs <= INT32_MAX && k_cache.size(0) <= INT32_MAX && T <= INT32_MAX,
                   op, "block_tables or query is too large");

  const c10::cuda::CUDAGuard guard(query.device());
  auto out = at::empty({T, HQ, D}, query.options());
  if (B == 0 || T == 0) return out;
  const at::Tensor q = vector_aligned(query, 8);  // the kernel loads 8-byte vectors of a row
  qops::attention::PagedPrefillInt8Params p{};
  p.query = q.data_ptr();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_cache = k_cache.data_ptr<int8_t>();
  p.v_cache = v_cache.data_ptr<int8_t>();
  p.k_scales = k_scales.data_ptr<float>();
  p.v_scales = v_scales.data_ptr<float>();
  p.static_scales = is_static;
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.batch = static_cast<int>(B);
  p.num_q_heads = static_cast<int>(HQ);
  p.num_kv_heads = static_cast<int>(HKV);
  p.head_dim = static_cast<int>(D);
  p.block_size = static_cast<int>(bs);
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.max_blocks = static_cast<int>(max_blocks);
  p.max_query_len = static_cast<int>(max_query_len);
  p.sm_scale = static_cast<float>(sm_scale);
  p.bf16 = query.scalar_type() == at::kBFloat16;
  p.no_pdl = !enable_pdl;
  check_launch(qops::attention::paged_prefill_attention_int8(p, c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}
}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8_cuda);
  m.impl("int4_gqa_decode", &int4_gqa_decode_cuda);
  m.impl("paged_prefill_attention_int8", &paged_prefill_attention_int8_cuda);
}
