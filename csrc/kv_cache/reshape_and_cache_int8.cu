// Paged int8 KV cache write: quantize each new token's K and V per (token, head) -- or with a
// static per-tensor scale -- and store them in their slots. See reshape_and_cache_int8.h.
//
// One group of LPR lanes (LPR = the power of two >= head_dim / 16) handles one (token, head) row
// of K and the same row of V: each lane loads 16 consecutive elements of each (two 16-byte loads
// when the rows are 16-byte aligned, so 64 bytes per thread are in flight), the group reduces
// amax with shuffles, and each lane stores its 16 int8 values as one 16-byte store, so a row of D
// bytes is written by consecutive lanes with full 16-byte stores.
#include "kv_cache/reshape_and_cache_int8.h"

#include "common/convert.cuh"  // to_float
#include "common/launch.cuh"   // pdl_wait, pdl_launch_dependents, launch_kernel
#include "common/quant.cuh"    // absmax_to_scale, RowQuant, quant_pack4

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>

namespace qops {
namespace kv_cache {
namespace {

constexpr int kThreads = 256;

constexpr int kElems = 16;  // elements per lane

template <typename T, bool kAligned>
__device__ __forceinline__ void load16(const T* p, float (&x)[kElems]) {
  if constexpr (kAligned) {
    uint4 u[2];
    u[0] = __ldg(reinterpret_cast<const uint4*>(p));
    u[1] = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    const T* e = reinterpret_cast<const T*>(u);
#pragma unroll
    for (int i = 0; i < kElems; ++i) x[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kElems; ++i) x[i] = to_float(p[i]);
  }
}

// 16 int8 of the qops convention (x / s rounded and saturated), as one 16-byte word: without a
// division per element where the scale allows (RowQuant, common/quant.cuh; the same quotient).
// kInfCheck: an element may be +-Inf on the fast path (static scales; a dynamic scale's fast path
// has only finite elements).
template <bool kFast, bool kInfCheck>
__device__ __forceinline__ uint4 quant16(const float (&x)[kElems], const RowQuant& qz) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = quant_pack4<kFast, kInfCheck>(x + 4 * j, qz);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int LPR>
__device__ __forceinline__ float group_amax(const float (&x)[kElems]) {
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < kElems; ++i) a = fmaxf(a, fabsf(x[i]));  // fmaxf ignores NaN
#pragma unroll
  for (int o = LPR / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

template <typename T, int LPR, bool kAligned, bool kStatic>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_int8_kernel(ReshapeAndCacheInt8Params p) {
  pdl_wait();  // the previous kernel may write the keys, values, slots (common/launch.cuh)
  pdl_launch_dependents();
  const int lane_in_row = threadIdx.x % LPR;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / LPR;
  const int64_t num_rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int col = lane_in_row * kElems;

  bool active = row < num_rows && col < p.head_dim;
  int64_t token = 0, slot = -1;
  int head = 0;
  if (row < num_rows) {
    token = row / p.num_heads;
    head = static_cast<int>(row % p.num_heads);
    slot = p.slot_mapping[token];
  }
  const int64_t capacity = static_cast<int64_t>(p.num_blocks) * p.block_size;
#if !defined(NDEBUG) || defined(QOPS_DEBUG)
  if (row < num_rows && lane_in_row == 0 && head == 0 && (slot < -1 || slot >= capacity)) {
    printf("qops.reshape_and_cache_int8: slot_mapping[%lld] = %lld is outside [-1, %lld)\n",
           static_cast<long long>(token), static_cast<long long>(slot),
           static_cast<long long>(capacity));
    __trap();
  }
#endif
  active = active && slot >= 0 && slot < capacity;  // never write out of bounds

  float xk[kElems], xv[kElems];
#pragma unroll
  for (int i = 0; i < kElems; ++i) xk[i] = xv[i] = 0.f;
  if (active) {
    const T* kp =
        static_cast<const T*>(p.key) + token * p.key_stride_t + head * p.key_stride_h + col;
    const T* vp =
        static_cast<const T*>(p.value) + token * p.value_stride_t + head * p.value_stride_h + col;
    load16<T, kAligned>(kp, xk);
    load16<T, kAligned>(vp, xv);
  }

  float sk, sv;
  if constexpr (kStatic) {
    sk = *p.k_scales;
    sv = *p.v_scales;
  } else {
    // every lane of the warp takes part in the shuffles (inactive rows contribute zeros)
    sk = absmax_to_scale(group_amax<LPR>(xk));
    sv = absmax_to_scale(group_amax<LPR>(xv));
  }
  if (!active) return;

  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int64_t sidx = (block * p.num_heads + head) * p.block_size + offset;
  const int64_t didx = sidx * p.head_dim + col;
  const RowQuant qk(sk), qv(sv);
  uint4 wk, wv;
  if (qk.fast && qv.fast) {
    wk = quant16<true, kStatic>(xk, qk);
    wv = quant16<true, kStatic>(xv, qv);
  } else {  // 0, Inf, NaN or extreme scales: the IEEE division per element
    wk = quant16<false, true>(xk, qk);
    wv = quant16<false, true>(xv, qv);
  }
  *reinterpret_cast<uint4*>(p.k_cache + didx) = wk;
  *reinterpret_cast<uint4*>(p.v_cache + didx) = wv;
  if constexpr (!kStatic) {
    if (lane_in_row == 0) {
      p.k_scales[sidx] = sk;
      p.v_scales[sidx] = sv;
    }
  }
}

template <typename T, int LPR>
cudaError_t launch(const ReshapeAndCacheInt8Params& p, bool aligned, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int64_t rows_per_block = kThreads / LPR;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  dim3 grid(static_cast<unsigned>(blocks));
  auto kernel = aligned ? (p.static_scales ? reshape_and_cache_int8_kernel<T, LPR, true, true>
                                           : reshape_and_cache_int8_kernel<T, LPR, true, false>)
                        : (p.static_scales ? reshape_and_cache_int8_kernel<T, LPR, false, true>
                                           : reshape_and_cache_int8_kernel<T, LPR, false, false>);
  return launch_kernel(kernel, grid, dim3(kThreads), stream, !p.no_pdl, p);
}

template <typename T>
cudaError_t dispatch_lpr(const ReshapeAndCacheInt8Params& p, bool aligned, cudaStream_t stream) {
  const int lanes = p.head_dim / kElems;
  if (lanes <= 4) return launch<T, 4>(p, aligned, stream);
  if (lanes <= 8) return launch<T, 8>(p, aligned, stream);
  return launch<T, 16>(p, aligned, stream);
}

bool aligned16(const void* ptr, int64_t stride_t, int64_t stride_h) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && stride_t % 8 == 0 && stride_h % 8 == 0;
}

}  // namespace

cudaError_t reshape_and_cache_int8(const ReshapeAndCacheInt8Params& p, cudaStream_t stream) {
  if (p.head_dim <= 0 || p.head_dim % kElems != 0 || p.head_dim > 256 || p.num_heads <= 0 ||
      p.block_size <= 0 || p.num_blocks <= 0 || p.num_tokens < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0) return cudaSuccess;
  const bool aligned = aligned16(p.key, p.key_stride_t, p.key_stride_h) &&
                       aligned16(p.value, p.value_stride_t, p.value_stride_h);
  return p.bf16 ? dispatch_lpr<__nv_bfloat16>(p, aligned, stream)
                : dispatch_lpr<__half>(p, aligned, stream);
}

}  // namespace kv_cache
}  // namespace qops
