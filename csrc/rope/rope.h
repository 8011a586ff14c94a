// Rotary position embedding (RoPE), rotate-half convention, applied in place (torch-free).
// Contract: docs/ops.md (rotary_embedding).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qops {

// For each token t (of `tokens`) at position p = positions[t], each head h of q (`q_heads`) and
// of k (`k_heads`), and each i < D/2 (h2 = D/2), with x the head's D values:
//   x'[i]      = T(x[i] * cos[p, i]           - x[i + h2] * sin[p, i])
//   x'[i + h2] = T(x[i + h2] * cos[p, i + h2] + x[i] * sin[p, i + h2])
// in float32, each product and the sum rounded separately (no FMA: the reference's PyTorch
// steps, bit for bit), then one rounding to T (__half or __nv_bfloat16). q is [tokens, q_heads, D]
// with element strides (q_token_stride, q_head_stride, 1), likewise k; cos and sin are float32
// [max_pos, D] contiguous. A position outside [0, max_pos) writes NaN into that token's heads
// (never reads outside the tables). The 16-byte path needs D % 16 == 0 and 16-byte aligned heads;
// other inputs take a scalar path. Returns cudaErrorInvalidValue for bad sizes, else the launch's
// error.
template <typename T>
cudaError_t rotary_embedding(const int64_t* positions, T* q, int64_t q_token_stride,
                             int64_t q_head_stride, int q_heads, T* k, int64_t k_token_stride,
                             int64_t k_head_stride, int k_heads, const float* cos, const float* sin,
                             int64_t max_pos, int64_t tokens, int head_dim, bool pdl,
                             cudaStream_t stream);

}  // namespace qops
