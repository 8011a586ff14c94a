// RMSNorm (+ residual add) + int8 quantization kernels. See norm.h for the contract and
// docs/norm_activation.md for the design.
//
// One pass over DRAM: each row is loaded once (16-byte vectors), the residual sum is written back
// from registers, the sum of squares and amax|z * w| are reduced together (one block barrier at
// most, plus a cluster barrier when a row is split over a cluster), and the quantized row is
// stored from registers. Because rstd > 0 and float rounding is monotonic,
// amax|fl(p * rstd)| == fl(amax|p| * rstd) for p = fl(z * w): the dynamic scale needs no second
// reduction and is exactly absmax_scale() of the y = fl(fl(z * w) * rstd) that the kernel
// quantizes.
#include "norm/fused_quant.cuh"
#include "norm/norm.h"

namespace qops {
namespace {

using fq::Vec;

// __launch_bounds__ of the norm kernel for E = NV * VEC elements per thread: (most threads per
// block, blocks per SM to fit). The kernel keeps only the raw row slice in registers (E / 2 for
// 16-bit T), so the caps are set for occupancy: 32 registers up to 16 elements (2048 threads/SM),
// 42 up to 32, 64 up to 64.
__host__ __device__ constexpr int norm_max_threads(int elems_per_thread) {
  return elems_per_thread <= 16 ? 1024 : (elems_per_thread <= 64 ? 512 : 256);
}
__host__ __device__ constexpr int norm_min_blocks(int elems_per_thread) {
  return elems_per_thread > 0 ? 1 : 1;  // forcing more blocks spilled (measured with ptxas -v)
}
int norm_max_threads_host(int e) { return norm_max_threads(e); }

struct NormParams {
  const void* in;
  int64_t in_stride;
  void* residual;  // nullptr: no residual add
  int64_t res_stride;
  const void* weight;
  int8_t* out;
  float* scale_out;
  const float* static_scale;  // nullptr: dynamic per-token scales
  int64_t rows;
  int hidden;
  int cluster;  // CTAs per row (blockIdx.x % cluster is the slice)
  int slice;    // vectors per CTA slice of a row
  float eps;
};

// y = (z * w) * rstd, quantized and stored; the weight re-read from L1/L2.
template <typename T, int VEC, int NV, bool kFast>
__device__ __forceinline__ void store_row(int8_t* o, const Vec<T, VEC> (&zv)[NV], const T* w,
                                          int v0, int v1, int tid, int tpr, float rstd,
                                          const fq::RowQuant& qz) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int v = v0 + tid + k * tpr;
    if (v < v1) {
      const Vec<T, VEC> wv = fq::reload_ldg<T, VEC>(w + v * VEC);
      float y[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) y[j] = (to_float(zv[k].v[j]) * to_float(wv.v[j])) * rstd;
      fq::store_q_impl<kFast>(o + v * VEC, y, qz);
    }
    // One vector at a time: keeps the scheduler from hoisting every vector's reload and math
    // (which costs registers, hence occupancy, for ILP the other resident rows already give).
    asm volatile("" ::: "memory");
  }
}

// Registers hold only the row slice itself (NV vectors of raw T, the residual sum when kRes):
// the weight is read for the reduction, dropped, and re-read (L1/L2) for the quantized store, so a
// 4096-wide row costs ~8 KB of registers and many rows stay in flight per SM.
template <typename T, int VEC, int NV, bool kRes>
__global__ void __launch_bounds__(norm_max_threads(NV* VEC), norm_min_blocks(NV* VEC))
    rms_norm_quant_kernel(const NormParams p) {
  __shared__ float red[2][32];
  __shared__ float part[2];
  const int tpr = blockDim.x;
  const int tid = threadIdx.x;
  const int C = p.cluster;
  const int rank = C > 1 ? static_cast<int>(blockIdx.x % C) : 0;
  const int nvec = p.hidden / VEC;
  const int v0 = rank * p.slice;
  const int v1 = min(nvec, v0 + p.slice);
  const bool dynamic = p.static_scale == nullptr;
  const T* w = static_cast<const T*>(p.weight);

  const float s_static = dynamic ? 0.0f : __ldg(p.static_scale);
  if (!dynamic && blockIdx.x == 0 && tid == 0 && threadIdx.y == 0) p.scale_out[0] = s_static;

  {
    const int64_t rb = blockIdx.x / C;
    const int64_t row = rb * blockDim.y + threadIdx.y;
    const bool row_ok = row < p.rows;
    const T* x = static_cast<const T*>(p.in) + (row_ok ? row : 0) * p.in_stride;
    T* res = kRes ? static_cast<T*>(p.residual) + (row_ok ? row : 0) * p.res_stride : nullptr;

    // Issue every load of the row slice before the first use.
    Vec<T, VEC> zv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = v0 + tid + k * tpr;
      if (row_ok && v < v1) zv[k] = fq::load<T, VEC>(x + v * VEC);
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
          amax = fmaxf(amax, fabsf(z * to_float(wv.v[j])));  // fmaxf ignores NaN
        }
      }
    }

    if (dynamic) {
      fq::row_reduce<true, true>(sumsq, amax, red);
      if (C > 1) fq::cluster_reduce<true, true>(sumsq, amax, part, C);
    } else {
      fq::row_reduce<true, false>(sumsq, amax, red);
      if (C > 1) fq::cluster_reduce<true, false>(sumsq, amax, part, C);
    }
    const float rstd = 1.0f / sqrtf(sumsq / static_cast<float>(p.hidden) + p.eps);
    float s = s_static;
    if (dynamic) {
      s = fmaxf(amax * rstd / 127.0f, kScaleFloor);
      if (row_ok && tid == 0 && rank == 0) p.scale_out[row] = s;
    }
    const fq::RowQuant qz(s);

    if (row_ok) {
      int8_t* o = p.out + row * static_cast<int64_t>(p.hidden);
      if (qz.fast)
        store_row<T, VEC, NV, true>(o, zv, w, v0, v1, tid, tpr, rstd, qz);
      else
        store_row<T, VEC, NV, false>(o, zv, w, v0, v1, tid, tpr, rstd, qz);
    }
    if (C > 1) fq::cluster_wait();  // peers may still read `part` until they arrive
  }
}

template <typename T, int VEC, int NV>
cudaError_t launch(const NormParams& p, const fq::RowShape& sh, cudaStream_t stream) {
  const int64_t row_blocks = (p.rows + sh.rows_per_block - 1) / sh.rows_per_block;
  auto kernel = p.residual != nullptr ? rms_norm_quant_kernel<T, VEC, NV, true>
                                      : rms_norm_quant_kernel<T, VEC, NV, false>;
  return fq::launch_rows(kernel, p, sh, row_blocks, stream);
}

template <typename T, int VEC>
cudaError_t dispatch_nv(const NormParams& p, const fq::RowShape& sh, cudaStream_t stream) {
  return fq::dispatch_vec_per_thread<VEC>(
      sh.vec_per_thread, [&](auto nv) { return launch<T, VEC, decltype(nv)::value>(p, sh, stream); });
}

}  // namespace

template <typename T>
cudaError_t rms_norm_quant(const T* in, int64_t in_row_stride, T* residual,
                           int64_t residual_row_stride, const T* weight, int8_t* out,
                           float* scale_out, const float* static_scale, int64_t rows,
                           int64_t hidden, float eps, cudaStream_t stream,
                           FusedQuantTuning tuning) {
  if (hidden <= 0 || rows < 0 || hidden > (1 << 30)) return cudaErrorInvalidValue;
  if (rows == 0) {
    if (static_scale == nullptr) return cudaSuccess;
    return cudaMemcpyAsync(scale_out, static_scale, sizeof(float), cudaMemcpyDeviceToDevice,
                           stream);
  }
  constexpr int VEC = 16 / sizeof(T);
  constexpr int64_t kBytes = sizeof(T);
  const bool vec_ok =
      hidden % VEC == 0 && is_aligned(in, 16) && (in_row_stride * kBytes) % 16 == 0 &&
      is_aligned(weight, 16) &&
      (residual == nullptr ||
       (is_aligned(residual, 16) && (residual_row_stride * kBytes) % 16 == 0)) &&
      is_aligned(out, 8);
  const fq::DeviceInfo dev = fq::device_info();
  fq::ShapeHints hints{tuning.threads_per_row_target, tuning.cluster};
  fq::RowShape sh;
  const bool ok =
      vec_ok ? fq::choose_row_shape_or_default(rows, hidden / VEC, VEC, hidden * kBytes, 8,
                                               dev.clusters, dev.sms, hints, &sh,
                                               norm_max_threads_host)
             : fq::choose_row_shape(rows, hidden, 1, hidden * kBytes, 32, false, dev.sms,
                                    fq::ShapeHints{512, 1}, &sh, norm_max_threads_host);
  if (!ok) return cudaErrorInvalidValue;
  const int64_t nvec = hidden / sh.vec;
  NormParams p{in,
               in_row_stride,
               residual,
               residual_row_stride,
               weight,
               out,
               scale_out,
               static_scale,
               rows,
               static_cast<int>(hidden),
               sh.cluster,
               static_cast<int>((nvec + sh.cluster - 1) / sh.cluster),
               eps};
  return vec_ok ? dispatch_nv<T, VEC>(p, sh, stream) : dispatch_nv<T, 1>(p, sh, stream);
}

#define QOPS_INSTANTIATE(T)                                                                  \
  template cudaError_t rms_norm_quant<T>(const T*, int64_t, T*, int64_t, const T*, int8_t*, \
                                         float*, const float*, int64_t, int64_t, float,     \
                                         cudaStream_t, FusedQuantTuning);
QOPS_INSTANTIATE(__half)
QOPS_INSTANTIATE(__nv_bfloat16)
#undef QOPS_INSTANTIATE

}  // namespace qops
