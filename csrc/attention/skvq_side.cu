// The full-precision side of an SKVQ int4 cache (seed 003): decode attention over each sequence's
// sinks and window, as one more split that the int4 split kernel folds into its output
// (paged_decode_int8.cu, fold_extra). See paged_decode_int8.h (SkvqSideParams) and docs/int4.md.
//
// One CTA of 8 warps per (sequence, kv head): the <= sinks + window side tokens and the group's
// queries are staged in shared memory; a warp per query head computes its scores (lanes over
// tokens), its softmax and its output (lanes over channels). CUDA cores in f32: the side is at
// most a few hundred tokens against the int4 split kernel's thousands.
#include "attention/paged_decode_int8.h"
#include "common/convert.cuh"  // to_float
#include "common/launch.cuh"   // launch_kernel, pdl_wait

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace qops {
namespace attention {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// Shared memory: K rows as 32-bit words with a row stride of D / 2 + 1 (odd: a warp reading one
// word of 32 different rows hits 32 banks), V rows packed, the group's queries (f32, log2-domain
// scaled) and one score row per warp.
template <int D>
struct SideSmem {
  static constexpr int kKStride = D / 2 + 1;  // words
  static int64_t bytes(int side, int group) {
    return 4LL * side * kKStride + 2LL * side * D + 4LL * group * D + 4LL * kWarps * side;
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) skvq_side_kernel(const SkvqSideParams p) {
  pdl_wait();  // the previous kernel (the cache write) may write the side buffers
  extern __shared__ __align__(16) unsigned char smem[];
  using T2 =
      typename std::conditional<std::is_same<T, __half>::value, __half2, __nv_bfloat162>::type;
  constexpr int KS = SideSmem<D>::kKStride;
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int G = p.num_q_heads / p.num_kv_heads;
  const int side = p.sinks + p.window;
  uint32_t* s_k = reinterpret_cast<uint32_t*>(smem);                            // [side][KS] words
  T* s_v = reinterpret_cast<T*>(s_k + static_cast<int64_t>(side) * KS);         // [side][D]
  float* s_q = reinterpret_cast<float*>(s_v + static_cast<int64_t>(side) * D);  // [G][D]
  float* s_p = s_q + G * D + warp * side;                                       // [kWarps][side]

  const int L = max(0, p.seq_lens[b]);
  const int n_sink = min(p.sinks, L);
  const int n_win = min(p.window, L - n_sink);
  const int n_all = n_sink + n_win;  // side tokens: indices [0, n_sink) and sinks + [0, n_win)
  // this CTA's part of them: [t0, t0 + n)
  const int part = blockIdx.z;
  const int t0 = n_all * part / p.parts;
  const int n = n_all * (part + 1) / p.parts - t0;
  const int64_t row0 = (static_cast<int64_t>(part) * p.batch + b) * p.num_q_heads + kvh * G;
  const T* q_base = static_cast<const T*>(p.query) + b * p.q_stride_b;
  if (n == 0) {
    for (int i = threadIdx.x; i < G * D; i += kThreads) p.out[row0 * D + i] = 0.f;
    for (int h = threadIdx.x; h < G; h += kThreads) p.lse[row0 + h] = -INFINITY;
    return;
  }
  // Stage the tokens: 16-byte vectors from global memory, words into the padded K rows.
  constexpr int kVec = 8;  // 2-byte values per 16 bytes
  const int64_t base = (static_cast<int64_t>(p.side_slots[b]) * p.num_kv_heads + kvh) * side * D;
  for (int i = threadIdx.x; i < n * (D / kVec); i += kThreads) {
    const int t = i / (D / kVec), c = (i % (D / kVec)) * kVec;
    const int ta = t0 + t;
    const int idx = ta < n_sink ? ta : p.sinks + (ta - n_sink);
    const int64_t src = base + static_cast<int64_t>(idx) * D + c;
    const uint4 kk = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.k_side) + src));
    uint32_t* kd = s_k + t * KS + c / 2;
    kd[0] = kk.x;
    kd[1] = kk.y;
    kd[2] = kk.z;
    kd[3] = kk.w;
    *reinterpret_cast<uint4*>(s_v + t * D + c) =
        __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.v_side) + src));
  }
  const float qscale = p.sm_scale * kLog2e;
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int h = i / D, d = i % D;
    const T* q = q_base + (kvh * G + h) * p.q_stride_h;
    s_q[i] = to_float(q[d]) * qscale;
  }
  __syncthreads();
  // A warp per query head: scores with lanes over tokens, the softmax, then O with lanes over the
  // head dim (E consecutive channels each).
  constexpr int E = D / 32;
  for (int h = warp; h < G; h += kWarps) {
    const float* q = s_q + h * D;
    float m = -INFINITY;
    for (int t = lane; t < n; t += 32) {
      const uint32_t* kr = s_k + t * KS;
      float acc0 = 0.f, acc1 = 0.f;
#pragma unroll 8
      for (int w = 0; w < D / 2; ++w) {
        const uint32_t kw = kr[w];
        const float2 kf = to_float2(*reinterpret_cast<const T2*>(&kw));
        const float2 qf = *reinterpret_cast<const float2*>(q + 2 * w);
        acc0 = fmaf(qf.x, kf.x, acc0);
        acc1 = fmaf(qf.y, kf.y, acc1);
      }
      const float s = acc0 + acc1;
      s_p[t] = s;
      m = fmaxf(m, s);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    float l = 0.f;
    for (int t = lane; t < n; t += 32) {
      const float e = exp2f(s_p[t] - m);
      s_p[t] = e;
      l += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(kFull, l, o);
    __syncwarp();  // the weights are in shared memory for every lane
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.f;
    for (int t = 0; t < n; ++t) {
      const float w = s_p[t];
      const T* vr = s_v + t * D + lane * E;
#pragma unroll
      for (int e = 0; e < E; e += 2) {
        const float2 vf = to_float2(*reinterpret_cast<const T2*>(vr + e));
        acc[e] = fmaf(w, vf.x, acc[e]);
        acc[e + 1] = fmaf(w, vf.y, acc[e + 1]);
      }
    }
    const float inv = 1.f / l;
    float* o = p.out + (row0 + h) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = acc[e] * inv;
    if (lane == 0) p.lse[row0 + h] = m + log2f(l);
    __syncwarp();  // before the next head reuses s_p
  }
}

template <typename T, int D>
cudaError_t launch_side(const SkvqSideParams& p, cudaStream_t stream) {
  const int64_t smem = skvq_side_smem_bytes(D, p.sinks + p.window, p.num_q_heads / p.num_kv_heads);
  auto kernel = skvq_side_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  // PDL: the cache write before it may still run; the split kernel after it waits for it.
  return launch_kernel_smem(kernel, dim3(p.num_kv_heads, p.batch, p.parts), dim3(kThreads),
                            static_cast<size_t>(smem), stream, !p.no_pdl, p);
}

}  // namespace

int64_t skvq_side_smem_bytes(int head_dim, int side_tokens, int group) {
  return head_dim == 128 ? SideSmem<128>::bytes(side_tokens, group)
                         : SideSmem<64>::bytes(side_tokens, group);
}

cudaError_t skvq_side_decode(const SkvqSideParams& p, cudaStream_t stream) {
  if ((p.head_dim != 64 && p.head_dim != 128) || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.sinks < 0 || p.window < 0 ||
      p.sinks + p.window == 0 || p.batch < 0 || p.batch > 65535 || p.parts < 1 || p.parts > 64) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  if (p.bf16) {
    return p.head_dim == 128 ? launch_side<__nv_bfloat16, 128>(p, stream)
                             : launch_side<__nv_bfloat16, 64>(p, stream);
  }
  return p.head_dim == 128 ? launch_side<__half, 128>(p, stream)
                           : launch_side<__half, 64>(p, stream);
}

}  // namespace attention
}  // namespace qops
