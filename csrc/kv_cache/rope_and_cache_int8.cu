// RoPE + paged int8 cache write in one launch (rope_and_cache_int8.h). A group of LPR lanes (the
// power of two >= D / 16) takes one (token, head) row: a q head (rotated in place), or a kv head
// (k rotated in place, then k and v quantized into the cache). The q rows come first, then the kv
// rows, so that nearly every warp does one kind of work; CTAs loop over row groups (grid-stride).
// Lane l holds 8 elements of each half of the row, [8 l, 8 l + 8) and [D/2 + 8 l, D/2 + 8 l + 8),
// so a rotate-half pair is in one lane (and an interleaved pair (2i, 2i + 1) too). The rotation is
// the reference's arithmetic (each product and the sum rounded separately, no FMA, then one
// rounding to T), and the cache gets the rounded rotated k, so the op is bit-exact with
// rotary_embedding followed by reshape_and_cache_int8. Every lane runs the shuffles of the row
// amax (q rows too, unused), so no shuffle sits in a divergent branch.
#include "kv_cache/rope_and_cache_int8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>

#include "common/convert.cuh"         // to_float, from_float
#include "common/launch.cuh"          // launch_kernel, pdl_wait, pdl_launch_dependents
#include "common/quant.cuh"           // absmax_to_scale, RowQuant, quant_pack4
#include "quant/fused_row_quant.cuh"  // fq::device_info

namespace qops {
namespace kv_cache {
namespace {

constexpr int kThreads = 256;
constexpr int kHalf = 8;  // elements per lane per half of the row

template <typename T, bool kAligned>
__device__ __forceinline__ void load8(const T* p, float (&x)[kHalf]) {
  if constexpr (kAligned) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < kHalf; ++i) x[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) x[i] = to_float(p[i]);
  }
}
// 8 elements as loaded (one 16-byte vector), converted later
template <typename T>
struct Raw8 {
  T e[kHalf];
};
template <typename T, bool kAligned>
__device__ __forceinline__ void load_raw(const T* p, Raw8<T>& r) {
  if constexpr (kAligned) {
    *reinterpret_cast<uint4*>(r.e) = *reinterpret_cast<const uint4*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) r.e[i] = p[i];
  }
}
template <typename T>
__device__ __forceinline__ void raw_to_float(const Raw8<T>& r, float (&x)[kHalf]) {
#pragma unroll
  for (int i = 0; i < kHalf; ++i) x[i] = to_float(r.e[i]);
}

template <typename T, bool kAligned>
__device__ __forceinline__ void store8(T* p, const float (&x)[kHalf]) {
  if constexpr (kAligned) {
    uint4 u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int i = 0; i < kHalf; ++i) e[i] = from_float<T>(x[i]);
    *reinterpret_cast<uint4*>(p) = u;
  } else {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) p[i] = from_float<T>(x[i]);
  }
}

// N consecutive table entries (f32): float4 loads on the aligned path (the table's rows are
// 16-byte aligned there, and every offset used is a multiple of 4 floats), else scalar loads.
template <bool kAligned, int N>
__device__ __forceinline__ void load_table(const float* p, float (&x)[N]) {
  if constexpr (kAligned) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p + i));
      x[i] = v.x;
      x[i + 1] = v.y;
      x[i + 2] = v.z;
      x[i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = __ldg(p + i);
  }
}

// a * c + b * s with each product and the sum rounded separately (the reference's float32 steps)
__device__ __forceinline__ float rot(float a, float c, float b, float s) {
  return __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}

template <int LPR>
__device__ __forceinline__ float group_amax(const float (&lo)[kHalf], const float (&hi)[kHalf]) {
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) a = fmaxf(a, fmaxf(fabsf(lo[i]), fabsf(hi[i])));  // NaN ignored
#pragma unroll
  for (int o = LPR / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

template <bool kStatic>
__device__ __forceinline__ uint2 quant8(const float (&x)[kHalf], const RowQuant& qz) {
  if (qz.fast) {
    return make_uint2(quant_pack4<true, kStatic>(x, qz), quant_pack4<true, kStatic>(x + 4, qz));
  }
  return make_uint2(quant_pack4<false, true>(x, qz), quant_pack4<false, true>(x + 4, qz));
}

// One (token, head) row for the LPR lanes of this group: rows [0, T * q_heads) are the q rows
// (token-major), then the kv rows, so that a warp's rows are all q rows (rotation only) or all kv
// rows (rotation, v and the cache write), except at the one boundary. Every lane of the warp calls
// this for the same iteration (rows past the end included), so the shuffles below are convergent.
template <typename T, int LPR, bool kAligned, bool kStatic>
__device__ __forceinline__ void rope_cache_row(const RopeCacheInt8Params& p, int64_t row,
                                               int lane) {
  const int64_t q_rows = static_cast<int64_t>(p.num_tokens) * p.q_heads;
  const int64_t rows = q_rows + static_cast<int64_t>(p.num_tokens) * p.kv_heads;
  const int h2 = p.head_dim / 2;
  const int col = lane * kHalf;
  const bool in_row = row < rows && col < h2;
  const bool is_q = row < q_rows;
  int64_t t = 0;
  int hk = 0;
  T* x = nullptr;
  if (is_q) {
    t = row / p.q_heads;
    const int h = static_cast<int>(row - t * p.q_heads);
    x = static_cast<T*>(p.q) + t * p.q_ts + h * p.q_hs;
  } else if (row < rows) {
    const int64_t r = row - q_rows;
    t = r / p.kv_heads;
    hk = static_cast<int>(r - t * p.kv_heads);
    x = static_cast<T*>(p.k) + t * p.k_ts + static_cast<int64_t>(hk) * p.k_hs;
  }
  float lo[kHalf], hi[kHalf], vlo[kHalf], vhi[kHalf];
#pragma unroll
  for (int i = 0; i < kHalf; ++i) lo[i] = hi[i] = vlo[i] = vhi[i] = 0.f;
  Raw8<T> vraw[2] = {};
  int64_t slot = -1;
  if (in_row) {
    // every load that does not depend on the position first (the row's q or k halves, the v
    // halves, the position), then the tables at the position: two memory round trips, not three
    const int64_t pos = __ldg(p.positions + t);
    if (!is_q) slot = __ldg(p.slot_mapping + t);
    load8<T, kAligned>(x + col, lo);
    load8<T, kAligned>(x + col + h2, hi);
    if (!is_q) {  // kept as loaded (T) until the rotation is done: fewer live registers
      const T* vp = static_cast<const T*>(p.v) + t * p.v_ts + static_cast<int64_t>(hk) * p.v_hs;
      load_raw<T, kAligned>(vp + col, vraw[0]);
      load_raw<T, kAligned>(vp + col + h2, vraw[1]);
    }
    if (pos < 0 || pos >= p.max_pos) {
#pragma unroll
      for (int i = 0; i < kHalf; ++i) lo[i] = hi[i] = NAN;
    } else {
      const float* cr = p.cos + pos * p.head_dim;
      const float* sr = p.sin + pos * p.head_dim;
      if (p.neox) {
        float c[kHalf], sn[kHalf], nh[kHalf];  // one half's tables at a time
        load_table<kAligned, kHalf>(cr + col + h2, c);
        load_table<kAligned, kHalf>(sr + col + h2, sn);
#pragma unroll
        for (int i = 0; i < kHalf; ++i) nh[i] = rot(hi[i], c[i], lo[i], sn[i]);
        load_table<kAligned, kHalf>(cr + col, c);
        load_table<kAligned, kHalf>(sr + col, sn);
#pragma unroll
        for (int i = 0; i < kHalf; ++i) {
          lo[i] = rot(lo[i], c[i], -hi[i], sn[i]);
          hi[i] = nh[i];
        }
      } else {  // pairs (2j, 2j + 1) at angle j = element / 2, in each half's 8 elements
        float cl[kHalf / 2], sl[kHalf / 2], ch[kHalf / 2], sh[kHalf / 2];
        load_table<kAligned, kHalf / 2>(cr + col / 2, cl);
        load_table<kAligned, kHalf / 2>(sr + col / 2, sl);
        load_table<kAligned, kHalf / 2>(cr + (col + h2) / 2, ch);
        load_table<kAligned, kHalf / 2>(sr + (col + h2) / 2, sh);
#pragma unroll
        for (int i = 0; i < kHalf; i += 2) {
          const float a0 = lo[i], a1 = lo[i + 1], b0 = hi[i], b1 = hi[i + 1];
          lo[i] = rot(a0, cl[i / 2], -a1, sl[i / 2]);
          lo[i + 1] = rot(a1, cl[i / 2], a0, sl[i / 2]);
          hi[i] = rot(b0, ch[i / 2], -b1, sh[i / 2]);
          hi[i + 1] = rot(b1, ch[i / 2], b0, sh[i / 2]);
        }
      }
      // what the cache quantizes is the rotated k as stored (rounded to T)
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        lo[i] = to_float(from_float<T>(lo[i]));
        hi[i] = to_float(from_float<T>(hi[i]));
      }
    }
    store8<T, kAligned>(x + col, lo);
    store8<T, kAligned>(x + col + h2, hi);
    if (!is_q) {
      raw_to_float(vraw[0], vlo);
      raw_to_float(vraw[1], vhi);
    }
  }
  // k and v rows of this group (zeros elsewhere): every lane shuffles
  float sk, sv;
  if constexpr (kStatic) {
    sk = *p.k_scales;
    sv = *p.v_scales;
  } else {
    sk = absmax_to_scale(group_amax<LPR>(lo, hi));
    sv = absmax_to_scale(group_amax<LPR>(vlo, vhi));
  }
  if (!in_row || is_q) return;
  const int64_t capacity = static_cast<int64_t>(p.num_blocks) * p.block_size;
#if !defined(NDEBUG) || defined(QOPS_DEBUG)
  if (lane == 0 && hk == 0 && (slot < -1 || slot >= capacity)) {
    printf("qops.rope_and_cache_int8: slot_mapping[%lld] = %lld is outside [-1, %lld)\n",
           static_cast<long long>(t), static_cast<long long>(slot),
           static_cast<long long>(capacity));
    __trap();
  }
#endif
  if (slot < 0 || slot >= capacity) return;  // padding; never write out of bounds
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  const int64_t sidx = (blk * p.kv_heads + hk) * p.block_size + off;
  int8_t* kc = p.k_cache + sidx * p.head_dim;
  int8_t* vc = p.v_cache + sidx * p.head_dim;
  const RowQuant qk(sk), qv(sv);
  *reinterpret_cast<uint2*>(kc + col) = quant8<kStatic>(lo, qk);
  *reinterpret_cast<uint2*>(kc + col + h2) = quant8<kStatic>(hi, qk);
  *reinterpret_cast<uint2*>(vc + col) = quant8<kStatic>(vlo, qv);
  *reinterpret_cast<uint2*>(vc + col + h2) = quant8<kStatic>(vhi, qv);
  if constexpr (!kStatic) {
    if (lane == 0) {
      p.k_scales[sidx] = sk;
      p.v_scales[sidx] = sv;
    }
  }
}

// A grid-stride loop over groups of kThreads / LPR rows (a CTA-uniform trip count): at most a few
// waves of CTAs, each over many rows (one row per CTA lifetime measured 2x slower at 16K tokens).
template <typename T, int LPR, bool kAligned, bool kStatic>
__global__ void __launch_bounds__(kThreads, 4) rope_cache_kernel(const RopeCacheInt8Params p) {
  pdl_wait();  // the previous kernel (the qkv GEMM) writes q, k, v; positions and slots are inputs
  pdl_launch_dependents();
  constexpr int kRowsPerCta = kThreads / LPR;
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * (p.q_heads + p.kv_heads);
  const int lane = threadIdx.x % LPR;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kRowsPerCta; base < rows;
       base += static_cast<int64_t>(gridDim.x) * kRowsPerCta) {
    rope_cache_row<T, LPR, kAligned, kStatic>(p, base + threadIdx.x / LPR, lane);
  }
}

template <typename T, int LPR>
cudaError_t launch(const RopeCacheInt8Params& p, bool aligned, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * (p.q_heads + p.kv_heads);
  const int64_t per_block = kThreads / LPR;
  const int64_t cap = static_cast<int64_t>(fq::device_info().sms) * 8;  // two waves at 4 per SM
  const int64_t needed = (rows + per_block - 1) / per_block;
  const int64_t blocks = needed < cap ? needed : cap;
  auto kernel = aligned ? (p.static_scales ? rope_cache_kernel<T, LPR, true, true>
                                           : rope_cache_kernel<T, LPR, true, false>)
                        : (p.static_scales ? rope_cache_kernel<T, LPR, false, true>
                                           : rope_cache_kernel<T, LPR, false, false>);
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream,
                       !p.no_pdl, p);
}

template <typename T>
cudaError_t dispatch(const RopeCacheInt8Params& p, bool aligned, cudaStream_t stream) {
  const int lanes = p.head_dim / (2 * kHalf);
  if (lanes <= 1) return launch<T, 1>(p, aligned, stream);
  if (lanes <= 2) return launch<T, 2>(p, aligned, stream);
  if (lanes <= 4) return launch<T, 4>(p, aligned, stream);
  if (lanes <= 8) return launch<T, 8>(p, aligned, stream);
  return launch<T, 16>(p, aligned, stream);
}

bool aligned16(const void* ptr, int64_t stride_t, int64_t stride_h) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && stride_t % 8 == 0 && stride_h % 8 == 0;
}

}  // namespace

cudaError_t rope_and_cache_int8(const RopeCacheInt8Params& p, cudaStream_t stream) {
  if (p.head_dim <= 0 || p.head_dim % 16 != 0 || p.head_dim > 256 || p.q_heads < 0 ||
      p.kv_heads <= 0 || p.block_size <= 0 || p.num_blocks <= 0 || p.num_tokens < 0 ||
      p.max_pos <= 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0) return cudaSuccess;
  // 16-byte vectors: 8-element halves at 8-element offsets (D / 2 is a multiple of 8), and the
  // cos / sin rows (D floats each, so 16-byte aligned when the tables' starts are)
  const bool aligned = aligned16(p.q, p.q_ts, p.q_hs) && aligned16(p.k, p.k_ts, p.k_hs) &&
                       aligned16(p.v, p.v_ts, p.v_hs) &&
                       reinterpret_cast<uintptr_t>(p.cos) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.sin) % 16 == 0;
  return p.bf16 ? dispatch<__nv_bfloat16>(p, aligned, stream)
                : dispatch<__half>(p, aligned, stream);
}

}  // namespace kv_cache
}  // namespace qops
