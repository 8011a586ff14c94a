// Device helpers shared by the fused "math + int8 quant" kernels of the norm and activation
// families (csrc/norm/norm_rowres.cu, csrc/norm/norm_pipelined.cu, csrc/activation/activation.cu):
// vector loads and stores, the row quantizer's packed stores, row and cluster reductions, and the
// row-resident launch shape and launch. Torch-free.
//
// Row-resident design (docs/norm_activation.md): a row is owned by `threads_per_row` threads (a
// multiple of 32, blockDim.x) and a block holds `rows_per_block` rows (blockDim.y). Each thread
// owns NV vectors of VEC elements, vector k of its row at index threadIdx.x + k * blockDim.x, and
// keeps its values in registers from the load to the quantized store, so that a dynamic per-token
// scale costs no second read of the row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cluster.cuh"   // cluster_arrive, cluster_wait, dsmem_addr
#include "common/cp_async.cuh"  // smem_addr
#include "common/device_cache.h"
#include "common/launch.cuh"  // append_pdl_attribute
#include "common/quant.cuh"   // RowQuant, quant_one, quant_pack4

namespace qops {
namespace fq {

// Raw storage type moved by one load / store of BYTES bytes.
template <int BYTES>
struct Raw;
template <>
struct Raw<16> {
  using type = uint4;
};
template <>
struct Raw<8> {
  using type = uint2;
};
template <>
struct Raw<4> {
  using type = uint32_t;
};
template <>
struct Raw<2> {
  using type = uint16_t;
};
template <>
struct Raw<1> {
  using type = uint8_t;
};

// N elements of T moved with one instruction.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load(const T* p) {
  using R = typename Raw<sizeof(T) * N>::type;
  Vec<T, N> r;
  *reinterpret_cast<R*>(&r) = *reinterpret_cast<const R*>(p);
  return r;
}

// Streamed data (read once per kernel): 16-byte loads that do not allocate in L1, so that what
// is reused from L1 (the norm weight) is not evicted by the stream. Other sizes: a plain load.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_stream(const T* p) {
  if constexpr (sizeof(T) * N == 16) {
    uint4 u;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                 : "l"(p));
    Vec<T, N> r;
    *reinterpret_cast<uint4*>(&r) = u;
    return r;
  } else {
    return load<T, N>(p);
  }
}

// Read-only, reused by every row (the norm weight): through the non-coherent path.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_ldg(const T* p) {
  using R = typename Raw<sizeof(T) * N>::type;
  Vec<T, N> r;
  *reinterpret_cast<R*>(&r) = __ldg(reinterpret_cast<const R*>(p));
  return r;
}

// The same read-only load, but `volatile` so that the compiler re-issues it rather than keeping the
// first load's registers alive across a barrier (the weight is re-read from L1/L2 after the
// reduction instead of occupying registers during it).
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> reload_ldg(const T* p) {
  static_assert(sizeof(T) * N == 16 || sizeof(T) * N == 2, "16-byte or 2-byte vectors");
  Vec<T, N> r;
  if constexpr (sizeof(T) * N == 16) {
    uint4 u;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                 : "l"(p));
    *reinterpret_cast<uint4*>(&r) = u;
  } else {
    uint16_t u;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(u) : "l"(p));
    *reinterpret_cast<uint16_t*>(&r) = u;
  }
  return r;
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& v) {
  using R = typename Raw<sizeof(T) * N>::type;
  *reinterpret_cast<R*>(p) = *reinterpret_cast<const R*>(&v);
}

// Asynchronous 16-byte global -> shared copies (sm_80+: cp.async.cg, L2 only, no registers), one
// commit group per call of cp_async_commit(), waited for with cp_async_wait<N>() (all but the N
// most recent groups of this thread complete, and their data visible to this thread). Below sm_80
// the copy is a plain load + store, already complete when issued (the waits are no-ops).
// `smem` is a 32-bit shared-window address (__cvta_generic_to_shared), 16-byte aligned, as is gmem.
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
#else
  const uint4 v = *reinterpret_cast<const uint4*>(gmem);
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// N quantized values packed into N bytes (little-endian: element 0 in the lowest byte).
template <bool kFast, int N, bool kInfCheck = true>
__device__ __forceinline__ void store_q_impl(int8_t* p, const float (&y_in)[N],
                                             const RowQuant& qz) {
  const float (&y)[N] = y_in;
  if constexpr (N % 4 == 0) {
    uint32_t w[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) w[i] = quant_pack4<kFast, kInfCheck>(y + 4 * i, qz);
    if constexpr (N == 8) {
      *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else if constexpr (N == 4) {
      *reinterpret_cast<uint32_t*>(p) = w[0];
    } else {
#pragma unroll
      for (int i = 0; i < N / 4; ++i) reinterpret_cast<uint32_t*>(p)[i] = w[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = static_cast<int8_t>(quant_one<kFast, kInfCheck>(y[i], qz));
  }
}

// Sum and max over the 32 lanes of a warp, every lane getting both (kSum / kMax: which of them).
template <bool kSum, bool kMax>
__device__ __forceinline__ void warp_reduce_sum_max(float& sum, float& mx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (kSum) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (kMax) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  }
}

// The two halves of a row reduction over several warps, around the caller's __syncthreads:
// warp_partials reduces each warp and leaves its (sum, max) in `red` (2 x 32 floats: at most 32
// warps per block); after the barrier, reduce_partials gives any warp of the row the row's
// (sum, max), every warp the same bitwise (the partials are re-reduced in the same order). A
// kernel where one warp finishes the row alone calls them directly (norm/norm_rowres.cu).
template <bool kSum, bool kMax>
__device__ __forceinline__ void store_partials(float sum, float mx, float (*red)[32]) {
  if ((threadIdx.x & 31) == 0) {
    const int w = threadIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (kSum) red[0][w] = sum;
    if (kMax) red[1][w] = mx;
  }
}
template <bool kSum, bool kMax>
__device__ __forceinline__ void warp_partials(float& sum, float& mx, float (*red)[32]) {
  warp_reduce_sum_max<kSum, kMax>(sum, mx);
  store_partials<kSum, kMax>(sum, mx, red);
}
template <bool kSum, bool kMax>
__device__ __forceinline__ void reduce_partials(float& sum, float& mx, const float (*red)[32]) {
  const int wpr = blockDim.x >> 5, lane = threadIdx.x & 31, base = threadIdx.y * wpr;
  if (kSum) sum = lane < wpr ? red[0][base + lane] : 0.0f;
  if (kMax) mx = lane < wpr ? red[1][base + lane] : 0.0f;
  warp_reduce_sum_max<kSum, kMax>(sum, mx);
}

// Sum and max over the threads of one row (blockDim.x threads; blockDim.y rows per block). Every
// thread of the row gets both results. kMax=false skips the max. One __syncthreads when a row
// spans several warps; none otherwise. Must be reached by every thread of the block (rows past
// the end included).
template <bool kSum, bool kMax>
__device__ __forceinline__ void row_reduce(float& sum, float& mx, float (*red)[32]) {
  warp_reduce_sum_max<kSum, kMax>(sum, mx);
  if (blockDim.x == 32) return;
  store_partials<kSum, kMax>(sum, mx, red);
  __syncthreads();
  reduce_partials<kSum, kMax>(sum, mx, red);
}

// Cross-CTA step of the row reduction when a row is split over a thread-block cluster of
// `cluster` CTAs (sm_90): every CTA publishes its partial (sum, max) in shared memory, and after a
// cluster barrier every thread sums the partials of ranks 0..cluster-1 in rank order, so every CTA
// of the row gets bitwise-identical results. The caller must call cluster_exit_wait() before it
// exits (a peer may still be reading this CTA's partial); cluster_arrive() here releases it.
// (cluster_arrive, cluster_wait, dsmem_addr: common/cluster.cuh; smem_addr: common/cp_async.cuh.)

template <bool kSum, bool kMax>
__device__ __forceinline__ void cluster_reduce(float& sum, float& mx, float* part, int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    part[0] = sum;
    part[1] = mx;
  }
  cluster_arrive();
  cluster_wait();
  const uint32_t local = smem_addr(part);
  float s = 0.0f, m = 0.0f;
  for (int r = 0; r < cluster; ++r) {
    const uint32_t remote = dsmem_addr(local, r);
    float ps, pm;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(ps) : "r"(remote));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(pm) : "r"(remote + 4));
    if (kSum) s += ps;
    if (kMax) m = fmaxf(m, pm);
  }
  sum = s;
  mx = m;
  cluster_arrive();  // this CTA is done reading its peers; cluster_wait() before exit
#endif
}

// Launch shape of a row-resident kernel: blockDim = (threads_per_row, rows_per_block), each
// thread owning `vec_per_thread` vectors of `vec` elements; a row is split over `cluster` CTAs
// (a thread-block cluster, sm_90) when cluster > 1, in which case rows_per_block is 1.
struct RowShape {
  int vec = 1;               // elements per vector (16 bytes of input, or 1 on the scalar path)
  int vec_per_thread = 1;    // NV
  int threads_per_row = 32;  // multiple of 32
  int rows_per_block = 1;
  int cluster = 1;   // CTAs per row
  bool pdl = false;  // launch with programmatic dependent launch (FusedQuantTuning::pdl)
};

// __launch_bounds__ (most threads per block, blocks per SM) for a kernel holding E = NV * VEC
// float values per thread in registers (the activation kernel): 64 registers up to 16 values,
// 85 up to 32 (3 blocks of 256), 128 up to 64 (2 blocks of 256).
__host__ __device__ constexpr int max_threads_for(int elems_per_thread) {
  return elems_per_thread <= 8 ? 1024 : (elems_per_thread <= 16 ? 512 : 256);
}
__host__ __device__ constexpr int min_blocks_for(int elems_per_thread) {
  return elems_per_thread > 32 && elems_per_thread <= 64
             ? 2
             : (elems_per_thread > 16 && elems_per_thread <= 32 ? 3 : 1);
}

// Tuning inputs of choose_row_shape (zeros: defaults).
struct ShapeHints {
  int target_tpr = 0;  // aim for about this many threads per row (per CTA slice)
  int cluster = 0;     // force this many CTAs per row (1, 2, 4, 8); 0 = choose
};

// Picks (cluster, NV, threads_per_row, rows_per_block) for rows of `nvec` vectors of `vec`
// elements (`row_bytes` of input per row), `rows` rows on a GPU with `sms` multiprocessors.
//  - cluster: 1 unless a row does not fit one CTA's registers at a good occupancy (more than
//    2048 vectors), or few rows would leave most SMs idle while each row is large: then the
//    smallest power of two (<= 8) that gives each CTA <= 16 KiB of a row, with rows * cluster
//    <= 2 * sms.
//  - NV = ceil(slice / target), then the fewest warps covering the slice, within the launch
//    bounds of that NV (target: see below); short rows are packed `rows_per_block` to a block of
//    >= 128 threads.
// Returns false when no shape fits (the row is too long).
// `max_threads(nv * vec)` is the kernel's __launch_bounds__ for that many elements per thread.
inline bool choose_row_shape(int64_t rows, int64_t nvec, int vec, int64_t row_bytes, int max_nv,
                             bool allow_cluster, int sms, ShapeHints hints, RowShape* out,
                             int (*max_threads)(int) = nullptr) {
  int c = 1;
  if (allow_cluster) {
    if (hints.cluster > 0) {
      c = hints.cluster;
    } else {
      while (c < 8 && (nvec + c - 1) / c > 2048) c *= 2;
      while (c < 8 && row_bytes / c > (16 << 10) && rows * c * 2 <= 2 * static_cast<int64_t>(sms))
        c *= 2;
    }
  }
  for (;; c *= 2) {
    if (c > (allow_cluster ? 8 : 1)) return false;
    // Default threads per row slice (measured, bench sweep): when every row slice gets its own SM
    // (decode), as many as the kernel allows (fewer vectors per thread: a shorter serial chain);
    // otherwise 256, or 128 for rows of <= 512 vectors (more rows resident per SM).
    const int target = hints.target_tpr > 0 ? hints.target_tpr
                                            : (rows * c <= sms ? 1024 : (nvec <= 512 ? 128 : 256));
    const int64_t slice = (nvec + c - 1) / c;
    int nv0 = static_cast<int>((slice + target - 1) / target);
    if (nv0 < 1) nv0 = 1;
    for (int nv = nv0; nv <= max_nv; ++nv) {
      int64_t tpr = (slice + nv - 1) / nv;
      tpr = (tpr + 31) / 32 * 32;
      if (tpr > (max_threads ? max_threads(nv * vec) : max_threads_for(nv * vec))) continue;
      RowShape s;
      s.vec = vec;
      s.cluster = c;
      s.threads_per_row = static_cast<int>(tpr);
      s.vec_per_thread = static_cast<int>((slice + tpr - 1) / tpr);
      s.rows_per_block = 1;
      if (c == 1)
        while (s.threads_per_row * s.rows_per_block * 2 <= 128) s.rows_per_block *= 2;
      *out = s;
      return true;
    }
    if (hints.cluster > 0) return false;
  }
}

// choose_row_shape with the tuning hints, or without them when the hinted shape does not fit.
inline bool choose_row_shape_or_default(int64_t rows, int64_t nvec, int vec, int64_t row_bytes,
                                        int max_nv, bool allow_cluster, int sms, ShapeHints hints,
                                        RowShape* out, int (*max_threads)(int) = nullptr) {
  if (choose_row_shape(rows, nvec, vec, row_bytes, max_nv, allow_cluster, sms, hints, out,
                       max_threads))
    return true;
  return (hints.target_tpr > 0 || hints.cluster > 0) &&
         choose_row_shape(rows, nvec, vec, row_bytes, max_nv, allow_cluster, sms, ShapeHints{}, out,
                          max_threads);
}

// Multiprocessor count of the current device and whether it runs thread-block clusters (sm_90+)
// (common/device_cache.h: read once per device); an H100's count without clusters if the query
// fails.
struct DeviceInfo {
  int sms = 132;
  bool clusters = false;
};
inline DeviceInfo device_info() {
  DeviceProps props;
  if (current_device_props(&props) != cudaSuccess) return DeviceInfo{};
  DeviceInfo d;
  d.sms = props.sms;
  d.clusters = props.cc_major >= 9;
  return d;
}

// Launches a row kernel: row_blocks * cluster blocks, as clusters of `cluster` CTAs (sm_90) when
// use_cluster and cluster > 1, with programmatic dependent launch when sh.pdl. (A persistent grid of clusters looping over rows was tried to pay
// the cluster launch once: the loop cost the compiler ~100 registers per thread at NV = 7.)
template <typename Kernel, typename Params>
cudaError_t launch_rows(Kernel kernel, const Params& p, const RowShape& sh, int64_t row_blocks,
                        cudaStream_t stream, bool use_cluster = true) {
  const int64_t grid = row_blocks * sh.cluster;
  const bool cluster = sh.cluster > 1 && use_cluster;
  if (grid > 0x7fffffff) return cudaErrorInvalidValue;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(sh.threads_per_row, sh.rows_per_block);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  if (cluster) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = sh.cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.numAttrs = 1;
  }
  if (sh.pdl) append_pdl_attribute(&cfg, attr);
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// Calls `f(std::integral_constant<int, NV>{})` for the run-time vectors-per-thread count, so each
// kernel is instantiated for the NV values its launch heuristic can choose: 1..8 on the 16-byte
// vector path (VEC > 1), powers of two up to 32 on the scalar path (VEC == 1, NV rounded up).
template <int VEC, typename F>
cudaError_t dispatch_vec_per_thread(int vec_per_thread, F&& f) {
  if constexpr (VEC > 1) {
    switch (vec_per_thread) {
      case 1:
        return f(std::integral_constant<int, 1>{});
      case 2:
        return f(std::integral_constant<int, 2>{});
      case 3:
        return f(std::integral_constant<int, 3>{});
      case 4:
        return f(std::integral_constant<int, 4>{});
      case 5:
        return f(std::integral_constant<int, 5>{});
      case 6:
        return f(std::integral_constant<int, 6>{});
      case 7:
        return f(std::integral_constant<int, 7>{});
      case 8:
        return f(std::integral_constant<int, 8>{});
      default:
        return cudaErrorInvalidValue;
    }
  } else {
    int nv = 1;
    while (nv < vec_per_thread) nv *= 2;
    switch (nv) {
      case 1:
        return f(std::integral_constant<int, 1>{});
      case 2:
        return f(std::integral_constant<int, 2>{});
      case 4:
        return f(std::integral_constant<int, 4>{});
      case 8:
        return f(std::integral_constant<int, 8>{});
      case 16:
        return f(std::integral_constant<int, 16>{});
      case 32:
        return f(std::integral_constant<int, 32>{});
      default:
        return cudaErrorInvalidValue;
    }
  }
}

}  // namespace fq
}  // namespace qops
