// RMSNorm (+ residual add) + int8 quantization: the persistent pipelined kernel (many rows; a
// cp.async row ring in shared memory) and its launcher. See norm.h for the contract,
// docs/norm_activation.md for the design and measurements, norm.cu for the launcher that picks
// the kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/device_cache.h"
#include "common/launch.cuh"  // pdl_wait, pdl_launch_dependents, append_pdl_attribute
#include "common/quant.cuh"   // absmax_to_scale, RowQuant, quant_div_exact
#include "norm/norm_common.cuh"
#include "quant/fused_quant_tuning.h"
#include "quant/fused_row_quant.cuh"

namespace qops {
namespace {

// ---- Pipelined variant (many rows) -----------------------------------------------------------
//
// A persistent grid (as many CTAs as fit, over all SMs) walks the rows with a grid stride. A CTA
// holds `rows_per_block` independent row groups (blockDim.y; 4 one-warp groups for rows of <= 128
// vectors, else one group) of `threads_per_row` threads (blockDim.x, 1..8 warps); each group owns
// a ring of S row buffers in shared memory (x, and the residual row when fused) that cp.async
// (16 bytes, .cg) fills S rows ahead. Every thread copies
// exactly the 16-byte slots it later reads (vector v = threadIdx.x + k * blockDim.x of the row),
// so the ring needs no block barrier: cp.async.wait_group makes a thread's own copies visible to
// it, and a slot is refilled by the thread that read it, after that read's value fed the row's
// reduction (the shuffles below wait for every load of the stage; the refill is issued after
// them). While row i is reduced, quantized and stored, rows i+1..i+S-1 (i+1..i+S during the
// quantize-store pass) are in flight.
//
// Registers hold the current row as p = z * w in float32 (8 per vector, NV <= 4 vectors per
// thread): the second pass is y = p * rstd and the quantizer, with no weight re-read. Numerics are
// the row-resident kernel's (y = fl(fl(z * w) * rstd), the same scale and quantizer); only the
// float32 order of sum(z^2) differs.
// (kPipeMaxNV, the vectors per thread, and kPipeOneWarpVectors: norm_common.cuh.)
constexpr int kPipeMaxWarpsPerRow = 8;  // nvec <= 8 * 32 * 4 = 1024 (hidden <= 8192 at 2 bytes)
constexpr int kPipeMaxThreads = 256;    // CTA size bound (rows_per_block * threads_per_row)
constexpr int kPipeMaxGroups = 4;       // one-warp rows per CTA (128 threads)
constexpr int kPipeDefaultStages = 2;   // ring depth (QOPS_NORM_PIPE_STAGES=3 overrides)

// Two T (16-bit) in a 32-bit word <-> two floats; element 0 in the low half. bf16 -> float is a
// shift / mask (exact), float -> T rounds to nearest even (the same conversions as to_float /
// from_float, two at a time).
__device__ __forceinline__ float2 unpack2(uint32_t u, __nv_bfloat16*) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
__device__ __forceinline__ float2 unpack2(uint32_t u, __half*) {
  __half2 h;
  memcpy(&h, &u, 4);
  return __half22float2(h);
}
__device__ __forceinline__ uint32_t pack2_rn(float a, float b, __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
__device__ __forceinline__ uint32_t pack2_rn(float a, float b, __half*) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// y = p * rstd, quantized, 8 bytes of int8 per vector.
template <int NV, bool kFull, bool kFast, bool kInfCheck>
__device__ __forceinline__ void pipe_store(int8_t* o, const float (&pz)[NV][8], int nvec, int tid,
                                           int tpr, float rstd, const RowQuant& qz) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (kFull || tid + k * tpr < nvec) {
      float y[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = pz[k][j] * rstd;
      fq::store_q_impl<kFast, 8, kInfCheck>(o + k * tpr * 8, y, qz);
    }
  }
}

// pipe_store's exact-division path uses quant_div_exact (common/quant.cuh), out of line.
// Inlined, its ~14 instructions and slow-path call per element made a ~690-instruction block that
// ptxas placed inside the row loop, between the reduction and the fast path (ncu, 4096 x 4096: 3.5
// "no instruction" stall cycles per issued instruction).

template <int NV, bool kFull>
__device__ __forceinline__ void pipe_store_exact(int8_t* o, const float (&pz)[NV][8], int nvec,
                                                 int tid, int tpr, float rstd, float s) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (kFull || tid + k * tpr < nvec) {
      uint32_t w[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        w[i] = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) w[i] |= quant_div_exact(pz[k][4 * i + j] * rstd, s) << (8 * j);
      }
      *reinterpret_cast<uint2*>(o + k * tpr * 8) = make_uint2(w[0], w[1]);
    }
  }
}

// The rows of one row group (see above). kFull: every thread owns NV vectors (nvec == NV * tpr).
template <typename T, int NV, int S, bool kRes, bool kDyn, bool kFull>
__device__ __forceinline__ void pipe_rows(const NormParams& p, uint4* ring_base,
                                          float (*red)[kPipeMaxGroups][16]) {
  static_assert(sizeof(T) == 2, "16-bit types: 8 per 16-byte vector");
  constexpr int VEC = 8;
  constexpr int kArrays = kRes ? 2 : 1;  // x, residual
  const int tpr = blockDim.x;
  const int tid = threadIdx.x;
  const int grp = threadIdx.y;
  const int wpr = tpr >> 5;
  const int lane = tid & 31;
  const int nvec = p.hidden / VEC;
  const uint32_t stage_bytes = static_cast<uint32_t>(kArrays * nvec) * 16u;
  const uint32_t kstep = static_cast<uint32_t>(tpr) * 16u;  // bytes between a thread's vectors
  // This thread's slot 0 of stage 0 (32-bit shared address); slot k of stage st of array a at
  // + st * stage_bytes + a * nvec * 16 + k * kstep.
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(ring_base)) +
                        static_cast<uint32_t>(grp) * S * stage_bytes +
                        static_cast<uint32_t>(tid) * 16u;
  const char* xt = static_cast<const char*>(p.in) + tid * 16;
  char* rt = kRes ? static_cast<char*>(p.residual) + tid * 16 : nullptr;
  const char* wt = static_cast<const char*>(p.weight) + tid * 16;
  const int64_t x_pitch = p.in_stride * 2, r_pitch = p.res_stride * 2;  // bytes per row
  const auto ok = [&](int k) { return kFull || tid + k * tpr < nvec; };

  const float s_static = kDyn ? 0.0f : __ldg(p.static_scale);
  if (!kDyn && blockIdx.x == 0 && tid == 0 && grp == 0) p.scale_out[0] = s_static;

  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + grp;

  // This thread's slots of row r into stage st, as one commit group (empty past the last row, so
  // that every thread commits one group per row step and wait_group<S - 1> means "row i landed").
  const auto issue = [&](int64_t r, int st) {
    if (r < p.rows) {
      const uint32_t d = ring + st * stage_bytes;
      const char* xr = xt + r * x_pitch;
#pragma unroll
      for (int k = 0; k < NV; ++k)
        if (ok(k)) fq::cp_async16(d + k * kstep, xr + k * kstep);
      if constexpr (kRes) {
        const char* rr = rt + r * r_pitch;
#pragma unroll
        for (int k = 0; k < NV; ++k)
          if (ok(k)) fq::cp_async16(d + nvec * 16 + k * kstep, rr + k * kstep);
      }
    }
    fq::cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < S; ++s) issue(row + s * stride, s);

  int st = 0;
  for (int it = 0; row < p.rows; ++it, row += stride) {
    fq::cp_async_wait<S - 1>();  // this thread's copies of `row` (stage st) have landed
    const uint32_t src = ring + st * stage_bytes;

    // Pass 1: z (x + residual, rounded to T and written back), sum(z^2), p = z * w, amax|p|.
    float pz[NV][VEC];
    float sumsq = 0.0f, amax = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (ok(k)) {
        uint4 z = lds128(src + k * kstep);
        if constexpr (kRes) {
          const uint4 rv = lds128(src + nvec * 16 + k * kstep);
          const uint32_t* zw = &z.x;
          const uint32_t* rw = &rv.x;
          uint32_t s4[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 a = unpack2(zw[i], static_cast<T*>(nullptr));
            const float2 b = unpack2(rw[i], static_cast<T*>(nullptr));
            s4[i] = pack2_rn(a.x + b.x, a.y + b.y, static_cast<T*>(nullptr));
          }
          z = make_uint4(s4[0], s4[1], s4[2], s4[3]);
          *reinterpret_cast<uint4*>(rt + row * r_pitch + k * kstep) = z;
        }
        const uint4 wv = __ldg(reinterpret_cast<const uint4*>(wt + k * kstep));
        const uint32_t* zw = &z.x;
        const uint32_t* ww = &wv.x;
        float ss = 0.0f, mx = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 zf = unpack2(zw[i], static_cast<T*>(nullptr));
          const float2 wf = unpack2(ww[i], static_cast<T*>(nullptr));
          ss = fmaf(zf.x, zf.x, ss);
          ss = fmaf(zf.y, zf.y, ss);
          pz[k][2 * i] = zf.x * wf.x;
          pz[k][2 * i + 1] = zf.y * wf.y;
          if (kDyn) mx = fmaxf(mx, fmaxf(fabsf(pz[k][2 * i]), fabsf(pz[k][2 * i + 1])));
        }
        sumsq += ss;
        if (kDyn) amax = fmaxf(amax, mx);  // fmaxf ignores NaN
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) pz[k][j] = 0.0f;
      }
    }

    // Row reduction: shuffles within each warp; with several warps per row, lane 0 of each warp
    // publishes its partials in red[it & 1][0] (sums at [0, 8), maxima at [8, 16); the slots of
    // absent warps stay zero), and after the CTA barrier (such rows are one group per CTA) every
    // thread reads them with 16-byte broadcasts and combines them in one fixed order: all threads
    // of the row get bitwise-identical results. Double-buffered by row parity, so one barrier per
    // row suffices: a warp rewrites red[b] only two rows later, after the next barrier, which
    // every warp reaches only after reading red[b].
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sumsq += __shfl_xor_sync(0xffffffffu, sumsq, o);
      if (kDyn) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    }
    if (wpr > 1) {
      float* r = red[it & 1][grp];
      if (lane == 0) {
        r[tid >> 5] = sumsq;
        if (kDyn) r[8 + (tid >> 5)] = amax;
      }
      __syncthreads();  // rows of several warps are one group per CTA (choose_pipe_shape)
      const float4* r4 = reinterpret_cast<const float4*>(r);
      const float4 a = r4[0];
      sumsq = (a.x + a.y) + (a.z + a.w);
      if (wpr > 4) {
        const float4 b = r4[1];
        sumsq += (b.x + b.y) + (b.z + b.w);
      }
      if (kDyn) {
        const float4 m = r4[2];
        amax = fmaxf(fmaxf(m.x, m.y), fmaxf(m.z, m.w));
        if (wpr > 4) {
          const float4 n = r4[3];
          amax = fmaxf(amax, fmaxf(fmaxf(n.x, n.y), fmaxf(n.z, n.w)));
        }
      }
    }

    // Refill stage st with the row S steps ahead. This thread's reads of stage st are complete:
    // every value read fed sumsq, which the shuffles above consumed; and the shared loads and the
    // copies are volatile asm with memory clobbers, so the compiler keeps their order.
    issue(row + S * stride, st);
    st = st + 1 == S ? 0 : st + 1;

    // Pass 2: quantize y = p * rstd (the row-resident kernel's expressions).
    const float rstd = row_rstd(sumsq, p.hidden, p.eps);
    const float s = kDyn ? absmax_to_scale(amax * rstd) : s_static;
    if (kDyn && tid == 0) p.scale_out[row] = s;
    const RowQuant qz(s);
    int8_t* o = p.out + row * static_cast<int64_t>(p.hidden) + tid * VEC;
    if (qz.fast)
      pipe_store<NV, kFull, true, !kDyn>(o, pz, nvec, tid, tpr, rstd, qz);
    else
      pipe_store_exact<NV, kFull>(o, pz, nvec, tid, tpr, rstd, s);
  }
  fq::cp_async_wait<0>();  // nothing is in flight past the last row; kept as a guard
}

// Register caps (ptxas -v, sm_90, NV = 4): 64 without the residual (8 CTAs of 128 threads per SM at
// H = 4096 instead of 6 at the ~80 registers it takes uncapped; the 2-stage build spills a few
// loop invariants, reloaded once per row), 85 with it (80 used: 6 CTAs at H = 4096, which the
// 32 KB ring per CTA allows too). One barrier (__syncthreads) only: see choose_pipe_shape.
template <typename T, int NV, int S, bool kRes>
__global__ void __launch_bounds__(kPipeMaxThreads, kRes ? 3 : 4)
    rms_norm_quant_pipe_kernel(const NormParams p) {
  extern __shared__ uint4 pipe_ring[];
  __shared__ __align__(16) float red[2][kPipeMaxGroups][16];
  pdl_wait();  // as rms_norm_quant_kernel (norm_rowres.cu)
  pdl_launch_dependents();
  {  // the partial slots of absent warps must read as zero (see the row reduction)
    const int t = threadIdx.y * blockDim.x + threadIdx.x;
    for (int i = t; i < 2 * kPipeMaxGroups * 16; i += blockDim.x * blockDim.y)
      (&red[0][0][0])[i] = 0.0f;
    __syncthreads();
  }
  const bool full = p.hidden / 8 == NV * static_cast<int>(blockDim.x);
  if (p.static_scale == nullptr) {
    if (full)
      pipe_rows<T, NV, S, kRes, true, true>(p, pipe_ring, red);
    else
      pipe_rows<T, NV, S, kRes, true, false>(p, pipe_ring, red);
  } else {
    if (full)
      pipe_rows<T, NV, S, kRes, false, true>(p, pipe_ring, red);
    else
      pipe_rows<T, NV, S, kRes, false, false>(p, pipe_ring, red);
  }
}

// Launch shape of the pipelined kernel.
struct PipeShape {
  int nv = 0;               // vectors per thread
  int threads_per_row = 0;  // blockDim.x (whole warps)
  int rows_per_block = 1;   // blockDim.y: independent row groups per CTA
  int stages = kPipeDefaultStages;
  size_t smem = 0;  // dynamic shared memory per CTA (the rings)
};

// The fewest warps per row giving <= kPipeMaxNV vectors per thread, except rows of exactly 4 or 8
// warps at 2 vectors per thread (H = 2048, 4096), which take those (or the QOPS_FQ_TPR hint when
// it fits); false when the row is too long for this kernel. H100, bf16, same-run A/B: H = 4096 at
// 16384 rows 80.0 -> 73.5 us with 8 warps instead of 4, H = 2048 40.0 -> 38.2 us (4096 rows:
// equal, 12.6 -> 11.6 us); 2 vectors per thread measured no better at H = 1536 (3 warps) and 5120
// (3 vectors at 7 warps), so those keep the rule.
bool choose_pipe_shape(int64_t nvec, bool res, const FusedQuantTuning& t, PipeShape* out) {
  auto make = [&](int tpr_target) {
    const bool two = nvec % 64 == 0 && (nvec / 64 == 4 || nvec / 64 == 8);
    int64_t wpr = tpr_target > 0 ? (tpr_target + 31) / 32
                  : two          ? nvec / 64
                                 : (nvec + 32 * kPipeMaxNV - 1) / (32 * kPipeMaxNV);
    if (wpr < 1) wpr = 1;
    if (wpr > kPipeMaxWarpsPerRow) return false;
    const int tpr = static_cast<int>(32 * wpr);
    const int64_t nv = (nvec + tpr - 1) / tpr;
    if (nv > kPipeMaxNV) return false;
    PipeShape s;
    s.nv = static_cast<int>(nv);
    s.threads_per_row = tpr;
    // Only one-warp rows share a CTA (they need no barrier): the rows of several warps use
    // __syncthreads, i.e. one row group per CTA. (Named barriers per group would cost occupancy: a
    // kernel whose bar.sync takes a register id reserves all 16 barriers, and sm_90 has 64 per SM,
    // which would cap it at 4 CTAs per SM.)
    s.rows_per_block = tpr == 32 ? kPipeMaxGroups : 1;
    s.stages = (t.pipe_stages == 2 || t.pipe_stages == 3) ? t.pipe_stages : kPipeDefaultStages;
    s.smem = static_cast<size_t>(s.rows_per_block) * s.stages * (res ? 2 : 1) * nvec * 16;
    *out = s;
    return true;
  };
  return (t.threads_per_row_target > 0 && make(t.threads_per_row_target)) || make(0);
}

using PipeKernel = void (*)(NormParams);

template <typename T, int NV>
PipeKernel pipe_kernel_nv(int stages, bool res) {
  if (stages == 3)
    return res ? rms_norm_quant_pipe_kernel<T, NV, 3, true>
               : rms_norm_quant_pipe_kernel<T, NV, 3, false>;
  return res ? rms_norm_quant_pipe_kernel<T, NV, 2, true>
             : rms_norm_quant_pipe_kernel<T, NV, 2, false>;
}

template <typename T>
PipeKernel pipe_kernel(int nv, int stages, bool res) {
  switch (nv) {
    case 1:
      return pipe_kernel_nv<T, 1>(stages, res);
    case 2:
      return pipe_kernel_nv<T, 2>(stages, res);
    case 3:
      return pipe_kernel_nv<T, 3>(stages, res);
    case 4:
      return pipe_kernel_nv<T, 4>(stages, res);
    default:
      return nullptr;
  }
}

// Resident CTAs per SM of `fn` at this block size and ring size on the current device (0 when the
// ring does not fit): raises the kernel's dynamic shared-memory limit and asks for the largest
// shared-memory carveout on first use; cached per (device, kernel, shape) (common/device_cache.h).
cudaError_t pipe_blocks_per_sm(PipeKernel fn, int threads, size_t smem, int* blocks) {
  const int64_t key = static_cast<int64_t>(smem) * 2048 + threads;  // threads <= 1024
  return cached_device_int(
      reinterpret_cast<const void*>(fn), key,
      [&](int device, int* b) {
        *b = 0;
        int optin = 0;
        cudaError_t e;
        if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) !=
            cudaSuccess)
          return e;
        cudaFuncAttributes attr;
        if ((e = cudaFuncGetAttributes(&attr, fn)) != cudaSuccess) return e;
        if (attr.sharedSizeBytes + smem > static_cast<size_t>(optin)) return cudaSuccess;
        if (smem > static_cast<size_t>(attr.maxDynamicSharedSizeBytes) &&
            (e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem))) != cudaSuccess)
          return e;
        if ((e = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared)) != cudaSuccess)
          return e;
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(b, fn, threads, smem);
      },
      blocks);
}

// Launches the pipelined kernel when the shape fits (*launched = true); otherwise leaves the
// launch to the row-resident kernel. Returns the first CUDA error. The ring is kPipeDefaultStages
// deep unless QOPS_NORM_PIPE_STAGES says otherwise (choose_pipe_shape).
template <typename T>
cudaError_t try_launch_pipelined(const NormParams& p, const FusedQuantTuning& tuning, int sms,
                                 cudaStream_t stream, bool* launched) {
  *launched = false;
  const bool res = p.residual != nullptr;
  const int64_t nvec = p.hidden / (16 / static_cast<int>(sizeof(T)));
  PipeShape sh;
  if (!choose_pipe_shape(nvec, res, tuning, &sh)) return cudaSuccess;
  const int threads = sh.threads_per_row * sh.rows_per_block;
  PipeKernel fn = pipe_kernel<T>(sh.nv, sh.stages, res);
  if (fn == nullptr) return cudaSuccess;
  int blocks_per_sm = 0;
  cudaError_t e = pipe_blocks_per_sm(fn, threads, sh.smem, &blocks_per_sm);
  if (e != cudaSuccess) return e;
  if (blocks_per_sm < 1) return cudaSuccess;
  const int64_t groups = (p.rows + sh.rows_per_block - 1) / sh.rows_per_block;
  const int64_t grid = std::min<int64_t>(groups, static_cast<int64_t>(blocks_per_sm) * sms);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(sh.threads_per_row, sh.rows_per_block);
  cfg.dynamicSmemBytes = sh.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (tuning.pdl) append_pdl_attribute(&cfg, attr);
  *launched = true;
  return cudaLaunchKernelEx(&cfg, fn, p);
}

}  // namespace

namespace norm {

template <typename T>
cudaError_t rms_norm_quant_pipelined(const RmsNormArgs<T>& a, const FusedQuantTuning& tuning,
                                     int sms, cudaStream_t stream, bool* launched) {
  constexpr int VEC = 16 / sizeof(T);
  const NormParams pp{a.in,
                      a.in_row_stride,
                      a.residual,
                      a.residual_row_stride,
                      a.weight,
                      a.out,
                      nullptr,  // out_float: the pipelined kernel only quantizes
                      a.scale_out,
                      a.static_scale,
                      a.rows,
                      static_cast<int>(a.hidden),
                      1,                                 // cluster (unused)
                      static_cast<int>(a.hidden / VEC),  // slice (unused)
                      a.eps};
  return try_launch_pipelined<T>(pp, tuning, sms, stream, launched);
}

template cudaError_t rms_norm_quant_pipelined<__half>(const RmsNormArgs<__half>&,
                                                      const FusedQuantTuning&, int, cudaStream_t,
                                                      bool*);
template cudaError_t rms_norm_quant_pipelined<__nv_bfloat16>(const RmsNormArgs<__nv_bfloat16>&,
                                                             const FusedQuantTuning&, int,
                                                             cudaStream_t, bool*);

}  // namespace norm
}  // namespace qops
