// ops/fp8.hpp's blocked e4m3 codec: one block (token, head) per iteration, the scalar reference
// functions of ops/fp8.hpp per element (a decode table of the 256 codes).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "diffcp/core/half.hpp"
#include "diffcp/ops/fp8.hpp"

#include "cpu_backend.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

namespace {
inline float value_of(float x) { return x; }
inline float value_of(bf16_t x) { return bf16_to_f32(x.bits); }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16_t* p, float v) { p->bits = f32_to_bf16(v); }

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[static_cast<std::size_t>(c)] = e4m3_to_float(static_cast<std::uint8_t>(c));
    return v;
  }();
  return t;
}

// x: [n, d]  enc: [n][d + 4]
template <typename T>
void encode_blocks(const T* x, std::int64_t n, std::int64_t d, std::uint8_t* enc) {
#pragma omp parallel for schedule(static) if (n * d > (1 << 15))
  for (std::int64_t b = 0; b < n; ++b) {
    const T* xb = x + b * d;
    std::uint8_t* e = enc + b * (d + kFp8ScaleBytes);
    float amax = 0.f;
    for (std::int64_t i = 0; i < d; ++i) {  // NaN propagates (std::max would drop it): the block decodes to NaN
      const float a = std::fabs(value_of(xb[i]));
      if (a > amax || std::isnan(a)) amax = a;  // once NaN, amax stays NaN (a > NaN is false)
    }
    const float s = amax / kE4M3Max;
    std::memcpy(e, &s, sizeof s);
    std::uint8_t* c = e + kFp8ScaleBytes;
    if (s == 0.f) {
      std::memset(c, 0, static_cast<std::size_t>(d));
      continue;
    }
    // x / s with x's sign: an infinite x in its own block (s = inf) gives NaN, whose sign bit is
    // the platform's; the code saturates to 448 with x's sign (+-inf once scaled back).
    for (std::int64_t i = 0; i < d; ++i) {
      const float v = value_of(xb[i]);
      c[i] = e4m3_from_float(std::copysign(std::fabs(v / s), v));
    }
  }
}

// enc: [n][d + 4]  x: [n, d]
template <typename T>
void decode_blocks(const std::uint8_t* enc, std::int64_t n, std::int64_t d, T* x) {
  const std::array<float, 256>& table = e4m3_table();
#pragma omp parallel for schedule(static) if (n * d > (1 << 15))
  for (std::int64_t b = 0; b < n; ++b) {
    const std::uint8_t* e = enc + b * (d + kFp8ScaleBytes);
    float s;
    std::memcpy(&s, e, sizeof s);
    const std::uint8_t* c = e + kFp8ScaleBytes;
    T* xb = x + b * d;
    for (std::int64_t i = 0; i < d; ++i) store(xb + i, table[c[i]] * s);
  }
}
}  // namespace

// x: [n, d] f32 | bf16  enc: [n, d + 4] u8
void CpuBackend::fp8_encode(ConstTensorView x, TensorView enc) {
  const std::int64_t n = x.size(0), d = x.size(1);
  if (x.dtype == DType::bf16)
    encode_blocks(x.ptr<const bf16_t>(), n, d, enc.ptr<std::uint8_t>());
  else
    encode_blocks(x.ptr<const float>(), n, d, enc.ptr<std::uint8_t>());
}

// enc: [n, d + 4] u8  x: [n, d] f32 | bf16
void CpuBackend::fp8_decode(ConstTensorView enc, TensorView x) {
  const std::int64_t n = x.size(0), d = x.size(1);
  if (x.dtype == DType::bf16)
    decode_blocks(enc.ptr<const std::uint8_t>(), n, d, x.ptr<bf16_t>());
  else
    decode_blocks(enc.ptr<const std::uint8_t>(), n, d, x.ptr<float>());
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
