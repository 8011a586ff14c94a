// int8 x int8 -> fp16/bf16 GEMM with a dequantizing epilogue for Ampere and Ada (sm_80, sm_86,
// sm_89): the w8a8_sm90 contract (gemm/w8a8_sm90.h: the same Problem, math and rounding) with
// CUTLASS 2.x kernels. Torch-free.
//
// The kernels and this API's implementation are generated at build time by
// cutlass_kernels/gen_w8a8.py from the rows of cutlass_kernels/w8a8_configs.py with arch=80
// (SM80_CONFIGS, family "w8a8_sm80"): a multistage cp.async + mma.sync mainloop and the epilogue
// traced into a CUTLASS 2.x epilogue visitor tree (Sm80EVT), one kernel per tile config x output
// dtype x scale mode. They are built as sm_80 code plus compute_80 PTX, so GPUs of compute
// capability 9.0 and later run them too, through the driver's compilation of the PTX (the tests
// do that on the H100). docs/w8a8_gemm.md has the design.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "gemm/w8a8_sm90.h"

namespace qops {
namespace w8a8_sm80 {

// The same problem description as the sm_90a family. Differences in what the kernels require:
// `bias`, when set, must be 16-byte aligned (it is read in 16-byte vectors), and the
// LaunchOptions, the SM count and the workspace are not used (no split-K: workspace_size is 0).
using w8a8_sm90::LaunchFn;
using w8a8_sm90::LaunchOptions;
using w8a8_sm90::OutDtype;
using w8a8_sm90::Problem;
using w8a8_sm90::ScaleMode;

// The configs, by name (w8a8_configs.config_names(family="w8a8_sm80"), in table order).
int num_configs();
const char* config_name(int config);

// The largest M that config `config` serves; 0 = any (every config of this family).
int config_max_m(int config);

// The config the table's SM80_SELECTION rules pick for a problem on a GPU with `num_sms` SMs
// (w8a8_configs.select_config(..., family="w8a8_sm80")).
int select_config(int m, int n, int k, int num_sms);

// 0 for every config of this family (kept for the sm_90a API's shape). Errors as for gemm.
cudaError_t workspace_size(const Problem& problem, int config, size_t* bytes);

// Runs the GEMM on `stream` with tile config `config` (-1: select_config). No allocation, no host
// synchronization (CUDA-graph safe). cudaErrorNoKernelImageForDevice on a device of compute
// capability below 8.0; cudaErrorInvalidValue when the config index is out of range or CUTLASS
// cannot implement the problem (alignment); launch errors otherwise.
cudaError_t gemm(const Problem& problem, int config, const LaunchOptions& options,
                 cudaStream_t stream);

}  // namespace w8a8_sm80
}  // namespace qops
