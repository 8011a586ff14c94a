// The fused one-shot all-reduce + residual add + RMSNorm (+ int8 quant): comm/allreduce_norm.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "comm/allreduce_norm.h"
#include "common/convert.cuh"  // to_float, from_float
#include "common/quant.cuh"
#include "common/reduce.cuh"

namespace qops {
namespace comm {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;                                     // halves per 16-byte vector
constexpr int kMaxChunks = kMaxHidden / (kVec * kThreads);  // vectors per thread

union Vec {
  uint4 u;
  uint16_t h[kVec];
};

template <typename T>
__device__ __forceinline__ float elem(const Vec& v, int i) {
  T x;
  memcpy(&x, &v.h[i], sizeof(T));
  return to_float(x);
}
template <typename T>
__device__ __forceinline__ void set_elem(Vec& v, int i, float f) {
  const T x = from_float<T>(f);
  memcpy(&v.h[i], &x, sizeof(T));
}

__device__ __forceinline__ uint32_t* flags_of(uint64_t buffer) {
  return reinterpret_cast<uint32_t*>(buffer);
}
__device__ __forceinline__ int flag_slot(int phase, int block, int src) {
  return (phase * kMaxBlocks + block) * kMaxRanks + src;
}
__device__ __forceinline__ uint32_t* epoch_of(uint64_t buffer, int block) {
  return flags_of(buffer) + 2 * kMaxBlocks * kMaxRanks + block;
}
__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block b of this rank meets block b of every rank in call `epoch`: thread r < world stores the
// epoch into this rank's flag in rank r's buffer (release: everything the block wrote before is
// visible to rank r once it sees the flag) and waits until rank r's flag in this rank's buffer
// holds it (acquire). A peer is at most one phase ahead, so "reached" is a wrap-safe >=.
__device__ void barrier(const ArNormProblem& p, int phase, uint32_t epoch) {
  __syncthreads();
  const int r = threadIdx.x;
  if (r < p.world) {
    store_release_sys(flags_of(p.buffers[r]) + flag_slot(phase, blockIdx.x, p.rank), epoch);
    const uint32_t* mine = flags_of(p.buffers[p.rank]) + flag_slot(phase, blockIdx.x, r);
    while (static_cast<int32_t>(load_acquire_sys(mine) - epoch) < 0) {
    }
  }
  __syncthreads();
}

template <typename T, bool kQuant>
__global__ void __launch_bounds__(kThreads) allreduce_norm_kernel(const ArNormProblem p) {
  __shared__ float red[32];
  // this call's number for this block (the same on every rank: every rank makes the same calls)
  uint32_t* epoch_word = epoch_of(p.buffers[p.rank], blockIdx.x);
  const uint32_t epoch = *epoch_word + 1;
  const int nvec = p.h / kVec;
  const size_t row_bytes = static_cast<size_t>(p.h) * sizeof(T);
  // 1. this rank's rows of the partial sums into its own buffer
  unsigned char* own = reinterpret_cast<unsigned char*>(p.buffers[p.rank]) + kFlagsBytes;
  const T* in = static_cast<const T*>(p.input);
  for (int row = blockIdx.x; row < p.t; row += gridDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(in + static_cast<int64_t>(row) * p.in_stride);
    uint4* dst = reinterpret_cast<uint4*>(own + row * row_bytes);
    for (int v = threadIdx.x; v < nvec; v += kThreads) dst[v] = src[v];
  }
  barrier(p, 0, epoch);

  // 2. every rank's rows, summed in rank order, + residual, norm (+ quant)
  T* res = static_cast<T*>(p.residual);
  const T* w = static_cast<const T*>(p.weight);
  for (int row = blockIdx.x; row < p.t; row += gridDim.x) {
    float z[kMaxChunks][kVec];
    float sumsq = 0.0f;
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int v = threadIdx.x + c * kThreads;
      if (v >= nvec) break;
      float s[kVec];  // rank 0's values, then the others added in rank order
      for (int r = 0; r < p.world; ++r) {
        Vec x;
        x.u = __ldcg(
            reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(p.buffers[r]) +
                                           kFlagsBytes + row * row_bytes) +
            v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) s[i] = r == 0 ? elem<T>(x, i) : s[i] + elem<T>(x, i);
      }
      T* rrow = res + static_cast<int64_t>(row) * p.res_stride;
      Vec rv;
      rv.u = *reinterpret_cast<const uint4*>(rrow + v * kVec);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float xsum = to_float(from_float<T>(s[i]));  // the all-reduce's output, in T
        set_elem<T>(rv, i, xsum + elem<T>(rv, i));         // residual <- x + residual (rounded)
        z[c][i] = elem<T>(rv, i);
        sumsq = fmaf(z[c][i], z[c][i], sumsq);
      }
      *reinterpret_cast<uint4*>(rrow + v * kVec) = rv.u;
    }
    sumsq = block_reduce_sum(sumsq, red);
    const float rstd = 1.0f / sqrtf(sumsq / static_cast<float>(p.h) + p.eps);
    // products p = z * w (float32), then y = p * rstd
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int v = threadIdx.x + c * kThreads;
      if (v >= nvec) break;
      Vec wv;
      wv.u = *reinterpret_cast<const uint4*>(w + v * kVec);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        z[c][i] = z[c][i] * elem<T>(wv, i);
        amax = fmaxf(amax, fabsf(z[c][i]));
      }
    }
    if constexpr (kQuant) {
      float scale;
      if (p.static_scale != nullptr) {
        scale = *p.static_scale;
      } else {
        amax = block_reduce_max(amax, red);
        scale = absmax_to_scale(amax * rstd);  // amax|fl(p * rstd)| == fl(amax|p| * rstd)
        if (threadIdx.x == 0) p.out_scale[row] = scale;
      }
      const RowQuant qz(scale);
      int8_t* orow = p.out_q + static_cast<int64_t>(row) * p.h;
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        const int v = threadIdx.x + c * kThreads;
        if (v >= nvec) break;
        float y[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) y[i] = z[c][i] * rstd;
        uint2 q;
        if (qz.fast) {
          q.x = quant_pack4<true>(y, qz);
          q.y = quant_pack4<true>(y + 4, qz);
        } else {
          q.x = quant_pack4<false>(y, qz);
          q.y = quant_pack4<false>(y + 4, qz);
        }
        *reinterpret_cast<uint2*>(orow + v * kVec) = q;
      }
    } else {
      T* orow = static_cast<T*>(p.out_f) + static_cast<int64_t>(row) * p.h;
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        const int v = threadIdx.x + c * kThreads;
        if (v >= nvec) break;
        Vec o;
#pragma unroll
        for (int i = 0; i < kVec; ++i) set_elem<T>(o, i, z[c][i] * rstd);
        *reinterpret_cast<uint4*>(orow + v * kVec) = o.u;
      }
    }
  }
  // 3. no rank leaves (and overwrites its buffer in its next call) while a peer still reads it
  barrier(p, 1, epoch);
  if (threadIdx.x == 0) *epoch_word = epoch;
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

template <typename T>
cudaError_t launch(const ArNormProblem& p, cudaStream_t stream) {
  const dim3 grid(std::min(p.t, kMaxBlocks));
  if (p.out_q != nullptr) {
    allreduce_norm_kernel<T, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    allreduce_norm_kernel<T, false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t allreduce_add_rms_norm(const ArNormProblem& p, cudaStream_t stream) {
  const bool quant = p.out_q != nullptr;
  if (p.buffers == nullptr || p.world < 1 || p.world > kMaxRanks || p.rank < 0 ||
      p.rank >= p.world || p.t < 0 || p.h <= 0 || p.h % kVec != 0 || p.h > kMaxHidden ||
      p.in_stride % kVec != 0 || p.res_stride % kVec != 0 || !aligned16(p.input) ||
      !aligned16(p.residual) || !aligned16(p.weight) ||
      kFlagsBytes + static_cast<size_t>(p.t) * p.h * 2 > p.buffer_bytes ||
      (quant && (p.static_scale == nullptr && p.out_scale == nullptr)) || (quant && p.h % 8 != 0) ||
      (!quant && (p.out_f == nullptr || !aligned16(p.out_f)))) {
    return cudaErrorInvalidValue;
  }
  if (p.t == 0) return cudaSuccess;
  return p.dtype == Dtype::kFloat16 ? launch<__half>(p, stream) : launch<__nv_bfloat16>(p, stream);
}

}  // namespace comm
}  // namespace qops
