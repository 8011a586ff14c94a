// CUDA implementation of qops::paged_decode_attention_int8 (torch glue only: checks, workspace,
// split-K choice, the fused merge's counters, stream; the kernels are in csrc/attention/).
#include <algorithm>
#include <atomic>
#include <string>
#include <mutex>

#include "attention/paged_decode_int8.h"
#include "common/device_cache.h"
#include "common.h"

namespace qops_glue {
// Defined in ops/kv_cache.cpp: checks one layer's cache tensors; true for static scales.
bool check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& k_scales, const at::Tensor& v_scales, const char* op);
}  // namespace qops_glue

namespace {

using namespace qops_glue;

// ---- counters of the fused split merge -----------------------------------------------------------
// With num_splits > 1 the split kernel merges the splits itself: the last CTA of each (sequence,
// kv head, head group) -- found with an int32 counter per group -- does it, so a call is one launch
// instead of two (csrc/attention/paged_decode_int8.h). The counters must be 0 on entry; the kernel
// leaves them 0. Where they live (docs/kv_cache.md, "The fused split merge"):
//
// - Normally in one small buffer per device, zeroed once (at::zeros, then a stream synchronize so
//   that a launch on any stream sees the zeros) and never freed. Never freeing it is what makes it
//   safe: a captured CUDA graph keeps its address forever, and there is no growth (a fixed size
//   covers every split count the heuristic picks by far: num_splits > 1 only when the grid has
//   fewer CTAs than half the SMs' slots, i.e. a few hundred groups) and so no old buffer that a
//   kernel in flight on another stream or a graph could still use. It is not made while the
//   current stream is capturing a graph (at::zeros would only be a node of that graph, run at
//   replay, and the memory would come from the graph's private pool).
// - Otherwise -- a call with more groups than the buffer holds (only a forced num_splits with a
//   large batch), or the very first fused call on a device made during a graph capture -- in the
//   per-call workspace, zeroed by a cudaMemsetAsync on the call's stream (a memset node when
//   captured, so every replay re-zeroes). Correct everywhere, one extra memset.
//
// The shared buffer means that fused calls on one device must be ordered with each other (one
// stream, or streams/graph replays synchronized with each other): two calls that can run at the
// same time, e.g. concurrently replayed graphs or unsynchronized streams, would count into the
// same counters and merge partial results. Such callers pass merge="separate". (A buffer
// per stream would not help graphs: torch.cuda.graph captures on its own stream, never used
// eagerly, so every capture would take the memset path.)
constexpr int64_t kSharedSplitCounters = 4096;  // 16 KiB per device
constexpr int kMaxDevices = 256;

// The zeroed per-device counter buffer, or nullptr when `needed` counters do not fit or when it
// does not exist yet and `stream` is capturing.
int32_t* shared_split_counters(int device, cudaStream_t stream, int64_t needed, const char* op) {
  static std::atomic<int32_t*> buffers[kMaxDevices];  // static storage: all nullptr
  static std::mutex mutex;
  if (needed > kSharedSplitCounters || device < 0 || device >= kMaxDevices) return nullptr;
  int32_t* ptr = buffers[device].load(std::memory_order_acquire);
  if (ptr != nullptr) return ptr;
  const std::lock_guard<std::mutex> lock(mutex);
  ptr = buffers[device].load(std::memory_order_acquire);
  if (ptr != nullptr) return ptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_launch(cudaStreamIsCapturing(stream, &capture), op);
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  // The caller's CUDAGuard made `device` current, so at::zeros runs on `stream`. The tensor is
  // deliberately leaked: never freed, not even at exit (when CUDA may be torn down already).
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  auto* keep = new at::Tensor(
      at::zeros({kSharedSplitCounters}, at::TensorOptions().dtype(at::kInt).device(dev)));
  check_launch(cudaStreamSynchronize(stream), op);  // the zeros are in memory for every stream
  ptr = keep->data_ptr<int32_t>();
  buffers[device].store(ptr, std::memory_order_release);
  return ptr;
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
  check_half(query, op, "query");
  QOPS_CHECK_VALUE(query.dim() == 3, op, "query must be [B, HQ, D], got shape ", query.sizes());
  QOPS_CHECK_VALUE(query.stride(2) == 1, op,
                   "query's last dimension must be contiguous (stride 1)");
  const bool is_static = check_kv_cache(k_cache, v_cache, k_scales, v_scales, op);
  check_same_device(query, k_cache, op, "query");
  const int64_t B = query.size(0), HQ = query.size(1), D = query.size(2);
  const int64_t HKV = k_cache.size(1);
  QOPS_CHECK_VALUE(D == k_cache.size(3), op, "query's D = ", D,
                   " must match k_cache's D = ", k_cache.size(3));
  QOPS_CHECK_VALUE(D == 64 || D == 128, op, "head dim D must be one of (64, 128), got ", D);
  QOPS_CHECK_VALUE(HQ > 0 && HQ % HKV == 0, op, "the number of query heads (", HQ,
                   ") must be a multiple of the number of kv heads (", HKV, ")");
  check_dtype(block_tables, at::kInt, op, "block_tables");
  QOPS_CHECK_VALUE(
      block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.size(1) >= 1, op,
      "block_tables must be int32 [B, max_blocks] with B = ", B, ", max_blocks >= 1, got shape ",
      block_tables.sizes());
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
  // The heuristic's count depends on the device only, not on `merge`, which chooses how the
  // splits are merged: the three merges of the same splits give bit-identical outputs.
  qops::DeviceProps props;  // the guard made the query's device current
  check_launch(qops::current_device_props(&props), op);
  const int major = props.cc_major;
  if (splits == 0) {
    splits = qops::attention::paged_decode_int8_num_splits(
        static_cast<int>(B), static_cast<int>(HQ), static_cast<int>(HKV), static_cast<int>(D),
        max_context, props.sms, /*cluster_merge=*/major >= 9);
  }
  splits = std::min(splits, qops::attention::kPagedDecodeMaxSplits);
  splits = std::max(1, std::min<int>(splits, static_cast<int>((max_context + 15) / 16)));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

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
  p.num_splits = splits;
  p.sm_scale = static_cast<float>(sm_scale);
  p.bf16 = query.scalar_type() == at::kBFloat16;
  p.warps = static_cast<int>(warps);  // 0: the launcher's rule
  p.no_pdl = !enable_pdl;
  // The caller's promise covers its own query tensor, not the aligned copy made just above.
  p.overlap_prologue = overlap_prologue && q_aligned;

  // How the splits are merged: in a thread-block cluster (no workspace), else fused into the
  // split kernel through a workspace and counters, else by a second kernel. Whether the clusters
  // fit is asked once; where the heuristic's don't, a few splits fewer may (the count must not
  // depend on `merge`, so this runs whether or not the cluster merge is allowed).
  const bool cluster_enabled = merge == Merge::kAuto || merge == Merge::kCluster;
  const bool auto_sm90 = num_splits == 0 && major >= 9;
  bool fits = splits > 1 && (cluster_enabled || auto_sm90) &&
              qops::attention::paged_decode_int8_cluster_merge_fits(p);
  if (auto_sm90 && splits > 1 && !fits) {
    const int fitted = qops::attention::paged_decode_int8_fit_cluster_splits(p, max_context);
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
  if (ws > 0 && fused_merge(merge, static_cast<int>(D), max_context)) {
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
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8_cuda);
}
