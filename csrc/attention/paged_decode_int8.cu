// Paged int8 KV-cache decode attention (flash-decoding split-K). See paged_decode_int8.h and
// docs/kv_cache.md ("The decode kernel") for the design; in short:
//
// - One CTA of 4 warps (8 when the grid has at most one CTA per SM) per (sequence, kv head, group
//   of <= 16 query heads, split). The split's 16-token chunks are dealt round-robin to the warps;
//   each warp keeps its own online softmax (m, l, O) and the CTA merges its warps in shared memory
//   at the end. With one split the CTA writes the output. With several (sm_90, <= 8) the splits
//   run as one thread-block cluster and push their (O / l, log2-sum-exp) to the owners of the
//   output slices (st.async + an mbarrier, "the cluster merge" below); otherwise they write them
//   to a workspace and either the last CTA of its (sequence, kv head, head group) merges the
//   splits (fused, one launch: a per-group counter, "the fused split merge") or a second kernel
//   does.
// - Per chunk, a warp computes S^T = K Q^T with mma.m16n8k16 (fp16 in, f32 accumulate): the
//   chunk's 16 tokens in M, query heads in N (8 per n-tile; heads >= G are zero), head dim in K.
//   int8 K converts exactly to fp16 (a byte-permute + one half2 subtract per 2 values); the head
//   dim is permuted so that each thread's K bytes are two (D=64: one) contiguous 16-byte loads and
//   Q is loaded with the same permutation. bf16 queries are scaled by a power of two into fp16
//   range (exact). (Tokens in M, not heads: a group of <= 8 heads fills an n-tile, whereas as the M
//   of S = Q K^T it left half of every MMA and of the Q registers zero.)
// - The 8x8 transposes (movmatrix) of S^T's accumulator fragments are the B fragments of
//   V^T P'^T. P' = exp2(s - m) * v_scale, times a power of two that keeps it in fp16 range, is
//   split into fp16 hi + lo parts and multiplied with int8 V converted exactly to fp16 (three
//   instructions per pair), f32 accumulation. V's output columns are permuted so that each thread
//   loads 16 (D=64: 8) contiguous bytes of 4 token rows.
// - Softmax in f32 in the log2 domain; per-token K scales multiply S, V scales multiply P. The
//   running max and the P scale move only when a chunk needs it (a score past the reference by
//   more than a margin, a larger V scale): most chunks rescale nothing.
#include "attention/paged_decode_int8.h"

#include "attention/split_merge.cuh"  // merge_weight, merge_add4, merge_inv, ..., store_out4
#include "common/cluster.cuh"         // cluster barriers, dsmem_addr, mbarriers, st_async4/1
#include "common/convert.cuh"         // to_float, from_float
#include "common/cp_async.cuh"        // cp_async16, cp_async_commit, cp_async_wait, smem_addr
#include "common/device_cache.h"
#include "common/launch.cuh"  // pdl_wait, pdl_launch_dependents, append_pdl_attribute
#include "common/math.cuh"    // fast_exp2
#include "common/mma.cuh"     // mma_f16, int8 -> fp16 fragments, movmatrix, pack_f16x2

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace qops {
namespace attention {
namespace {

// The fewest tokens of a split the heuristic makes: a split's fixed cost (block-table and Q loads,
// pipeline fill, warp merge, its share of the split merge) against its stream. The cluster merge
// is cheap enough for one 16-token chunk per warp of an 8-warp CTA; the workspace merges are not.
constexpr int kMinTokensPerSplit = 512;
constexpr int kMinTokensPerClusterSplit = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

template <int D>
struct VBytes;  // the bytes of one V row a thread loads: D / 8
template <>
struct VBytes<128> {
  using type = uint4;
};
template <>
struct VBytes<64> {
  using type = uint2;
};

// One 16-token chunk of K, V and scales as a thread holds it.
template <int D>
struct Chunk {
  static constexpr int KW = D / 64;  // 16-byte K loads per token row
  uint4 k[2][KW];                    // K rows gid and gid + 8
  typename VBytes<D>::type v[4];     // V rows 2*t4, 2*t4 + 1, 2*t4 + 8, 2*t4 + 9
  float ks[2], vs[2];                // scales of tokens gid and gid + 8
  bool ok;                           // the block id is valid
};

// ---- the per-warp shared-memory pipeline ----------------------------------------------------------
// Each warp streams its chunks through kStages stages of shared memory with cp.async (16-byte,
// L1-bypassing), so several chunks per warp are in flight. One stage holds a 16-token chunk:
// K [16][D] int8, V [16][D] int8 and (dynamic scales) 16 K and 16 V scales. The 16-byte column
// chunks of row r are XOR-swizzled with swz(r) so that the fragment reads are free of bank
// conflicts (D=128; the D=64 V reads are 2-way).
// (cp_async16 / cp_async_commit / cp_async_wait: common/cp_async.cuh.)

__device__ __forceinline__ int swz(int r) {
  return ((r & 1) << 2) ^ (((r >> 1) & 3) << 1);
}

template <int D>
struct Stage {
  static constexpr int kCpr = D / 16;  // 16-byte chunks per row
  static constexpr int kKBytes = 16 * D;
  static constexpr int kBytes = 2 * kKBytes + 128;  // K, V, 32 scales
  __device__ static int chunk_off(int r, int ch) {
    return r * D + ((ch ^ swz(r)) & (kCpr - 1)) * 16;
  }
};

// Stages per warp: 4 at D = 128, 6 at D = 64 (deeper rings, 5-10 stages, measured no faster at
// B = 1-128 on the H100, and cost CTAs per SM in the 4-warp build).
template <int D>
constexpr int kStages = D == 128 ? 4 : 6;

// Chunks a warp computes per main-loop step: two at D = 64, so that a step's loop control,
// rescale vote and max reduction cover 32 tokens and its two S^T and P V chains overlap (H100,
// same-run A/B against one chunk per step: SmolLM2 0.7-4% faster at B = 1-128; at D = 128 with
// 8 warps the same change was 0-3% slower, and the 4-warp D = 128 builds have no registers to
// spare).
template <int D>
constexpr int kChunksPerStep = D == 64 ? 2 : 1;

// ---- the cache formats (template parameter kFmt) ------------------------------------------------
// int8 with dynamic (per token) or static scales, or seed-002 int4 rows of 1 or 4 groups.
constexpr int kFmtInt8 = 0, kFmtInt8Static = 1, kFmtInt4G1 = 2, kFmtInt4G4 = 3;
template <int kFmt>
constexpr int kFmtGroups = kFmt == kFmtInt4G4 ? 4 : 1;

// An int4 stage: a 16-token chunk of K rows then of V rows, each 16 rows of kRB bytes copied as
// one contiguous run of kRB 16-byte pieces (a block's rows are contiguous; 16 rows of a 4-byte
// multiple are a 16-byte multiple). Rows start at 4-byte boundaries: 32-bit fragment loads.
template <int D, int KG>
struct Stage4 {
  static constexpr int kRB = 4 * KG + D / 2;  // row bytes
  static constexpr int kKBytes = 16 * kRB;
  static constexpr int kBytes = 2 * kKBytes;
};
// Stages per warp for int4 (a chunk is 1/4 of int8's bytes): more chunks in flight per warp.
template <int D>
constexpr int kStages4 = D == 128 ? 6 : 8;

template <int D, int kFmt>
constexpr int kStageBytes =
    kFmt >= kFmtInt4G1 ? Stage4<D, kFmtGroups<kFmt>>::kBytes : Stage<D>::kBytes;
template <int D, int kFmt>
constexpr int kNumStages = kFmt >= kFmtInt4G1 ? kStages4<D> : kStages<D>;

// One 16-token chunk of int4 K and V as a thread holds it (32-bit words of the rows).
// K: rows gid and gid + 8, their KG headers (scale | shift << 16) and NKW data words: word
// 4 j + t4 for j < NKW (each word: 8 channels, two k-steps' worth of this thread's A fragment),
// or at D = 64 with 4 groups word 2 j + t4 / 2 (one k-step, half a word: k-steps must not mix
// groups). V: rows 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 (the k of V^T's A fragment), the header of
// the thread's group and D / 64 data words 2 gid + jj (D = 128) or gid (D = 64).
template <int D, int KG>
struct Chunk4 {
  static constexpr bool kHalfWords = D == 64 && KG == 4;
  static constexpr int NKW = kHalfWords ? 4 : D / 32;
  uint32_t kh[2][KG];
  uint32_t k[2][NKW];
  uint32_t vh[4];
  uint32_t v[4][D / 64];
  bool ok;
};

template <int D, int kFmt, int NW>
constexpr int kPipeBytes = NW * kNumStages<D, kFmt> * kStageBytes<D, kFmt>;

template <int D, bool kTwoRows, int NW>
constexpr int kMergeBytes = NW * (kTwoRows ? 16 : 8) * (D + 4) * 4 + 2 * NW * 16 * 4;

// The cluster merge's receive buffers (the cluster kernel's only), past the pipeline and the
// warp-merge buffers: peers write them while this CTA may still be in its main loop. An mbarrier
// (16 bytes), then for each source split `per` units of O / l (float4: 4 consecutive elements of
// a row) and their rows' lse, where units = rows * D / 4, per = ceil(units / num_splits), so
// num_splits * per < units + num_splits <= kRecvUnits.
template <int D, bool kTwoRows>
constexpr int kRecvUnits = (kTwoRows ? 16 : 8) * D / 4 + kPagedDecodeMaxClusterSplits;

template <int D, bool kTwoRows, int kFmt, int NW>
constexpr int kBaseSmemBytes =
    kPipeBytes<D, kFmt, NW> > kMergeBytes<D, kTwoRows, NW> ? kPipeBytes<D, kFmt, NW>
                                                           : kMergeBytes<D, kTwoRows, NW>;

template <int D, bool kTwoRows, int kFmt, int NW, bool kCluster>
constexpr int kSmemBytes = kBaseSmemBytes<D, kTwoRows, kFmt, NW> +
                           (kCluster ? 16 + kRecvUnits<D, kTwoRows> * (16 + 4) : 0);

// ---- the split kernel ---------------------------------------------------------------------------
// CTAs per SM the register budget is set for (D=128 with 16 query rows needs ~240 registers).
// int4 row-wise at D = 128 with <= 8 query heads per kv head: 4 (its 127 registers fit 128, and 4
// CTAs' pipelines 209 KB of shared memory).
template <int D, bool kTwoRows, int kFmt, int NW>
constexpr int kMinBlocksPerSm =
    NW == 8 ? 1
            : (kFmt == kFmtInt4G1 && D == 128 && !kTwoRows ? 4 : (D == 128 && kTwoRows ? 2 : 3));

template <typename T, int D, bool kTwoRows, int kFmt, int NW, bool kCluster>
__global__ void __launch_bounds__(NW * 32, kMinBlocksPerSm<D, kTwoRows, kFmt, NW>)
    paged_decode_int8_kernel(const PagedDecodeInt8Params p) {
  constexpr bool kStatic = kFmt == kFmtInt8Static;
  constexpr bool kInt4 = kFmt >= kFmtInt4G1;
  constexpr int KG = kFmtGroups<kFmt>;
  constexpr int kWarps = NW;
  constexpr int kThreads = NW * 32;
  constexpr int KC = D / 16;            // k-steps of Q K^T
  constexpr int DPT = D / 8;            // V bytes per token row a thread reads
  constexpr int MT = D / 16;            // m-tiles of V^T P^T
  constexpr int NH = kTwoRows ? 2 : 1;  // n-tiles (8 query heads each) of V^T P^T
  constexpr int KW = D / 64;
  constexpr int kRows = kTwoRows ? 16 : 8;
  constexpr int kPad = 4;
  constexpr int S = kNumStages<D, kFmt>;
  constexpr int NC = kInt4 ? 1 : kChunksPerStep<D>;
  constexpr int kSB = kStageBytes<D, kFmt>;
  extern __shared__ __align__(16) unsigned char smem[];

  // Programmatic dependent launch (when the launch allows it, see split_config): wait for the
  // previous kernel in the stream to complete before reading what it may have written. By
  // default that is everything (the query, the cache, the block tables, ...). With
  // p.overlap_prologue the caller promises that of what this kernel reads it wrote only each
  // sequence's last token in the KV cache (K, V and their scales, as the decode step's cache
  // write does), so the prologue's reads -- seq_len, the first block ids, the query, the ALiBi
  // slopes, the static scales and the first chunks' K/V except the last token's -- happen while
  // it finishes (below). The next kernel is released after the main loop.
  if (!p.overlap_prologue) pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int split = blockIdx.x, b = blockIdx.z;
  const int G = p.num_q_heads / p.num_kv_heads;
  const int HG = kTwoRows ? (G + 15) / 16 : 1;
  const int kvh = blockIdx.y / HG, hg = blockIdx.y % HG;
  const int h0 = kvh * G + hg * 16;
  const int rows = min(kRows, G - hg * 16);
  const int bs = p.block_size;
  const int num_splits = p.num_splits;

  // The cluster merge (see the end): this CTA (rank = split) merges the output units [u0, u1)
  // (kUnit consecutive elements of a row each) of its group, which every split pushes into its
  // receive buffers. Its mbarrier expects all their bytes; it is initialized before a (relaxed)
  // cluster arrival here, and every CTA waits for that barrier before its first remote store,
  // after its main loop.
  constexpr int kUnit = 4;
  const int units = rows * (D / kUnit);
  const int u_per = (units + num_splits - 1) / num_splits;
  const int u0 = min(units, split * u_per), u1 = min(units, u0 + u_per);
  uint64_t* r_bar = reinterpret_cast<uint64_t*>(smem + kBaseSmemBytes<D, kTwoRows, kFmt, NW>);
  float4* r_part = reinterpret_cast<float4*>(smem + kBaseSmemBytes<D, kTwoRows, kFmt, NW> + 16);
  float* r_lse = reinterpret_cast<float*>(r_part + kRecvUnits<D, kTwoRows>);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kCluster) {
    if (threadIdx.x == 0) {
      mbar_init(r_bar, 1);
      mbar_arrive_expect_tx(r_bar, static_cast<uint32_t>(num_splits * (u1 - u0) * (16 + 4)));
      fence_mbar_init();
    }
    cluster_arrive_relaxed();
  }
#endif

  // The block ids of this warp's first 32 chunks, loaded before seq_len is known, so that the
  // two loads overlap instead of being two dependent round trips ahead of the first K/V load.
  // The split's chunk range depends on seq_len; this guesses it from the table's width, which
  // is right for the sequences that fill their table row (the batch's longest when the table is
  // as wide as needed: the ones on the critical path). A wrong guess is reloaded below. The
  // entries read are inside the row but may lie past seq_len: they are only used for chunks
  // below it.
  const int32_t* bt_row = p.block_tables + b * p.bt_stride;
  const int chunks_per_block_shift = __ffs(bs >> 4) - 1;  // bs / 16 is a power of two
  // A split's share of a sequence of n chunks (the last split may get fewer).
  auto chunks_per_split = [&](int n) { return (n + p.num_splits - 1) / p.num_splits; };
  const int max_chunks = (p.max_blocks * bs) >> 4;
  const int c_begin_guess = split * chunks_per_split(max_chunks);
  const int cc_guess = c_begin_guess + warp + lane * kWarps;
  const int bt_guess =
      cc_guess < max_chunks ? __ldg(bt_row + (cc_guess >> chunks_per_block_shift)) : 0;

  // Everything the first K/V loads and the Q fragments need is requested here, before any of it
  // is used: the query rows, the ALiBi slopes, static scales, seq_len (with the guessed block
  // ids above). Then the first chunks' K/V copies are issued, and the Q fragments are built while
  // they are in flight: ahead of the first chunk, two round trips (seq_len, the block ids and Q
  // together, then K/V), not three (seq_len, then Q, then K/V: ptxas had scheduled the Q loads
  // after the seq_len-dependent code, and the K/V copies came after the Q fragments).
  // int8: 16 (D=64) or 32 query values of head gid + 8h, d = kw * 64 + t4 * 16 + [0, 16);
  // int4: the 8 channels of each K word this thread converts (Chunk4), 8 w + [0, 8).
  using C4 = Chunk4<D, KG>;
  constexpr int QW = kInt4 ? C4::NKW : 2 * KW;
  auto q_word_channel = [&](int i) {  // int4: the first channel of the thread's i-th K word
    return C4::kHalfWords ? 16 * i + 8 * (t4 >> 1) : 32 * i + 8 * t4;
  };
  uint4 qraw[NH][QW];
  float my_slope[NH];
#pragma unroll
  for (int h = 0; h < NH; ++h) {
    const int row = gid + 8 * h;
    my_slope[h] = 0.f;
#pragma unroll
    for (int i = 0; i < QW; ++i) qraw[h][i] = make_uint4(0, 0, 0, 0);
    if (row < rows) {
      const T* qp = static_cast<const T*>(p.query) + b * p.q_stride_b + (h0 + row) * p.q_stride_h;
      if constexpr (kInt4) {
#pragma unroll
        for (int i = 0; i < QW; ++i)
          qraw[h][i] = __ldg(reinterpret_cast<const uint4*>(qp + q_word_channel(i)));
      } else {
#pragma unroll
        for (int kw = 0; kw < KW; ++kw) {
          qraw[h][2 * kw] = __ldg(reinterpret_cast<const uint4*>(qp + kw * 64 + t4 * 16));
          qraw[h][2 * kw + 1] = __ldg(reinterpret_cast<const uint4*>(qp + kw * 64 + t4 * 16 + 8));
        }
      }
      if (p.alibi_slopes != nullptr) my_slope[h] = __ldg(p.alibi_slopes + h0 + row) * kLog2e;
    }
  }
  const float k_static = kStatic ? __ldg(p.k_scales) : 1.f;
  const float v_static = kStatic ? __ldg(p.v_scales) : 1.f;

  int L = p.seq_lens[b];
  L = max(0, min(L, p.max_blocks * bs));
  // The tokens read from the cache: [lo, hi). int8: all. int4 with SKVQ: not the sinks nor the
  // window (skvq_side_decode reads those).
  int lo = 0, hi = L;
  if constexpr (kInt4) {
    lo = min(p.sinks, L);
    hi = max(lo, L - p.window);
  }
  const int nchunks = (hi + 15) >> 4;
  const int c_first = lo >> 4;
  const int per = chunks_per_split(nchunks - c_first);
  const int c_begin = c_first + split * per;
  const int c_end = min(nchunks, c_begin + per);

  int bt_cache = 0;

  unsigned char* my_pipe = smem + warp * S * kSB;
  const unsigned pipe_s = smem_addr(my_pipe);
  unsigned s_off[D / 32];  // stage offset of this lane's i-th 16-byte piece (see issue)
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const int piece = lane + 32 * i;
    s_off[i] = Stage<D>::chunk_off(piece / Stage<D>::kCpr, piece % Stage<D>::kCpr);
  }
  unsigned ok_mask = 0;  // bit st: the block of the chunk in stage st is valid (warp-uniform)

  // Issues the cp.async copies of chunk c (this warp's idx-th) into stage st.
  auto issue = [&](int c, int idx, int st) {
    if ((idx & 31) == 0) {  // refill the lane-held block ids of this warp's next 32 chunks
      const int cc = c + lane * kWarps;
      if (idx == 0 && c_begin == c_begin_guess) {
        bt_cache = cc < c_end ? bt_guess : 0;  // cc == cc_guess
      } else {
        bt_cache = cc < c_end ? __ldg(bt_row + (cc >> chunks_per_block_shift)) : 0;
      }
    }
    int blk = __shfl_sync(kFull, bt_cache, idx & 31);
    const bool ok = blk >= 0 && blk < p.num_blocks;
#if !defined(NDEBUG) || defined(QOPS_DEBUG)
    if (!ok && lane == 0) {
      printf("qops.paged_decode_attention_int8: block_tables[%d][%d] = %d is outside [0, %d)\n", b,
             c >> chunks_per_block_shift, blk, p.num_blocks);
      __trap();
    }
#endif
    ok_mask = ok ? (ok_mask | (1u << st)) : (ok_mask & ~(1u << st));
    if (!ok) blk = 0;  // never read out of bounds; the chunk is masked
    const int off = (c << 4) & (bs - 1);
    const int64_t sbase = (static_cast<int64_t>(blk) * p.num_kv_heads + kvh) * bs + off;
    if constexpr (kInt4) {  // the chunk's 16 K rows, then its 16 V rows: kRB pieces each
      constexpr int RB = Stage4<D, KG>::kRB;
      const int8_t* kb = p.k_cache + sbase * RB;
      const int8_t* vb = p.v_cache + sbase * RB;
      const unsigned st_k = pipe_s + st * kSB;
#pragma unroll
      for (int i = 0; i < (RB + 31) / 32; ++i) {
        const int piece = lane + 32 * i;
        if (RB % 32 == 0 || piece < RB) {
          cp_async16(st_k + 16 * piece, kb + 16 * piece);
          cp_async16(st_k + Stage4<D, KG>::kKBytes + 16 * piece, vb + 16 * piece);
        }
      }
      return;
    }
    // 16 rows x D/16 pieces of 16 bytes: piece lane + 32 i sits at byte 16 * (lane + 32 i) of the
    // chunk's contiguous [16][D] rows; its stage slot (swizzled) is s_off[i].
    const int8_t* kb = p.k_cache + sbase * D + lane * 16;
    const int8_t* vb = p.v_cache + sbase * D + lane * 16;
    const unsigned st_k = pipe_s + st * kSB;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      cp_async16(st_k + s_off[i], kb + 512 * i);
      cp_async16(st_k + Stage<D>::kKBytes + s_off[i], vb + 512 * i);
    }
    if constexpr (!kStatic) {  // lanes 0-3: the 16 K scales, 4-7: the 16 V scales
      if (lane < 8) {
        const float* src = (lane < 4 ? p.k_scales : p.v_scales) + sbase + 4 * (lane & 3);
        cp_async16(st_k + 2 * Stage<D>::kKBytes + 16 * lane, src);
      }
    }
  };

  // Reads stage st into the fragment registers.
  // int4: reads stage st into the fragment words (Chunk4).
  auto read_stage4 = [&](C4& x, int st) {
    constexpr int RB = Stage4<D, KG>::kRB;
    const unsigned char* st_k = my_pipe + st * kSB;
    const unsigned char* st_v = st_k + Stage4<D, KG>::kKBytes;
    auto word = [](const unsigned char* base, int row, int byte) {
      return *reinterpret_cast<const uint32_t*>(base + row * RB + byte);
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = gid + 8 * r;
      if constexpr (KG == 4) {  // 80-byte (D=128) or 48-byte rows: the header is 16-byte aligned
        const uint4 h4 = *reinterpret_cast<const uint4*>(st_k + row * RB);
        x.kh[r][0] = h4.x;
        x.kh[r][1] = h4.y;
        x.kh[r][2] = h4.z;
        x.kh[r][3] = h4.w;
      } else {
        x.kh[r][0] = word(st_k, row, 0);
      }
#pragma unroll
      for (int j = 0; j < C4::NKW; ++j) x.k[r][j] = word(st_k, row, 4 * KG + q_word_channel(j) / 2);
    }
    const int vg = KG == 4 ? gid >> 1 : 0;  // the group of this thread's V channels
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = 2 * t4 + (j & 1) + 8 * (j >> 1);
      x.vh[j] = word(st_v, row, 4 * vg);
#pragma unroll
      for (int jj = 0; jj < D / 64; ++jj)
        x.v[j][jj] = word(st_v, row, 4 * KG + 4 * ((D / 64) * gid + jj));
    }
    x.ok = (ok_mask >> st) & 1u;
  };

  auto read_stage = [&](Chunk<D>& x, int st) {
    const unsigned char* st_k = my_pipe + st * kSB;
    const unsigned char* st_v = st_k + Stage<D>::kKBytes;
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) {
      x.k[0][kw] = *reinterpret_cast<const uint4*>(st_k + Stage<D>::chunk_off(gid, kw * 4 + t4));
      x.k[1][kw] =
          *reinterpret_cast<const uint4*>(st_k + Stage<D>::chunk_off(gid + 8, kw * 4 + t4));
    }
    using VT = typename VBytes<D>::type;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int vrow = 2 * t4 + (j & 1) + 8 * (j >> 1);
      if constexpr (D == 128) {
        x.v[j] = *reinterpret_cast<const VT*>(st_v + Stage<D>::chunk_off(vrow, gid));
      } else {
        x.v[j] = *reinterpret_cast<const VT*>(st_v + Stage<D>::chunk_off(vrow, gid >> 1) +
                                              (gid & 1) * 8);
      }
    }
    if constexpr (!kStatic) {
      const float* st_s = reinterpret_cast<const float*>(st_v + Stage<D>::kKBytes);
      x.ks[0] = st_s[gid];
      x.ks[1] = st_s[8 + gid];
      x.vs[0] = st_s[16 + gid];
      x.vs[1] = st_s[24 + gid];
    }
    x.ok = (ok_mask >> st) & 1u;
  };

  // ---- the pipeline's prologue: this warp's chunks c_begin + warp + i * kWarps, S - NC in flight
  const int first = c_begin + warp;
  const int my_n = first < c_end ? (c_end - first + kWarps - 1) / kWarps : 0;
  // Without p.overlap_prologue the wait came first. With it, the previous kernel wrote at most
  // the sequence's last token's K/V and scales (position L - 1, chunk nchunks - 1; the decode
  // step's cache write): a warp whose first chunks do not hold that chunk issues their copies
  // before the wait, so they stream while that kernel finishes; the warp that holds it waits
  // first. Every later chunk is issued after the wait.
  const int to_last = nchunks - 1 - first;  // the last chunk is this warp's (to_last / kWarps)-th
  const bool holds_last =
      to_last >= 0 && to_last % kWarps == 0 && to_last / kWarps < min(S - NC, my_n);
  const bool kv_early = p.overlap_prologue && !holds_last;
  if (p.overlap_prologue && !kv_early) pdl_wait();
#pragma unroll
  for (int i = 0; i < S - NC; ++i) {
    if (i < my_n) issue(first + i * kWarps, i, i);
    cp_async_commit();
  }
  if (kv_early) pdl_wait();

  // ---- Q fragments (B of S^T = K Q^T: k = head dim, n = query heads), with the head-dim
  // permutation of the K loads: k-step c of thread t4 covers
  // d = (c / 4) * 64 + t4 * 16 + (c % 4) * 4 + {0, 1 (reg 0) | 2, 3 (reg 1)}; thread gid holds
  // head 8h + gid of n-tile h.
  uint32_t qb[NH][KC][2];
  // per head 8h + 2*t4 + e (the S^T columns this thread holds): the score scale (sm_scale, log2 e,
  // the bf16 power of two, a static K scale) and the ALiBi slope, log2 domain
  float rs[NH][2], slope[NH][2];
  // int4 (the K rows enter S^T unscaled, as 1024 + q, or 1024 + 16 q for a word's odd nibbles,
  // whose Q values are divided by 16): per head 8h + 2*t4 + e and group g, c_off = 1024 * (the
  // sum of the group's Q values as they enter the MMA) and q_sum = the sum of its Q values; then
  // S = sum_g scale_g * (S_g - c_off_g) + shift_g * q_sum_g (docs/int4.md).
  float c_off[NH][2][KG], q_sum[NH][2][KG];
#pragma unroll
  for (int h = 0; h < NH; ++h) {
    const int row = gid + 8 * h;
    float qf[QW][8];
#pragma unroll
    for (int i = 0; i < QW; ++i) {
      const T* e = reinterpret_cast<const T*>(&qraw[h][i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) qf[i][j] = to_float(e[j]);
    }
    float scale = 1.f, inv = 1.f;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      // a power of two that brings max|q| into [2^14, 2^15): the fp16 conversion is then exact
      float mx = 0.f;
#pragma unroll
      for (int i = 0; i < QW; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fabsf(qf[i][j]));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
      if (mx > 0.f && mx < INFINITY) {
        int e;
        frexpf(mx, &e);  // mx = f * 2^e, f in [0.5, 1)
        const int sh = max(-126, min(127, 15 - e));
        scale = ldexpf(1.f, sh);
        inv = ldexpf(1.f, -sh);
      }
    }
    if constexpr (kInt4) {
      // k-step kc: word kc / 2, nibbles {0, 4 | 1, 5} (kc even) or {2, 6 | 3, 7} (odd); with half
      // words (D = 64, 4 groups), word kc, the half t4 & 1.
      float cs[KG], qs[KG];
#pragma unroll
      for (int g = 0; g < KG; ++g) cs[g] = qs[g] = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        const int wi = C4::kHalfWords ? kc : kc / 2;
        const int g = kc / (KC / KG);
        const bool odd = C4::kHalfWords ? (t4 & 1) != 0 : (kc & 1) != 0;
        const float e0 = odd ? qf[wi][2] : qf[wi][0], e1 = odd ? qf[wi][6] : qf[wi][4];
        const float o0 = odd ? qf[wi][3] : qf[wi][1], o1 = odd ? qf[wi][7] : qf[wi][5];
        const __half2 b0 = __floats2half2_rn(e0 * scale, e1 * scale);
        const __half2 b1 = __floats2half2_rn(o0 * scale * 0.0625f, o1 * scale * 0.0625f);
        qb[h][kc][0] = *reinterpret_cast<const uint32_t*>(&b0);
        qb[h][kc][1] = *reinterpret_cast<const uint32_t*>(&b1);
        const float2 f0 = __half22float2(b0), f1 = __half22float2(b1);
        cs[g] += (f0.x + f0.y) + (f1.x + f1.y);
        qs[g] += (f0.x + f0.y) + 16.f * (f1.x + f1.y);
      }
#pragma unroll
      for (int g = 0; g < KG; ++g) {  // over the 4 threads of head gid, then to the S^T columns
        cs[g] += __shfl_xor_sync(kFull, cs[g], 1);
        cs[g] += __shfl_xor_sync(kFull, cs[g], 2);
        qs[g] += __shfl_xor_sync(kFull, qs[g], 1);
        qs[g] += __shfl_xor_sync(kFull, qs[g], 2);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          c_off[h][e][g] = 1024.f * __shfl_sync(kFull, cs[g], (2 * t4 + e) * 4);
          q_sum[h][e][g] = __shfl_sync(kFull, qs[g], (2 * t4 + e) * 4);
        }
      }
    } else {
#pragma unroll
      for (int kw = 0; kw < KW; ++kw)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int c = kw * 4 + w;
          const float* q8 = qf[2 * kw + w / 2] + 4 * (w & 1);  // d offset 4 w of this kw
          qb[h][c][0] = pack_f16x2(q8[0] * scale, q8[1] * scale);
          qb[h][c][1] = pack_f16x2(q8[2] * scale, q8[3] * scale);
        }
    }
    const float my_scale = row < rows ? p.sm_scale * kLog2e * inv * k_static : 0.f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // head 8h + 2*t4 + e is row 2*t4 + e of n-tile h: lane 4 * that
      rs[h][e] = __shfl_sync(kFull, my_scale, (2 * t4 + e) * 4);
      slope[h][e] = __shfl_sync(kFull, my_slope[h], (2 * t4 + e) * 4);
    }
  }

  // ---- online softmax state, per head 8h + 2*t4 + e (uniform over gid)
  // m_run: the reference the exponentials are taken against (-inf: no valid token yet). It is
  // raised only when a chunk's score exceeds it by more than kSlack (log2 units), so most chunks
  // rescale nothing (FlashAttention-4's conditional rescaling); exponentials are then <= 2^kSlack.
  constexpr float kSlack = 8.f;
  float m_run[NH][2], m_ref[NH][2];  // m_ref: m_run, or 0 while m_run is -inf
  float l_run[NH][2];                // this thread's tokens only (summed over gid at the end)
#pragma unroll
  for (int h = 0; h < NH; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m_run[h][e] = -INFINITY;
      m_ref[h][e] = 0.f;
      l_run[h][e] = 0.f;
    }
  // P' = exp2(s - m_ref) * v_scale enters the P V product as fp16 hi + lo parts, scaled by 2^p_exp
  // so that P' 2^p_exp < 2^15 (fp16 range): static scales, P' <= 2^kSlack, so 2^p_exp = 2^6;
  // dynamic, P' < 2^kSlack * 2^(v_bits - 126), with v_bits the largest biased exponent of a valid
  // V scale so far, so p_exp = 133 - v_bits (clamped to [-63, 63]: 2^p_exp and its inverse are
  // normal floats). p_exp only decreases, when a larger V scale arrives (O is then rescaled).
  // hi + lo carries each P' 2^p_exp to a relative 2^-22, or an absolute 2^-24 below 2^-2, against
  // terms of up to 2^15: far below the fp16 output's rounding.
  int v_bits = 0;
  int p_exp = kInt4 ? 0 : (kStatic ? 6 : 63);         // int4: P and V are plain fp16 (below)
  float p_inv = __int_as_float((127 - p_exp) << 23);  // 2^-p_exp: O is kept in units of 2^p_exp
  // O^T = V^T P'^T, m-tile i (16 head-dim rows) x n-tile h (8 query heads): thread holds
  // d = gid * DPT + 2 * i + {0 (c0, c1), 1 (c2, c3)} for heads 8 * h + 2 * t4 + {0 (c0, c2), 1}.
  float o[MT][NH][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < NH; ++h) o[i][h][0] = o[i][h][1] = o[i][h][2] = o[i][h][3] = 0.f;

  // One main-loop step: NC chunks (c[q]: chunk index, x[q]: its fragments; x[q].ok false for a
  // chunk past this warp's range, which then counts for nothing). Their scores share one rescale
  // vote and one max reduction, and their S^T and P V products are independent chains.
  // int4: one chunk. S^T = K Q^T per group on the raw words (1024 + q, 1024 + 16 q: one LOP3
  // per half2), then the rows' scales and shifts (see c_off); V dequantized to fp16 in registers
  // (q * scale + shift, two half2 FMAs per pair) and O += V^T P^T with P = exp2(s - m) in fp16.
  auto compute4 = [&](const C4& x, int c) {
    float s[KG][NH][4];
#pragma unroll
    for (int g = 0; g < KG; ++g)
#pragma unroll
      for (int h = 0; h < NH; ++h) s[g][h][0] = s[g][h][1] = s[g][h][2] = s[g][h][3] = 0.f;
    const int shift = C4::kHalfWords ? 8 * (t4 & 1) : 0;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const int wi = C4::kHalfWords ? kc : kc / 2;
      const int g = kc / (KC / KG);
      const int sh = C4::kHalfWords ? shift : 8 * (kc & 1);
      uint32_t a[4];
      a[0] = int4_lop3<0x000F000F>(x.k[0][wi] >> sh);
      a[2] = int4_lop3<0x00F000F0>(x.k[0][wi] >> sh);
      a[1] = int4_lop3<0x000F000F>(x.k[1][wi] >> sh);
      a[3] = int4_lop3<0x00F000F0>(x.k[1][wi] >> sh);
#pragma unroll
      for (int h = 0; h < NH; ++h) mma_f16(s[g][h], a, qb[h][kc][0], qb[h][kc][1]);
    }
    const int j0 = (c << 4) + gid;  // token of regs 0, 1; regs 2, 3: j0 + 8
    const bool ok0 = x.ok && j0 >= lo && j0 < hi, ok1 = x.ok && j0 + 8 >= lo && j0 + 8 < hi;
    float sc[2][KG], sf[2][KG];  // the rows' scales and shifts
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int g = 0; g < KG; ++g) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x.kh[r][g]));
        sc[r][g] = f.x;
        sf[r][g] = f.y;
      }
    float sv[NH][4];
    bool need = false;
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i >> 1, e = i & 1;
        float v = 0.f;
#pragma unroll
        for (int g = 0; g < KG; ++g)
          v += sc[r][g] * (s[g][h][i] - c_off[h][e][g]) + sf[r][g] * q_sum[h][e][g];
        sv[h][i] = (r == 0 ? ok0 : ok1) ? v * rs[h][e] : -INFINITY;
      }
    float lmax[NH][2];
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        lmax[h][e] = fmaxf(sv[h][e], sv[h][2 + e]);
        need |= lmax[h][e] > m_run[h][e] + kSlack;
      }
    if (__any_sync(kFull, need)) {  // warp-uniform; rare once the context's maxima are reached
      float o_alpha[NH][2];
#pragma unroll
      for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float mx = lmax[h][e];
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 16));
          const float m_new = fmaxf(m_run[h][e], mx);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = fast_exp2(m_run[h][e] - m_use);
          m_run[h][e] = m_new;
          m_ref[h][e] = m_use;
          l_run[h][e] *= alpha;
          o_alpha[h][e] = alpha;
        }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          o[i][h][0] *= o_alpha[h][0];
          o[i][h][1] *= o_alpha[h][1];
          o[i][h][2] *= o_alpha[h][0];
          o[i][h][3] *= o_alpha[h][1];
        }
    }
    uint32_t pb[NH][2];  // P^T's B fragments (k = tokens, n = heads): token half r -> reg r
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      float pv[4];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        pv[e] = fast_exp2(sv[h][e] - m_ref[h][e]);  // -inf -> 0
        pv[2 + e] = fast_exp2(sv[h][2 + e] - m_ref[h][e]);
        l_run[h][e] += pv[e] + pv[2 + e];
      }
      pb[h][0] = transpose8x8_b16(pack_f16x2(pv[0], pv[1]));
      pb[h][1] = transpose8x8_b16(pack_f16x2(pv[2], pv[3]));
    }
    // V^T's A fragments: m-tile 4 jj + i, row gid: channel 2 i of word (D/64) gid + jj, row
    // gid + 8: channel 2 i + 1; k: tokens (2t4, 2t4 + 1) (regs 0, 1), (2t4 + 8, 2t4 + 9) (2, 3).
    // A masked token's V row (past the sequence, or a sink / window token) may hold anything: its
    // scale and shift become 0, so that its V is 0 and P (0) * V stays 0, never NaN.
    uint32_t vh[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tok = (c << 4) + 2 * t4 + (j & 1) + 8 * (j >> 1);
      vh[j] = x.ok && tok >= lo && tok < hi ? x.vh[j] : 0u;
    }
    const uint32_t s_lo = __byte_perm(vh[0], vh[1], 0x5410);  // (scale_a, scale_b)
    const uint32_t b_lo = __byte_perm(vh[0], vh[1], 0x7632);  // (shift_a, shift_b)
    const uint32_t s_hi = __byte_perm(vh[2], vh[3], 0x5410);
    const uint32_t b_hi = __byte_perm(vh[2], vh[3], 0x7632);
#pragma unroll
    for (int jj = 0; jj < D / 64; ++jj) {
      const uint32_t y_lo = __byte_perm(x.v[0][jj], x.v[1][jj], 0x5410);  // bytes 0, 1 of a, b
      const uint32_t z_lo = __byte_perm(x.v[0][jj], x.v[1][jj], 0x7632);  // bytes 2, 3
      const uint32_t y_hi = __byte_perm(x.v[2][jj], x.v[3][jj], 0x5410);
      const uint32_t z_hi = __byte_perm(x.v[2][jj], x.v[3][jj], 0x7632);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t w_lo = (i < 2 ? y_lo : z_lo) >> (8 * (i & 1));
        const uint32_t w_hi = (i < 2 ? y_hi : z_hi) >> (8 * (i & 1));
        uint32_t a[4];
        a[0] = dequant_int4_even(w_lo, s_lo, b_lo);
        a[1] = dequant_int4_odd(w_lo, s_lo, b_lo);
        a[2] = dequant_int4_even(w_hi, s_hi, b_hi);
        a[3] = dequant_int4_odd(w_hi, s_hi, b_hi);
#pragma unroll
        for (int h = 0; h < NH; ++h) mma_f16(o[4 * jj + i][h], a, pb[h][0], pb[h][1]);
      }
    }
  };

  auto compute = [&](const Chunk<D>(&x)[NC], const int (&c)[NC]) {
    // S^T = K Q^T for each chunk's 16 tokens (m: token gid (regs 0, 1) and gid + 8 (regs 2, 3))
    // and the query heads (n: 8h + 2*t4 + {0 (regs 0, 2), 1 (regs 1, 3)}); K's int8 rows gid and
    // gid + 8 convert exactly to the A fragments.
    float s[NC][NH][4];
#pragma unroll
    for (int q = 0; q < NC; ++q)
#pragma unroll
      for (int h = 0; h < NH; ++h) s[q][h][0] = s[q][h][1] = s[q][h][2] = s[q][h][3] = 0.f;
#pragma unroll
    for (int q = 0; q < NC; ++q) {
      const uint32_t* k0 = reinterpret_cast<const uint32_t*>(&x[q].k[0][0]);
      const uint32_t* k1 = reinterpret_cast<const uint32_t*>(&x[q].k[1][0]);
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        uint32_t a[4];
        i8x4_to_f16x2x2(k0[kc], a[0], a[2]);
        i8x4_to_f16x2x2(k1[kc], a[1], a[3]);
#pragma unroll
        for (int h = 0; h < NH; ++h) mma_f16(s[q][h], a, qb[h][kc][0], qb[h][kc][1]);
      }
    }
    // scale, bias, mask; whether any head's reference or the P scale must move
    bool need = false;
    float lmax[NH][2];
    float vs0[NC], vs1[NC];
    int vb = 0;
#pragma unroll
    for (int q = 0; q < NC; ++q) {
      const int j0 = (c[q] << 4) + gid;  // token of regs 0, 1; regs 2, 3: j0 + 8
      const bool ok0 = x[q].ok && j0 < L, ok1 = x[q].ok && j0 + 8 < L;
      const float ks0 = kStatic ? 1.f : x[q].ks[0], ks1 = kStatic ? 1.f : x[q].ks[1];
      // a masked token's scale may be garbage: 0 keeps it out of P' and of the P scale
      vs0[q] = kStatic ? 1.f : (ok0 ? x[q].vs[0] : 0.f);
      vs1[q] = kStatic ? 1.f : (ok1 ? x[q].vs[1] : 0.f);
      const float bias0 = static_cast<float>(j0 - (L - 1)), bias1 = bias0 + 8.f;
#pragma unroll
      for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v0 = s[q][h][e] * ks0 * rs[h][e] + slope[h][e] * bias0;
          const float v1 = s[q][h][2 + e] * ks1 * rs[h][e] + slope[h][e] * bias1;
          s[q][h][e] = ok0 ? v0 : -INFINITY;
          s[q][h][2 + e] = ok1 ? v1 : -INFINITY;
          const float mx = fmaxf(s[q][h][e], s[q][h][2 + e]);
          lmax[h][e] = q == 0 ? mx : fmaxf(lmax[h][e], mx);
        }
      if constexpr (!kStatic) vb = max(vb, __float_as_int(fmaxf(vs0[q], vs1[q])) >> 23);
    }
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) need |= lmax[h][e] > m_run[h][e] + kSlack;
    if constexpr (!kStatic) need |= vb > v_bits;
    if (__any_sync(kFull, need)) {  // warp-uniform; rare once the context's maxima are reached
      float rescale = 1.f;          // 2^(p_exp new - old)
      if constexpr (!kStatic) {
        const int vmax = __reduce_max_sync(kFull, vb);
        if (vmax > v_bits) {
          v_bits = vmax;
          const int ex = min(63, max(-63, 133 - v_bits));
          rescale = __int_as_float((127 + ex - p_exp) << 23);
          p_exp = ex;
          p_inv = __int_as_float((127 - ex) << 23);
        }
      }
      float o_alpha[NH][2];
#pragma unroll
      for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float mx = lmax[h][e];  // over the step's tokens: the 8 lanes of this t4
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 16));
          const float m_new = fmaxf(m_run[h][e], mx);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = fast_exp2(m_run[h][e] - m_use);  // 0 from -inf; 1 when unchanged
          m_run[h][e] = m_new;
          m_ref[h][e] = m_use;
          l_run[h][e] *= alpha;
          o_alpha[h][e] = alpha * rescale;
        }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          o[i][h][0] *= o_alpha[h][0];
          o[i][h][1] *= o_alpha[h][1];
          o[i][h][2] *= o_alpha[h][0];
          o[i][h][3] *= o_alpha[h][1];
        }
    }
    const float pscale = __int_as_float((127 + p_exp) << 23);
    // P'^T (tokens x heads, S^T's layout) in fp16 hi + lo; its 8x8 transposes are the B
    // fragments (k = tokens, n = heads) of V^T P'^T: token half r -> register r.
    uint32_t ph[NC][NH][2], pl[NC][NH][2];
#pragma unroll
    for (int q = 0; q < NC; ++q) {
      const float w0 = vs0[q] * pscale, w1 = vs1[q] * pscale;
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        float pv[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p0 = fast_exp2(s[q][h][e] - m_ref[h][e]);  // -inf -> 0
          const float p1 = fast_exp2(s[q][h][2 + e] - m_ref[h][e]);
          l_run[h][e] += p0 + p1;
          pv[e] = p0 * w0;
          pv[2 + e] = p1 * w1;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const __half2 hi = __floats2half2_rn(pv[2 * r], pv[2 * r + 1]);
          const float2 hf = __half22float2(hi);
          ph[q][h][r] = transpose8x8_b16(*reinterpret_cast<const uint32_t*>(&hi));
          pl[q][h][r] = transpose8x8_b16(pack_f16x2(pv[2 * r] - hf.x, pv[2 * r + 1] - hf.y));
        }
      }
    }
    // V^T as the A fragments: rows = head dim (row gid: d = 2i, row gid + 8: d = 2i + 1 of this
    // thread's DPT bytes), k = tokens 2*t4, 2*t4 + 1 (regs 0, 1) and 2*t4 + 8, 2*t4 + 9 (regs 2, 3)
#pragma unroll
    for (int q = 0; q < NC; ++q) {
      const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&x[q].v[0]);
      const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&x[q].v[1]);
      const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&x[q].v[2]);
      const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&x[q].v[3]);
#pragma unroll
      for (int wi = 0; wi < DPT / 4; ++wi) {
        const uint32_t w0 = v0[wi], w1 = v1[wi], w2 = v2[wi], w3 = v3[wi];
        uint32_t a[2][4];  // m-tiles 2*wi and 2*wi + 1
        a[0][0] = i8pair_to_f16x2<0>(w0, w1);
        a[0][1] = i8pair_to_f16x2<1>(w0, w1);
        a[0][2] = i8pair_to_f16x2<0>(w2, w3);
        a[0][3] = i8pair_to_f16x2<1>(w2, w3);
        a[1][0] = i8pair_to_f16x2<2>(w0, w1);
        a[1][1] = i8pair_to_f16x2<3>(w0, w1);
        a[1][2] = i8pair_to_f16x2<2>(w2, w3);
        a[1][3] = i8pair_to_f16x2<3>(w2, w3);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int h = 0; h < NH; ++h) {
            mma_f16(o[2 * wi + j][h], a[j], ph[q][h][0], ph[q][h][1]);
            mma_f16(o[2 * wi + j][h], a[j], pl[q][h][0], pl[q][h][1]);
          }
      }
    }
  };

  // ---- the main loop: chunks i .. i + NC - 1 per step, S - NC more in flight
  {
    auto wrap = [](int st) { return st >= S ? st - S : st; };  // st < 2 S
    int st = 0;                                                // the stage of chunk i
    for (int i = 0; i < my_n; i += NC) {
#pragma unroll
      for (int q = 0; q < NC; ++q) {  // into the stages of the previous step's chunks
        const int in = i + S - NC + q;
        if (in < my_n) issue(first + in * kWarps, in, wrap(st + S - NC + q));
        cp_async_commit();
      }
      cp_async_wait<S - NC>();
      __syncwarp();
      if constexpr (kInt4) {
        C4 x;
        read_stage4(x, st);
        __syncwarp();  // all lanes have read the stage before a later issue refills it
        compute4(x, first + i * kWarps);
      } else {
        Chunk<D> x[NC];
        int c[NC];
#pragma unroll
        for (int q = 0; q < NC; ++q) {
          read_stage(x[q], wrap(st + q));
          c[q] = first + (i + q) * kWarps;
          if (q > 0 && i + q >= my_n) x[q].ok = false;  // no such chunk: its stage is stale
        }
        __syncwarp();  // all lanes have read the stages before a later issue refills them
        compute(x, c);
      }
      st = wrap(st + NC);
    }
    cp_async_wait<0>();
  }
  // Let the next kernel launch once every CTA is past its stream (its CTAs wait in their own
  // pdl_wait until this grid has completed). Not at the start: with more CTAs than fit at once,
  // waiting CTAs of the next kernel would take the slots of this one's later waves.
  pdl_launch_dependents();
  __syncthreads();  // the pipeline's shared memory becomes the merge buffer

  // ---- merge the warps
  auto s_o = reinterpret_cast<float (*)[kRows][D + kPad]>(smem);
  auto s_m = reinterpret_cast<float (*)[16]>(smem + kWarps * kRows * (D + kPad) * 4);
  auto s_l =
      reinterpret_cast<float (*)[16]>(smem + kWarps * kRows * (D + kPad) * 4 + kWarps * 16 * 4);
#pragma unroll
  for (int h = 0; h < NH; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_run[h][e];  // over the 8 lanes of this t4 (tokens gid, gid + 8 of each chunk)
      l += __shfl_xor_sync(kFull, l, 4);
      l += __shfl_xor_sync(kFull, l, 8);
      l += __shfl_xor_sync(kFull, l, 16);
      if (gid == 0) {
        const int head = 8 * h + 2 * t4 + e;
        s_m[warp][head] = m_run[h][e];  // O and l are relative to it (m_ref) where l > 0
        s_l[warp][head] = l;
      }
    }
#pragma unroll
  for (int h = 0; h < NH; ++h)
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int d = gid * DPT + 2 * i;
      const int head = 8 * h + 2 * t4;
      s_o[warp][head][d] = o[i][h][0] * p_inv;  // O in units of 1 (exact: a power of two)
      s_o[warp][head + 1][d] = o[i][h][1] * p_inv;
      s_o[warp][head][d + 1] = o[i][h][2] * p_inv;
      s_o[warp][head + 1][d + 1] = o[i][h][3] * p_inv;
    }
  __syncthreads();

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kCluster) cluster_wait();  // every peer's receive mbarrier is initialized
#endif
  // Each thread merges 4 consecutive elements of one row (one row per warp at D = 128, so the
  // row's m and l loads are broadcasts). Approximate ex2, rcp and lg2, as in the split merge:
  // this loop is on every CTA's critical path.
  for (int u = threadIdx.x; u < units; u += kThreads) {
    const int row = u / (D / kUnit), d0 = (u % (D / kUnit)) * kUnit;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, s_m[w][row]);
    float l = 0.f;
    float val[kUnit] = {0.f, 0.f, 0.f, 0.f};
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = fast_exp2(s_m[w][row] - m);  // 0 for a warp without tokens
        l = __fmaf_rn(f, s_l[w][row], l);
        merge_add4(val, f, *reinterpret_cast<const float4*>(&s_o[w][row][d0]));
      }
    }
    const bool empty = !(l > 0.f);  // l >= 1 otherwise: the reference m's own token has weight 1
    const float scale = empty ? 0.f : __fdividef(v_static, l);
#pragma unroll
    for (int e = 0; e < kUnit; ++e) val[e] *= scale;
    const float lse = empty ? -INFINITY : m + __log2f(l);
    const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + h0 + row;
    if (num_splits == 1) {
      if constexpr (kInt4) {
        if (p.extra_lse != nullptr)
          fold_extra(val, lse, p.extra_out + bh * D + d0, p.extra_lse + bh, p.extra_parts,
                     static_cast<int64_t>(p.batch) * p.num_q_heads * D,
                     static_cast<int64_t>(p.batch) * p.num_q_heads);
      }
      store_out4(static_cast<T*>(p.out) + bh * D + d0, val);
    } else if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // to the unit's owner, slot [split][u - its u0]; the partial is read only where the lse is
      // finite
      const int owner = u / u_per, slot = split * u_per + (u - owner * u_per);
      const uint32_t bar = dsmem_addr(smem_addr(r_bar), owner);
      st_async4(dsmem_addr(smem_addr(r_part + slot), owner),
                make_float4(val[0], val[1], val[2], val[3]), bar);
      st_async1(dsmem_addr(smem_addr(r_lse + slot), owner), lse, bar);
#endif
    } else {
      if (!empty) {
        *reinterpret_cast<float4*>(p.partial_out + (bh * num_splits + split) * D + d0) =
            make_float4(val[0], val[1], val[2], val[3]);
      }
      if (d0 == 0) p.partial_lse[bh * num_splits + split] = lse;
    }
  }
  if (num_splits == 1) return;
  if constexpr (kCluster) {
    // ---- the cluster merge (sm_90): the num_splits CTAs of this (sequence, kv head, head group)
    // are one thread-block cluster (rank = split). Each CTA owns the output units [u0, u1) of the
    // group; above, every CTA pushed each unit of its O / l, with its row's lse, to the unit's
    // owner (st.async into the owner's receive buffers, counted on its mbarrier). The owner waits
    // for its mbarrier's phase to complete (all splits' bytes have landed), merges in the same
    // split order and arithmetic as the other paths (bit-identical outputs) and stores. No
    // workspace, atomic or L2 round trip, one wait instead of two cluster barriers, and no CTA
    // reads a peer's shared memory, so none has to stay alive for its peers. (Until 2026-11-22
    // each CTA kept its partials and every CTA read its slice from all peers between two cluster
    // barriers: the first's release is a MEMBAR.ALL.GPU, ~1000 cycles for the last CTA to arrive.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mbar_wait_cluster(r_bar, 0);
    constexpr int kMaxS = kPagedDecodeMaxClusterSplits;
    for (int u = u0 + threadIdx.x; u < u1; u += kThreads) {
      const int row = u / (D / kUnit), d0 = (u % (D / kUnit)) * kUnit;
      float lse[kMaxS];
      float4 v[kMaxS];
#pragma unroll
      for (int s = 0; s < kMaxS; ++s) {
        lse[s] = -INFINITY;
        v[s] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (s < num_splits) {
          lse[s] = r_lse[s * u_per + (u - u0)];
          v[s] = r_part[s * u_per + (u - u0)];
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int s = 0; s < kMaxS; ++s) mx = fmaxf(mx, lse[s]);
      float acc[kUnit] = {0.f, 0.f, 0.f, 0.f};
      float wsum = 0.f;
      if (mx != -INFINITY) {
#pragma unroll
        for (int s = 0; s < kMaxS; ++s) {
          if (lse[s] == -INFINITY) continue;  // an empty split (or s >= num_splits)
          const float w = merge_weight(lse[s], mx);
          wsum += w;
          merge_add4(acc, w, v[s]);
        }
      }
      const float inv = merge_inv(wsum);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) acc[e] = merge_finish(acc[e], inv);
      if constexpr (kInt4) {
        if (p.extra_lse != nullptr) {
          const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + h0 + row;
          fold_extra(acc, merged_lse(mx, wsum), p.extra_out + bh * D + d0, p.extra_lse + bh,
                     p.extra_parts, static_cast<int64_t>(p.batch) * p.num_q_heads * D,
                     static_cast<int64_t>(p.batch) * p.num_q_heads);
        }
      }
      store_out4(
          static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.num_q_heads + h0 + row) * D + d0,
          acc);
    }
#endif
    return;
  }
  if (p.split_counters == nullptr) return;  // (CTA-uniform)

  // ---- the fused split merge: the last CTA of this (sequence, kv head, head group) to finish
  // merges all num_splits partials (CUTLASS's serial split-K reduction / TensorRT-LLM's
  // multi-block mode). Memory ordering, in the PTX memory model's terms:
  // - release: every thread fences its partial-output stores (fence.sc.gpu), the CTA barrier
  //   orders them before thread 0, which fences again (the fence after the barrier is what makes
  //   thread 0's fence + atomicAdd a release pattern covering the other threads' stores, as in
  //   cooperative groups' grid sync) and increments the group's counter.
  // - acquire: the thread 0 that reads num_splits - 1 (every other CTA of the group has already
  //   released its partials into the counter) fences, and the barrier orders that before the
  //   merging threads' loads. Those loads are ld.global.cg (__ldcg): served by L2, never by a
  //   possibly stale L1 line (e.g. of an earlier call's workspace at the same address).
  // - reset: no other CTA of this launch touches the counter after the last increment, so the
  //   last CTA sets it back to 0 at once; the kernel's completion makes that visible to the next
  //   launch on the stream (and to every CUDA-graph replay), so the buffer never needs a memset.
  // No CTA waits for another: there is no deadlock however the CTAs are scheduled.
  __threadfence();
  __syncthreads();
  int ticket = 0;
  if (threadIdx.x == 0) {
    int* counter = p.split_counters + static_cast<int64_t>(b) * gridDim.y + blockIdx.y;
    __threadfence();
    ticket = atomicAdd(counter, 1);
    if (ticket == num_splits - 1) {
      __threadfence();
      atomicExch(counter, 0);
    }
  }
  if (!__syncthreads_or(ticket == num_splits - 1)) return;  // not the last CTA (CTA-uniform)

  // The group's lse rows are contiguous ([B, HQ, num_splits], rows h0 .. h0 + rows - 1): stage
  // them in shared memory (the merge buffers above are no longer read after the barrier), then
  // each warp takes the max of its rows (exact, order-independent: the reduce kernel's value).
  const int64_t bh0 = static_cast<int64_t>(b) * p.num_q_heads + h0;
  float* s_lse = reinterpret_cast<float*>(smem);  // [rows][num_splits]
  float* s_max = s_lse + rows * num_splits;       // [rows]
  {
    const float* g_lse = p.partial_lse + bh0 * num_splits;
    for (int i = threadIdx.x; i < rows * num_splits; i += kThreads) s_lse[i] = __ldcg(g_lse + i);
  }
  __syncthreads();
  for (int row = warp; row < rows; row += kWarps) {
    float mx = -INFINITY;
    for (int s = lane; s < num_splits; s += 32) mx = fmaxf(mx, s_lse[row * num_splits + s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    if (lane == 0) s_max[row] = mx;
  }
  __syncthreads();
  // Each thread merges 4 consecutive elements of one row over all splits in split order, with
  // kAhead splits' loads in flight (the accumulation order is still s = 0, 1, ...).
  constexpr int kVec = 4, kAhead = 8;
  constexpr int kUnits = D / kVec;  // per row
  for (int u = threadIdx.x; u < rows * kUnits; u += kThreads) {
    const int row = u / kUnits, d0 = (u % kUnits) * kVec;
    const float mx = s_max[row];
    const float* lse = s_lse + row * num_splits;
    const float* po = p.partial_out + (bh0 + row) * num_splits * D + d0;
    float acc[kVec] = {0.f, 0.f, 0.f, 0.f};
    float wsum = 0.f;
    if (mx != -INFINITY) {
      for (int s0 = 0; s0 < num_splits; s0 += kAhead) {
        float4 v[kAhead];
#pragma unroll
        for (int i = 0; i < kAhead; ++i) {  // an empty split wrote no partial output: skip it
          v[i] = s0 + i < num_splits && lse[s0 + i] != -INFINITY
                     ? __ldcg(reinterpret_cast<const float4*>(po + (s0 + i) * D))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < kAhead; ++i) {
          if (s0 + i >= num_splits) break;
          const float ls = lse[s0 + i];
          if (ls == -INFINITY) continue;  // an empty split
          const float w = merge_weight(ls, mx);
          wsum += w;
          merge_add4(acc, w, v[i]);
        }
      }
    }
    const float inv = merge_inv(wsum);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = merge_finish(acc[e], inv);
    if constexpr (kInt4) {
      if (p.extra_lse != nullptr) {
        fold_extra(acc, merged_lse(mx, wsum), p.extra_out + (bh0 + row) * D + d0,
                   p.extra_lse + bh0 + row, p.extra_parts,
                   static_cast<int64_t>(p.batch) * p.num_q_heads * D,
                   static_cast<int64_t>(p.batch) * p.num_q_heads);
      }
    }
    store_out4(static_cast<T*>(p.out) + (bh0 + row) * D + d0, acc);
  }
}

// ---- the split merge: one warp per (sequence, query head) ----------------------------------------
// (The merge arithmetic, shared with the fused and the cluster merge: attention/split_merge.cuh.)
template <typename T, int D>
__global__ void __launch_bounds__(128)
    paged_decode_int8_reduce_kernel(const float* partial_out, const float* partial_lse, T* out,
                                    int rows, int num_splits, const float* extra_out,
                                    const float* extra_lse, int extra_parts) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float* lse = partial_lse + static_cast<int64_t>(row) * num_splits;
  float m = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) m = fmaxf(m, lse[s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  float wsum = 0.f;
  if (m != -INFINITY) {
    for (int s = 0; s < num_splits; ++s) {
      const float ls = lse[s];
      if (ls == -INFINITY) continue;  // an empty split wrote no partial output
      const float w = merge_weight(ls, m);
      wsum += w;
      const float* po = partial_out + (static_cast<int64_t>(row) * num_splits + s) * D + lane * E;
      if constexpr (E == 4) {
        merge_add4(acc, w, *reinterpret_cast<const float4*>(po));
      } else {
        const float2 v = *reinterpret_cast<const float2*>(po);
        merge_add(acc[0], w, v.x);
        merge_add(acc[1], w, v.y);
      }
    }
  }
  T* op = out + static_cast<int64_t>(row) * D + lane * E;
  const float inv = merge_inv(wsum);
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = merge_finish(acc[e], inv);
  if (extra_lse != nullptr) {  // the SKVQ side tokens: one more split
    fold_extra(acc, merged_lse(m, wsum), extra_out + static_cast<int64_t>(row) * D + lane * E,
               extra_lse + row, extra_parts, static_cast<int64_t>(rows) * D, rows);
  }
#pragma unroll
  for (int e = 0; e < E; ++e) op[e] = from_float<T>(acc[e]);
}

// The launch configuration of the cluster-merge kernel: clusters of num_splits CTAs along x.
// The launch configuration of the split kernel: clusters of num_splits CTAs along x (kCluster),
// and programmatic stream serialization when the context is split (num_splits > 1) and not
// p.no_pdl: the kernel's CTAs may launch while the previous kernel in the stream finishes
// (griddepcontrol.wait holds them before any read; in a CUDA graph this becomes a programmatic
// edge). Split grids are sized to one wave of resident CTAs. Unsplit grids of many CTAs (large
// batches) launch without it: dispatched early, as slots free up, their CTAs were placed unevenly
// and the call ran 4-11% slower (H100, scratch A/B at B = 8-128), where split grids gained
// 0.1-0.9 us. `attrs` must hold 2 entries.
template <typename T, int D, bool kTwoRows, int kFmt, int NW, bool kCluster>
cudaError_t split_config(const PagedDecodeInt8Params& p, const DeviceProps& props, dim3 grid,
                         cudaStream_t stream, cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attrs) {
  // 8-warp CTAs (grids of at most one CTA per SM) reserve over half an SM's shared memory, so
  // that one runs per SM: with ~100 KB at D = 64 two fit, and a cluster launch (or the next call's
  // CTAs, dispatched early under PDL) then stacked two on some SMs while others idled (Nsight
  // Compute: 0 to 2 CTAs per SM). H100, same-run A/B, SmolLM2 B = 4, T = 16384: 14.9 -> 12.2 us.
  int smem = kSmemBytes<D, kTwoRows, kFmt, NW, kCluster>;
  if (NW == 8) smem = std::max(smem, std::min(props.smem_per_block, props.smem_per_sm / 2 + 1));
  auto kernel = paged_decode_int8_kernel<T, D, kTwoRows, kFmt, NW, kCluster>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  *cfg = cudaLaunchConfig_t{};
  cfg->gridDim = grid;
  cfg->blockDim = dim3(NW * 32);
  cfg->dynamicSmemBytes = smem;
  cfg->stream = stream;
  cfg->attrs = attrs;
  cfg->numAttrs = 0;
  if (kCluster) {
    if (p.num_splits > kPagedDecodePortableClusterSplits) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
    }
    cudaLaunchAttribute& a = attrs[cfg->numAttrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = static_cast<unsigned>(p.num_splits);
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
  }
  if (!p.no_pdl && p.num_splits > 1) append_pdl_attribute(cfg, attrs);
  return cudaSuccess;
}

// Launches the split kernel; with max_clusters set, only reports how many clusters of the
// cluster-merge configuration can be resident at once (0: it cannot launch) and launches nothing.
template <typename T, int D, bool kTwoRows, int kFmt, int NW>
cudaError_t launch_split(const PagedDecodeInt8Params& p, const DeviceProps& props, dim3 grid,
                         cudaStream_t stream, int* max_clusters) {
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attrs[2];
  if ((p.cluster_merge && p.num_splits > 1) || max_clusters != nullptr) {
    cudaError_t err =
        split_config<T, D, kTwoRows, kFmt, NW, true>(p, props, grid, stream, &cfg, attrs);
    if (err != cudaSuccess) return err;
    auto kernel = paged_decode_int8_kernel<T, D, kTwoRows, kFmt, NW, true>;
    if (max_clusters != nullptr) return cudaOccupancyMaxActiveClusters(max_clusters, kernel, &cfg);
    return cudaLaunchKernelEx(&cfg, kernel, p);
  }
  cudaError_t err =
      split_config<T, D, kTwoRows, kFmt, NW, false>(p, props, grid, stream, &cfg, attrs);
  if (err != cudaSuccess) return err;
  return cudaLaunchKernelEx(&cfg, paged_decode_int8_kernel<T, D, kTwoRows, kFmt, NW, false>, p);
}

// Warps per CTA: p.warps when set (4 or 8; an override for tests and sweeps), else 8 when the grid
// has at most one CTA per SM (small batches: more warps per SM without more splits), else 4.
// (12 warps in one CTA per SM -- D = 128 at 168 registers fits -- measured 2-6% slower than 8 at
// B = 1: warp occupancy does not limit a split; docs/kv_cache.md, "The cluster merge".)
int decode_warps(int forced, int64_t ctas, int sms) {
  if (forced == 4 || forced == 8) return forced;
  return ctas <= sms ? 8 : 4;
}

template <typename T, int D, bool kTwoRows, int kFmt>
cudaError_t launch(const PagedDecodeInt8Params& p, cudaStream_t stream, int* max_clusters) {
  const int G = p.num_q_heads / p.num_kv_heads;
  const int HG = kTwoRows ? (G + 15) / 16 : 1;
  dim3 grid(p.num_splits, p.num_kv_heads * HG, p.batch);
  DeviceProps props;
  cudaError_t err = current_device_props(&props);
  if (err != cudaSuccess) return err;
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  err = decode_warps(p.warps, ctas, props.sms) == 8
            ? launch_split<T, D, kTwoRows, kFmt, 8>(p, props, grid, stream, max_clusters)
            : launch_split<T, D, kTwoRows, kFmt, 4>(p, props, grid, stream, max_clusters);
  if (max_clusters != nullptr) return err;
  // one split: the kernel wrote `out`; fused or cluster merge: the split kernel merged the splits
  if (err != cudaSuccess || p.num_splits == 1 || p.split_counters != nullptr || p.cluster_merge)
    return err;
  const int rows = p.batch * p.num_q_heads;
  paged_decode_int8_reduce_kernel<T, D><<<(rows + 3) / 4, 128, 0, stream>>>(
      p.partial_out, p.partial_lse, static_cast<T*>(p.out), rows, p.num_splits, p.extra_out,
      p.extra_lse, p.extra_parts);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t dispatch_rows(const PagedDecodeInt8Params& p, cudaStream_t stream, int* max_clusters) {
  const bool two = p.num_q_heads / p.num_kv_heads > 8;
  if (p.kv_format == KvFormat::kInt4) {
    if (two) {
      return p.num_groups == 4 ? launch<T, D, true, kFmtInt4G4>(p, stream, max_clusters)
                               : launch<T, D, true, kFmtInt4G1>(p, stream, max_clusters);
    }
    return p.num_groups == 4 ? launch<T, D, false, kFmtInt4G4>(p, stream, max_clusters)
                             : launch<T, D, false, kFmtInt4G1>(p, stream, max_clusters);
  }
  if (two) {
    return p.static_scales ? launch<T, D, true, kFmtInt8Static>(p, stream, max_clusters)
                           : launch<T, D, true, kFmtInt8>(p, stream, max_clusters);
  }
  return p.static_scales ? launch<T, D, false, kFmtInt8Static>(p, stream, max_clusters)
                         : launch<T, D, false, kFmtInt8>(p, stream, max_clusters);
}

template <typename T>
cudaError_t dispatch_dim(const PagedDecodeInt8Params& p, cudaStream_t stream, int* max_clusters) {
  return p.head_dim == 128 ? dispatch_rows<T, 128>(p, stream, max_clusters)
                           : dispatch_rows<T, 64>(p, stream, max_clusters);
}

// Head groups per kv head: one with G <= 8 query heads per kv head, else groups of 16 (the
// kernel's kTwoRows build). The host side of the grid's y = num_kv_heads * head_groups.
int64_t head_groups(int G) {
  return G > 8 ? (G + 15) / 16 : 1;
}

bool valid_params(const PagedDecodeInt8Params& p) {
  if (p.kv_format == KvFormat::kInt4 &&
      ((p.num_groups != 1 && p.num_groups != 4) || p.sinks < 0 || p.window < 0 ||
       p.alibi_slopes != nullptr || p.overlap_prologue)) {
    return false;
  }
  return !((p.head_dim != 64 && p.head_dim != 128) || p.num_kv_heads <= 0 ||
           p.num_q_heads % p.num_kv_heads != 0 || p.block_size < 16 || (p.block_size & 15) != 0 ||
           ((p.block_size >> 4) & ((p.block_size >> 4) - 1)) != 0 || p.num_splits < 1 ||
           p.num_splits > kPagedDecodeMaxSplits || p.batch < 0 || p.batch > 65535 ||
           p.max_blocks < 1);
}

}  // namespace

int paged_decode_int8_num_splits(int batch, int num_q_heads, int num_kv_heads, int head_dim,
                                 int max_context, int num_sms, bool cluster_merge) {
  if (batch <= 0 || num_kv_heads <= 0 || num_q_heads <= 0) return 1;
  const int G = num_q_heads / num_kv_heads;
  const int64_t ctas = static_cast<int64_t>(batch) * num_kv_heads * head_groups(G);
  const int64_t sms = num_sms > 0 ? num_sms : 132;
  // Measured on H100 (bench/bench_decode_attention.py's num_splits sweep): the best split count
  // gives about one 8-warp CTA per SM (more splits cost more than the extra parallelism brings).
  // Until the 8-warp CTAs reserved one SM each, D = 64 aimed at 3 4-warp CTAs per SM instead;
  // one 8-warp CTA per SM measured 0.82-0.94x of that at SmolLM2 B = 4-16, T >= 4096 (1.07x at
  // B = 4, T = 1024; docs/kv_cache.md). A batch with a CTA for half the SMs runs unsplit at either
  // D (SmolLM2, B = 32: 96 CTAs; 25.4 us unsplit, 28.4 us at 4 splits).
  if (2 * ctas >= sms) return 1;
  // at most `sms` CTAs (a partial second wave of equal CTAs costs a whole CTA time), and at
  // least kMinTokensPerSplit (cluster merge: kMinTokensPerClusterSplit) tokens per split. Short
  // contexts with the cluster merge (H100, forced splits, same run): Llama-3-8B GQA B = 1,
  // T = 1024: 2 splits 6.7 us, 8 splits 5.2 us; SmolLM2 B = 1, T = 1024: 5.0 -> 3.5 us.
  const int min_tokens = cluster_merge ? kMinTokensPerClusterSplit : kMinTokensPerSplit;
  int64_t s = sms / ctas;
  const int64_t by_len = (static_cast<int64_t>(max_context) + min_tokens - 1) / min_tokens;
  if (s > by_len) s = by_len;
  if (s > kPagedDecodeMaxSplits) s = kPagedDecodeMaxSplits;
  // Past a portable cluster's 8 splits: where 16 splits of every group fit one CTA per SM (at
  // most 8 kv-head groups on an H100: SmolLM2 or a tensor-parallel slice of a GQA model at small
  // batch), up to 16 splits in one non-portable cluster; where those clusters do not all fit at
  // once (an H100 holds about one 16-CTA cluster per GPC), the glue's fit step
  // (paged_decode_int8_fit_cluster_splits) lowers the count to one that does, down to 8. H100,
  // SmolLM2 B = 1 (3 kv heads), same run: T = 4096, 8 splits 5.31 us, 16 in clusters 4.55;
  // T = 16384, 16 in clusters 7.83 us, 32 through the workspace 10.73, 8 in clusters 12.7; one kv
  // head at B = 1, T = 4096: 6.45 -> 5.32 us. Elsewhere 8, or for very long contexts more through
  // the workspace (~2 us more per call than in a cluster: B = 1, 8 splits 8.0 vs 10.1 us).
  if (cluster_merge && s > kPagedDecodePortableClusterSplits) {
    if (ctas * kPagedDecodeMaxClusterSplits > sms) {
      s = kPagedDecodePortableClusterSplits;
    } else if (max_context <=
               static_cast<int64_t>(kPagedDecodeMaxClusterSplits) * kClusterFitTokens) {
      s = std::min<int64_t>(s, kPagedDecodeMaxClusterSplits);
    } else {  // the workspace merge's own floor (SmolLM2 B = 1, T = 16384: 128 splits 16.8 us)
      s = std::min<int64_t>(s, (max_context + kMinTokensPerSplit - 1) / kMinTokensPerSplit);
    }
  }
  return s < 1 ? 1 : static_cast<int>(s);
}

int paged_decode_int4_num_splits(int batch, int num_q_heads, int num_kv_heads, int head_dim,
                                 int num_groups, int max_context, int num_sms, bool cluster_merge) {
  if (batch <= 0 || num_kv_heads <= 0 || num_q_heads <= 0) return 1;
  const int row_bytes = 4 * num_groups + head_dim / 2;
  // the int8 rule at the int8 context of the same bytes (D + 4 per token and kv head)
  const int64_t int8_context =
      std::max<int64_t>(1, static_cast<int64_t>(max_context) * row_bytes / (head_dim + 4));
  int s = paged_decode_int8_num_splits(batch, num_q_heads, num_kv_heads, head_dim,
                                       static_cast<int>(int8_context), num_sms, cluster_merge);
  const int G = num_q_heads / num_kv_heads;
  const int64_t ctas = static_cast<int64_t>(batch) * num_kv_heads * head_groups(G);
  const int64_t sms = num_sms > 0 ? num_sms : 132;
  // resident 4-warp CTAs per SM (kMinBlocksPerSm)
  const int per_sm = head_dim == 128 ? (G > 8 ? 2 : (num_groups == 1 ? 4 : 3)) : 3;
  const int64_t slots = sms * per_sm;
  if (head_dim == 64 && ctas < slots) {
    // fewer CTAs than a wave: more splits, at least kMinInt4TokensPerSplit tokens each
    const int64_t by_len = std::max<int64_t>(1, max_context / kMinInt4TokensPerSplit);
    const int64_t want = std::min<int64_t>(by_len, kPagedDecodeMaxClusterSplits);
    if (want > s) s = static_cast<int>(want);
  } else if (s == 1 && ctas > slots) {
    // several waves: the split count (<= 4) whose last wave is the fullest
    double best = 0.0;
    for (int k = 1; k <= 4; ++k) {
      const double waves = static_cast<double>(ctas) * k / static_cast<double>(slots);
      const double fill = waves / std::ceil(waves);
      if (fill > best + 1e-6) {
        best = fill;
        s = k;
      }
    }
  }
  return s < 1 ? 1 : s;
}

int64_t paged_decode_int8_workspace_floats(int batch, int num_q_heads, int head_dim,
                                           int num_splits) {
  if (num_splits <= 1) return 0;
  return static_cast<int64_t>(batch) * num_q_heads * num_splits * (head_dim + 1);
}

int64_t paged_decode_int8_num_counters(int batch, int num_q_heads, int num_kv_heads) {
  if (batch <= 0 || num_kv_heads <= 0 || num_q_heads <= 0) return 0;
  const int G = num_q_heads / num_kv_heads;
  return static_cast<int64_t>(batch) * num_kv_heads * head_groups(G);
}

bool paged_decode_int8_cluster_merge_fits(const PagedDecodeInt8Params& q) {
  PagedDecodeInt8Params p = q;
  p.cluster_merge = true;
  if (!valid_params(p) || p.num_splits < 2 || p.num_splits > kPagedDecodeMaxClusterSplits ||
      p.batch < 1) {
    return false;
  }
  DeviceProps props;
  if (current_device_props(&props) != cudaSuccess || props.cc_major < 9) return false;
  // One cluster per (sequence, kv head, head group): as many as the fused merge's counters.
  const int64_t clusters_needed =
      paged_decode_int8_num_counters(p.batch, p.num_q_heads, p.num_kv_heads);
  const int64_t ctas = clusters_needed * p.num_splits;
  // Cached per kernel configuration: which kernel (and so its shared memory and block size) the
  // launch picks depends on the dtype, D, the head grouping, static scales, and whether the grid
  // has at most one CTA per SM (8 warps) or not (4 warps).
  const int G = p.num_q_heads / p.num_kv_heads;
  const int fmt = p.kv_format == KvFormat::kInt4 ? (p.num_groups == 4 ? 3 : 2) : p.static_scales;
  const int key = ((((p.bf16 * 2 + (p.head_dim == 128)) * 2 + (G > 8)) * 4 + fmt) * 2 +
                   (decode_warps(p.warps, ctas, props.sms) == 8)) *
                      32 +
                  p.num_splits;
  // The grid must be one wave of clusters: a cluster needs all its CTAs resident on one GPC at
  // once, so clusters beyond the co-resident count wait for a whole cluster to finish (measured:
  // 32 clusters of 4 one-CTA-per-SM CTAs, Llama-2-7B MHA at B = 1, ran 1.45x slower than the
  // workspace merge). Co-resident clusters per configuration, asked once (common/device_cache.h);
  // a configuration that cannot launch counts as "does not fit".
  static const int tag = 0;
  int clusters = 0;
  if (cached_device_int(
          &tag, key,
          [&](int, int* c) {
            if ((p.bf16 ? dispatch_dim<__nv_bfloat16>(p, nullptr, c)
                        : dispatch_dim<__half>(p, nullptr, c)) != cudaSuccess) {
              cudaGetLastError();
              *c = 0;  // not launchable: remembered as "fits none"
            }
            return cudaSuccess;
          },
          &clusters) != cudaSuccess)
    return false;
  return clusters >= clusters_needed;
}

int paged_decode_int8_fit_cluster_splits(const PagedDecodeInt8Params& q, int max_context) {
  const int s = q.num_splits;
  if (s < 3 || s > kPagedDecodeMaxClusterSplits) return s;
  // down to three quarters of s, or, past a portable cluster, to a portable cluster
  const int lowest =
      s > kPagedDecodePortableClusterSplits ? kPagedDecodePortableClusterSplits : (3 * s + 3) / 4;
  // Measured on H100 (Llama-2-7B MHA at B = 1, 32 clusters; 4-CTA clusters of the one-CTA-per-SM
  // kernel do not all fit, 3-CTA ones do): T = 4096, 3 splits in clusters 17.8 us, 4 through the
  // workspace 19.0 us; T = 16384: 57.7 against 55.0 us, so long contexts keep the splits.
  // The same bytes per split at either head_dim: a D = 64 token row is half a D = 128 one.
  // (SmolLM2 B = 8, T = 16384: 5 splits through the workspace 26.4 us, 4 in clusters 21.4 us.)
  const int fit_tokens = kClusterFitTokens * 128 / q.head_dim;
  PagedDecodeInt8Params p = q;
  for (int t = s - 1; t >= lowest; --t) {
    if ((max_context + t - 1) / t > fit_tokens) break;
    p.num_splits = t;
    if (paged_decode_int8_cluster_merge_fits(p)) return t;
  }
  return s;
}

cudaError_t paged_decode_attention_int8(const PagedDecodeInt8Params& p, cudaStream_t stream) {
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (p.cluster_merge && p.num_splits > kPagedDecodeMaxClusterSplits) return cudaErrorInvalidValue;
  if (p.num_splits > 1 && !p.cluster_merge &&
      (p.partial_out == nullptr || p.partial_lse == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int G = p.num_q_heads / p.num_kv_heads;
  if (static_cast<int64_t>(p.num_kv_heads) * head_groups(G) > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  if (p.batch == 0) return cudaSuccess;
  return p.bf16 ? dispatch_dim<__nv_bfloat16>(p, stream, nullptr)
                : dispatch_dim<__half>(p, stream, nullptr);
}

}  // namespace attention
}  // namespace qops
