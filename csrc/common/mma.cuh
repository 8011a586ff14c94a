// Tensor-core mma.sync wrappers (sm_80+) and the fragment conversions around them: int8 -> fp16
// (exact), f32 -> packed fp16, and the 8x8 fragment transpose (torch-free).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace qops {

// ---- mma.sync -----------------------------------------------------------------------------------
// c (16 x 8, f32) += a (16 x 16, f16, row) * b (16 x 8, f16, col).
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc (16 x 8, int32) += a (16 x 32, s8, row) * b (32 x 8, s8, col).
__device__ __forceinline__ void mma_s8(int (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- fragments and conversions ------------------------------------------------------------------
// 4 int8 (bytes b0..b3 of w) -> half2 (b0, b1) and half2 (b2, b3), exactly: the byte (x + 128)
// becomes the low mantissa byte of 1024.0 (0x6400), then 1152 = 1024 + 128 is subtracted.
__device__ __forceinline__ void i8x4_to_f16x2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = w ^ 0x80808080u;
  uint32_t l = __byte_perm(u, 0x64646464u, 0x5140);
  uint32_t h = __byte_perm(u, 0x64646464u, 0x5342);
  const uint32_t magic = 0x64806480u;  // half2(1152, 1152)
  asm("sub.f16x2 %0, %0, %1;" : "+r"(l) : "r"(magic));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(h) : "r"(magic));
  lo = l;
  hi = h;
}

// byte I of int8x4 words a and b -> half2 (a_I, b_I), exactly, in three instructions: a byte
// permute puts a_I in byte 0 and b_I in byte 2, one LOP3 keeps those bytes, flips their sign bit
// (x -> x + 128) and sets the high bytes to 0x64 (half 1024 + (x + 128)), and one half2 subtract
// of 1152 leaves x. All three take immediates, so no constant is re-materialized per use.
// (The LOP3 is written out: from C++, ptxas emits an AND and an XOR, each with its immediate,
// instead of one LOP3 that takes the magic from a register: 32 more instructions per chunk.)
template <int I>
__device__ __forceinline__ uint32_t i8pair_to_f16x2(uint32_t ua, uint32_t ub) {
  constexpr uint32_t kSel = I | (I << 4) | ((4 + I) << 8) | ((4 + I) << 12);
  const uint32_t magic = 0x64806480u;  // half2(1152, 1152)
  uint32_t h;
  // h = (perm & 0x00FF00FF) ^ magic
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;"
      : "=r"(h)
      : "r"(__byte_perm(ua, ub, kSel)), "n"(0x00FF00FF), "r"(magic));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(h) : "r"(magic));
  return h;
}

// ---- int4 (unsigned nibbles) -> fp16 ---------------------------------------------------------
// (x & kMask) | 0x64006400 in one LOP3: with kMask = 0x000F000F, the nibbles at bits 0 and 16 of x
// become half2 (1024 + q0, 1024 + q1); with 0x00F000F0, those at bits 4 and 20 become
// (1024 + 16 q0, 1024 + 16 q1). Both exact.
template <uint32_t kMask>
__device__ __forceinline__ uint32_t int4_lop3(uint32_t x) {
  uint32_t h;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(h) : "r"(x), "n"(kMask), "r"(0x64006400u));
  return h;
}

// The low nibbles (bits 0 and 16) of w dequantized: half2 (q0 * s.x + b.x, q1 * s.y + b.y), with
// the product and sum rounded once to fp16 (fma.rn.f16x2); s, b: half2 scales and shifts.
__device__ __forceinline__ uint32_t dequant_int4_even(uint32_t w, uint32_t s, uint32_t b) {
  uint32_t q = int4_lop3<0x000F000Fu>(w);
  asm("sub.f16x2 %0, %0, %1;" : "+r"(q) : "r"(0x64006400u));  // 1024 + q - 1024: exact
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(q), "r"(s), "r"(b));
  return d;
}
// The same for the nibbles at bits 4 and 20.
__device__ __forceinline__ uint32_t dequant_int4_odd(uint32_t w, uint32_t s, uint32_t b) {
  uint32_t q = int4_lop3<0x00F000F0u>(w);
  // (1024 + 16 q) / 16 - 64 = q, exactly
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(q) : "r"(0x2C002C00u), "r"(0xD400D400u));
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(q), "r"(s), "r"(b));
  return d;
}

// The transpose of an 8x8 matrix of 16-bit values held as an mma fragment (thread lane holds row
// lane / 4, columns 2 * (lane % 4) + {0, 1}): returns the same fragment of the transpose.
__device__ __forceinline__ uint32_t transpose8x8_b16(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Two floats -> half2 (round to nearest even) as one 32-bit fragment register, a in the low half.
__device__ __forceinline__ uint32_t pack_f16x2(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace qops
