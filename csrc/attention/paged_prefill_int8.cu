// Prefill / chunked-prefill attention over the paged int8 KV cache (paged_prefill_int8.h): the
// FlashAttention-2 loop on mma.sync, with the int8 K and V converted to fp16 in registers (no
// dequantized copy of the cache).
//
// A CTA takes 64 queries (4 warps x 16 rows) of one sequence and one query head, and walks that
// head's kv head's keys in tiles of 64, copied (cp.async, two stages) from the cache pages into
// shared memory as they are: K [64][D] int8, V [64][D] int8 and their 64 + 64 scales. Per tile a
// warp computes S = Q K^T (fp16 MMAs, f32 accumulation) on the raw int8 K (exact in fp16), scales
// the columns by the keys' K scales, masks (causal, past the context), and updates the online
// softmax; P' = P * v_scale * 2^p_exp (fp16) then multiplies the raw int8 V: the V scales ride in
// P', and 2^p_exp (from the largest V scale so far, non-increasing) keeps P' in fp16 range, with
// O kept in units of 2^-p_exp. bf16 queries are scaled by a power of two per row into fp16's range
// (exact), undone in the score scale.
//
// Head-dim permutations (both exact reorderings of the sums): k-step kc of S covers
// d = 16 kc + 4 t4 + {0, 1 (register 0) | 2, 3 (register 1)}, so a thread's Q and K fragment
// values are 4 consecutive channels (one 32-bit K word); output n-tile 4 q + r holds
// d = 32 q + 4 n + r, so a thread's V fragment values for 4 n-tiles are one 32-bit word per key and
// its output row values are 8 consecutive channels.
#include "attention/paged_prefill_int8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <type_traits>

#include "common/convert.cuh"   // to_float, from_float
#include "common/cp_async.cuh"  // cp_async16, cp_async_commit, cp_async_wait, smem_addr
#include "common/launch.cuh"    // launch_kernel_smem, pdl_wait, pdl_launch_dependents
#include "common/math.cuh"      // fast_exp2
#include "common/mma.cuh"       // mma_f16, i8x4_to_f16x2x2, i8pair_to_f16x2, pack_f16x2

namespace qops {
namespace attention {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBM = 16 * kWarps;  // queries per CTA
constexpr int kBN = 64;           // keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// One stage of shared memory: K [kBN][D], V [kBN][D] (int8), then kBN K scales and kBN V scales.
// The 16-byte chunk c of row r sits at chunk c ^ swz(r): the K fragment reads are free of bank
// conflicts, the V reads 2-way at most (D = 64).
template <int D>
struct Tile {
  static constexpr int kCpr = D / 16;  // 16-byte chunks per row
  static constexpr int kKV = kBN * D;  // bytes of K (or of V) per stage
  static constexpr int kBytes = 2 * kKV + 2 * kBN * 4;
  __device__ static int off(int r, int c) {
    const int swz = D == 128 ? (r & 7) : ((r >> 1) & 3);
    return r * D + ((c ^ swz) & (kCpr - 1)) * 16;
  }
};

template <typename T, int D, bool kStatic>
__global__ void __launch_bounds__(kThreads)
    paged_prefill_int8_kernel(const PagedPrefillInt8Params p) {
  constexpr int KC = D / 16;   // k-steps of S = Q K^T
  constexpr int NQ = D / 32;   // output channel groups of 4 n-tiles
  constexpr int NT = D / 8;    // output n-tiles
  constexpr int NS = kBN / 8;  // S n-tiles per key tile
  using TL = Tile<D>;
  extern __shared__ __align__(16) unsigned char smem[];

  pdl_wait();  // the previous kernel (the cache write) wrote the queries' own keys and values
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const int kvh = h / (p.num_q_heads / p.num_kv_heads);
  const int q_begin = p.cu_seqlens_q[b];
  const int n_q = p.cu_seqlens_q[b + 1] - q_begin;
  // Query tiles m0 = blockIdx.x, + gridDim.x, ... from the end (the tiles with the most keys
  // first): max_query_len only sizes the grid, a smaller one costs time, not rows.
  for (int m0 = (gridDim.x - 1 - blockIdx.x) * kBM; m0 < n_q; m0 += gridDim.x * kBM) {
    const int bs = p.block_size;
    const int bs_shift = __ffs(bs) - 1;
    const int L = max(0, min(p.seq_lens[b], p.max_blocks * bs));
    const int ctx0 = L - n_q;                          // the position of query 0
    const int kend = max(0, min(L, ctx0 + m0 + kBM));  // the keys this CTA reads: [0, kend)
    const int n_tiles = (kend + kBN - 1) / kBN;
    const int32_t* bt_row = p.block_tables + static_cast<int64_t>(b) * p.bt_stride;
    const unsigned smem_base = smem_addr(smem);

    // The cache row (in units of rows of D bytes, or of scales) of position pos < L.
    auto cache_row = [&](int pos) {
      int blk = __ldg(bt_row + (pos >> bs_shift));
#if !defined(NDEBUG) || defined(QOPS_DEBUG)
      if (blk < 0 || blk >= p.num_blocks) {
        printf("qops.paged_prefill_attention_int8: block_tables[%d][%d] = %d is outside [0, %d)\n",
               b, pos >> bs_shift, blk, p.num_blocks);
        __trap();
      }
#endif
      if (blk < 0 || blk >= p.num_blocks) blk = 0;  // never read out of bounds
      return (static_cast<int64_t>(blk) * p.num_kv_heads + kvh) * bs + (pos & (bs - 1));
    };
    // Copies key tile `tile` into stage st: the rows below L (the rest of the stage is stale and
    // masked).
    auto issue = [&](int tile, int st) {
      const unsigned s0 = smem_base + st * TL::kBytes;
      const int k0 = tile * kBN;
#pragma unroll
      for (int i = 0; i < kBN * TL::kCpr / kThreads; ++i) {
        const int id = threadIdx.x + i * kThreads;
        const int r = id / TL::kCpr, c = id % TL::kCpr;
        if (k0 + r < L) {
          const int64_t row = cache_row(k0 + r);
          const unsigned so = s0 + TL::off(r, c);
          cp_async16(so, p.k_cache + row * D + c * 16);
          cp_async16(so + TL::kKV, p.v_cache + row * D + c * 16);
        }
      }
      if constexpr (!kStatic) {
        // 4 scales per copy (4 consecutive positions share a page: block_size is a multiple of 16)
        if (threadIdx.x < kBN / 2) {
          const int which = threadIdx.x / (kBN / 4);  // 0: K scales, 1: V scales
          const int r = 4 * (threadIdx.x % (kBN / 4));
          if (k0 + r < L) {
            const float* src = (which == 0 ? p.k_scales : p.v_scales) + cache_row(k0 + r);
            cp_async16(s0 + 2 * TL::kKV + (which * kBN + r) * 4, src);
          }
        }
      }
    };

    if (n_tiles > 0) issue(0, 0);
    cp_async_commit();

    // ---- the queries: rows r0 (gid) and r0 + 8 of this warp, as A fragments (see the top)
    const int r0 = m0 + warp * 16 + gid;
    bool q_ok[2];
    int q_pos[2];
    float rs[2], slope[2];
    uint32_t qa[KC][4];
    {
      float qf[2][KC][4];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = r0 + 8 * e;
        q_ok[e] = r < n_q;
        q_pos[e] = ctx0 + r;
        const T* qp = static_cast<const T*>(p.query) +
                      static_cast<int64_t>(q_begin + (q_ok[e] ? r : 0)) * p.q_stride_t +
                      static_cast<int64_t>(h) * p.q_stride_h;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          uint2 u = make_uint2(0, 0);
          if (q_ok[e]) u = *reinterpret_cast<const uint2*>(qp + 16 * kc + 4 * t4);
          const T* x = reinterpret_cast<const T*>(&u);
#pragma unroll
          for (int i = 0; i < 4; ++i) qf[e][kc][i] = to_float(x[i]);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float scale = 1.f, inv = 1.f;
        if constexpr (std::is_same<T, __nv_bfloat16>::value) {
          // a power of two that brings max|q| of the row into [2^14, 2^15): exact in fp16
          float mx = 0.f;
#pragma unroll
          for (int kc = 0; kc < KC; ++kc)
#pragma unroll
            for (int i = 0; i < 4; ++i) mx = fmaxf(mx, fabsf(qf[e][kc][i]));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
          if (mx > 0.f && mx < INFINITY) {
            int ex;
            frexpf(mx, &ex);
            const int sh = max(-126, min(127, 15 - ex));
            scale = ldexpf(1.f, sh);
            inv = ldexpf(1.f, -sh);
          }
        }
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          qa[kc][e] = pack_f16x2(qf[e][kc][0] * scale, qf[e][kc][1] * scale);
          qa[kc][2 + e] = pack_f16x2(qf[e][kc][2] * scale, qf[e][kc][3] * scale);
        }
        const float k_static = kStatic ? __ldg(p.k_scales) : 1.f;
        rs[e] = p.sm_scale * kLog2e * inv * k_static;
        slope[e] = p.alibi_slopes != nullptr ? __ldg(p.alibi_slopes + h) * kLog2e : 0.f;
      }
    }

    // ---- the online softmax: per row e, m_run (the max so far, -inf before any valid key), m_ref
    // (m_run, or 0 while it is -inf) and this thread's share of the row sum l_run.
    float m_run[2] = {-INFINITY, -INFINITY}, m_ref[2] = {0.f, 0.f}, l_run[2] = {0.f, 0.f};
    int v_bits = 0;                // the largest biased exponent of a valid V scale so far
    int p_exp = kStatic ? 0 : 63;  // O is kept in units of 2^-p_exp
    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    // the last position this warp's rows see (-1: the warp has no row, every tile is skipped)
    const int warp_last = m0 + warp * 16 < n_q ? ctx0 + m0 + warp * 16 + 15 : -1;

    for (int t = 0; t < n_tiles; ++t) {
      if (t + 1 < n_tiles) issue(t + 1, (t + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      const int k0 = t * kBN;
      if (k0 <= warp_last) {  // warp-uniform: a tile wholly past every row of this warp is skipped
        const unsigned char* st = smem + (t & 1) * TL::kBytes;
        const float* kss = reinterpret_cast<const float*>(st + 2 * TL::kKV);
        const float* vss = kss + kBN;
        // S = Q K^T for the tile's NS n-tiles of 8 keys
        float s[NS][4];
#pragma unroll
        for (int j = 0; j < NS; ++j) {
          s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
          for (int kc = 0; kc < KC; ++kc) {
            const uint32_t w =
                *reinterpret_cast<const uint32_t*>(st + TL::off(8 * j + gid, kc) + 4 * t4);
            uint32_t b0, b1;
            i8x4_to_f16x2x2(w, b0, b1);
            mma_f16(s[j], qa[kc], b0, b1);
          }
        }
        // scale, bias, mask; the tile's row maxima
        float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < NS; ++j) {
          const int kk = 8 * j + 2 * t4;
          float ks0 = 1.f, ks1 = 1.f;
          if constexpr (!kStatic) {
            const float2 f = *reinterpret_cast<const float2*>(kss + kk);
            ks0 = f.x;
            ks1 = f.y;
          }
#pragma unroll
          for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int key = k0 + kk + c;
              const bool ok = q_ok[e] && key < L && key <= q_pos[e];
              const float v = s[j][2 * e + c] * (c ? ks1 : ks0) * rs[e] +
                              slope[e] * static_cast<float>(key - q_pos[e]);
              s[j][2 * e + c] = ok ? v : -INFINITY;
              tmax[e] = fmaxf(tmax[e], s[j][2 * e + c]);
            }
        }
        // the V scales' exponent: P' = P v_scale 2^p_exp < 2^15 needs p_exp <= 141 - v_bits
        float rescale = 1.f;
        if constexpr (!kStatic) {
          float vmx = 0.f;
          if (k0 + lane < L) vmx = vss[lane];
          if (k0 + lane + 32 < L) vmx = fmaxf(vmx, vss[lane + 32]);
#pragma unroll
          for (int o2 = 16; o2 > 0; o2 >>= 1) vmx = fmaxf(vmx, __shfl_xor_sync(kFull, vmx, o2));
          const int vb = __float_as_int(vmx) >> 23;  // warp-uniform
          if (vb > v_bits) {
            v_bits = vb;
            const int ex = min(63, max(-63, 141 - v_bits));
            rescale = __int_as_float((127 + ex - p_exp) << 23);
            p_exp = ex;
          }
        }
        float alpha[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float mx = tmax[e];
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
          const float m_new = fmaxf(m_run[e], mx);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          alpha[e] = fast_exp2(m_run[e] - m_use);  // 0 from -inf; 1 when unchanged
          m_run[e] = m_new;
          m_ref[e] = m_use;
          l_run[e] *= alpha[e];
          alpha[e] *= rescale;
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          o[j][0] *= alpha[0];
          o[j][1] *= alpha[0];
          o[j][2] *= alpha[1];
          o[j][3] *= alpha[1];
        }
        const float pscale = __int_as_float((127 + p_exp) << 23);
        // P' as the A fragments of O += P' V, 16 keys (two S n-tiles) per k-step
#pragma unroll
        for (int ks = 0; ks < kBN / 16; ++ks) {
          uint32_t pa[4];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int j = 2 * ks + half;
            const int kk = 8 * j + 2 * t4;
            float vs0 = 1.f, vs1 = 1.f;
            if constexpr (!kStatic) {  // a key past the context: its scale may be garbage
              const float2 f = *reinterpret_cast<const float2*>(vss + kk);
              vs0 = k0 + kk < L ? f.x * pscale : 0.f;
              vs1 = k0 + kk + 1 < L ? f.y * pscale : 0.f;
            }
            float pv[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p0 = fast_exp2(s[j][2 * e] - m_ref[e]);  // -inf -> 0
              const float p1 = fast_exp2(s[j][2 * e + 1] - m_ref[e]);
              l_run[e] += p0 + p1;
              pv[2 * e] = p0 * vs0;
              pv[2 * e + 1] = p1 * vs1;
            }
            pa[2 * half] = pack_f16x2(pv[0], pv[1]);      // row gid
            pa[2 * half + 1] = pack_f16x2(pv[2], pv[3]);  // row gid + 8
          }
          // V: the words of keys 16 ks + {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9} at channels
          // 32 q + 4 gid + [0, 4)
          const unsigned char* sv = st + TL::kKV;
          const int kr = 16 * ks + 2 * t4;
#pragma unroll
          for (int q = 0; q < NQ; ++q) {
            const int ch = 2 * q + (gid >> 2), bo = 4 * (gid & 3);
            const uint32_t w0 = *reinterpret_cast<const uint32_t*>(sv + TL::off(kr, ch) + bo);
            const uint32_t w1 = *reinterpret_cast<const uint32_t*>(sv + TL::off(kr + 1, ch) + bo);
            const uint32_t w2 = *reinterpret_cast<const uint32_t*>(sv + TL::off(kr + 8, ch) + bo);
            const uint32_t w3 = *reinterpret_cast<const uint32_t*>(sv + TL::off(kr + 9, ch) + bo);
            mma_f16(o[4 * q + 0], pa, i8pair_to_f16x2<0>(w0, w1), i8pair_to_f16x2<0>(w2, w3));
            mma_f16(o[4 * q + 1], pa, i8pair_to_f16x2<1>(w0, w1), i8pair_to_f16x2<1>(w2, w3));
            mma_f16(o[4 * q + 2], pa, i8pair_to_f16x2<2>(w0, w1), i8pair_to_f16x2<2>(w2, w3));
            mma_f16(o[4 * q + 3], pa, i8pair_to_f16x2<3>(w0, w1), i8pair_to_f16x2<3>(w2, w3));
          }
        }
      }
      __syncthreads();  // every warp is done with stage t & 1 before tile t + 2 is copied into it
    }
    cp_async_wait<0>();

    // ---- O / l, in the query's dtype: row gid + 8 e, channels 32 q + 8 t4 + [0, 8)
    const float v_static = kStatic ? __ldg(p.v_scales) : 1.f;
    const float unit = __int_as_float((127 - p_exp) << 23) * v_static;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_run[e];
      l += __shfl_xor_sync(kFull, l, 1);
      l += __shfl_xor_sync(kFull, l, 2);
      if (!q_ok[e]) continue;
      const float f = l > 0.f ? unit / l : 0.f;
      T* op = static_cast<T*>(p.out) +
              (static_cast<int64_t>(q_begin + r0 + 8 * e) * p.num_q_heads + h) * D;
#pragma unroll
      for (int q = 0; q < NQ; ++q) {
        uint4 u;
        T* x = reinterpret_cast<T*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          x[i] = from_float<T>(o[4 * q + i][2 * e] * f);
          x[4 + i] = from_float<T>(o[4 * q + i][2 * e + 1] * f);
        }
        *reinterpret_cast<uint4*>(op + 32 * q + 8 * t4) = u;
      }
    }
  }  // query tiles
  pdl_launch_dependents();
}

template <typename T, int D, bool kStatic>
cudaError_t launch(const PagedPrefillInt8Params& p, cudaStream_t stream) {
  const dim3 grid(std::max(1, (p.max_query_len + kBM - 1) / kBM), p.num_q_heads, p.batch);
  return launch_kernel_smem(paged_prefill_int8_kernel<T, D, kStatic>, grid, dim3(kThreads),
                            2 * Tile<D>::kBytes, stream, !p.no_pdl, p);
}

template <typename T>
cudaError_t dispatch(const PagedPrefillInt8Params& p, cudaStream_t stream) {
  if (p.head_dim == 64) {
    return p.static_scales ? launch<T, 64, true>(p, stream) : launch<T, 64, false>(p, stream);
  }
  return p.static_scales ? launch<T, 128, true>(p, stream) : launch<T, 128, false>(p, stream);
}

}  // namespace

cudaError_t paged_prefill_attention_int8(const PagedPrefillInt8Params& p, cudaStream_t stream) {
  if ((p.head_dim != 64 && p.head_dim != 128) || p.num_kv_heads <= 0 || p.num_q_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.block_size < 16 ||
      (p.block_size & (p.block_size - 1)) != 0 || p.batch < 0 || p.batch > 65535 ||
      p.num_q_heads > 65535 || p.max_query_len < 0 || p.num_blocks <= 0 || p.max_blocks <= 0) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  return p.bf16 ? dispatch<__nv_bfloat16>(p, stream) : dispatch<__half>(p, stream);
}

}  // namespace attention
}  // namespace qops
