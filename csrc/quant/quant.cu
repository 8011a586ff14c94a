// Symmetric int8 quantization kernels. See quant.h for the contract.
//
// quant_per_token: one CTA per row. When the row is 16-byte aligned and its length a multiple of
// the vector width, each thread keeps its VPT 16-byte vectors in registers between the amax
// reduction and the quantization, so the row is read from DRAM once. Other rows take a scalar
// two-pass path (the second pass re-reads the row, normally from L2).
//
// Every kernel quantizes with RowQuant (common/quant.cuh): one reciprocal per scale and two
// FMAs per element instead of a division, the same correctly rounded quotient.
#include "common/convert.cuh"  // to_float
#include "common/launch.cuh"   // pdl_wait, pdl_launch_dependents, launch_kernel
#include "common/memory.cuh"   // is_aligned
#include "common/quant.cuh"    // absmax_to_scale, RowQuant, quant_one, quant_pack4
#include "common/reduce.cuh"   // block_reduce_max
#include "quant/quant.h"

namespace qops {
namespace {

template <int E>
struct Int8Chunk;  // E int8 values stored with one instruction
template <>
struct Int8Chunk<8> {
  using type = uint2;
};
template <>
struct Int8Chunk<4> {
  using type = uint32_t;
};

// The E int8 values of one 16-byte vector of T, packed little-endian.
template <typename T, bool kFast, bool kInfCheck>
__device__ __forceinline__ typename Int8Chunk<16 / sizeof(T)>::type quant_vec(const uint4& x,
                                                                              const RowQuant& qz) {
  constexpr int E = 16 / sizeof(T);
  const T* e = reinterpret_cast<const T*>(&x);
  float y[E];
#pragma unroll
  for (int j = 0; j < E; ++j) y[j] = to_float(e[j]);
  alignas(16 / sizeof(T)) uint32_t w[E / 4];
#pragma unroll
  for (int i = 0; i < E / 4; ++i) w[i] = quant_pack4<kFast, kInfCheck>(y + 4 * i, qz);
  return *reinterpret_cast<const typename Int8Chunk<E>::type*>(w);
}

template <typename T, int VPT, bool kFast, bool kInfCheck>
__device__ __forceinline__ void store_row_vec(const uint4 (&regs)[VPT],
                                              typename Int8Chunk<16 / sizeof(T)>::type* row_out,
                                              int64_t nvec, const RowQuant& qz) {
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t v = threadIdx.x + int64_t(i) * blockDim.x;
    if (v < nvec) row_out[v] = quant_vec<T, kFast, kInfCheck>(regs[i], qz);
  }
}

// At most 256 threads for 16 vectors per thread: 512 capped the registers at 128, and the row
// (64 registers) spilled once the quantizer had a fast and an exact path.
template <typename T, int VPT>
__global__ void __launch_bounds__(VPT >= 16 ? 256 : 512)
    quant_per_token_vec_kernel(const T* __restrict__ in, int64_t in_row_stride,
                               int8_t* __restrict__ out, float* __restrict__ scales, int64_t cols) {
  constexpr int E = 16 / sizeof(T);
  using Chunk = typename Int8Chunk<E>::type;
  __shared__ float smem[32];
  pdl_wait();  // the previous kernel may write `in` (common/launch.cuh)
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const uint4* row_in = reinterpret_cast<const uint4*>(in + row * in_row_stride);
  const int64_t nvec = cols / E;

  uint4 regs[VPT];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t v = threadIdx.x + int64_t(i) * blockDim.x;
    if (v < nvec) {
      regs[i] = row_in[v];
      const T* e = reinterpret_cast<const T*>(&regs[i]);
#pragma unroll
      for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(to_float(e[j])));
    }
  }
  const float scale = absmax_to_scale(block_reduce_max(amax, smem));
  if (threadIdx.x == 0) scales[row] = scale;

  Chunk* row_out = reinterpret_cast<Chunk*>(out + row * cols);
  const RowQuant qz(scale);
  if (qz.fast) {  // a finite amax: no element is +-Inf
    store_row_vec<T, VPT, true, false>(regs, row_out, nvec, qz);
  } else {
    store_row_vec<T, VPT, false, true>(regs, row_out, nvec, qz);
  }
}

template <typename T>
__global__ void quant_per_token_scalar_kernel(const T* __restrict__ in, int64_t in_row_stride,
                                              int8_t* __restrict__ out, float* __restrict__ scales,
                                              int64_t cols) {
  __shared__ float smem[32];
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const T* row_in = in + row * in_row_stride;
  float amax = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    amax = fmaxf(amax, fabsf(to_float(row_in[c])));
  const float scale = absmax_to_scale(block_reduce_max(amax, smem));
  if (threadIdx.x == 0) scales[row] = scale;
  const RowQuant qz(scale);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float x = to_float(row_in[c]);
    out[row * cols + c] =
        static_cast<int8_t>(qz.fast ? quant_one<true, false>(x, qz) : quant_one<false>(x, qz));
  }
}

template <typename T, bool kVec>
__global__ void quant_per_tensor_kernel(const T* __restrict__ in, int64_t in_row_stride,
                                        int8_t* __restrict__ out,
                                        const float* __restrict__ scale_ptr, int64_t cols) {
  constexpr int E = kVec ? 16 / sizeof(T) : 1;
  pdl_wait();
  pdl_launch_dependents();
  const RowQuant qz(*scale_ptr);
  const int64_t row = blockIdx.y;
  const T* row_in = in + row * in_row_stride;
  int8_t* row_out = out + row * cols;
  const int64_t n = cols / E;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < n;
       v += int64_t(gridDim.x) * blockDim.x) {
    // a static scale: elements may be +-Inf on the fast path (kInfCheck)
    if constexpr (kVec) {
      using Chunk = typename Int8Chunk<E>::type;
      const uint4 x = reinterpret_cast<const uint4*>(row_in)[v];
      reinterpret_cast<Chunk*>(row_out)[v] =
          qz.fast ? quant_vec<T, true, true>(x, qz) : quant_vec<T, false, true>(x, qz);
    } else {
      const float x = to_float(row_in[v]);
      row_out[v] = static_cast<int8_t>(qz.fast ? quant_one<true>(x, qz) : quant_one<false>(x, qz));
    }
  }
}

inline int round_up_warp(int64_t n) {
  return int((n + 31) / 32 * 32);
}

template <typename T, int VPT>
cudaError_t launch_token_vec(const T* in, int64_t stride, int8_t* out, float* scales, int64_t rows,
                             int64_t cols, int threads, cudaStream_t stream, bool pdl) {
  return launch_kernel(quant_per_token_vec_kernel<T, VPT>, dim3(rows), dim3(threads), stream, pdl,
                       in, stride, out, scales, cols);
}

}  // namespace

template <typename T>
cudaError_t quant_per_token(const T* in, int64_t in_row_stride, int8_t* out, float* scales,
                            int64_t rows, int64_t cols, cudaStream_t stream, bool pdl) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  constexpr int E = 16 / sizeof(T);
  const bool vec = cols % E == 0 && in_row_stride % E == 0 && is_aligned(in, 16);
  const int64_t nvec = cols / E;
  if (vec) {
    // Smallest vectors-per-thread that covers the row with <= 256 threads, so short rows (decode)
    // still get a full CTA of lanes. Longer rows (past 4096 vectors: 32768 bf16) take the scalar
    // two-pass kernel.
    if (nvec <= 256 * 1)
      return launch_token_vec<T, 1>(in, in_row_stride, out, scales, rows, cols, round_up_warp(nvec),
                                    stream, pdl);
    if (nvec <= 256 * 2)
      return launch_token_vec<T, 2>(in, in_row_stride, out, scales, rows, cols,
                                    round_up_warp((nvec + 1) / 2), stream, pdl);
    if (nvec <= 256 * 4)
      return launch_token_vec<T, 4>(in, in_row_stride, out, scales, rows, cols,
                                    round_up_warp((nvec + 3) / 4), stream, pdl);
    if (nvec <= 256 * 8)
      return launch_token_vec<T, 8>(in, in_row_stride, out, scales, rows, cols,
                                    round_up_warp((nvec + 7) / 8), stream, pdl);
    if (nvec <= 256 * 16)
      return launch_token_vec<T, 16>(in, in_row_stride, out, scales, rows, cols,
                                     round_up_warp((nvec + 15) / 16), stream, pdl);
  }
  const int threads = cols >= 1024 ? 1024 : round_up_warp(cols);
  return launch_kernel(quant_per_token_scalar_kernel<T>, dim3(rows), dim3(threads), stream, pdl, in,
                       in_row_stride, out, scales, cols);
}

template <typename T>
cudaError_t quant_per_tensor(const T* in, int64_t in_row_stride, int8_t* out, const float* scale,
                             int64_t rows, int64_t cols, cudaStream_t stream, bool pdl) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows > 65535 * 1024LL) return cudaErrorInvalidValue;
  constexpr int E = 16 / sizeof(T);
  const bool vec = cols % E == 0 && in_row_stride % E == 0 && is_aligned(in, 16);
  const int64_t n = vec ? cols / E : cols;
  const int threads = n >= 256 ? 256 : round_up_warp(n);
  const int64_t blocks_x = (n + threads - 1) / threads;
  // Rows go on grid.y (at most 65535 per launch), columns on grid.x.
  for (int64_t r0 = 0; r0 < rows; r0 += 65535) {
    const int64_t nr = rows - r0 < 65535 ? rows - r0 : 65535;
    const dim3 grid(unsigned(blocks_x < 1024 ? blocks_x : 1024), unsigned(nr));
    auto kernel = vec ? quant_per_tensor_kernel<T, true> : quant_per_tensor_kernel<T, false>;
    cudaError_t err =
        launch_kernel(kernel, grid, dim3(threads), stream, pdl, in + r0 * in_row_stride,
                      in_row_stride, out + r0 * cols, scale, cols);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

#define QOPS_INSTANTIATE_QUANT(T)                                                               \
  template cudaError_t quant_per_token<T>(const T*, int64_t, int8_t*, float*, int64_t, int64_t, \
                                          cudaStream_t, bool);                                  \
  template cudaError_t quant_per_tensor<T>(const T*, int64_t, int8_t*, const float*, int64_t,   \
                                           int64_t, cudaStream_t, bool);
QOPS_INSTANTIATE_QUANT(float)
QOPS_INSTANTIATE_QUANT(__half)
QOPS_INSTANTIATE_QUANT(__nv_bfloat16)

}  // namespace qops
