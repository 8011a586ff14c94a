// Paged int4 KV cache writes; see cache_int4.h. Bit-identical to the CPU reference
// (python/qops/int4_kv.py): float32 min/max, IEEE divisions, round-half-even.
//
// One worker of D / 4 lanes per (token, kv head), 4 channels per lane; it quantizes K, then V.
// A row's scale/shift pairs are stored by the first lane of each group, the packed nibbles as one
// 16-bit store per lane. SKVQ: a new window token's worker first moves the old occupant of its
// ring entry into the int4 cache if that token leaves the window, then stores the new one; no
// other worker touches that entry, and each lane reads and writes only its own 4 channels of it,
// so program order puts the read before the overwrite.
#include "kv_cache/cache_int4.h"

#include "common/convert.cuh"  // to_float
#include "common/launch.cuh"   // pdl_wait, pdl_launch_dependents, launch_kernel

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>

namespace qops {
namespace kv_cache {
namespace {

constexpr int kThreads = 128;
constexpr float kFp16Max = 65504.f;

// Quantizes 4 channels (x) of a row whose worker has LANES lanes (this lane: r) in groups of
// GL lanes, and stores them into `row` (4 * G header bytes, then D / 2 data bytes).
template <int LANES, int GL>
__device__ __forceinline__ void quantize_store(const float (&x)[4], uint8_t* row, int r, int G,
                                               float clip) {
  float xc[4];
  float lo = INFINITY, hi = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    xc[i] = isnan(x[i]) ? x[i] : fminf(fmaxf(x[i], -kFp16Max), kFp16Max);
    if (!isnan(xc[i])) {
      lo = fminf(lo, xc[i]);
      hi = fmaxf(hi, xc[i]);
    }
  }
#pragma unroll
  for (int o = 1; o < GL; o <<= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o, LANES));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o, LANES));
  }
  if (isinf(lo)) lo = hi = 0.f;  // every value NaN
  if (clip != 1.f) {
    lo *= clip;
    hi *= clip;
  }
  const __half shift_h = __float2half_rn(lo);
  const __half scale_h = __float2half_rn(__fdiv_rn(hi - lo, 15.f));
  const float s = __half2float(scale_h), b = __half2float(shift_h);
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float v = rintf(__fdiv_rn(xc[i] - b, s));
    q[i] = (s == 0.f || isnan(v)) ? 0u : static_cast<uint32_t>(fminf(fmaxf(v, 0.f), 15.f));
  }
  const uint16_t packed = static_cast<uint16_t>(q[0] | (q[1] << 4) | (q[2] << 8) | (q[3] << 12));
  *reinterpret_cast<uint16_t*>(row + 4 * G + 2 * r) = packed;
  if (r % GL == 0) {
    const uint32_t hdr = static_cast<uint32_t>(__half_as_ushort(scale_h)) |
                         (static_cast<uint32_t>(__half_as_ushort(shift_h)) << 16);
    *reinterpret_cast<uint32_t*>(row + 4 * (r / GL)) = hdr;
  }
}

template <typename T>
__device__ __forceinline__ void load4(const T* src, float (&x)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = to_float(src[i]);
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads) cache_int4_kernel(const CacheInt4Params p) {
  pdl_wait();  // the previous kernel may write the keys, values, slots, tables
  pdl_launch_dependents();
  constexpr int LANES = D / 4;       // a worker's lanes
  constexpr int GL = LANES / G;      // lanes per group
  constexpr int RB = 4 * G + D / 2;  // row bytes
  const int r = threadIdx.x % LANES;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / LANES;
  if (item >= static_cast<int64_t>(p.num_tokens) * p.num_heads) return;  // (worker-uniform)
  const int t = static_cast<int>(item / p.num_heads), h = static_cast<int>(item % p.num_heads);
  const int bs = p.block_size;
  const int64_t capacity = static_cast<int64_t>(p.num_blocks) * bs;
  auto row_at = [&](uint8_t* cache, int64_t slot) {
    return cache + ((slot / bs * p.num_heads + h) * bs + slot % bs) * RB;
  };
  const T* kx = static_cast<const T*>(p.key) + t * p.key_stride_t + h * p.key_stride_h + 4 * r;
  const T* vx =
      static_cast<const T*>(p.value) + t * p.value_stride_t + h * p.value_stride_h + 4 * r;
  float xk[4], xv[4];
  load4(kx, xk);
  load4(vx, xv);

  if (p.slot_mapping != nullptr) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) return;  // padding
    if (slot >= capacity) {
#if !defined(NDEBUG) || defined(QOPS_DEBUG)
      if (r == 0) {
        printf("qops.reshape_and_cache_int4: slot_mapping[%d] = %lld is past the cache (%lld)\n", t,
               static_cast<long long>(slot), static_cast<long long>(capacity));
        __trap();
      }
#endif
      return;
    }
    quantize_store<LANES, GL>(xk, row_at(p.k_cache, slot), r, G, p.clip_ratio);
    if (p.v_cache != nullptr) {  // (quantize_kv_int4: K only)
      quantize_store<LANES, GL>(xv, row_at(p.v_cache, slot), r, G, p.clip_ratio);
    }
    return;
  }

  // SKVQ: the token's sequence (the last b with cu_seqlens[b] <= t) and position
  int lo_b = 0, hi_b = p.batch;  // cu[lo_b] <= t < cu[hi_b]
  while (hi_b - lo_b > 1) {
    const int mid = (lo_b + hi_b) >> 1;
    if (p.cu_seqlens[mid] <= t)
      lo_b = mid;
    else
      hi_b = mid;
  }
  const int b = lo_b;
  const int n_new = p.cu_seqlens[b + 1] - p.cu_seqlens[b];
  const int l_new = p.seq_lens[b], l_old = l_new - n_new;
  const int pos = l_old + (t - p.cu_seqlens[b]);
  const int S = p.sinks, W = p.window;
  const int hi_new = max(min(S, l_new), l_new - W);
  const int hi_old = max(min(S, l_old), l_old - W);
  auto slot_of = [&](int position) -> int64_t {  // -1: a block id past the cache (skipped)
    const int blk = p.block_tables[b * p.bt_stride + position / bs];
    if (blk < 0 || blk >= p.num_blocks) {
#if !defined(NDEBUG) || defined(QOPS_DEBUG)
      if (r == 0) {
        printf("qops.skvq_cache_write: block_tables[%d][%d] = %d is outside [0, %d)\n", b,
               position / bs, blk, p.num_blocks);
        __trap();
      }
#endif
      return -1;
    }
    return static_cast<int64_t>(blk) * bs + position % bs;
  };
  const int64_t side_row =
      (static_cast<int64_t>(S + W) * (static_cast<int64_t>(p.side_slots[b]) * p.num_heads + h));
  auto side_at = [&](void* side, int position) {
    const int idx = position < S ? position : S + (position - S) % W;
    return static_cast<T*>(side) + (side_row + idx) * D + 4 * r;
  };
  // A window token's ring entry may hold a token of the old window that now leaves it: the last
  // old-window position congruent to pos (mod W). This worker moves it into the int4 cache before
  // overwriting the entry; new tokens that skip the ring (straight to int4) touch no entry, so no
  // other worker reads or writes this one.
  if (W > 0 && pos >= S && pos >= hi_new) {
    const int w0 = max(S, hi_old);                     // the old window: [w0, l_old)
    const int pe = pos - W * ((pos - l_old + W) / W);  // <= l_old - 1, > l_old - 1 - W
    if (pe >= w0 && pe < hi_new) {
      const int64_t slot = slot_of(pe);
      float ek[4], ev[4];
      load4(side_at(p.k_side, pe), ek);
      load4(side_at(p.v_side, pe), ev);
      if (slot >= 0) {
        quantize_store<LANES, GL>(ek, row_at(p.k_cache, slot), r, G, p.clip_ratio);
        quantize_store<LANES, GL>(ev, row_at(p.v_cache, slot), r, G, p.clip_ratio);
      }
    }
  }
  if (pos < S || pos >= hi_new) {  // a sink or a window token: full precision
    T* dk = side_at(p.k_side, pos);
    T* dv = side_at(p.v_side, pos);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dk[i] = kx[i];
      dv[i] = vx[i];
    }
    return;
  }
  const int64_t slot = slot_of(pos);
  if (slot < 0) return;
  quantize_store<LANES, GL>(xk, row_at(p.k_cache, slot), r, G, p.clip_ratio);
  quantize_store<LANES, GL>(xv, row_at(p.v_cache, slot), r, G, p.clip_ratio);
}

template <typename T, int D, int G>
cudaError_t launch(const CacheInt4Params& p, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(p.num_tokens) * p.num_heads * (D / 4);
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads));
  return launch_kernel(cache_int4_kernel<T, D, G>, grid, dim3(kThreads), stream, !p.no_pdl, p);
}

template <typename T>
cudaError_t dispatch(const CacheInt4Params& p, cudaStream_t stream) {
  if (p.head_dim == 128) {
    return p.num_groups == 4 ? launch<T, 128, 4>(p, stream) : launch<T, 128, 1>(p, stream);
  }
  return p.num_groups == 4 ? launch<T, 64, 4>(p, stream) : launch<T, 64, 1>(p, stream);
}

}  // namespace

cudaError_t cache_int4_write(const CacheInt4Params& p, cudaStream_t stream) {
  if ((p.head_dim != 64 && p.head_dim != 128) || (p.num_groups != 1 && p.num_groups != 4) ||
      p.num_tokens < 0 || p.num_heads <= 0 || p.block_size <= 0) {
    return cudaErrorInvalidValue;
  }
  if (p.slot_mapping == nullptr && (p.sinks < 0 || p.window < 0 || p.batch < 1)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0) return cudaSuccess;
  return p.bf16 ? dispatch<__nv_bfloat16>(p, stream) : dispatch<__half>(p, stream);
}

}  // namespace kv_cache
}  // namespace qops
