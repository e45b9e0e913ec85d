// 16-bit floating-point storage formats: bf16 (bfloat16: f32's sign and exponent, 7 mantissa
// bits) and f16 (IEEE 754 binary16), converted to and from f32 bit-exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "diffcp/core/dtype.hpp"

namespace diffcp {

inline float bf16_to_f32(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even (what PyTorch's .to(torch.bfloat16) does); NaN stays a quiet NaN.
inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  std::uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    u = sign;  // +-0
  } else {     // subnormal: man * 2^-24, exact in f32
    const float f = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even; overflow gives +-inf, tiny values f16 subnormals or +-0.
inline std::uint16_t f32_to_f16(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
  if (exp == 0xff) return static_cast<std::uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0u));  // inf / quiet NaN
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (e <= 0) {  // f16 subnormal (value = m * 2^-24) or zero
    if (e < -10) return static_cast<std::uint16_t>(sign);
    const std::uint32_t m = man | 0x800000u, shift = static_cast<std::uint32_t>(14 - e);
    std::uint32_t h = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = sign | (static_cast<std::uint32_t>(e) << 10) | (man >> 13);
  const std::uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right (up to inf)
  return static_cast<std::uint16_t>(h);
}

// Bulk conversions (vectorised; same rounding as the scalar functions above).
inline void convert_to_f32(const std::uint16_t* __restrict bf16, float* __restrict out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t u = static_cast<std::uint32_t>(bf16[i]) << 16;
    std::memcpy(out + i, &u, 4);
  }
}
inline void convert_to_bf16(const float* __restrict x, std::uint16_t* __restrict out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, x + i, 4);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const std::uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    out[i] = static_cast<std::uint16_t>((nan ? (u | 0x400000u) : r) >> 16);
  }
}

inline void convert_to_f32(const bf16_t* x, float* out, std::int64_t n) {
  convert_to_f32(reinterpret_cast<const std::uint16_t*>(x), out, n);
}
inline void convert_to_bf16(const float* x, bf16_t* out, std::int64_t n) {
  convert_to_bf16(x, reinterpret_cast<std::uint16_t*>(out), n);
}

}  // namespace diffcp
