// Rotary position embedding in place on q and k (rope.h): one thread per (token, head, VEC pairs),
// a grid-stride loop over all of them. Memory-bound: each thread reads VEC values from both halves
// of its head and the four table slices (L2-resident: a decode step's tokens share few positions),
// and writes the head halves back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "common/convert.cuh"         // to_float, from_float
#include "common/launch.cuh"          // launch_kernel, pdl_wait, pdl_launch_dependents
#include "common/memory.cuh"          // is_aligned
#include "quant/fused_row_quant.cuh"  // fq::Vec, fq::load, fq::store, fq::device_info

namespace qops {
namespace {

using fq::Vec;

struct RopeParams {
  const int64_t* positions;
  void* q;
  int64_t q_ts, q_hs;
  void* k;
  int64_t k_ts, k_hs;
  const float* cos;
  const float* sin;
  int64_t max_pos, tokens;
  int q_heads, k_heads, head_dim;
};

template <int N>
__device__ __forceinline__ void load_f32(float (&v)[N], const float* p) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(p + j));
      v[j] = f.x, v[j + 1] = f.y, v[j + 2] = f.z, v[j + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = __ldg(p + j);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) rope_kernel(const RopeParams p) {
  pdl_wait();  // the previous kernel (the qkv GEMM) writes q and k
  pdl_launch_dependents();
  const int h2 = p.head_dim / 2;
  const int per_head = h2 / VEC;
  const int heads = p.q_heads + p.k_heads;
  const int64_t per_token = static_cast<int64_t>(heads) * per_head;
  const int64_t total = p.tokens * per_token;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_token;
    const int rem = static_cast<int>(idx - t * per_token);
    const int h = rem / per_head;
    const int i = (rem - h * per_head) * VEC;
    T* x = h < p.q_heads
               ? static_cast<T*>(p.q) + t * p.q_ts + h * p.q_hs
               : static_cast<T*>(p.k) + t * p.k_ts + static_cast<int64_t>(h - p.q_heads) * p.k_hs;
    const int64_t pos = __ldg(p.positions + t);
    Vec<T, VEC> lo, hi;
    if (pos < 0 || pos >= p.max_pos) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) lo.v[j] = hi.v[j] = from_float<T>(NAN);
    } else {
      lo = fq::load<T, VEC>(x + i);
      hi = fq::load<T, VEC>(x + i + h2);
      float c0[VEC], c1[VEC], s0[VEC], s1[VEC];
      const float* cr = p.cos + pos * p.head_dim;
      const float* sr = p.sin + pos * p.head_dim;
      load_f32(c0, cr + i);
      load_f32(c1, cr + i + h2);
      load_f32(s0, sr + i);
      load_f32(s1, sr + i + h2);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float a = to_float(lo.v[j]), b = to_float(hi.v[j]);
        // xf * cos + rot * sin with rot = (-b, a): separate roundings, as the reference
        lo.v[j] = from_float<T>(__fadd_rn(__fmul_rn(a, c0[j]), __fmul_rn(-b, s0[j])));
        hi.v[j] = from_float<T>(__fadd_rn(__fmul_rn(b, c1[j]), __fmul_rn(a, s1[j])));
      }
    }
    fq::store<T, VEC>(x + i, lo);
    fq::store<T, VEC>(x + i + h2, hi);
  }
}

template <typename T, int VEC>
cudaError_t launch(const RopeParams& p, bool pdl, cudaStream_t stream) {
  const int64_t total = p.tokens * (p.q_heads + p.k_heads) * (p.head_dim / 2 / VEC);
  constexpr int kThreads = 256;
  const int64_t blocks_needed = (total + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(fq::device_info().sms) * 8;
  const unsigned blocks = static_cast<unsigned>(blocks_needed < cap ? blocks_needed : cap);
  return launch_kernel(rope_kernel<T, VEC>, dim3(blocks), dim3(kThreads), stream, pdl, p);
}

}  // namespace

template <typename T>
cudaError_t rotary_embedding(const int64_t* positions, T* q, int64_t q_token_stride,
                             int64_t q_head_stride, int q_heads, T* k, int64_t k_token_stride,
                             int64_t k_head_stride, int k_heads, const float* cos, const float* sin,
                             int64_t max_pos, int64_t tokens, int head_dim, bool pdl,
                             cudaStream_t stream) {
  if (head_dim <= 0 || head_dim % 2 != 0 || q_heads < 0 || k_heads < 0 || tokens < 0 ||
      max_pos <= 0)
    return cudaErrorInvalidValue;
  if (tokens == 0 || q_heads + k_heads == 0) return cudaSuccess;
  const RopeParams p{
      positions, q,   q_token_stride, q_head_stride, k,       k_token_stride, k_head_stride,
      cos,       sin, max_pos,        tokens,        q_heads, k_heads,        head_dim};
  constexpr int VEC = 16 / sizeof(T);
  constexpr int64_t kB = sizeof(T);
  const bool vec_ok = head_dim % (2 * VEC) == 0 && is_aligned(q, 16) && is_aligned(k, 16) &&
                      (q_token_stride * kB) % 16 == 0 && (q_head_stride * kB) % 16 == 0 &&
                      (k_token_stride * kB) % 16 == 0 && (k_head_stride * kB) % 16 == 0 &&
                      is_aligned(cos, 16) && is_aligned(sin, 16);
  return vec_ok ? launch<T, VEC>(p, pdl, stream) : launch<T, 1>(p, pdl, stream);
}

#define QOPS_INSTANTIATE(T)                                                                        \
  template cudaError_t rotary_embedding<T>(const int64_t*, T*, int64_t, int64_t, int, T*, int64_t, \
                                           int64_t, int, const float*, const float*, int64_t,      \
                                           int64_t, int, bool, cudaStream_t);
QOPS_INSTANTIATE(__half)
QOPS_INSTANTIATE(__nv_bfloat16)
#undef QOPS_INSTANTIATE

}  // namespace qops
