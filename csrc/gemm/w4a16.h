// The W4A16 GEMM family (int4 weights with group scales (and zeros) x fp16/bf16 activations):
// the problem every kernel of the family takes, the prepack into the shuffled weight layout, and
// the hand-written decode GEMV. Torch-free. docs/int4.md has the layouts, docs/w4a16_gemm.md the
// design.
//
//   W[n, k] = q[n, k] * scales[k / G][n] (+ zeros[k / G][n]),   d[m, n] = sum_k a[m, k] W[n, k]
//
// The weights are stored once, by `prepack`, in the layout the CUTLASS mixed-input kernels read
// (cutlass::compute_memory_reordering_atom with the [0,2,4,6,1,3,5,7] value shuffle that
// cutlass_library emits): 16 x 16 (n, k) atoms of 128 bytes, the atoms of one 16-wide K slice
// contiguous over N, the K slices one after the other. Inside an atom, lane L = 4 (n % 8) +
// (k / 2) % 4 owns the 32-bit word L, whose nibble v = (n % 16) / 8 + 2 ((k % 16) / 8) + 4 (k % 2)
// holds q[n, k]: exactly the A fragment of mma.sync m16n8k16 (and of a wgmma RS warp slice), so
// one 32-bit load and four masks give a lane its four A registers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qops {
namespace w4a16 {

enum class Dtype : int { kFloat16 = 0, kBFloat16 = 1 };

struct Problem {
  const void* a = nullptr;  // [M, K] activations (Dtype), row stride lda, K contiguous
  int64_t lda = 0;
  const uint8_t* w = nullptr;    // prepacked weights, N * K / 2 bytes (layout above)
  const void* scales = nullptr;  // [K / G][N], N contiguous (Dtype)
  const void* zeros = nullptr;   // same layout, or nullptr (scale-only)
  void* d = nullptr;             // [M, N] row-major (Dtype)
  int m = 0, n = 0, k = 0, group_size = 0;
  Dtype dtype = Dtype::kFloat16;
  void* workspace = nullptr;  // workspace_bytes from the launcher's query
  size_t workspace_bytes = 0;
  int* counters = nullptr;  // >= num_counters zeroed int32s (left zeroed), split-K GEMV only
  int num_counters = 0;
};

struct LaunchOptions {
  bool pdl = false;  // programmatic dependent launch (the hand-written kernels)
};

// One kernel of the family's config table: launches p on `stream`, or with `workspace_bytes` set
// stores the workspace p needs and launches nothing.
using LaunchFn = cudaError_t (*)(const Problem& p, const LaunchOptions& options, int sm_count,
                                 cudaStream_t stream, size_t* workspace_bytes);

// ---- prepack ------------------------------------------------------------------------------------
// in: the reference layout, uint8 [N, K/2] row-major (two's-complement nibbles, even k low);
// out: N * K / 2 bytes in the shuffled layout. n % 16 == 0 and k % 16 == 0, else
// cudaErrorInvalidValue. in and out must not overlap.
cudaError_t prepack(const uint8_t* in, uint8_t* out, int n, int k, cudaStream_t stream);

// ---- the decode GEMV (csrc/gemm/w4a16_gemv.cu) ---------------------------------------------------
// Any M (one CTA row of up to 16 tokens per 16 rows of M; the generated CUTLASS kernels are the
// fast path above M = 16 on sm_90a), n % 16 == 0, k % group_size == 0, group_size 64 or 128, a and
// d 4-byte aligned, lda even. mma.sync (sm_80+). It splits K over the warps of a CTA and, where
// the rows alone give the GPU too few CTAs, over CTAs: the last CTA of a row tile (found with
// p.counters) adds the splits' float partials from the workspace in a fixed order.
cudaError_t gemv(const Problem& p, const LaunchOptions& options, int sm_count, cudaStream_t stream,
                 size_t* workspace_bytes);

// The counters gemv needs for p (0 when it does not split K over CTAs).
int gemv_num_counters(const Problem& p, int sm_count);

}  // namespace w4a16
}  // namespace qops
