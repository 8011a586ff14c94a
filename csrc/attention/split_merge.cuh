// The merge of split-K (flash-decoding) partials of the decode attention kernels (the counterpart
// of FlashInfer's attention/cascade.cuh): the log-sum-exp-weighted sum of the splits' normalized
// outputs O_s / l_s, with lse_s = m_s + log2(l_s) in the log2 domain. Every merge path of a
// kernel (a separate reduce kernel, a merge fused into the last CTA, a cluster merge) uses these,
// so that all give bit-identical outputs. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "common/convert.cuh"  // from_float
#include "common/math.cuh"     // fast_exp2

namespace qops {
namespace attention {

// ---- the split merge arithmetic ------------------------------------------------------------------
// Shared by the reduce kernel and the fused merge so that both give bit-identical outputs: per
// output element, over the non-empty splits s = 0, 1, ... in increasing order,
//   w = exp2(lse[s] - max lse),  wsum += w,  acc = fma(w, partial_out[s], acc),
// and out = acc * (1 / wsum) (0 when wsum is not > 0). How elements are dealt to threads does not
// change any element's value. The exponential and the reciprocal are the approximate hardware ones
// (ex2.approx, rcp.approx: relative errors near 2^-22): the IEEE-exact library versions cost a
// range check, a slow-path branch and a call per element on the merge's critical path, which at
// small batch is as long as the stream itself.
__device__ __forceinline__ float merge_weight(float lse, float m) {
  return fast_exp2(lse - m);
}
__device__ __forceinline__ void merge_add(float& acc, float w, float v) {
  acc = __fmaf_rn(w, v, acc);
}
__device__ __forceinline__ void merge_add4(float (&acc)[4], float w, const float4& v) {
  merge_add(acc[0], w, v.x);
  merge_add(acc[1], w, v.y);
  merge_add(acc[2], w, v.z);
  merge_add(acc[3], w, v.w);
}
__device__ __forceinline__ float merge_inv(float wsum) {
  return wsum > 0.f ? __fdividef(1.f, wsum) : 0.f;  // wsum <= num_splits
}
__device__ __forceinline__ float merge_finish(float acc, float inv) {
  return acc * inv;
}

// Folds more partials -- the SKVQ side tokens' (O / l, lse), `parts` of them (skvq_side_decode),
// part k's N consecutive elements at eo + k * o_stride and its lse at el[k * l_stride] -- into N
// merged outputs `acc` whose splits had log2-sum-exp `lse` (-inf: none; acc is then 0). All
// empty: acc stays 0.
template <int N>
__device__ __forceinline__ void fold_extra(float (&acc)[N], float lse, const float* eo,
                                           const float* el, int parts, int64_t o_stride,
                                           int64_t l_stride) {
  float m = lse;
  for (int k = 0; k < parts; ++k) m = fmaxf(m, el[k * l_stride]);
  if (m == -INFINITY) return;
  const float w0 = lse == -INFINITY ? 0.f : merge_weight(lse, m);
  float wsum = w0;
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] *= w0;
  for (int k = 0; k < parts; ++k) {
    const float l = el[k * l_stride];
    if (l == -INFINITY) continue;  // a part without tokens
    const float w = merge_weight(l, m);
    wsum += w;
#pragma unroll
    for (int i = 0; i < N; ++i) merge_add(acc[i], w, eo[k * o_stride + i]);
  }
  const float inv = merge_inv(wsum);
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = merge_finish(acc[i], inv);
}
// The log2-sum-exp of merged splits: max lse + log2(sum of weights), -inf when none.
__device__ __forceinline__ float merged_lse(float m, float wsum) {
  return wsum > 0.f ? m + __log2f(wsum) : -INFINITY;
}

// Four consecutive outputs as one 8-byte store (p + 4 i: 8-byte aligned).
template <typename T>
__device__ __forceinline__ void store_out4(T* p, const float (&v)[4]) {
  T t[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) t[e] = from_float<T>(v[e]);
  *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(t);
}

}  // namespace attention
}  // namespace qops
