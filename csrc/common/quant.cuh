// The qops int8 quantization convention on the device (python/qops/quantization.py, docs/ops.md):
// the dynamic scale from a row's amax, and the quantizer y -> clamp(round_half_even(y / s)) with
// its fast division-free path (torch-free).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace qops {

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

}  // namespace qops
