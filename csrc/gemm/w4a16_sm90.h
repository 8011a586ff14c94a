// The sm_90a kernels of the W4A16 family: the CUTLASS mixed-input GEMMs that
// cutlass_kernels/gen_w8a8.py emits from the config table (cutlass_kernels/w8a8_configs.py,
// family "w4a16"), behind one dispatch table whose last entry is the hand-written GEMV
// (gemm/w4a16.h). Implemented by the generated w4a16_dispatch.cu (sm_90a builds only; the glue
// sees QOPS_HAVE_W4A16_SM90). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "gemm/w4a16.h"

namespace qops {
namespace w4a16_sm90 {

int num_configs();
const char* config_name(int config);  // nullptr when out of range
int config_max_m(int config);         // the largest M a config serves (0: any)
// config="auto": the table's choice for m tokens, n weight rows, k (w8a8_configs.select_config).
int select_config(int m, int n, int k, int num_sms);

// The workspace the config needs for p, and the launch on `stream`. cudaErrorInvalidValue when the
// config cannot run p (CUTLASS's can_implement), cudaErrorNoKernelImageForDevice off sm_90.
cudaError_t workspace_size(const w4a16::Problem& p, int config, size_t* bytes);
cudaError_t gemm(const w4a16::Problem& p, int config, const w4a16::LaunchOptions& options,
                 cudaStream_t stream);

}  // namespace w4a16_sm90
}  // namespace qops
