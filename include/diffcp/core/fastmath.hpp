// Vectorisable math for hot loops.
#pragma once

#include <cstdint>
#include <cstring>

namespace diffcp {

// 2^x, rel. error ~2e-7, for x clamped to [-127, 127]: 2^-127 and below give exactly 0, 2^127 is
// the largest result (never inf, never a denormal). x = n + f with n the nearest integer (adding
// 1.5*2^23 rounds), 2^f (|f| <= 0.5) by the degree-6 polynomial of Cephes' exp2f, n put straight
// into the exponent bits. Branch-free so loops around it vectorise: GCC 12 vectorises neither
// std::floor/std::bit_cast versions of this nor glibc's expf/tanhf here (checked with
// -fopt-info-vec).
inline float fast_exp2(float x) {
  x = x < -127.f ? -127.f : (x > 127.f ? 127.f : x);
  constexpr float kShifter = 12582912.f;  // 1.5 * 2^23, bit pattern 0x4B400000
  const float t = x + kShifter;
  const float n = t - kShifter;
  const float f = x - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  std::int32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof t_bits);
  const std::int32_t bits = (t_bits - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace diffcp
