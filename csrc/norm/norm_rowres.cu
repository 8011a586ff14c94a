// RMSNorm (+ residual add) + int8 quantization: the row-resident kernel (one row per CTA, or per
// cluster of CTAs; registers only) and its launcher. See norm.h for the contract,
// docs/norm_activation.md for the design, norm.cu for the launcher that picks the kernel.
//
// One pass over DRAM: each row is loaded once (16-byte vectors), the residual sum is written back
// from registers, the sum of squares and amax|z * w| are reduced together (one block barrier, and
// a second one after which one warp's row scalars are read, when a row spans several warps of a
// CTA; a cluster barrier instead when a row is split over a cluster), and the quantized row is
// stored from registers. Because rstd > 0 and float rounding is monotonic,
// amax|fl(p * rstd)| == fl(amax|p| * rstd) for p = fl(z * w): the dynamic scale needs no second
// reduction and is exactly absmax_scale() of the y = fl(fl(z * w) * rstd) that the kernel
// quantizes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/cluster.cuh"  // cluster_wait
#include "common/convert.cuh"  // to_float, from_float
#include "common/launch.cuh"   // pdl_wait, pdl_launch_dependents
#include "common/quant.cuh"    // absmax_to_scale, RowQuant
#include "norm/norm_common.cuh"
#include "quant/fused_quant_tuning.h"
#include "quant/fused_row_quant.cuh"

namespace qops {
namespace {

using fq::Vec;

// __launch_bounds__ of the norm kernel for E = NV * VEC elements per thread: (most threads per
// block, blocks per SM to fit). The kernel keeps only the raw row slice in registers (E / 2 for
// 16-bit T), so the caps are set for occupancy: 32 registers up to 16 elements (2048 threads/SM),
// 42 up to 32, 64 up to 64. Forcing more blocks per SM spilled (ptxas -v), except in the
// kTight build below.
__host__ __device__ constexpr int norm_max_threads(int elems_per_thread) {
  return elems_per_thread <= 16 ? 1024 : (elems_per_thread <= 64 ? 512 : 256);
}
int norm_max_threads_host(int e) {
  return norm_max_threads(e);
}

// The kTight build: no residual, 2 vectors (16 elements) per thread, blocks of at most 512
// threads, bounded at (512, 3) = 40 registers without spills (ptxas -v, sm_90, CUDA 13.0), where
// the (1024, 1) build takes 46: 6 blocks of 256 threads per SM instead of 5. 4096 x 4096 bf16,
// row-resident at 256 threads: 21.4 -> 20.7 us (H100, interleaved CUDA-graph replays).
constexpr int kTightThreads = 512;
constexpr int kTightMinBlocks = 3;
constexpr int kTightElems = 16;

// y = (z * w) * rstd, quantized and stored; the weight re-read from L1/L2.
template <typename T, int VEC, int NV, bool kFast, bool kInfCheck>
__device__ __forceinline__ void store_row(int8_t* o, const Vec<T, VEC> (&zv)[NV], const T* w,
                                          int v0, int v1, int tid, int tpr, float rstd,
                                          const RowQuant& qz) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int v = v0 + tid + k * tpr;
    if (v < v1) {
      const Vec<T, VEC> wv = fq::reload_ldg<T, VEC>(w + v * VEC);
      float y[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) y[j] = (to_float(zv[k].v[j]) * to_float(wv.v[j])) * rstd;
      fq::store_q_impl<kFast, VEC, kInfCheck>(o + v * VEC, y, qz);
    }
    // One vector at a time: keeps the scheduler from hoisting every vector's reload and math
    // (which costs registers, hence occupancy, for ILP the other resident rows already give).
    asm volatile("" ::: "memory");
  }
}

// y = p * rstd quantized and stored, from the products p = z * w the first pass kept (float32).
template <int VEC, int NV, bool kFast, bool kInfCheck>
__device__ __forceinline__ void store_row_p(int8_t* o, const float (&pz)[NV][VEC], int v0, int v1,
                                            int tid, int tpr, float rstd, const RowQuant& qz) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int v = v0 + tid + k * tpr;
    if (v < v1) {
      float y[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) y[j] = pz[k][j] * rstd;
      fq::store_q_impl<kFast, VEC, kInfCheck>(o + v * VEC, y, qz);
    }
  }
}

// Registers hold only the row slice itself (NV vectors of raw T, the residual sum when kRes):
// the weight is read for the reduction, dropped, and re-read (L1/L2) for the quantized store, so a
// 4096-wide row costs ~8 KB of registers and many rows stay in flight per SM.
// Without a residual and at <= 16 elements per thread (kKeepP), the first pass keeps the float32
// products p = z * w instead (8 more registers at 16 elements): the store pass is then p * rstd and
// the quantizer, without the weight re-read, the second conversion of z and w and the product.
// Without a residual, x is loaded with L1::no_allocate (fq::load_stream): read once, it would
// otherwise evict the weight, which every row re-reads from L1 (4096 x 4096 bf16: 24.5 -> 21.4 us;
// with a residual it measured 0-2% slower at the Llama sizes, so the fused add keeps plain loads).
//
// kQ = false (rms_norm, fused_add_rms_norm): the same kernel without the quantizer: no amax, no
// scale, and y = (z * w) * rstd rounded once to T into p.out_float.
template <typename T, int VEC, int NV, bool kRes, bool kTight = false, bool kQ = true>
__global__ void __launch_bounds__(kTight ? kTightThreads : norm_max_threads(NV * VEC),
                                  kTight ? kTightMinBlocks : 1)
    rms_norm_quant_kernel(const NormParams p) {
  static_assert(!kTight || (!kRes && NV * VEC == kTightElems), "kTight: no residual, 16 elements");
  static_assert(kQ || !kTight, "kTight: quantizing build only");
  __shared__ float red[2][32];
  __shared__ float part[2];
  __shared__ float fin[32][3];  // per row of the block: rstd, scale, 1 / scale (one-warp finish)
  pdl_wait();  // the previous kernel may write x, the residual, the scale (common/launch.cuh)
  pdl_launch_dependents();
  const int tpr = blockDim.x;
  const int tid = threadIdx.x;
  const int C = p.cluster;
  const int rank = C > 1 ? static_cast<int>(blockIdx.x % C) : 0;
  const int nvec = p.hidden / VEC;
  const int v0 = rank * p.slice;
  const int v1 = min(nvec, v0 + p.slice);
  const bool dynamic = kQ && p.static_scale == nullptr;
  const T* w = static_cast<const T*>(p.weight);

  const float s_static = (!kQ || dynamic) ? 0.0f : __ldg(p.static_scale);
  if (kQ && !dynamic && blockIdx.x == 0 && tid == 0 && threadIdx.y == 0) p.scale_out[0] = s_static;

  {
    const int64_t rb = C > 1 ? blockIdx.x / C : blockIdx.x;
    const int64_t row = rb * blockDim.y + threadIdx.y;
    const bool row_ok = row < p.rows;
    const T* x = static_cast<const T*>(p.in) + (row_ok ? row : 0) * p.in_stride;
    T* res = kRes ? static_cast<T*>(p.residual) + (row_ok ? row : 0) * p.res_stride : nullptr;

    // Issue every load of the row slice before the first use.
    Vec<T, VEC> zv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = v0 + tid + k * tpr;
      if (row_ok && v < v1)
        zv[k] = kRes ? fq::load<T, VEC>(x + v * VEC) : fq::load_stream<T, VEC>(x + v * VEC);
    }
    if constexpr (kRes) {
      Vec<T, VEC> rv[NV];
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int v = v0 + tid + k * tpr;
        if (row_ok && v < v1) rv[k] = fq::load<T, VEC>(res + v * VEC);
      }
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int v = v0 + tid + k * tpr;
        if (row_ok && v < v1) {
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            zv[k].v[j] = from_float<T>(to_float(zv[k].v[j]) + to_float(rv[k].v[j]));
          fq::store<T, VEC>(res + v * VEC, zv[k]);
        }
      }
    }

    constexpr bool kKeepP = !kRes && NV * VEC <= 16;
    float pz[kKeepP ? NV : 1][VEC];
    float sumsq = 0.0f, amax = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = v0 + tid + k * tpr;
      if (row_ok && v < v1) {
        const Vec<T, VEC> wv = fq::load_ldg<T, VEC>(w + v * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float z = to_float(zv[k].v[j]);
          sumsq = fmaf(z, z, sumsq);
          const float pj = z * to_float(wv.v[j]);
          if constexpr (kKeepP) pz[k][j] = pj;
          amax = fmaxf(amax, fabsf(pj));  // fmaxf ignores NaN
        }
      }
    }

    // The row's scalars from its (sum z^2, amax|p|): rstd and the scale (written out if dynamic).
    const auto finish = [&](float ss, float am, bool write) {
      const float rs = row_rstd(ss, p.hidden, p.eps);
      float sc = s_static;
      if (dynamic) {
        sc = absmax_to_scale(am * rs);
        if (write && row_ok && rank == 0) p.scale_out[row] = sc;
      }
      return make_float2(rs, sc);
    };
    float2 rs_s;
    // RowQuant(s).r where one warp computed it. (A flag set in the branch, not its condition
    // re-tested below: re-testing took the 1-vector build from 32 to 39 registers, ptxas -v.)
    float recip = 0.0f;
    bool shared_recip = false;
    if (C == 1 && tpr > 32) {
      // Several warps, one CTA: one warp finishes the reduction and computes the scalars (~140
      // instructions per warp: the second shuffle round, the correctly rounded sqrt and
      // divisions), the others read them after a second barrier instead of repeating them. 4096 x
      // 4096 bf16 / fp16: 20.3 -> 19.4 / 19.0 -> 18.0 us (H100, docs/norm_activation.md).
      if (dynamic)
        fq::warp_partials<true, true>(sumsq, amax, red);
      else
        fq::warp_partials<true, false>(sumsq, amax, red);
      __syncthreads();
      if (tid < 32) {
        if (dynamic)
          fq::reduce_partials<true, true>(sumsq, amax, red);
        else
          fq::reduce_partials<true, false>(sumsq, amax, red);
        if (tid == 0) {
          const float2 f = finish(sumsq, amax, true);
          fin[threadIdx.y][0] = f.x;
          fin[threadIdx.y][1] = f.y;
          fin[threadIdx.y][2] = RowQuant(f.y).r;
        }
      }
      __syncthreads();
      rs_s = make_float2(fin[threadIdx.y][0], fin[threadIdx.y][1]);
      recip = fin[threadIdx.y][2];
      shared_recip = true;
    } else {
      if (dynamic) {
        fq::row_reduce<true, true>(sumsq, amax, red);
        if (C > 1) fq::cluster_reduce<true, true>(sumsq, amax, part, C);
      } else {
        fq::row_reduce<true, false>(sumsq, amax, red);
        if (C > 1) fq::cluster_reduce<true, false>(sumsq, amax, part, C);
      }
      rs_s = finish(sumsq, amax, tid == 0);
    }
    const float rstd = rs_s.x, s = rs_s.y;
    const RowQuant qz = shared_recip ? RowQuant(s, recip) : RowQuant(s);

    if constexpr (!kQ) {
      if (row_ok) {
        T* o = static_cast<T*>(p.out_float) + row * static_cast<int64_t>(p.hidden);
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const int v = v0 + tid + k * tpr;
          if (v < v1) {
            Vec<T, VEC> ov;
            if constexpr (kKeepP) {
#pragma unroll
              for (int j = 0; j < VEC; ++j) ov.v[j] = from_float<T>(pz[k][j] * rstd);
            } else {
              const Vec<T, VEC> wv = fq::reload_ldg<T, VEC>(w + v * VEC);
#pragma unroll
              for (int j = 0; j < VEC; ++j)
                ov.v[j] = from_float<T>((to_float(zv[k].v[j]) * to_float(wv.v[j])) * rstd);
            }
            fq::store<T, VEC>(o + v * VEC, ov);
          }
          asm volatile("" ::: "memory");  // one vector at a time (see store_row)
        }
      }
    } else if (row_ok) {
      // A dynamic scale on the fast path (s <= 1e30) has no +-Inf y: the quantizer's Inf select
      // can go (quant_one's kInfCheck, common/quant.cuh).
      int8_t* o = p.out + row * static_cast<int64_t>(p.hidden);
      auto store = [&](auto fast, auto inf_check) {
        constexpr bool kF = decltype(fast)::value, kI = decltype(inf_check)::value;
        if constexpr (kKeepP)
          store_row_p<VEC, NV, kF, kI>(o, pz, v0, v1, tid, tpr, rstd, qz);
        else
          store_row<T, VEC, NV, kF, kI>(o, zv, w, v0, v1, tid, tpr, rstd, qz);
      };
      using Y = std::true_type;
      using N = std::false_type;
      if (qz.fast && dynamic)
        store(Y{}, N{});
      else if (qz.fast)
        store(Y{}, Y{});
      else
        store(N{}, Y{});
    }
    if (C > 1) cluster_wait();  // peers may still read `part` until they arrive
  }
}

template <typename T, int VEC, int NV>
cudaError_t launch(const NormParams& p, const fq::RowShape& sh, cudaStream_t stream) {
  const int64_t row_blocks = (p.rows + sh.rows_per_block - 1) / sh.rows_per_block;
  if (p.out == nullptr) {  // rms_norm / fused_add_rms_norm: T output
    auto kernel = p.residual != nullptr ? rms_norm_quant_kernel<T, VEC, NV, true, false, false>
                                        : rms_norm_quant_kernel<T, VEC, NV, false, false, false>;
    return fq::launch_rows(kernel, p, sh, row_blocks, stream);
  }
  auto kernel = p.residual != nullptr ? rms_norm_quant_kernel<T, VEC, NV, true>
                                      : rms_norm_quant_kernel<T, VEC, NV, false>;
  if constexpr (VEC > 1 && NV * VEC == kTightElems) {
    if (p.residual == nullptr && sh.threads_per_row * sh.rows_per_block <= kTightThreads)
      kernel = rms_norm_quant_kernel<T, VEC, NV, false, true>;
  }
  return fq::launch_rows(kernel, p, sh, row_blocks, stream);
}

template <typename T, int VEC>
cudaError_t dispatch_nv(const NormParams& p, const fq::RowShape& sh, cudaStream_t stream) {
  return fq::dispatch_vec_per_thread<VEC>(sh.vec_per_thread, [&](auto nv) {
    return launch<T, VEC, decltype(nv)::value>(p, sh, stream);
  });
}

}  // namespace

namespace norm {

template <typename T>
cudaError_t rms_norm_quant_rowres(const RmsNormArgs<T>& a, bool vec_ok, const fq::DeviceInfo& dev,
                                  const FusedQuantTuning& tuning, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int64_t kBytes = sizeof(T);
  const int64_t rows = a.rows, hidden = a.hidden;
  fq::ShapeHints hints{tuning.threads_per_row_target, tuning.cluster};
  // Without a residual, many rows of 129-1024 vectors (H 1032-8192 at 2 bytes) take 2 vectors per
  // thread (the kTight build) rather than choose_row_shape's 128-256 threads per row (4 vectors at
  // H = 4096 / 8192): 4096 x 4096 bf16 21.2 -> 20.7 us, 4096 x 8192 46.3 -> 44.7 us (H100).
  const int64_t nvec_all = hidden / VEC;
  if (vec_ok && a.residual == nullptr && hints.target_tpr == 0 && hints.cluster == 0 &&
      rows > dev.sms && nvec_all > kPipeOneWarpVectors && nvec_all <= 2 * kTightThreads)
    hints.target_tpr = static_cast<int>((nvec_all + 63) / 64 * 32);
  fq::RowShape sh;
  const bool ok = vec_ok
                      ? fq::choose_row_shape_or_default(rows, hidden / VEC, VEC, hidden * kBytes, 8,
                                                        dev.clusters, dev.sms, hints, &sh,
                                                        norm_max_threads_host)
                      : fq::choose_row_shape(rows, hidden, 1, hidden * kBytes, 32, false, dev.sms,
                                             fq::ShapeHints{512, 1}, &sh, norm_max_threads_host);
  if (!ok) return cudaErrorInvalidValue;
  sh.pdl = tuning.pdl;
  const int64_t nvec = hidden / sh.vec;
  NormParams p{a.in,
               a.in_row_stride,
               a.residual,
               a.residual_row_stride,
               a.weight,
               a.out,
               a.out_float,
               a.scale_out,
               a.static_scale,
               rows,
               static_cast<int>(hidden),
               sh.cluster,
               static_cast<int>((nvec + sh.cluster - 1) / sh.cluster),
               a.eps};
  return vec_ok ? dispatch_nv<T, VEC>(p, sh, stream) : dispatch_nv<T, 1>(p, sh, stream);
}

template cudaError_t rms_norm_quant_rowres<__half>(const RmsNormArgs<__half>&, bool,
                                                   const fq::DeviceInfo&, const FusedQuantTuning&,
                                                   cudaStream_t);
template cudaError_t rms_norm_quant_rowres<__nv_bfloat16>(const RmsNormArgs<__nv_bfloat16>&, bool,
                                                          const fq::DeviceInfo&,
                                                          const FusedQuantTuning&, cudaStream_t);

}  // namespace norm
}  // namespace qops
