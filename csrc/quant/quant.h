// Symmetric int8 quantization kernels (torch-free). Contract: docs/ops.md, quant_per_token and
// quant_per_tensor; conventions: python/qops/quantization.py.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qops {

// out[r, c] = saturate(rne(in[r, c] / scale[r])), scale[r] = max(amax_c |in[r, c]| / 127, 1e-10).
// `in` has `rows` rows of `cols` contiguous elements, `in_row_stride` elements apart; `out` is
// contiguous [rows, cols]; `scales` is [rows]. T is float, __half or __nv_bfloat16.
// pdl: launch with programmatic dependent launch (sm_90; common/launch.cuh).
template <typename T>
cudaError_t quant_per_token(const T* in, int64_t in_row_stride, int8_t* out, float* scales,
                            int64_t rows, int64_t cols, cudaStream_t stream, bool pdl = true);

// out[r, c] = saturate(rne(in[r, c] / scale[0])), scale read on the device.
template <typename T>
cudaError_t quant_per_tensor(const T* in, int64_t in_row_stride, int8_t* out, const float* scale,
                             int64_t rows, int64_t cols, cudaStream_t stream, bool pdl = true);

}  // namespace qops
