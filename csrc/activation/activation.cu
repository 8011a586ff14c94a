// SiLU-and-mul + int8 quantization kernels. See activation.h for the contract and
// docs/norm_activation.md for the design.
//
// The row-resident scheme of the norm kernels (csrc/quant/fused_row_quant.cuh): each thread loads
// its gate and up vectors (16 bytes each) for all of its NV slots before the first use, keeps
// y = silu(g) * u in registers while the row's amax is reduced (dynamic scales), then stores the
// int8 row (8 bytes per vector). With a static scale there is no reduction and no barrier.
#include "activation/activation.h"
#include "common/cluster.cuh"  // cluster_wait
#include "common/convert.cuh"  // to_float
#include "common/launch.cuh"   // pdl_wait, pdl_launch_dependents
#include "common/memory.cuh"   // is_aligned
#include "common/quant.cuh"    // absmax_to_scale, RowQuant
#include "quant/fused_quant_tuning.h"
#include "quant/fused_row_quant.cuh"

namespace qops {
namespace {

using fq::Vec;

struct ActParams {
  const void* in;
  int64_t in_stride;
  int8_t* out;      // int8 output (silu_and_mul_quant)
  void* out_float;  // T output (silu_and_mul; out is then nullptr)
  float* scale_out;
  const float* static_scale;  // nullptr: dynamic per-token scales
  int64_t rows;
  int inter;
  int cluster;  // CTAs per row
  int slice;    // vectors per CTA slice of a row
};

// silu(g) = g / (1 + e^-g): ex2.approx and a fast division (the contract allows one int8 step;
// the quantizing division below stays IEEE). g -> -inf gives -0 (e^-g = inf), as does the
// reference up to sign; NaN stays NaN.
__device__ __forceinline__ float silu(float g) {
  return __fdividef(g, 1.0f + __expf(-g));
}

// kQ = false (silu_and_mul): y rounded once to T into p.out_float; no amax, no scale, no barrier.
template <typename T, int VEC, int NV, bool kQ = true>
__global__ void __launch_bounds__(fq::max_threads_for(NV* VEC), fq::min_blocks_for(NV* VEC))
    silu_and_mul_quant_kernel(const ActParams p) {
  __shared__ float red[2][32];
  __shared__ float part[2];
  pdl_wait();  // the previous kernel may write the input (common/launch.cuh)
  pdl_launch_dependents();
  const int tpr = blockDim.x;
  const int tid = threadIdx.x;
  const int C = p.cluster;
  const int rank = C > 1 ? static_cast<int>(blockIdx.x % C) : 0;
  const int nvec = p.inter / VEC;
  const int v0 = rank * p.slice;
  const int v1 = min(nvec, v0 + p.slice);
  const bool dynamic = kQ && p.static_scale == nullptr;
  // Static scales (and no quantization): the slices of a row never meet (no cluster launch).
  const bool sync_cluster = dynamic && C > 1;

  const float s_static = (!kQ || dynamic) ? 0.0f : __ldg(p.static_scale);
  if (kQ && !dynamic && blockIdx.x == 0 && tid == 0 && threadIdx.y == 0) p.scale_out[0] = s_static;
  const RowQuant qz_static(s_static);

  {
    const int64_t rb = blockIdx.x / C;
    const int64_t row = rb * blockDim.y + threadIdx.y;
    const bool row_ok = row < p.rows;
    const T* g = static_cast<const T*>(p.in) + (row_ok ? row : 0) * p.in_stride;
    const T* u = g + p.inter;

    Vec<T, VEC> gv[NV], uv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = v0 + tid + k * tpr;
      if (row_ok && v < v1) {
        gv[k] = fq::load<T, VEC>(g + v * VEC);
        uv[k] = fq::load<T, VEC>(u + v * VEC);
      }
    }

    float y[NV][VEC];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = v0 + tid + k * tpr;
      if (row_ok && v < v1) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          y[k][j] = silu(to_float(gv[k].v[j])) * to_float(uv[k].v[j]);
          amax = fmaxf(amax, fabsf(y[k][j]));  // fmaxf ignores NaN
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) y[k][j] = 0.0f;
      }
    }

    if constexpr (!kQ) {
      if (row_ok) {
        T* o = static_cast<T*>(p.out_float) + row * static_cast<int64_t>(p.inter);
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const int v = v0 + tid + k * tpr;
          if (v < v1) {
            Vec<T, VEC> ov;
#pragma unroll
            for (int j = 0; j < VEC; ++j) ov.v[j] = from_float<T>(y[k][j]);
            fq::store<T, VEC>(o + v * VEC, ov);
          }
        }
      }
      return;
    }
    float s = s_static;
    if (dynamic) {
      float unused = 0.0f;
      fq::row_reduce<false, true>(unused, amax, red);
      if (sync_cluster) fq::cluster_reduce<false, true>(unused, amax, part, C);
      s = absmax_to_scale(amax);
      if (row_ok && tid == 0 && rank == 0) p.scale_out[row] = s;
    }
    const RowQuant qz = dynamic ? RowQuant(s) : qz_static;

    if (row_ok) {
      int8_t* o = p.out + row * static_cast<int64_t>(p.inter);
      if (qz.fast) {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const int v = v0 + tid + k * tpr;
          if (v < v1) fq::store_q_impl<true>(o + v * VEC, y[k], qz);
          asm volatile("" ::: "memory");  // one vector at a time (registers, see norm_rowres.cu)
        }
      } else {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const int v = v0 + tid + k * tpr;
          if (v < v1) fq::store_q_impl<false>(o + v * VEC, y[k], qz);
          asm volatile("" ::: "memory");  // one vector at a time (registers, see norm_rowres.cu)
        }
      }
    }
    if (sync_cluster) cluster_wait();  // peers may still read `part` until they arrive
  }
}

template <typename T, int VEC, int NV>
cudaError_t launch(const ActParams& p, const fq::RowShape& sh, cudaStream_t stream) {
  const int64_t row_blocks = (p.rows + sh.rows_per_block - 1) / sh.rows_per_block;
  if (p.out == nullptr)  // silu_and_mul: the slices of a row never meet
    return fq::launch_rows(silu_and_mul_quant_kernel<T, VEC, NV, false>, p, sh, row_blocks, stream,
                           /*use_cluster=*/false);
  return fq::launch_rows(silu_and_mul_quant_kernel<T, VEC, NV>, p, sh, row_blocks, stream,
                         /*use_cluster=*/p.static_scale == nullptr);
}

template <typename T, int VEC>
cudaError_t dispatch_nv(const ActParams& p, const fq::RowShape& sh, cudaStream_t stream) {
  return fq::dispatch_vec_per_thread<VEC>(sh.vec_per_thread, [&](auto nv) {
    return launch<T, VEC, decltype(nv)::value>(p, sh, stream);
  });
}

// Both ops: out (int8) or out_float (T), the other nullptr.
template <typename T>
cudaError_t silu_and_mul_impl(const T* in, int64_t in_row_stride, int8_t* out, T* out_float,
                              float* scale_out, const float* static_scale, int64_t rows,
                              int64_t inter, cudaStream_t stream, FusedQuantTuning tuning) {
  if (inter <= 0 || rows < 0 || inter > (1 << 29)) return cudaErrorInvalidValue;
  if (rows == 0) {
    if (static_scale == nullptr || out == nullptr) return cudaSuccess;
    return cudaMemcpyAsync(scale_out, static_scale, sizeof(float), cudaMemcpyDeviceToDevice,
                           stream);
  }
  constexpr int VEC = 16 / sizeof(T);
  constexpr int64_t kBytes = sizeof(T);
  const bool vec_ok = inter % VEC == 0 && is_aligned(in, 16) &&
                      (in_row_stride * kBytes) % 16 == 0 &&
                      (out != nullptr ? is_aligned(out, 8) : is_aligned(out_float, 16));
  const fq::DeviceInfo dev = fq::device_info();
  fq::ShapeHints hints{tuning.threads_per_row_target, tuning.cluster};
  fq::RowShape sh;
  const bool ok = vec_ok
                      ? fq::choose_row_shape_or_default(rows, inter / VEC, VEC, 2 * inter * kBytes,
                                                        8, dev.clusters, dev.sms, hints, &sh)
                      : fq::choose_row_shape(rows, inter, 1, 2 * inter * kBytes, 32, false, dev.sms,
                                             fq::ShapeHints{512, 1}, &sh);
  if (!ok) return cudaErrorInvalidValue;
  sh.pdl = tuning.pdl;
  const int64_t nvec = inter / sh.vec;
  ActParams p{in,         in_row_stride,
              out,        out_float,
              scale_out,  static_scale,
              rows,       static_cast<int>(inter),
              sh.cluster, static_cast<int>((nvec + sh.cluster - 1) / sh.cluster)};
  return vec_ok ? dispatch_nv<T, VEC>(p, sh, stream) : dispatch_nv<T, 1>(p, sh, stream);
}

}  // namespace

template <typename T>
cudaError_t silu_and_mul_quant(const T* in, int64_t in_row_stride, int8_t* out, float* scale_out,
                               const float* static_scale, int64_t rows, int64_t inter,
                               cudaStream_t stream, FusedQuantTuning tuning) {
  return silu_and_mul_impl<T>(in, in_row_stride, out, nullptr, scale_out, static_scale, rows, inter,
                              stream, tuning);
}

template <typename T>
cudaError_t silu_and_mul(const T* in, int64_t in_row_stride, T* out, int64_t rows, int64_t inter,
                         cudaStream_t stream, FusedQuantTuning tuning) {
  return silu_and_mul_impl<T>(in, in_row_stride, nullptr, out, nullptr, nullptr, rows, inter,
                              stream, tuning);
}

#define QOPS_INSTANTIATE(T)                                                                     \
  template cudaError_t silu_and_mul_quant<T>(const T*, int64_t, int8_t*, float*, const float*,  \
                                             int64_t, int64_t, cudaStream_t, FusedQuantTuning); \
  template cudaError_t silu_and_mul<T>(const T*, int64_t, T*, int64_t, int64_t, cudaStream_t,   \
                                       FusedQuantTuning);
QOPS_INSTANTIATE(__half)
QOPS_INSTANTIATE(__nv_bfloat16)
#undef QOPS_INSTANTIATE

}  // namespace qops
