// One CPU backend per instruction set, from the same sources. src/CMakeLists.txt compiles each
// kernel file of src/cpu/ once per ISA of the build (avx512, avx2, generic = the x86-64 baseline;
// or only `native` when DIFFCP_NATIVE=ON builds for -march=native) with
// -DDIFFCP_CPU_ISA=<isa> -DDIFFCP_CPU_ISA_<ISA>; dispatch.cpp picks one at run time from the CPU's
// features (DIFFCP_CPU_ISA=<isa> in the environment overrides).
//
// This header must be a kernel file's LAST include (tests/kernels/cpu_isa_check.sh checks it): the
// `#pragma GCC target` below applies to every function defined after it, so the kernel file's own
// functions, its OpenMP regions and what they inline are compiled for the ISA, while the library
// and std templates declared in the headers above it keep the baseline ISA in every copy (no
// AVX-512 instantiation can be picked by the linker for code that runs on an AVX2 CPU).
//
// It also gives the kernels a small SIMD layer (namespace simd): GCC vector types of the ISA's
// width, for the loops GCC does not vectorise by itself (the online softmax's exp2 on AVX2: its
// clamp became branches; `-fopt-info-vec-missed`: "control flow in loop").
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>  // before the target pragma, as every library header
#endif

#if !defined(DIFFCP_CPU_ISA)
#error "src/cpu kernel files are compiled once per ISA with -DDIFFCP_CPU_ISA=<isa> (src/CMakeLists.txt)"
#endif

// GCC's C++ front end lexes the file before it parses the pragma, so __AVX2__ & co. do not follow
// it: the width comes from our own macro.
// The features each target enables are exactly those dispatch.cpp checks before it runs them.
#if defined(DIFFCP_CPU_ISA_AVX512)
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,prefer-vector-width=512")
#define DIFFCP_SIMD_BYTES 64
#elif defined(DIFFCP_CPU_ISA_AVX2)
#pragma GCC target("avx2,fma")
#define DIFFCP_SIMD_BYTES 32
#elif defined(DIFFCP_CPU_ISA_NATIVE) && defined(__AVX512F__)
#define DIFFCP_SIMD_BYTES 64
#elif defined(DIFFCP_CPU_ISA_NATIVE) && defined(__AVX2__)
#define DIFFCP_SIMD_BYTES 32
#else  // generic: SSE2 on x86-64 (16-byte vectors; other CPUs lower them as they can)
#define DIFFCP_SIMD_BYTES 16
#endif

namespace diffcp::cpu::DIFFCP_CPU_ISA::simd {

constexpr std::int64_t kLanes = DIFFCP_SIMD_BYTES / 4;
typedef float vf __attribute__((vector_size(DIFFCP_SIMD_BYTES)));
typedef std::int32_t vi __attribute__((vector_size(DIFFCP_SIMD_BYTES)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf broadcast(float x) { return vf{} + x; }
// n < kLanes elements, the rest `fill`.
inline vf load_part(const float* p, std::int64_t n, float fill) {
  vf v = broadcast(fill);
  for (std::int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
inline void store_part(float* p, vf v, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) p[i] = v[i];
}
inline vf max(vf a, vf b) { return a > b ? a : b; }
inline vf min(vf a, vf b) { return a < b ? a : b; }
inline float hsum(vf v) {
  float s = 0.f;
  for (std::int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (std::int64_t i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// 2^x per lane, rel. error ~2e-7, for x clamped to [-127, 127]: 2^-127 and below give exactly 0,
// 2^127 is the largest result (never inf, never a denormal). x = n + f with n the nearest integer
// (adding 1.5*2^23 rounds), 2^f (|f| <= 0.5) by the degree-6 polynomial of Cephes' exp2f, n put
// straight into the exponent bits. Branch-free on vectors: the same code as a plain float loop
// was vectorised by GCC 12 for AVX-512 but not for AVX2, and glibc's exp2f / expf not at all.
inline vf exp2(vf x) {
  x = min(max(x, broadcast(-127.f)), broadcast(127.f));
  const vf shifter = broadcast(12582912.f);  // 1.5 * 2^23, bit pattern 0x4B400000
  const vf t = x + shifter;
  const vf f = x - (t - shifter);
  vf p = broadcast(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  vi t_bits;
  std::memcpy(&t_bits, &t, sizeof t_bits);
  const vi bits = (t_bits - 0x4B400000 + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
// One value, the same bits as a lane of the vector form.
inline float exp2(float x) { return exp2(broadcast(x))[0]; }

// f32 <-> bf16 on vectors, bit-exact with core/half.hpp's convert_to_bf16 / convert_to_f32 (round to
// nearest even, a NaN stays a quiet NaN). half.hpp's loops sit above this header's pragma, so they
// compile for the baseline ISA: the kernels' conversions (the DiT's bf16 GEMM operands, P of the
// bf16 attention tiles) use these (issue #54).
typedef std::uint32_t vu __attribute__((vector_size(DIFFCP_SIMD_BYTES)));
typedef std::uint16_t vh __attribute__((vector_size(DIFFCP_SIMD_BYTES / 2)));
// The m <= kLanes first lanes of v, rounded, into out[0..m).
inline void store_bf16(std::uint16_t* out, vf v, std::int64_t m = kLanes) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const vu nan = reinterpret_cast<vu>((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const vh h = __builtin_convertvector(((nan & (u | 0x400000u)) | (~nan & rounded)) >> 16, vh);
  if (m == kLanes)
    std::memcpy(out, &h, sizeof h);
  else
    for (std::int64_t i = 0; i < m; ++i) out[i] = h[i];
}
inline void to_bf16(const float* __restrict x, std::uint16_t* __restrict out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_bf16(out + i, load(x + i));
  if (i < n) store_bf16(out + i, load_part(x + i, n - i, 0.f), n - i);
}
inline void to_f32(const std::uint16_t* __restrict x, float* __restrict out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vh h;
    std::memcpy(&h, x + i, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    std::memcpy(out + i, &u, sizeof u);
  }
  for (; i < n; ++i) {
    const std::uint32_t u = static_cast<std::uint32_t>(x[i]) << 16;
    std::memcpy(out + i, &u, 4);
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA::simd

#if defined(__x86_64__) && DIFFCP_SIMD_BYTES >= 32
// Helpers of the fused attention kernels (attention_amx.cpp, attention_vec.cpp) on the ISA's
// registers: lanes_max / lanes_sum (horizontal max / sum) and exp2_floor<kDegree>(x), 2^x for
// x <= 2^7 (a softmax argument), clamped at 2^-126 (the smallest normal: no denormal reaches a sum
// or a product). f = x - floor(x) in [0, 1) (exact), 2^f by a fit of relative error on [0, 1),
// times 2^floor(x). kDegree 5: relative error 1.5e-7 (f32 results); 4: 2.7e-6 (P rounded to bf16,
// 2^-9, right after). Both widths run the same steps: f exact, the same fit, an exact scaling.
namespace diffcp::cpu::DIFFCP_CPU_ISA::simd {

// The fits' coefficients, highest power first.
constexpr float kExp2Fit5[6] = {1.8775753e-3f, 8.98934435e-3f, 5.58263138e-2f, 2.40153626e-1f, 6.93153083e-1f,
                                0.99999994f};
constexpr float kExp2Fit4[5] = {1.353414e-2f, 5.201157e-2f, 2.4144264e-1f, 6.9300387e-1f, 1.00000259f};
template <int kDegree>
constexpr const float* exp2_fit() {
  static_assert(kDegree == 4 || kDegree == 5);
  return kDegree == 5 ? kExp2Fit5 : kExp2Fit4;
}

#if DIFFCP_SIMD_BYTES == 64
// The masked forms of the intrinsics with a full mask: GCC 12's unmasked ones warn on their
// undefined pass-through operand.
constexpr __mmask16 kAll = 0xffff;
inline float lanes_max(__m512 v) {
  v = _mm512_mask_max_ps(v, kAll, v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0x4E));
  v = _mm512_mask_max_ps(v, kAll, v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0xB1));
  v = _mm512_mask_max_ps(v, kAll, v, _mm512_mask_permute_ps(v, kAll, v, 0x4E));
  return _mm512_cvtss_f32(_mm512_mask_max_ps(v, kAll, v, _mm512_mask_permute_ps(v, kAll, v, 0xB1)));
}
inline float lanes_sum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, kAll, v, 0x4E));
  return _mm512_cvtss_f32(_mm512_add_ps(v, _mm512_mask_permute_ps(v, kAll, v, 0xB1)));
}
// f by vreduceps, the product by vscalefps.
template <int kDegree>
inline __m512 exp2_floor(__m512 x) {
  x = _mm512_mask_max_ps(x, kAll, x, _mm512_set1_ps(-126.f));
  const __m512 f = _mm512_mask_reduce_ps(x, kAll, x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(exp2_fit<kDegree>()[0]);
#pragma GCC unroll 5
  for (int i = 1; i <= kDegree; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_fit<kDegree>()[i]));
  return _mm512_mask_scalef_ps(p, kAll, p, x);
}
#else
inline float lanes_max(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
inline float lanes_sum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
// f by vroundps and a subtraction, 2^floor(x) put into the exponent bits.
template <int kDegree>
inline __m256 exp2_floor(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_floor_ps(x), f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(exp2_fit<kDegree>()[0]);
#pragma GCC unroll 5
  for (int i = 1; i <= kDegree; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_fit<kDegree>()[i]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA::simd
#endif
