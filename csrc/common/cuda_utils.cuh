// Small device helpers shared by the hand-written kernels (torch-free).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace qops {

// ---- programmatic dependent launch (PDL, sm_90+) -----------------------------------------------
// A kernel launched with the attribute append_pdl_attribute adds may be dispatched while the
// previous kernel in the stream is still running (in a CUDA graph: a programmatic edge). It must
// call pdl_wait() before touching memory that kernel may have written -- pdl_wait() returns once
// the previous grid has completed and its writes are visible -- and may call
// pdl_launch_dependents() to let the next PDL kernel be dispatched before this one ends (without
// the call that happens when it ends). Both are no-ops below sm_90 and when the launch did not
// allow PDL. QOPS_PDL=0 launches every qops kernel without the attribute (qops_glue::pdl_enabled).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- cp.async (sm_80+): global -> shared copies that hold no registers while in flight ---------
// `smem` is a shared-memory address (smem_addr). The 16-byte form bypasses L1 (.cg); the 4-byte
// form must go through it (.ca: .cg takes only 16 bytes). Commit groups complete in issue order.
__device__ __forceinline__ void cp_async16(unsigned smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(unsigned smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- thread-block clusters (sm_90) --------------------------------------------------------------
// The 32-bit shared-window address of a shared variable (what PTX shared-memory operands take).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The address of shared-window address `smem` of this CTA in the shared memory of cluster rank
// `rank` (for ld/st.shared::cluster, st.async, remote mbarriers). sm_90 only.
__device__ __forceinline__ uint32_t dsmem_addr(uint32_t smem, uint32_t rank) {
  uint32_t r = smem;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem), "r"(rank));
#endif
  return r;
}
// The cluster barrier in its two halves; every thread of every CTA of the cluster arrives, then
// waits until all have arrived (the wait acquires what the arrivals released). cluster_arrive()
// releases the thread's prior writes, shared and global, to the cluster: ptxas implements that as
// MEMBAR.ALL.GPU, which also waits for the thread's outstanding global stores.
// cluster_arrive_relaxed() orders nothing: enough where the barrier only says "every CTA has got
// this far" (peers' mbarriers are initialized; peers have used the values they read from this
// CTA). No-ops below sm_90.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// Appends the programmatic-stream-serialization attribute to `cfg`, whose attributes live in
// `attrs` (room for one more entry). Harmless on devices without PDL (the runtime ignores it).
inline void append_pdl_attribute(cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attrs) {
  cfg->attrs = attrs;
  cudaLaunchAttribute& a = attrs[cfg->numAttrs++];
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
}

// kernel<<<grid, block, 0, stream>>>(args...), with programmatic dependent launch when `pdl`.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl) append_pdl_attribute(&cfg, attr);
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

constexpr float kScaleFloor = 1e-10f;  // python/qops/quantization.py SCALE_FLOOR

// Dynamic symmetric scale from a row's amax (fmaxf-reduced, so NaN is ignored).
__device__ __forceinline__ float absmax_to_scale(float amax) {
  return fmaxf(amax / 127.0f, kScaleFloor);
}

// The quantizer of one row (one scale): the qops int8 convention (python/qops/quantization.py,
// docs/ops.md: y / s as an IEEE float32 division, rounded half to even, saturated to [-128, 127],
// NaN to 0), with that quotient computed without a per-element division: with r = RN(1 / s) (one
// IEEE division per row), q0 = RN(y * r) is within one ulp of y / s, and Markstein's correction
// RN(q0 + RN(y - s * q0) * r) (two FMAs; the remainder is exact) is the correctly rounded
// quotient. That holds while y, s, r and the quotient stay normal; the fast path is taken only
// for 1e-30 <= |s| <= 1e30, where every quotient that can round to a non-zero int8 is normal.
// Other scales (0, Inf, NaN, extreme statics) take the IEEE division itself. Where the correction
// yields NaN (y = +-Inf), q0 already holds IEEE's answer (+-Inf).
// The saving is the per-element MUFU.RCP + FCHK + slow-path branch of the IEEE division: the
// conversion/special-function pipe runs at 1/8 of the FMA rate on sm_90, and was the busiest.
// Used by the fused norm / activation kernels, the quantization kernels and the KV-cache write.
struct RowQuant {
  float s, r;
  bool fast;
  __device__ __forceinline__ explicit RowQuant(float scale) : s(scale) {
    const float a = fabsf(scale);
    fast = a >= 1e-30f && a <= 1e30f;
    r = fast ? __frcp_rn(scale) : 0.0f;
  }
  // The same quantizer from RowQuant(scale).r computed by another thread (shared memory): saves
  // the reciprocal's ~10 instructions where many warps quantize one row.
  __device__ __forceinline__ RowQuant(float scale, float recip) : s(scale), r(recip) {
    const float a = fabsf(scale);
    fast = a >= 1e-30f && a <= 1e30f;
  }
};

// cvt.rni.sat.s8: round half to even, saturate to [-128, 127], NaN -> 0; the int8 in the low byte.
__device__ __forceinline__ uint32_t cvt_s8(float q) {
  uint32_t r;
  asm("cvt.rni.sat.s8.f32 %0, %1;" : "=r"(r) : "f"(q));
  return r & 0xffu;
}
// kInfCheck = false drops the select for y = +-Inf (two instructions per element). Only valid where
// no y is +-Inf on the fast path: the dynamic per-token scale, where fast means
// s = fl(amax|y| / 127) <= 1e30, so every |y| <= amax|y| is finite (NaN y gives NaN q either way,
// and cvt maps NaN to 0, as the checked form does).
template <bool kFast, bool kInfCheck = true>
__device__ __forceinline__ uint32_t quant_one(float y, const RowQuant& qz) {
  if constexpr (kFast) {
    const float q0 = y * qz.r;
    const float q = fmaf(fmaf(-qz.s, q0, y), qz.r, q0);
    if constexpr (kInfCheck)
      return cvt_s8(q != q ? q0 : q);
    else
      return cvt_s8(q);
  } else {
    return cvt_s8(__fdiv_rn(y, qz.s));
  }
}

// Four quantized values as one word, little-endian (y[0] in the lowest byte).
template <bool kFast, bool kInfCheck = true>
__device__ __forceinline__ uint32_t quant_pack4(const float* y, const RowQuant& qz) {
  return quant_one<kFast, kInfCheck>(y[0], qz) | (quant_one<kFast, kInfCheck>(y[1], qz) << 8) |
         (quant_one<kFast, kInfCheck>(y[2], qz) << 16) |
         (quant_one<kFast, kInfCheck>(y[3], qz) << 24);
}

// quant_one<false> out of line: the exact-division path of a kernel whose fast path is hot (scales
// outside RowQuant's range are rare), so that its per-element division and slow-path call neither
// bloat the hot code nor take its registers. Same quotient.
static __device__ __noinline__ uint32_t quant_div_exact(float y, float s) {
  return cvt_s8(__fdiv_rn(y, s));
}

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide max; every thread gets the result. `smem` holds at least 32 floats.
__device__ __forceinline__ float block_reduce_max(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_reduce_max(v);
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.0f;
  return warp_reduce_max(v);
}

__device__ __forceinline__ float block_reduce_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_reduce_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.0f;
  return warp_reduce_sum(v);
}

inline bool is_aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

}  // namespace qops
