// float32 → bfloat16 / float16 rounding, written once for the device and the host: the
// kernel in convert.cu calls these, and tests/backend/cuda_math_test.cc checks them on a machine
// without a GPU (under nvcc they are __host__ __device__, under a plain C++ compiler
// ordinary inline functions, as in elementwise_math.cuh).
//
// Both round to nearest, ties to even — what cuda_bf16.h's __float2bfloat16_rn and
// cuda_fp16.h's __float2half_rn are documented to do — in integer arithmetic on the bit
// pattern, so the host and the device give the same bits whatever the compiler's math flags.
// The results are the 16-bit patterns (uint16_t), which cuBLASLt reads as CUDA_R_16BF /
// CUDA_R_16F elements. NaN becomes the canonical quiet NaN 0x7FFF (as those headers' own
// software paths do; its payload and sign are not kept); ±inf stays ±inf; ±0 keeps its sign.
//
// bf16 (1 sign, 8 exponent, 7 mantissa bits) is float32 without its low 16 bits: the same
// exponent range, subnormals included, and a relative rounding error of at most 2^-8.
// fp16 (1, 5, 10) has a relative error of at most 2^-11 over its normal range [2^-14, 65504];
// below it, subnormals are multiples of 2^-24 (absolute error ≤ 2^-25), and from 65520 =
// 65504 + half a unit up, values round to infinity.
#ifndef PIPESHARD_BACKEND_MATH_CONVERT_MATH_CUH_
#define PIPESHARD_BACKEND_MATH_CONVERT_MATH_CUH_

#include <cstdint>
#include <cstring>

#include "backend/math/host_device.h"

namespace pipeshard::cuda::math {

PIPESHARD_HD inline uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

PIPESHARD_HD inline float float_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

constexpr uint16_t kCanonicalNan16 = 0x7FFF;  // quiet NaN in both formats

// The upper 16 bits of f after adding 0x7FFF plus the lowest kept bit: below half a bf16
// unit rounds down, above it up, and a tie (low half exactly 0x8000) up only from an odd
// kept value. A carry out of the mantissa raises the exponent, up to inf from beyond the
// largest bf16 (0x7F7F); subnormals round the same way.
PIPESHARD_HD inline uint16_t float_to_bf16_rn(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kCanonicalNan16;
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
}

PIPESHARD_HD inline uint16_t float_to_fp16_rn(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kCanonicalNan16;
  // 65520 (0x477FF000) is halfway between 65504, the largest fp16 (odd mantissa), and
  // 65536: the tie goes to the even side, which is infinity; so does everything above.
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (a >= 0x38800000u) {  // normal in fp16 (≥ 2^-14): rebias the exponent (127 → 15), round off 13 bits
    const uint32_t rebiased = a - 0x38000000u;
    const uint32_t lsb = (rebiased >> 13) & 1u;
    return static_cast<uint16_t>(sign | ((rebiased + 0x0FFFu + lsb) >> 13));
  }
  // Subnormal in fp16: the value is m·2^-24 with m = (1.mantissa · 2^23) >> (126 − exponent).
  // Below 2^-25 (exponent < 102) it rounds to zero; exactly 2^-25 is a tie that goes to 0.
  const uint32_t exponent = a >> 23;
  if (exponent < 102u) return static_cast<uint16_t>(sign);
  const uint32_t mantissa = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14 … 24
  uint32_t m = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (m & 1u) != 0u)) ++m;  // m = 0x400 is the smallest normal: still right
  return static_cast<uint16_t>(sign | m);
}

// The float a bf16 pattern stands for (exact).
PIPESHARD_HD inline float bf16_to_float(uint16_t h) { return float_from_bits(static_cast<uint32_t>(h) << 16); }

// The float an fp16 pattern stands for (exact: every fp16 value is a float).
PIPESHARD_HD inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return float_from_bits(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0u) return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // zero or subnormal: mantissa·2^-24, exact in float
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
  return sign != 0u ? -magnitude : magnitude;
}

}  // namespace pipeshard::cuda::math

#endif  // PIPESHARD_BACKEND_MATH_CONVERT_MATH_CUH_
