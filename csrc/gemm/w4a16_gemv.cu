// The W4A16 decode GEMV and the weight prepack (gemm/w4a16.h). Torch-free.
//
// Each CTA owns 64 rows of N (four 16-row blocks) and up to 16 tokens, and a range of the K groups;
// its 8 warps take one group at a time. For a group a warp loads every 32-bit word of its atoms
// (4 row blocks x G/16 K slices, one coalesced 128-byte line per atom per warp) before it computes:
//  - A = the raw nibbles as halves OFF + q (one mask+xor per register: 1032 + q in fp16, 136 + q in
//    bf16, both exact), straight from the shuffled layout into mma.sync m16n8k16 fragments;
//  - B = the activations (token g of the lane, 2 x 32-bit loads per K slice, L1-resident);
//  - per group, the float partial sums t = sum x (OFF + q) and the activations' sum sx = sum x
//    (the same MMA with A = 1) give sum x W = s t + (z - OFF s) sx exactly in float32:
//    the scales and zeros are applied once per (row, group), not per weight.
// The warps' partials meet in shared memory; with K split over CTAs the last CTA of a row tile
// (an atomic counter) adds the CTAs' float partials in split order (deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/convert.cuh"  // to_float, from_float
#include "common/launch.cuh"
#include "gemm/w4a16.h"

namespace qops {
namespace w4a16 {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowBlocks = 4;  // 16-row blocks per CTA
constexpr int kMaxTokens = 16;

template <typename T>
struct Int4Half;
template <>
struct Int4Half<__half> {
  static constexpr uint32_t kXor = 0x64086408u;  // 0x6400 = 1024.0 (ulp 1); nibble ^ 8 = q + 8
  static constexpr float kOffset = 1032.0f;
  static constexpr uint32_t kOnes = 0x3C003C00u;  // (1.0, 1.0)
};
template <>
struct Int4Half<__nv_bfloat16> {
  static constexpr uint32_t kXor = 0x43084308u;  // 0x4300 = 128.0 (ulp 1)
  static constexpr float kOffset = 136.0f;
  static constexpr uint32_t kOnes = 0x3F803F80u;
};

// c (16 x 8, f32) += a (16 x 16, row) * b (16 x 8, col), halves of type T.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t load_weight(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr));
  return v;
}

struct Params {
  const void* a;
  int64_t lda;
  const uint32_t* w;
  const void* scales;
  const void* zeros;
  void* d;
  float* partial;  // [k_splits][m][n] when k_splits > 1
  int* counters;   // [gridDim.z * gridDim.x] when k_splits > 1
  int m, n, k;
  int row_blocks;  // n / 16
  int groups;      // k / G
  int k_splits;
};

// kTok: MMA n-tiles of 8 tokens (1 or 2); kKb: 16-wide K slices per group (G / 16).
template <typename T, int kTok, int kKb, bool kZeros>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(const Params p) {
  __shared__ float red[kWarps][kRowBlocks * kTok * 4][32];
  __shared__ bool last_cta;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int nb0 = blockIdx.x * kRowBlocks;
  const int tok0 = blockIdx.z * kMaxTokens;
  const int split = blockIdx.y;
  const int g_begin = static_cast<int>(static_cast<int64_t>(p.groups) * split / p.k_splits);
  const int g_end = static_cast<int>(static_cast<int64_t>(p.groups) * (split + 1) / p.k_splits);
  const T* a = static_cast<const T*>(p.a);
  const T* scales = static_cast<const T*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);

  // The lane's B column: token tok0 + 8 tt + g (clamped to a real row; its results are dropped).
  const T* xrow[kTok];
#pragma unroll
  for (int tt = 0; tt < kTok; ++tt) {
    xrow[tt] = a + static_cast<int64_t>(min(tok0 + tt * 8 + g, p.m - 1)) * p.lda + 2 * t;
  }
  const uint32_t ones[4] = {Int4Half<T>::kOnes, Int4Half<T>::kOnes, Int4Half<T>::kOnes,
                            Int4Half<T>::kOnes};

  float acc[kRowBlocks][kTok][4];
#pragma unroll
  for (int r = 0; r < kRowBlocks; ++r)
#pragma unroll
    for (int tt = 0; tt < kTok; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][tt][e] = 0.0f;

  bool waited = false;
  for (int gi = g_begin + warp; gi < g_end; gi += kWarps) {
    // The group's weights: every load first (4 x kKb words per lane in flight).
    uint32_t wq[kKb][kRowBlocks];
#pragma unroll
    for (int j = 0; j < kKb; ++j) {
      const int64_t slice = static_cast<int64_t>(gi) * kKb + j;
#pragma unroll
      for (int r = 0; r < kRowBlocks; ++r) {
        const int nb = nb0 + r;
        wq[j][r] =
            nb < p.row_blocks ? load_weight(p.w + (slice * p.row_blocks + nb) * 32 + lane) : 0u;
      }
    }
    float s_lo[kRowBlocks], s_hi[kRowBlocks], z_lo[kRowBlocks], z_hi[kRowBlocks];
#pragma unroll
    for (int r = 0; r < kRowBlocks; ++r) {
      const int nb = nb0 + r;
      const int64_t at = static_cast<int64_t>(gi) * p.n + nb * 16 + g;
      const bool ok = nb < p.row_blocks;
      s_lo[r] = ok ? to_float(scales[at]) : 0.0f;
      s_hi[r] = ok ? to_float(scales[at + 8]) : 0.0f;
      z_lo[r] = kZeros && ok ? to_float(zeros[at]) : 0.0f;
      z_hi[r] = kZeros && ok ? to_float(zeros[at + 8]) : 0.0f;
    }
    if (!waited) {  // the activations may come from the previous kernel (PDL)
      pdl_wait();
      waited = true;
    }
    float part[kRowBlocks][kTok][4];
    float sx[kTok][4];
#pragma unroll
    for (int tt = 0; tt < kTok; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sx[tt][e] = 0.0f;
#pragma unroll
        for (int r = 0; r < kRowBlocks; ++r) part[r][tt][e] = 0.0f;
      }
#pragma unroll
    for (int j = 0; j < kKb; ++j) {
      const int64_t k0 = (static_cast<int64_t>(gi) * kKb + j) * 16;
      uint32_t b[kTok][2];
#pragma unroll
      for (int tt = 0; tt < kTok; ++tt) {
        b[tt][0] = __ldg(reinterpret_cast<const unsigned int*>(xrow[tt] + k0));
        b[tt][1] = __ldg(reinterpret_cast<const unsigned int*>(xrow[tt] + k0 + 8));
        mma<T>(sx[tt], ones, b[tt][0], b[tt][1]);
      }
#pragma unroll
      for (int r = 0; r < kRowBlocks; ++r) {
        const uint32_t w = wq[j][r];
        const uint32_t frag[4] = {(w & 0x000F000Fu) ^ Int4Half<T>::kXor,
                                  ((w >> 4) & 0x000F000Fu) ^ Int4Half<T>::kXor,
                                  ((w >> 8) & 0x000F000Fu) ^ Int4Half<T>::kXor,
                                  ((w >> 12) & 0x000F000Fu) ^ Int4Half<T>::kXor};
#pragma unroll
        for (int tt = 0; tt < kTok; ++tt) mma<T>(part[r][tt], frag, b[tt][0], b[tt][1]);
      }
    }
    // sum_k x W = s * sum x (OFF + q) + (z - OFF s) * sum x, per row (c0, c1: row g; c2, c3: g + 8)
#pragma unroll
    for (int r = 0; r < kRowBlocks; ++r) {
      const float c_lo = z_lo[r] - Int4Half<T>::kOffset * s_lo[r];
      const float c_hi = z_hi[r] - Int4Half<T>::kOffset * s_hi[r];
#pragma unroll
      for (int tt = 0; tt < kTok; ++tt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float s = e < 2 ? s_lo[r] : s_hi[r];
          const float c = e < 2 ? c_lo : c_hi;
          acc[r][tt][e] = fmaf(s, part[r][tt][e], fmaf(c, sx[tt][e], acc[r][tt][e]));
        }
      }
    }
  }
  if (!waited) pdl_wait();  // before any write (the previous kernel may still read d's memory)
  pdl_launch_dependents();

  // The warps' partials -> shared memory -> one sum per (row, token).
#pragma unroll
  for (int r = 0; r < kRowBlocks; ++r)
#pragma unroll
    for (int tt = 0; tt < kTok; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][(r * kTok + tt) * 4 + e][lane] = acc[r][tt][e];
  __syncthreads();
  constexpr int kEntries = kRowBlocks * kTok * 4 * 32;
  constexpr int kPerThread = kEntries / kThreads;
  float sum[kPerThread];
  int row[kPerThread], tok[kPerThread];
  bool valid[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int l = idx & 31, slot = idx >> 5;
    const int e = slot & 3, tt = (slot >> 2) % kTok, r = (slot >> 2) / kTok;
    row[i] = (nb0 + r) * 16 + (l >> 2) + 8 * (e >> 1);
    tok[i] = tok0 + tt * 8 + 2 * (l & 3) + (e & 1);
    valid[i] = nb0 + r < p.row_blocks && tok[i] < p.m;
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) v += red[wi][slot][l];
    sum[i] = v;
  }
  T* d = static_cast<T*>(p.d);
  if (p.k_splits == 1) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (valid[i]) d[static_cast<int64_t>(tok[i]) * p.n + row[i]] = from_float<T>(sum[i]);
    }
    return;
  }
  // Split K over CTAs: publish this CTA's partial, the last CTA of the tile adds them all.
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (valid[i]) {
      p.partial[(static_cast<int64_t>(split) * p.m + tok[i]) * p.n + row[i]] = sum[i];
    }
  }
  __threadfence();
  __syncthreads();
  int* counter = p.counters + blockIdx.z * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) last_cta = atomicAdd(counter, 1) == p.k_splits - 1;
  __syncthreads();
  if (!last_cta) return;
  __threadfence();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (!valid[i]) continue;
    float v = 0.0f;
    for (int s = 0; s < p.k_splits; ++s) {
      v += __ldcg(p.partial + (static_cast<int64_t>(s) * p.m + tok[i]) * p.n + row[i]);
    }
    d[static_cast<int64_t>(tok[i]) * p.n + row[i]] = from_float<T>(v);
  }
  if (threadIdx.x == 0) *counter = 0;  // left zeroed for the next call
}

// One 32-bit word of the shuffled layout per thread (gemm/w4a16.h): word `wi` is lane wi % 32 of
// atom wi / 32 = (K slice) * N / 16 + (row block).
__global__ void prepack_kernel(const uint8_t* __restrict__ in, uint32_t* __restrict__ out, int n,
                               int k) {
  const int64_t words = static_cast<int64_t>(n) * k / 8;
  const int row_blocks = n / 16;
  const int64_t half_k = k / 2;
  for (int64_t wi = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; wi < words;
       wi += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int lane = static_cast<int>(wi & 31);
    const int64_t atom = wi >> 5;
    const int64_t nb = atom % row_blocks, kb = atom / row_blocks;
    const int64_t n_lo = nb * 16 + (lane >> 2), n_hi = n_lo + 8;
    const int64_t col = kb * 8 + (lane & 3);  // byte of k = 16 kb + 2 t (and 2 t + 1)
    const uint32_t b0 = in[n_lo * half_k + col], b1 = in[n_hi * half_k + col];
    const uint32_t b2 = in[n_lo * half_k + col + 4], b3 = in[n_hi * half_k + col + 4];
    // nibble v = (row half) + 2 (k half) + 4 (k parity)
    out[wi] = (b0 & 0xF) | (b1 & 0xF) << 4 | (b2 & 0xF) << 8 | (b3 & 0xF) << 12 | (b0 >> 4) << 16 |
              (b1 >> 4) << 20 | (b2 >> 4) << 24 | (b3 >> 4) << 28;
  }
}

struct Plan {
  int row_tiles, tok_blocks, k_splits;
};

constexpr int kMaxSplitCounters = 4096;

Plan plan(const Problem& p, int sm_count) {
  Plan pl{};
  pl.row_tiles = (p.n / 16 + kRowBlocks - 1) / kRowBlocks;
  pl.tok_blocks = (p.m + kMaxTokens - 1) / kMaxTokens;
  const int groups = p.k / p.group_size;
  const int64_t base = static_cast<int64_t>(pl.row_tiles) * pl.tok_blocks;
  // Two resident CTAs per SM: as many splits as fit in one wave (a second, partial wave of CTAs
  // would double the time of the SMs that run it); each warp keeps at least one group.
  const int64_t target = 2LL * std::max(sm_count, 1);
  const int64_t want = std::max<int64_t>(1, target / base);
  const int64_t most = std::max(1, groups / kWarps);
  pl.k_splits = static_cast<int>(std::max<int64_t>(1, std::min(want, most)));
  if (base > kMaxSplitCounters) pl.k_splits = 1;
  return pl;
}

template <typename T, int kTok, int kKb>
cudaError_t launch_typed(const Params& kp, dim3 grid, bool zeros, cudaStream_t stream, bool pdl) {
  if (zeros)
    return launch_kernel(gemv_kernel<T, kTok, kKb, true>, grid, dim3(kThreads), stream, pdl, kp);
  return launch_kernel(gemv_kernel<T, kTok, kKb, false>, grid, dim3(kThreads), stream, pdl, kp);
}

template <typename T>
cudaError_t launch_dtype(const Params& kp, dim3 grid, int group_size, bool zeros,
                         cudaStream_t stream, bool pdl) {
  const bool one_tile = kp.m <= 8;
  if (group_size == 64) {
    return one_tile ? launch_typed<T, 1, 4>(kp, grid, zeros, stream, pdl)
                    : launch_typed<T, 2, 4>(kp, grid, zeros, stream, pdl);
  }
  return one_tile ? launch_typed<T, 1, 8>(kp, grid, zeros, stream, pdl)
                  : launch_typed<T, 2, 8>(kp, grid, zeros, stream, pdl);
}

bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

int gemv_num_counters(const Problem& p, int sm_count) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || (p.group_size != 64 && p.group_size != 128)) return 0;
  const Plan pl = plan(p, sm_count);
  return pl.k_splits > 1 ? pl.row_tiles * pl.tok_blocks : 0;
}

cudaError_t gemv(const Problem& p, const LaunchOptions& options, int sm_count, cudaStream_t stream,
                 size_t* workspace_bytes) {
  if (p.m < 0 || p.n <= 0 || p.k <= 0 || p.n % 16 != 0 ||
      (p.group_size != 64 && p.group_size != 128) || p.k % p.group_size != 0 || p.lda % 2 != 0 ||
      !aligned(p.a, 4) || !aligned(p.d, 4) || !aligned(p.w, 4)) {
    return cudaErrorInvalidValue;
  }
  const Plan pl = plan(p, sm_count);
  const size_t need =
      pl.k_splits > 1 ? static_cast<size_t>(pl.k_splits) * p.m * p.n * sizeof(float) : 0;
  if (workspace_bytes != nullptr) {
    *workspace_bytes = need;
    return cudaSuccess;
  }
  if (p.m == 0) return cudaSuccess;
  if (pl.k_splits > 1 && (p.workspace_bytes < need || p.workspace == nullptr ||
                          p.counters == nullptr || p.num_counters < pl.row_tiles * pl.tok_blocks)) {
    return cudaErrorInvalidValue;
  }
  if (pl.tok_blocks > 65535) return cudaErrorInvalidValue;
  Params kp{};
  kp.a = p.a;
  kp.lda = p.lda;
  kp.w = reinterpret_cast<const uint32_t*>(p.w);
  kp.scales = p.scales;
  kp.zeros = p.zeros;
  kp.d = p.d;
  kp.partial = static_cast<float*>(p.workspace);
  kp.counters = p.counters;
  kp.m = p.m;
  kp.n = p.n;
  kp.k = p.k;
  kp.row_blocks = p.n / 16;
  kp.groups = p.k / p.group_size;
  kp.k_splits = pl.k_splits;
  const dim3 grid(pl.row_tiles, pl.k_splits, pl.tok_blocks);
  const bool zeros = p.zeros != nullptr;
  return p.dtype == Dtype::kFloat16
             ? launch_dtype<__half>(kp, grid, p.group_size, zeros, stream, options.pdl)
             : launch_dtype<__nv_bfloat16>(kp, grid, p.group_size, zeros, stream, options.pdl);
}

cudaError_t prepack(const uint8_t* in, uint8_t* out, int n, int k, cudaStream_t stream) {
  if (n <= 0 || k <= 0 || n % 16 != 0 || k % 16 != 0 || !aligned(out, 4))
    return cudaErrorInvalidValue;
  const int64_t words = static_cast<int64_t>(n) * k / 8;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((words + threads - 1) / threads, 65535LL * 16);
  prepack_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      in, reinterpret_cast<uint32_t*>(out), n, k);
  return cudaGetLastError();
}

}  // namespace w4a16
}  // namespace qops
