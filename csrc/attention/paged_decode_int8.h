// Single-token decode attention over the paged int8 KV cache (torch-free). docs/kv_cache.md
// describes the layout and the kernel.
//
//   query:        half/bf16 [B, HQ, D] (last dim contiguous; batch/head strides given), D in {64, 128}
//   k/v_cache:    int8 [num_blocks, HKV, block_size, D], contiguous, block_size a multiple of 16
//   k/v_scales:   f32 [num_blocks, HKV, block_size] (dynamic) or f32 [1] (static)
//   block_tables: int32 [B, max_blocks] (row stride bt_stride); seq_lens: int32 [B]
//   alibi_slopes: f32 [HQ] or nullptr
//   out:          [B, HQ, D] contiguous, the query's dtype
//   partial_out, partial_lse: f32 workspace [B, HQ, num_splits, D] and [B, HQ, num_splits] when
//                 num_splits > 1 (see paged_decode_int8_workspace_floats)
//   split_counters: int32 [B, HKV * head_groups] (paged_decode_int8_num_counters) or nullptr.
//                 With num_splits > 1 and split_counters set, the merge of the splits is fused
//                 into the split kernel (one launch): every CTA writes its partials, fences, and
//                 increments its (sequence, kv head, head group) counter; the CTA that sees
//                 num_splits - 1 merges all splits and writes `out`, and sets the counter back to
//                 0. The counters must be 0 on entry and are 0 again when the kernel has finished,
//                 so a zeroed buffer can be reused by every later launch (and CUDA-graph replay)
//                 that is stream-ordered after this one. Two launches that may run at the same
//                 time must not share counters. With nullptr (or num_splits == 1) a second
//                 kernel merges the splits (the two-kernel path). Both paths give bit-identical
//                 outputs (same merge arithmetic, same split order).
//   cluster_merge: merge the splits inside the split kernel through distributed shared memory:
//                 the num_splits CTAs of a (sequence, kv head, head group) run as one thread-block
//                 cluster (sm_90, 2 <= num_splits <= kPagedDecodeMaxClusterSplits; check with
//                 paged_decode_int8_cluster_merge_fits). Needs no workspace and no counters; the
//                 output is bit-identical to the other paths.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qops {
namespace attention {

// The cache formats the decode kernel reads (docs/kv_cache.md, docs/int4.md).
enum class KvFormat : int {
  kInt8 = 0,  // int8 [num_blocks, HKV, block_size, D] with f32 scales (dynamic or static)
  kInt4 = 1,  // seed-002 int4 rows [num_blocks, HKV, block_size, 4 * num_groups + D / 2]
};

struct PagedDecodeInt8Params {
  const void* query;
  int64_t q_stride_b, q_stride_h;  // in elements
  const int8_t* k_cache;
  const int8_t* v_cache;
  const float* k_scales;
  const float* v_scales;
  bool static_scales;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const float* alibi_slopes;
  void* out;
  float* partial_out;
  float* partial_lse;
  int32_t* split_counters;  // fused split merge when non-null (see above)
  bool cluster_merge;       // cluster (DSMEM) split merge (see above); overrides split_counters
  int warps;                // warps per CTA: 0 = the launcher's rule; 4 or 8 (override for tests)
  bool no_pdl;              // launch without programmatic dependent launch (sm_90; see the .cu)
  // Of what this kernel reads, the previous kernel in the stream writes only each sequence's last
  // token (position seq_lens[b] - 1) in the KV cache and its per-token scales, as the decode
  // step's cache write does; none of query, block_tables, seq_lens, alibi_slopes or static
  // scales. With programmatic dependent launch the kernel then reads those, and the K/V of its
  // first chunks that do not hold the last token, before it waits for that kernel.
  bool overlap_prologue;
  int batch, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks;
  int num_splits;
  float sm_scale;
  bool bf16;
  // ---- the int4 cache (kv_format == kInt4; k_cache / v_cache then point at its bytes) ----
  KvFormat kv_format;
  int num_groups;  // 1 or 4
  // SKVQ: positions [min(sinks, L), max(min(sinks, L), L - window)) are read from the int4 cache;
  // the others (the sinks and the window, full precision) by skvq_side_decode into extra_out /
  // extra_lse (extra_parts x [B, HQ, D] O / l and [B, HQ] log2-sum-exp, the kernel's units),
  // which the split kernel folds into its output as more splits. extra_lse == nullptr: none.
  int sinks, window;
  const float* extra_out;
  const float* extra_lse;
  int extra_parts;
};

// The full-precision side of an SKVQ cache: the sinks and the window of each sequence.
//   k_side, v_side: the query's dtype [num_side_slots, HKV, sinks + window, D], contiguous
//   side_slots: int32 [B]; out: f32 [parts, B, HQ, D] (O / l; zeros where no side token), lse:
//   f32 [parts, B, HQ] (log2 domain: max(s * sm_scale * log2 e) + log2(sum), -inf where none).
//   Part k of a sequence's n side tokens is tokens [k n / parts, (k + 1) n / parts): more CTAs
//   where the batch has few (sequence, kv head) pairs.
struct SkvqSideParams {
  const void* query;
  int64_t q_stride_b, q_stride_h;
  const void* k_side;
  const void* v_side;
  const int32_t* side_slots;
  const int32_t* seq_lens;
  float* out;
  float* lse;
  int batch, num_q_heads, num_kv_heads, head_dim, sinks, window, parts;
  float sm_scale;
  bool bf16;
  bool no_pdl;
};

// Dynamic shared memory skvq_side_decode needs (it must fit the device's per-block limit).
int64_t skvq_side_smem_bytes(int head_dim, int side_tokens, int group);

cudaError_t skvq_side_decode(const SkvqSideParams& p, cudaStream_t stream);

constexpr int kPagedDecodeMaxSplits = 128;
// The most splits the cluster merge takes: one cluster per (sequence, kv head, head group), of at
// most the non-portable cluster size an H100 allows (16; the launch opts in past the portable 8).
// Few clusters of 9-16 one-CTA-per-SM CTAs fit at once (an H100 GPC has 16-18 SMs): the
// heuristic asks for them only where 16 CTAs per group fit the SMs (SmolLM2 at B = 1: 3 groups),
// and paged_decode_int8_cluster_merge_fits checks that they fit.
constexpr int kPagedDecodeMaxClusterSplits = 16;
constexpr int kPagedDecodePortableClusterSplits = 8;

// The split-K factor the kernel would choose: one split when the batch has a CTA for at least
// half of the `num_sms` SMs; otherwise as many as fit in one wave, with at least 512 tokens of
// `max_context` (an upper bound of the sequence lengths) per split. With `cluster_merge` (the
// device can merge splits in a thread-block cluster: sm_90), at least 128 tokens per split and at
// most a portable cluster's worth (8); where 16 splits of every (sequence, kv head, head group)
// fit `num_sms` CTAs, up to kPagedDecodeMaxClusterSplits (16) in a cluster, or for contexts longer
// than 16 * kClusterFitTokens more through the workspace.
int paged_decode_int8_num_splits(int batch, int num_q_heads, int num_kv_heads, int head_dim,
                                 int max_context, int num_sms, bool cluster_merge);

// The split count for the int4 cache: the int8 rule at the int8 context of the same bytes, then
// - head_dim 64, fewer CTAs than a wave of resident 4-warp CTAs: ceil(context / 1024) splits, at
//   most 16 (H100, bench/bench_int4_decode.py --sweep, forced split counts in one run: SmolLM2
//   B = 32, T = 16384: 1 split 83.8 us, 4 70.7, 8 64.0, 16 61.1; T = 4096: 1 split 23.1, 4 20.7,
//   16 22.3);
// - one split of several waves: the count (<= 4) whose last wave is the fullest (seed config,
//   4 groups, B = 512: 512 CTAs on 396 slots, 1 split 307 us, 2 splits 256.7).
// At head_dim 128, more splits of fewer CTAs than a wave measured slower than the int8 rule's
// (seed config B = 64: 2 splits 33.6 us, 8 41.6; Llama-3-8B B = 32, T = 4096: 1 split 58.7, 8 68.3).
int paged_decode_int4_num_splits(int batch, int num_q_heads, int num_kv_heads, int head_dim,
                                 int num_groups, int max_context, int num_sms, bool cluster_merge);
constexpr int kMinInt4TokensPerSplit = 1024;

// Floats of workspace needed for `num_splits` (0 when num_splits == 1).
int64_t paged_decode_int8_workspace_floats(int batch, int num_q_heads, int head_dim,
                                           int num_splits);

// Counters the fused split merge needs: one per (sequence, kv head, head group) =
// batch * num_kv_heads * head_groups, where head_groups = ceil(G / 16) when G = num_q_heads /
// num_kv_heads > 8, else 1.
int64_t paged_decode_int8_num_counters(int batch, int num_q_heads, int num_kv_heads);

// Whether the cluster merge should run p's launch (p.num_splits CTAs per cluster) on the current
// device: sm_90+, 2 <= num_splits <= kPagedDecodeMaxClusterSplits, and all of the grid's clusters
// can be resident at once (cudaOccupancyMaxActiveClusters, cached per kernel configuration).
bool paged_decode_int8_cluster_merge_fits(const PagedDecodeInt8Params& p);

// The heuristic's split count p.num_splits, adjusted for the cluster merge on this device; for a
// p whose clusters do not all fit at once (paged_decode_int8_cluster_merge_fits(p) is false: the
// launch would take the workspace merge). Where those of a few splits fewer do (down to three
// quarters of p.num_splits, or to 8 from past 8), and the context is short, the fewer splits; else
// p.num_splits. Short:
// at most kClusterFitTokens of `max_context` per split at head_dim 128 (twice as many at 64: the
// same bytes), where the workspace merge's fixed cost
// (~1-2 us) is more than the stream loses to a quarter fewer CTAs. Depends on the device only (as
// the heuristic's count must: the merge paths are bit-identical only for equal split counts).
int paged_decode_int8_fit_cluster_splits(const PagedDecodeInt8Params& p, int max_context);
constexpr int kClusterFitTokens = 2048;

cudaError_t paged_decode_attention_int8(const PagedDecodeInt8Params& p, cudaStream_t stream);

}  // namespace attention
}  // namespace qops
