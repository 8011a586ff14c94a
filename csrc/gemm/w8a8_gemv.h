// The decode (M <= 16) kernel of w8a8_gemm: a hand-written split-K int8 GEMV. Torch-free.
//
// Same contract and Problem as the generated CUTLASS kernels (gemm/w8a8_sm90.h):
//   d[m, n] = out_dtype( (float(acc[m, n]) * a_scale[m or 0]) * b_scale[n or 0] + float(bias[n]) )
// It joins their config table as the hand-written config "gemv" (cutlass_kernels/w8a8_configs.py
// HAND_WRITTEN), so the generated dispatch, the tuner and config= reach it like any tile config.
//
// Why a GEMV: at M <= 16 the GEMM is a stream of the weight matrix, and a CUTLASS tile of 64 N
// columns gives N = 4096 only 64 CTAs for 132 SMs. This kernel gives every SM a share of the
// weights: small CTAs over 8 or 16 rows of N split K among their warps and reduce the int32
// partial sums in shared memory. No workspace, no atomics; exact int32 accumulation with
// mma.sync m16n8k32 (sm_80+). docs/w8a8_gemm.md, "The decode GEMV".
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "gemm/w8a8_sm90.h"
#include "w8a8_gemv_shapes.h"  // generated: GemvShape, kGemvShapes

namespace qops {
namespace w8a8_sm90 {

// The largest M the GEMV serves (one m16 MMA tile of rows).
constexpr int kGemvMaxM = 16;

// Runs d = dequant(a @ b^T) for p.m <= kGemvMaxM on `stream` (the config table's LaunchFn:
// `sm_count` feeds gemv_shape; with `workspace_bytes` set, reports 0 and launches nothing). Reads
// options.pdl, options.overlap_prologue and options.gemv. No allocation, no host synchronization.
// cudaErrorInvalidValue when p.m > kGemvMaxM, the layout contract of Problem is broken (alignment,
// k % 16, n % 2) or options.gemv names a shape that is not built; launch errors otherwise.
cudaError_t gemv(const Problem& p, const LaunchOptions& options, int sm_count, cudaStream_t stream,
                 size_t* workspace_bytes);

// The launch shapes (GemvShape: rows of N per CTA, warps (K slices) per CTA, 64-byte K chunks
// each warp loads per batch before it multiplies them) are kernel instantiations built from the
// table in cutlass_kernels/w8a8_configs.py (GEMV_SHAPES), whose generator emits kGemvShapes into
// w8a8_gemv_shapes.h. {16, 8, 4} is taken only at M > 8 under overlap_prologue (gemv in
// w8a8_gemv.cu).

// The shape the GEMV picks for this problem (one of kGemvShapes). resident_c4 / resident_c8: the
// resident CTAs per SM of the 8-row, 4-warp builds with 4 / 8 chunks per batch for this M and
// output dtype (the occupancy API's answer; 0 when unknown), to count the grid's waves.
GemvShape gemv_shape(int m, int n, int k, int sm_count, int resident_c4, int resident_c8);

}  // namespace w8a8_sm90
}  // namespace qops
