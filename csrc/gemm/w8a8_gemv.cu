// The decode (M <= 16) kernel of w8a8_gemm: split-K int8 GEMV with the dequantizing epilogue.
// Header: gemm/w8a8_gemv.h; design and measurements: docs/w8a8_gemm.md, "The decode GEMV".
//
// Work split. The weights b [N, K] are cut into CTA tiles of 8 * J rows; a CTA's W warps each take
// one contiguous slice of the tile's K range (all J row groups of 8). Small CTAs (8 rows, 4 warps)
// make many of them: every SM streams weights, several CTAs per SM overlap their start-up and
// epilogue with the others' loads.
//
// Inner loop (one warp, one 64-byte chunk of K): lane (g = lane / 4, q = lane % 4) loads 16 bytes
// of weight row g of each row group and 16 bytes of activation rows g and g + 8, at byte 16 q of
// the chunk, and issues two mma.sync m16n8k32 per row group. The MMA wants lane q's k values at
// 4q..4q+3 and 16+4q..16+4q+3 of a 32-wide k step; a dot product does not care about the order
// of k as long as a and b agree, so each lane's 16 contiguous bytes are used as those k values
// of two k steps, for a and b alike: coalesced 16-byte loads with no shuffles, and every k is
// summed exactly once. U chunks are loaded before any is multiplied (J * U weight loads of
// 16 bytes in flight per lane); the weight loads skip L1 and ask L2 for the 256-byte sector
// group (a lane quad's next chunks), the activation loads are L1 hits after the first CTA.
//
// Reduction: int32, exact, in a fixed order (warps), then the epilogue in float32 as the
// reference does it: (float(acc) * a_scale) * b_scale + bias, each op rounded once.
// The epilogue's scales and bias are requested before the main loop, so that their round trip
// overlaps the weight stream.
#include "gemm/w8a8_gemv.h"

#include "common/cp_async.cuh"  // cp_async4, cp_async_commit, cp_async_wait, smem_addr
#include "common/device_cache.h"
#include "common/launch.cuh"  // pdl_wait, pdl_launch_dependents, launch_kernel
#include "common/memory.cuh"  // load_stream, load_cached
#include "common/mma.cuh"     // mma_s8

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace qops {
namespace w8a8_sm90 {
namespace {

constexpr int kChunk = 64;  // bytes of K per warp step (4 lanes x 16 bytes)

struct Params {
  const int8_t* a;
  int64_t lda;
  const int8_t* b;
  int64_t ldb;
  const float* a_scale;
  const float* b_scale;
  const void* bias;
  void* d;
  int64_t ldd;
  int m, n, k;
  bool per_tensor;
  // Always 0. The kernel masks with it where it needs a data dependency that ptxas cannot see
  // through (kWholeBatch); a constant 0 would be folded away.
  int zero = 0;
};

template <typename OutT>
struct Out2;
template <>
struct Out2<__half> {
  using T = __half2;
  static __device__ __forceinline__ T make(float x, float y) { return __floats2half2_rn(x, y); }
  static __device__ __forceinline__ float get(const void* p, int i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
};
template <>
struct Out2<__nv_bfloat16> {
  using T = __nv_bfloat162;
  static __device__ __forceinline__ T make(float x, float y) { return __floats2bfloat162_rn(x, y); }
  static __device__ __forceinline__ float get(const void* p, int i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
};

// The epilogue's work item: output pair i of a CTA whose first row of N is n0, lane l's
// accumulator registers 2h, 2h + 1 of row group j, i.e. row m = l / 4 + 8 h and columns
// n = n0 + 8 j + 2 (l % 4) + {0, 1}. Thread i of the CTA owns pair i.
template <int J, int kPairs>
struct EpiPair {
  int i, l, j, h, m, n;
  bool ok;
  __device__ __forceinline__ EpiPair(int t, int n0, const Params& p)
      : i(t),
        l(t % 32),
        j((t / 32) % J),
        h(t / (32 * J)),
        m(l / 4 + 8 * h),
        n(n0 + 8 * j + 2 * (l % 4)),
        ok(t < kPairs && m < p.m && n < p.n) {}
};

// A pair's epilogue operands: (acc * sa) * sb[0|1] + bias[0|1].
struct EpiOperands {
  float sa, sb0, sb1, bias0, bias1;
};

template <typename OutT>
__device__ __forceinline__ void load_bias_pair(EpiOperands& o, const void* bias, int n) {
  o.bias0 = Out2<OutT>::get(bias, n);
  o.bias1 = Out2<OutT>::get(bias, n + 1);
}

template <typename OutT, int J, int kPairs>
__device__ __forceinline__ EpiOperands load_epi_operands(const EpiPair<J, kPairs>& e,
                                                         const Params& p) {
  EpiOperands o{p.a_scale[p.per_tensor ? 0 : e.m], p.b_scale[p.per_tensor ? 0 : e.n],
                p.b_scale[p.per_tensor ? 0 : e.n + 1], 0.f, 0.f};
  if (p.bias != nullptr) load_bias_pair<OutT>(o, p.bias, e.n);
  return o;
}

// The same operands through shared memory: cp.async copies (4 words per pair: the scales' f32
// bits and the bias pair), which hold no registers while in flight. The bias pair is one
// 4-byte copy when the bias is 4-byte aligned (n is even); a bias that starts at an odd element
// (a slice) is read in the epilogue instead.
__device__ __forceinline__ bool bias_pairs_aligned(const Params& p) {
  return reinterpret_cast<uintptr_t>(p.bias) % 4 == 0;
}
template <typename OutT, int J, int kPairs>
__device__ __forceinline__ void stage_epi_operands(const EpiPair<J, kPairs>& e, const Params& p,
                                                   uint32_t slot) {
  cp_async4(slot, p.a_scale + (p.per_tensor ? 0 : e.m));
  cp_async4(slot + 4, p.b_scale + (p.per_tensor ? 0 : e.n));
  cp_async4(slot + 8, p.b_scale + (p.per_tensor ? 0 : e.n + 1));
  if (p.bias != nullptr && bias_pairs_aligned(p)) {
    cp_async4(slot + 12, static_cast<const OutT*>(p.bias) + e.n);
  }
}
template <typename OutT, int J, int kPairs>
__device__ __forceinline__ EpiOperands staged_epi_operands(const EpiPair<J, kPairs>& e,
                                                           const Params& p, const uint32_t* w) {
  EpiOperands o{__uint_as_float(w[0]), __uint_as_float(w[1]), __uint_as_float(w[2]), 0.f, 0.f};
  if (p.bias != nullptr) {
    if (bias_pairs_aligned(p)) {
      const auto pair = *reinterpret_cast<const typename Out2<OutT>::T*>(&w[3]);
      o.bias0 = __low2float(pair);
      o.bias1 = __high2float(pair);
    } else {
      load_bias_pair<OutT>(o, p.bias, e.n);
    }
  }
  return o;
}

// threadIdx.x, read again (volatile: not merged with earlier reads, so values derived from it
// are recomputed where this is called instead of held in registers across a loop).
__device__ __forceinline__ int fresh_tid_x() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// The most of a lane's 16-byte weight loads a build holds across the PDL wait: 8 (32 registers)
// at M <= 8 and 4 at M > 8, where the activation rows g + 8 take registers too -- except in the
// builds with two row groups per CTA, where each activation load serves two weight loads: 8 at
// any M. Past those caps the early loads were slower at the same residency (H100,
// docs/w8a8_gemm.md): at M <= 8 two 8-chunk batches took 7B / 8B o from 6.6 to 7.6 us; at M > 8
// one 8-chunk batch of the one-row-group build was never faster and took 70B-tp8 down from 13.3
// to 14.8 us, where the 16-row build's batch of 4 chunks x 2 row groups took it to 12.0.
__host__ __device__ constexpr int early_load_cap(bool m16, int row_groups) {
  return m16 && row_groups < 2 ? 4 : 8;
}

// The most weight batches a build of U chunks x J row groups per batch requests before the PDL
// wait (kEarly; see launch_variant): up to two, within early_load_cap.
constexpr int max_early_batches(bool m16, int chunks, int row_groups) {
  const int loads = chunks * row_groups, cap = early_load_cap(m16, row_groups);
  return loads * 2 <= cap ? 2 : loads <= cap ? 1 : 0;
}

// The waves a grid of `ctas` CTAs takes at `per_sm` resident CTAs on each of `sms` SMs.
int64_t waves(int64_t ctas, int per_sm, int sms) {
  const int64_t slots = static_cast<int64_t>(per_sm) * sms;
  return (ctas + slots - 1) / slots;
}

// J row groups of 8 per CTA, U chunks per load batch, kWarps warps (K slices) per CTA, kM16:
// M > 8 (activation rows 8..15 read), kEarly: weight batches requested before the PDL wait.
// One CTA per 8 * J rows of N.
template <int J, int U, int kWarps, bool kM16, typename OutT, int kEarly>
__global__ void __launch_bounds__(kWarps * 32) w8a8_gemv_kernel(const Params p) {
  constexpr int kThreads = kWarps * 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int n0 = blockIdx.x * (8 * J);

  // This warp's chunks of K: slice `warp` of kWarps equal slices.
  const int chunks = (p.k + kChunk - 1) / kChunk;
  const int c0 = chunks * warp / kWarps, c1 = chunks * (warp + 1) / kWarps;

  const int8_t* brow[J];
  bool brow_ok[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int n = n0 + 8 * j + g;
    brow_ok[j] = n < p.n;
    brow[j] = p.b + static_cast<int64_t>(brow_ok[j] ? n : 0) * p.ldb + 16 * q;
  }
  const bool a0_ok = g < p.m, a1_ok = kM16 && g + 8 < p.m;
  const int8_t* arow0 = p.a + static_cast<int64_t>(a0_ok ? g : 0) * p.lda + 16 * q;
  const int8_t* arow1 = p.a + static_cast<int64_t>(a1_ok ? g + 8 : 0) * p.lda + 16 * q;

  int acc[J][4];
#pragma unroll
  for (int j = 0; j < J; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;

  // The activations' rows of chunk c + u (zeros past K), and the MMAs of one load batch.
  auto load_x = [&](int c, int u, uint4& x, uint4& y) {
    const int kb = (c + u) * kChunk;
    const bool ok = c + u < c1 && kb + 16 * q < p.k;
    x = load_cached(arow0 + kb, p.a, ok && a0_ok);
    y = kM16 ? load_cached(arow1 + kb, p.a, ok && a1_ok) : make_uint4(0, 0, 0, 0);
  };
  auto load_w = [&](int c, int u, int j) {
    const int kb = (c + u) * kChunk;
    const bool ok = c + u < c1 && kb + 16 * q < p.k;
    return load_stream(brow[j] + kb, p.b, ok && brow_ok[j]);
  };
  // kWholeBatch: every weight load of a main-loop batch is issued before its first MMA. Left to
  // itself, ptxas issues 5-7 of an 8-load batch, then the first MMAs (which wait for the first
  // load to land), then the rest: those pay a second round trip. Adding (OR of the batch's
  // weights) & p.zero, i.e. 0, to the accumulator makes the first MMA depend on every load, so
  // all are issued first; the MMAs then run once the last one lands. Only in the early builds
  // that already hold early_load_cap loads across the PDL wait, where the whole batch costs no
  // resident CTA:
  // - M <= 8 with 4 warps (several CTAs per SM, whose warps cover the MMAs): 104 -> 110
  //   registers at 8 chunks, 80 -> 80 at 4 chunks x 2 batches. H100, overlapped calls at M = 1
  //   and 8: 7B / 8B o, 7B qkv and 8B qkv 2-5% faster. The 8-warp builds (70B-tp8 qkv, 1-2 CTAs
  //   per SM) were 3% slower with it;
  // - M > 8, the 16-row build with one early batch of 4 chunks x 2 row groups: 94 -> 108
  //   registers, still 2 CTAs of 8 warps per SM. At M = 16: 7B / 8B o 6.6 -> 6.3 us, 7B and 8B
  //   down 5-6% faster, 70B-tp8 down the same; the 16-row build's two batches of 2 chunks were
  //   mostly slower with it.
  // The plain builds and the 4-load early builds, where it costs 4 registers and, at 62, a
  // resident CTA, were up to 15% slower (docs/w8a8_gemm.md, "Whole batches in flight").
  constexpr int kCap = early_load_cap(kM16, J);
  constexpr bool kWholeBatch =
      kM16 ? J == 2 && kEarly == 1 && U * J == kCap : kWarps == 4 && kEarly * U * J == kCap;
  auto mma_batch = [&](const uint4(&x)[U], const uint4(&y)[U], const uint4(&w)[U][J], bool whole) {
    if (whole) {
      uint32_t any = 0;
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < J; ++j) any |= w[u][j].x;
      acc[0][0] += static_cast<int>(any & static_cast<uint32_t>(p.zero));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        mma_s8(acc[j], x[u].x, y[u].x, x[u].y, y[u].y, w[u][j].x, w[u][j].y);
        mma_s8(acc[j], x[u].z, y[u].z, x[u].w, y[u].w, w[u][j].z, w[u][j].w);
      }
    }
  };

  // kEarly > 0 (the caller's overlap_prologue, with PDL): the previous kernel in the stream does
  // not write the weights, so this warp's first kEarly batches are requested before the wait
  // below, and their round trip runs while that kernel finishes. (Batches past the warp's slice
  // are skipped: a warp-uniform branch.)
  uint4 w_early[kEarly > 0 ? kEarly : 1][U][J];
#pragma unroll
  for (int e = 0; e < kEarly; ++e) {
    if (e == 0 || c0 + e * U < c1) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < J; ++j) w_early[e][u][j] = load_w(c0 + e * U, u, j);
    }
  }

  // Programmatic dependent launch (when the launch allows it, see launch_variant): the next
  // kernel in the stream may start launching its CTAs now, and this one waits here for the
  // previous kernel (which may write `a` and the scales) before it reads anything (else).
  pdl_launch_dependents();
  pdl_wait();

  // The epilogue's operands are requested now, so that their round trip (b_scale and the bias
  // come from DRAM) overlaps the weight stream instead of following it: 1-13% faster at M <= 8,
  // most on the small layers, whose CTAs all run in one wave (docs/w8a8_gemm.md). The M <= 8
  // builds hold them in registers (4-12 more, the same CTAs per SM); the M > 8 builds, where
  // that costs a CTA per SM (70B-tp8 gate_up at M = 16: 23% slower), stage them in shared
  // memory with cp.async and recompute the pair's indices after the loop.
  constexpr int kPairs = J * 64;
  static_assert(kPairs <= kThreads, "one output pair per thread");
  __shared__ uint32_t staged[kM16 ? kPairs : 1][4];
  const EpiPair<J, kPairs> pair(threadIdx.x, n0, p);
  EpiOperands ops{};
  if constexpr (kM16) {
    if (pair.ok) stage_epi_operands<OutT>(pair, p, smem_addr(staged[threadIdx.x]));
    cp_async_commit();
  } else {
    if (pair.ok) ops = load_epi_operands<OutT>(pair, p);
  }

  int c = c0;
#pragma unroll
  for (int e = 0; e < kEarly; ++e) {
    if (c < c1) {
      uint4 x[U], y[U];
#pragma unroll
      for (int u = 0; u < U; ++u) load_x(c, u, x[u], y[u]);
      mma_batch(x, y, w_early[e], false);  // issued before the wait: long in flight
      c += U;
    }
  }
  for (; c < c1; c += U) {
    uint4 w[U][J], x[U], y[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      load_x(c, u, x[u], y[u]);
#pragma unroll
      for (int j = 0; j < J; ++j) w[u][j] = load_w(c, u, j);
    }
    mma_batch(x, y, w, kWholeBatch);
  }

  // ---- reduce the warps' partial sums: red[warp][j][e][lane] (e: the 4 accumulator registers).
  __shared__ int red[kWarps][J][4][32];
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp][j][e][lane] = acc[j][e];
  __syncthreads();
  const EpiPair<J, kPairs> e = kM16 ? EpiPair<J, kPairs>(fresh_tid_x(), n0, p) : pair;
  if (!e.ok) return;
  int s0 = 0, s1 = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    s0 += red[w][e.j][2 * e.h][e.l];
    s1 += red[w][e.j][2 * e.h + 1][e.l];
  }
  if constexpr (kM16) {
    cp_async_wait<0>();  // this thread's own copies: no barrier needed
    ops = staged_epi_operands<OutT>(e, p, staged[e.i]);
  }
  float v0 = __fmul_rn(__fmul_rn(static_cast<float>(s0), ops.sa), ops.sb0);
  float v1 = __fmul_rn(__fmul_rn(static_cast<float>(s1), ops.sa), ops.sb1);
  if (p.bias != nullptr) {
    v0 = __fadd_rn(v0, ops.bias0);
    v1 = __fadd_rn(v1, ops.bias1);
  }
  *reinterpret_cast<typename Out2<OutT>::T*>(static_cast<OutT*>(p.d) + e.m * p.ldd + e.n) =
      Out2<OutT>::make(v0, v1);
}

// pdl: launch with programmatic stream serialization (sm_90): the kernel's CTAs may launch
// while the previous kernel in the stream finishes; they wait for it (griddepcontrol.wait)
// before reading anything. Inside a CUDA graph this becomes a programmatic edge.
// early: the weight batches each warp requests before that wait (the kEarly build), only where
// the caller promised that the previous kernel does not write them (overlap_prologue) and the
// launch uses PDL; clamped to max_early_batches. gemv() picks it (early_batches).
// With `resident` set, reports the build's resident CTAs per SM (the occupancy API: registers,
// shared memory, threads) instead of launching.
template <int J, int U, int kWarps, bool kM16, typename OutT>
cudaError_t launch_variant(const Params& p, bool pdl, int early, cudaStream_t stream,
                           int* resident) {
  constexpr int kMaxEarly = max_early_batches(kM16, U, J);
  const int e = early < kMaxEarly ? early : kMaxEarly;
  auto kernel = w8a8_gemv_kernel<J, U, kWarps, kM16, OutT, 0>;
  if constexpr (kMaxEarly >= 1) {
    if (e == 1) kernel = w8a8_gemv_kernel<J, U, kWarps, kM16, OutT, 1>;
  }
  if constexpr (kMaxEarly >= 2) {
    if (e == 2) kernel = w8a8_gemv_kernel<J, U, kWarps, kM16, OutT, 2>;
  }
  if (resident != nullptr) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, kWarps * 32, 0);
  }
  const dim3 grid((p.n + 8 * J - 1) / (8 * J)), block(kWarps * 32);
  return launch_kernel(kernel, grid, block, stream, pdl, p);
}

// The variants: kGemvShapes (the generated table, cutlass_kernels/w8a8_configs.py GEMV_SHAPES;
// docs/w8a8_gemm.md has the sweeps they were picked from; gemv_shape and gemv choose): 8 rows x 4
// or 8 warps with 4 or 8 chunks per load batch, and 16 rows x 8 warps with 2 or 4 chunks per batch
// (each activation load serves two row groups). Shape I is launch_variant<rows / 8, chunks, warps>.
template <int I, bool kM16, typename OutT>
cudaError_t launch_shape_from(const Params& p, GemvShape s, bool pdl, int early,
                              cudaStream_t stream, int* resident) {
  if constexpr (I == sizeof(kGemvShapes) / sizeof(kGemvShapes[0])) {
    return cudaErrorInvalidValue;  // not in kGemvShapes
  } else {
    constexpr GemvShape k = kGemvShapes[I];
    static_assert(k.rows_per_cta % 8 == 0 && k.warps % 4 == 0 && k.chunks >= 2,
                  "GEMV_SHAPES: rows a multiple of 8, warps a multiple of 4, at least 2 chunks");
    if (s.rows_per_cta == k.rows_per_cta && s.warps == k.warps && s.chunks == k.chunks) {
      return launch_variant<k.rows_per_cta / 8, k.chunks, k.warps, kM16, OutT>(p, pdl, early,
                                                                               stream, resident);
    }
    return launch_shape_from<I + 1, kM16, OutT>(p, s, pdl, early, stream, resident);
  }
}

template <bool kM16, typename OutT>
cudaError_t launch_shape(const Params& p, GemvShape s, bool pdl, int early, cudaStream_t stream,
                         int* resident) {
  return launch_shape_from<0, kM16, OutT>(p, s, pdl, early, stream, resident);
}

// launch_shape for the build of this M (> 8 or not) and output dtype.
cudaError_t launch_build(const Params& p, GemvShape s, bool m16, bool fp16, bool pdl, int early,
                         cudaStream_t stream, int* resident = nullptr) {
  if (fp16) {
    return m16 ? launch_shape<true, __half>(p, s, pdl, early, stream, resident)
               : launch_shape<false, __half>(p, s, pdl, early, stream, resident);
  }
  return m16 ? launch_shape<true, __nv_bfloat16>(p, s, pdl, early, stream, resident)
             : launch_shape<false, __nv_bfloat16>(p, s, pdl, early, stream, resident);
}

// Resident CTAs per SM of shape s's build for this M (<= 8 or not), output dtype and early
// batches, on the current device (the occupancy API, asked once per device and build:
// common/device_cache.h); 0 if the query fails.
int resident_ctas(GemvShape s, bool m16, bool fp16, int early) {
  static const int tag = 0;  // this function's questions in the device cache
  const int64_t key =
      ((((int64_t{s.rows_per_cta} * 64 + s.warps) * 64 + s.chunks) * 2 + m16) * 2 + fp16) * 4 +
      early;
  int r = 0;
  const cudaError_t err = cached_device_int(
      &tag, key,
      [&](int, int* v) { return launch_build(Params{}, s, m16, fp16, false, early, nullptr, v); },
      &r);
  return err == cudaSuccess && r > 0 ? r : 0;
}

// The waves of shape s's grid for this problem with `early` batches before the PDL wait
// (its build's resident CTAs per SM on `sm_count` SMs); 0 if unknown.
int64_t grid_waves(const Problem& pr, GemvShape s, bool m16, bool fp16, int early, int sm_count) {
  const int per_sm = resident_ctas(s, m16, fp16, early);
  if (per_sm == 0 || sm_count <= 0) return 0;
  return waves((pr.n + s.rows_per_cta - 1) / s.rows_per_cta, per_sm, sm_count);
}

// The weight batches each warp requests before the PDL wait under the caller's promise
// (overlap_prologue): the most the build has (max_early_batches) whose grid takes no more waves
// than the plain build's. Each early batch holds U x J x 16 bytes of registers per lane across
// the wait; where that costs a resident CTA per SM and the grid then spills into another wave,
// the early start loses more than it gains (H100, interleaved graph replays, docs/w8a8_gemm.md):
//   M <= 8, two batches: 8B qkv (768 CTAs, one wave at 6 or 8 per SM) 10.0 -> 9.3 us at M = 1;
//     7B down, where 3 per SM instead of 4 make two waves, 17.2 -> 20.0 us;
//   M = 16, one batch of 4 chunks: 8B qkv 10.9 -> 10.3 us (one wave at 6 or 7 per SM); 70B-tp8
//     gate_up, where 6 per SM instead of 7 make two waves, 22.0 -> 27.5 us.
// forced >= 0 (GemvTuning::early_batches: tests, sweeps) takes that instead, clamped to the build's.
int early_batches(const Problem& pr, GemvShape s, bool m16, bool fp16, int sm_count, int forced) {
  const int most = max_early_batches(m16, s.chunks, s.rows_per_cta / 8);
  if (forced >= 0) return forced < most ? forced : most;
  const int64_t plain = grid_waves(pr, s, m16, fp16, 0, sm_count);
  if (plain == 0) return m16 ? 0 : 1;  // unknown: the rule before waves were counted
  int early = 0;
  for (int e = 1; e <= most; ++e) {
    const int64_t w = grid_waves(pr, s, m16, fp16, e, sm_count);
    if (w == 0 || w > plain) break;
    early = e;
  }
  return early;
}

// Under the caller's promise at M > 8, where the own shape s affords no early batch: whether the
// 16-row, 8-warp, 4-chunk build with one early batch takes no more waves than s's plain grid (its
// 8 early loads per lane fit because each activation load serves two row groups; 2 CTAs of 8
// warps per SM). Then it is taken instead. H100, overlapped calls at M = 16 (docs/w8a8_gemm.md,
// "M = 16: two row groups under the promise"):
//   7B / 8B o (one wave either way) 7.6 -> 6.3 us; 7B down 19.0 -> 17.5; 8B down 23.0 -> 20.9;
//   70B-tp8 down (two waves either way) 13.3 -> 12.0.
// Where it costs a wave it loses or ties: 8B qkv (whose 4-chunk shape has its own early batch)
// 10.4 -> 11.5, 70B-tp8 gate_up 22.0 -> 22.1, the gate_up layers of 7B / 8B 6-9% slower.
constexpr GemvShape kTwoRowGroups{16, 8, 4};
bool two_row_groups_early(const Problem& pr, GemvShape s, bool fp16, int sm_count) {
  const int64_t plain = grid_waves(pr, s, true, fp16, 0, sm_count);
  const int64_t two = grid_waves(pr, kTwoRowGroups, true, fp16, 1, sm_count);
  return plain > 0 && two > 0 && two <= plain;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

GemvShape gemv_shape(int m, int n, int k, int sm_count, int resident_c4, int resident_c8) {
  // From bench/bench_w8a8_gemm.py --gemv-shapes on the H100 (docs/w8a8_gemm.md): 8 rows x 4 warps
  // streams best in general; 8 warps where the 8-row CTAs are fewer than two per SM (more warps
  // per SM) or, at M <= 8, where K is long (shorter serial chains per warp); at M > 8 with short
  // K, 16 rows share each activation load between two row groups. 8 chunks per load batch
  // instead of 4 where N <= 4096 (at M <= 8 only up to K = 8192): twice the weight bytes in
  // flight per warp, at 98-126 registers instead of 50-80 (fewer CTAs per SM, which the larger
  // N do not afford: 8B qkv, N = 6144, M = 16: 11.2 -> 11.8 us).
  //
  // Past N = 4096, 8 chunks are still taken where they cost no extra wave: where the 4-chunk
  // grid spills into a second (third, ...) wave anyway, and the 8-chunk grid, at its fewer CTAs
  // per SM, takes no more waves. 70B-tp8 down at M = 16: 1024 CTAs meet 924 slots with 4 chunks
  // (a last wave of 100 CTAs) and 528 with 8 (two full waves): 14.4 -> 13.2 us. (8B qkv at
  // M = 16, one wave with 4 chunks and two with 8, keeps 4.)
  if (m > 8 && k <= 2048) return GemvShape{16, 8, 2};
  const bool short_k = m > 8 || k <= 8192;
  int chunks = n <= 4096 && short_k ? 8 : 4;
  if (n / 8 < 2 * sm_count || (m <= 8 && k >= 8192)) return GemvShape{8, 8, chunks};
  if (chunks == 4 && short_k && resident_c4 > 0 && resident_c8 > 0) {
    const int64_t ctas = (n + 7) / 8;
    const int64_t w4 = waves(ctas, resident_c4, sm_count);
    if (w4 > 1 && waves(ctas, resident_c8, sm_count) <= w4) chunks = 8;
  }
  return GemvShape{8, 4, chunks};
}

cudaError_t gemv(const Problem& pr, const LaunchOptions& options, int sm_count, cudaStream_t stream,
                 size_t* workspace_bytes) {
  if (workspace_bytes != nullptr) {
    *workspace_bytes = 0;
    return cudaSuccess;
  }
  if (pr.m < 1 || pr.m > kGemvMaxM || pr.n < 1 || pr.k < 1 || pr.k % 16 != 0 || pr.n % 2 != 0 ||
      !aligned16(pr.a) || !aligned16(pr.b) || (pr.m > 1 && pr.lda % 16 != 0) ||
      (pr.n > 1 && pr.ldb % 16 != 0) || pr.ldd % 2 != 0 || reinterpret_cast<uintptr_t>(pr.d) % 4) {
    return cudaErrorInvalidValue;
  }
  const bool m16 = pr.m > 8, fp16 = pr.out_dtype == OutDtype::kFloat16;
  const GemvTuning& t = options.gemv;
  GemvShape s{t.rows_per_cta, t.warps, t.chunks};
  if (s.rows_per_cta == 0) {
    s = gemv_shape(pr.m, pr.n, pr.k, sm_count, resident_ctas(GemvShape{8, 4, 4}, m16, fp16, 0),
                   resident_ctas(GemvShape{8, 4, 8}, m16, fp16, 0));
  }
  const Params p{pr.a,
                 pr.lda,
                 pr.b,
                 pr.ldb,
                 pr.a_scale,
                 pr.b_scale,
                 pr.bias,
                 pr.d,
                 pr.ldd,
                 pr.m,
                 pr.n,
                 pr.k,
                 pr.scale_mode == ScaleMode::kPerTensor};
  const bool pdl = options.pdl, promise = pdl && options.overlap_prologue;
  int early = promise ? early_batches(pr, s, m16, fp16, sm_count, t.early_batches) : 0;
  // A forced shape or early count (tests, sweeps) is kept as given.
  const bool own = t.rows_per_cta == 0 && t.early_batches < 0;
  if (promise && m16 && early == 0 && own && two_row_groups_early(pr, s, fp16, sm_count)) {
    s = kTwoRowGroups;
    early = 1;
  }
  return launch_build(p, s, m16, fp16, pdl, early, stream);
}

}  // namespace w8a8_sm90
}  // namespace qops
