// FP8 E4M3 (OCP 8-bit floating point, E4M3: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN, largest finite 448) and the blocked encoding the DiT's exchanges
// send with --wire fp8 (dit/wire.hpp): one f32 scale per block of d elements (one (token, head)).
//
// Encoded block (d + 4 bytes; ggml's block_q8_0 layout, with an e4m3 payload):
//   bytes [0, 4)      s = amax(|x_0..x_{d-1}|) / 448 as f32 (the host's byte order: the exchanges
//                     move it between ranks of one machine type)
//   bytes [4, 4 + d)  c_i = e4m3(x_i / s), round to nearest even, saturating to +-448; s = 0 (an
//                     all-zero block) gives c_i = 0
// Decoded: x_i' = e4m3_value(c_i) * s, rounded once to the destination dtype (f32 or bf16).
//
// Error bound (f32 decode; what tests/dit/test_dit_fp8.cpp asserts): with y = fl(x / s),
//   |x' - x| <= 2^-4 |x| + 2^-10 s + 2^-21 |x|
// 2^-4 |x|: half an ulp of a 3-bit mantissa (|y| in the normal range [2^-6, 448]); 2^-10 s: half the
// subnormal spacing 2^-9 (|y| < 2^-6); 2^-21 |x|: the f32 roundings of x / s and c s. |y| <= 448
// (1 + 2^-24) by the choice of s, so nothing saturates by more than that rounding, and no NaN code is
// ever produced from finite input. A value c s with c an e4m3 value and s = amax / 448 exactly (e.g.
// s a power of two with one element at +-448 s) round-trips exactly. A non-finite input makes the
// block's scale non-finite and its whole decode non-finite (NaN; an inf element +-inf): visible, not
// hidden (tests/dit/test_dit_fp8.cpp NonFiniteInput...). bf16 decode adds one bf16
// rounding (2^-9 |x'|).
//
// Legend: n blocks of d elements; enc: [n][d + 4] bytes.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "diffcp/core/dtype.hpp"

namespace diffcp {

inline constexpr float kE4M3Max = 448.f;        // largest finite e4m3
inline constexpr std::int64_t kFp8ScaleBytes = 4;  // the f32 scale of a block

// The e4m3 code of y (round to nearest even, |y| >= 448 saturates to +-448, NaN to +-448 too: the
// encoder never emits the NaN code). The reference the CPU kernel runs, element by element.
inline std::uint8_t e4m3_from_float(float y) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(y);
  const std::uint8_t sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  const float a = std::fabs(y);
  if (!(a < kE4M3Max)) return sign | 0x7Eu;  // 448 = 2^8 x 1.110b
  const std::uint32_t ab = bits & 0x7FFFFFFFu;
  if (ab < (121u << 23)) {  // |y| < 2^-6: subnormal codes 0..7 step 2^-9 (8 rounds up to 2^-6 = code 8)
    return sign | static_cast<std::uint8_t>(std::nearbyint(a * 512.f));
  }
  // Normal: keep 3 mantissa bits, round to nearest even (a carry moves into the exponent), rebias
  // the exponent from 127 to 7. a < 448 rounds to at most 448 (code 0x7E).
  const std::uint32_t r = (ab + 0x7FFFFu + ((ab >> 20) & 1u)) >> 20;
  return sign | static_cast<std::uint8_t>(r - (120u << 3));
}

// The value of an e4m3 code (0x7F / 0xFF: NaN).
inline float e4m3_to_float(std::uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  float v;
  if (e == 15 && m == 7)
    v = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(static_cast<float>(m), -9);
  else
    v = std::ldexp(static_cast<float>(8 + m), e - 10);
  return (c & 0x80) ? -v : v;
}

// The blocked codec as ops on the active backend (ops/backend.hpp fp8_encode / fp8_decode), device
// pointers as the other ops take them:
//   x: [n, d] contiguous of t (f32 or bf16)  enc: [n][d + 4] bytes out
void fp8_encode(const void* x, DType t, std::int64_t n, std::int64_t d, void* enc);
//   enc: [n][d + 4] bytes  x: [n, d] contiguous of t (f32 or bf16) out
void fp8_decode(const void* enc, std::int64_t n, std::int64_t d, void* x, DType t);
// Bytes of n encoded blocks of d elements.
inline std::int64_t fp8_encoded_bytes(std::int64_t n, std::int64_t d) { return n * (d + kFp8ScaleBytes); }

}  // namespace diffcp
