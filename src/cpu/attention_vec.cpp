// The attention of one dense block fused on vector registers (issue #54): the DiT's attention,
// where a block is one image's tokens and every query row sees the same keys. f32 runs on the FMA
// units, on AVX-512 (zmm, 16 lanes) or AVX2 (ymm, 8 lanes); bf16 on avx512_bf16's dot products
// (vdpbf16ps: two bf16 products per f32 lane), where the CPU has no AMX (attention_amx.cpp) or AMX
// is turned off. The tile-GEMM path (attention.cpp) writes each [128, keys] f32 score tile to L2
// through oneDNN and reads it back twice, and oneDNN packs the short-K operands of every call again.
// Here a strip of kRows query rows walks the keys in chunks of kChunk = two vectors: S = q K^T in
// kRows x 2 vector accumulators (AVX-512: 12 x 2 = 24 of the 32 zmm registers; AVX2: 6 x 2 = 12 of
// the 16 ymm; K^T packed once per block so each step of the dot product loads two vectors of keys
// and broadcasts one q element, or one pair of them, per row), the online softmax on those
// registers (a stale max that moves only when a chunk's exceeds it by 2^kStaleMax, checked in the
// score domain without a horizontal reduction; P = 2^(c s - m) by simd::exp2_floor), P stored as a
// kRows x kChunk L1 tile (bf16: rounded there, as the tile path rounds it), then O += P V with O's
// rows loaded into the accumulators two vectors of columns at a time (bf16: V packed in key
// pairs), one chunk behind (after the next chunk's softmax: P is never read right after it is
// stored; a moving max rescales the held row of P with O). kGroup strips (96 query rows) take each
// span of kSpan keys in turn (their K^T and V stay in L2: at FLUX's width a head's K and V, 4.7 MB
// in f32, outgrow it).
// Same math as the tile path: f32 (or bf16) operands, f32 accumulation, base-2 online softmax on
// c * scores, P rounded to bf16 only as an operand, exp to 1.5e-7 in f32 (the tile path's
// simd::exp2: 2e-7) and 2.7e-6 in bf16 (P is then rounded to 2^-9); only the order of the f32 sums
// differs. A query row's result depends only on the ordered keys it sees (never on the other rows
// of its strip or on where the keys were stored), so P = 1 and the shards of P = 2 give the same
// bits.
//
// On the avx512 and avx2 kernels (and a native build on such a CPU); bf16 only on avx512, where the
// CPU has avx512_bf16. DIFFCP_CPU_FUSED=0 turns it off (the tile path then runs these blocks).
// Shapes: q [GB, d] (dense rows: the block's packed query tile), k, v [n, d] (dense rows, the keys
// the block sees, in order), d a multiple of 32; outputs o [GB, d] f32 (unnormalised, as the tile
// path's accumulator), m [GB] (base-2 row max of c * scores), l [GB] (the row sums at that max).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_backend.hpp"
#include "diffcp/core/env.hpp"
#include "diffcp/core/error.hpp"
#include "isa.hpp"  // last (isa.hpp)

#if defined(__x86_64__) && (defined(DIFFCP_CPU_ISA_AVX512) || (defined(DIFFCP_CPU_ISA_NATIVE) && defined(__AVX512F__)))
#define DIFFCP_VEC_KERNEL 512
#pragma GCC push_options
#pragma GCC target("avx512bf16")  // the bf16 steps only run where the CPU has it (cpu_has_avx512_bf16)
#elif defined(__x86_64__) && \
    (defined(DIFFCP_CPU_ISA_AVX2) || (defined(DIFFCP_CPU_ISA_NATIVE) && defined(__AVX2__) && defined(__FMA__)))
#define DIFFCP_VEC_KERNEL 256
#endif

namespace diffcp::cpu::DIFFCP_CPU_ISA {

namespace {

// DIFFCP_CPU_FUSED: unset or 1 = the fused kernels where these kernels carry them, 0 = off;
// anything else is an error.
bool fused_knob_on() { return env_switch(EnvKnob::cpu_fused, "on: the avx512 and avx2 kernels"); }

}  // namespace

#if defined(DIFFCP_VEC_KERNEL)

namespace {

// The registers of this ISA: F a vector of kLanes f32, Mask a set of its lanes; kRows query rows
// per strip (their 2 x kRows score accumulators, two vectors of keys and a broadcast fill the
// register file).
#if DIFFCP_VEC_KERNEL == 512
struct Reg {
  static constexpr std::int64_t kLanes = 16, kRows = 12;
  using F = __m512;
  using Mask = __mmask16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F fmadd(F a, F b, F acc) { return _mm512_fmadd_ps(a, b, acc); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_mask_max_ps(a, simd::kAll, a, b); }
  static bool any_above(F v, float t) { return _mm512_cmp_ps_mask(v, set1(t), _CMP_GT_OQ) != 0; }
  static Mask first(std::int64_t n) { return n >= kLanes ? simd::kAll : static_cast<Mask>((1u << n) - 1); }  // n >= 0
  static F blend(Mask live, F v, F dead) { return _mm512_mask_blend_ps(live, dead, v); }
  static F keep(Mask live, F v) { return _mm512_maskz_mov_ps(live, v); }
};
#else
struct Reg {
  static constexpr std::int64_t kLanes = 8, kRows = 6;
  using F = __m256;
  using Mask = __m256;  // all ones in the live lanes
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fmadd(F a, F b, F acc) { return _mm256_fmadd_ps(a, b, acc); }
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static bool any_above(F v, float t) { return _mm256_movemask_ps(_mm256_cmp_ps(v, set1(t), _CMP_GT_OQ)) != 0; }
  static Mask first(std::int64_t n) {  // n >= 0
    return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), set1(static_cast<float>(n)), _CMP_LT_OQ);
  }
  static F blend(Mask live, F v, F dead) { return _mm256_blendv_ps(dead, v, live); }
  static F keep(Mask live, F v) { return _mm256_and_ps(v, live); }
};
#endif

constexpr std::int64_t kLanes = Reg::kLanes;
constexpr std::int64_t kRows = Reg::kRows;       // query rows per strip
constexpr std::int64_t kChunk = 2 * kLanes;      // keys per online-softmax step: two vectors of scores per row
constexpr std::int64_t kSpan = 256;              // keys whose K^T and V a group of strips shares in cache
constexpr std::int64_t kGroup = 96 / kRows;      // strips that take each span in turn
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kStaleMax = 8.f;  // base 2
using F = Reg::F;
using simd::lanes_max;
using simd::lanes_sum;

// The storage type's operands. f32: one element per lane; bf16 (avx512 only): a pair per 32-bit
// lane (the pair is along d in q K^T and along the keys in P V), vdpbf16ps adding both products to
// the f32 lane.
template <typename E>
struct Ops;
template <>
struct Ops<float> {
  static constexpr std::int64_t kPair = 1;
  using V = F;
  static V load(const float* p) { return Reg::load(p); }
  static V broadcast(const float* p) { return Reg::set1(*p); }
  static F madd(F acc, V a, V b) { return Reg::fmadd(a, b, acc); }
  static void store_p(float* p, F e0, F e1) {
    Reg::store(p, e0);
    Reg::store(p + kLanes, e1);
  }
  static void scale_p(float* p, F alpha) {  // a row of P held for the next O += P V
    Reg::store(p, Reg::mul(Reg::load(p), alpha));
    Reg::store(p + kLanes, Reg::mul(Reg::load(p + kLanes), alpha));
  }
};
#if DIFFCP_VEC_KERNEL == 512
using simd::kAll;

template <>
struct Ops<std::uint16_t> {
  static constexpr std::int64_t kPair = 2;
  using V = __m512i;
  static V load(const std::uint16_t* p) { return _mm512_load_si512(p); }
  static V broadcast(const std::uint16_t* p) {
    std::int32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return _mm512_set1_epi32(pair);
  }
  static __m512 madd(__m512 acc, V a, V b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static void store_p(std::uint16_t* p, __m512 e0, __m512 e1) {  // P's 32 keys in order, rounded
    _mm512_store_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  static __m512 widen(const std::uint16_t* p) {  // 16 bf16 -> f32
    const __m512i wide = _mm512_maskz_cvtepu16_epi32(kAll, _mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, wide, 16));
  }
  static void scale_p(std::uint16_t* p, __m512 alpha) {  // rounded twice: only where a row's max moves
    store_p(p, _mm512_mul_ps(widen(p), alpha), _mm512_mul_ps(widen(p + kLanes), alpha));
  }
};

// bf16 V in key pairs: vp[((ch * kChunk / 2 + jp) * d + c) * 2 + i] = v[ch * kChunk + 2 jp + i][c];
// keys n..n_pad are zero (their P is 0, and 0 * 0 stays 0).
void pack_values(const std::uint16_t* v, std::int64_t n, std::int64_t n_pad, std::int64_t d, std::uint16_t* vp) {
  for (std::int64_t j = 0; j < n_pad; j += 2)
    for (std::int64_t i = 0; i < 2; ++i) {
      const std::uint16_t* row = j + i < n ? v + (j + i) * d : nullptr;
      std::uint16_t* out = vp + (j / 2) * d * 2 + i;
      for (std::int64_t c = 0; c < d; ++c) out[2 * c] = row ? row[c] : std::uint16_t{0};
    }
}
#endif

// 2^x for a softmax argument x <= kStaleMax (simd::exp2_floor): f32 degree 5, relative error
// 1.5e-7 (the tile path's simd::exp2: 2e-7); bf16, whose P is rounded to 2^-9 right after, the AMX
// kernel's degree 4 (2.7e-6).
template <typename E>
inline F exp2_clamped(F x) {
  return simd::exp2_floor<Ops<E>::kPair == 1 ? 5 : 4>(x);
}

// K^T by chunks, d in runs of kPair: kt[((ch * d / kPair + e) * kChunk + j) * kPair + i] =
// k[ch * kChunk + j][e * kPair + i]; keys n..n_pad are zero.
template <typename E>
void pack_keys(const E* k, std::int64_t n, std::int64_t n_pad, std::int64_t d, E* kt) {
  constexpr std::int64_t kPair = Ops<E>::kPair;
  for (std::int64_t j0 = 0; j0 < n_pad; j0 += kChunk) {
    E* chunk = kt + j0 * d;
    for (std::int64_t j = 0; j < kChunk; ++j) {
      const E* row = j0 + j < n ? k + (j0 + j) * d : nullptr;
      for (std::int64_t e = 0; e < d; ++e) chunk[((e / kPair) * kChunk + j) * kPair + e % kPair] = row ? row[e] : E{};
    }
  }
}

// The per-strip state: O [kRows, d] (unnormalised), each row's base-2 max m, its threshold in the
// score domain thr = (m + kStaleMax) / c (a score above it moves the max), and kLanes partial row
// sums lv at m.
struct Strip {
  float* O;
  float* m;
  float* thr;
  float* lv;
};

// The scores and the online softmax of strip st (query rows qs [kRows, d]) on a chunk of keys,
// `valid` of them real (K^T chunk kc [d / kPair, kChunk, kPair]): P [kRows, kChunk] (the padding
// keys' columns 0). `held`: the previous chunk's P, whose O += P V is still to come: where a row's
// max moves, O, the sums and that row of `held` are rescaled (the first chunk: by 0).
template <typename E, bool kFull>
void scores_softmax(const E* qs, const E* kc, std::int64_t valid, std::int64_t d, float c, const Strip& st, E* P,
                    E* held) {
  using Op = Ops<E>;
  constexpr std::int64_t kPair = Op::kPair;
  F s[kRows][2];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = Reg::zero();
  for (std::int64_t e = 0; e < d / kPair; ++e) {
    const E* b = kc + e * kChunk * kPair;
    const auto b0 = Op::load(b), b1 = Op::load(b + kLanes * kPair);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const auto a = Op::broadcast(qs + r * d + e * kPair);
      s[r][0] = Op::madd(s[r][0], a, b0);
      s[r][1] = Op::madd(s[r][1], a, b1);
    }
  }
  // The real keys' lanes (the last chunk may hold fewer than kChunk).
  const typename Reg::Mask live0 = Reg::first(std::min(valid, kLanes));
  const typename Reg::Mask live1 = Reg::first(std::max<std::int64_t>(0, valid - kLanes));
  const F cv = Reg::set1(c), neg_inf = Reg::set1(kNegInf);
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    const F s0 = kFull ? s[r][0] : Reg::blend(live0, s[r][0], neg_inf);
    const F s1 = kFull ? s[r][1] : Reg::blend(live1, s[r][1], neg_inf);
    const F vmax = Reg::max(s0, s1);
    if (__builtin_expect(Reg::any_above(vmax, st.thr[r]), 0)) {
      // The max moves: O, the sums and the held P so far are rescaled to the new one.
      const float mx = c * lanes_max(vmax), m_old = st.m[r];
      const F alpha = Reg::set1(m_old == kNegInf ? 0.f : exp2_clamped<E>(Reg::set1(m_old - mx))[0]);
      float* orow = st.O + r * d;
      for (std::int64_t e = 0; e < d; e += kLanes) Reg::store(orow + e, Reg::mul(Reg::load(orow + e), alpha));
      Reg::store(st.lv + r * kLanes, Reg::mul(Reg::load(st.lv + r * kLanes), alpha));
      if (held) Op::scale_p(held + r * kChunk, alpha);
      st.m[r] = mx;
      st.thr[r] = (mx + kStaleMax) / c;
    }
    if (__builtin_expect(st.m[r] == kNegInf, 0)) {  // every score so far -inf or NaN: nothing to add
      Op::store_p(P + r * kChunk, Reg::zero(), Reg::zero());
      continue;
    }
    const F sh = Reg::set1(st.m[r]);
    F e0 = exp2_clamped<E>(Reg::fmsub(s0, cv, sh)), e1 = exp2_clamped<E>(Reg::fmsub(s1, cv, sh));
    if (!kFull) {
      e0 = Reg::keep(live0, e0);
      e1 = Reg::keep(live1, e1);
    }
    Op::store_p(P + r * kChunk, e0, e1);
    Reg::store(st.lv + r * kLanes, Reg::add(Reg::load(st.lv + r * kLanes), Reg::add(e0, e1)));
  }
}

// O [kRows, d] += P V for one chunk: P [kRows, kChunk], V rows vc (f32 [valid, d]; bf16 in key pairs
// [kChunk / 2, d, 2], the padding keys' P and V zero), `steps` keys (bf16: pairs of keys), two
// vectors of columns of O at a time in the accumulators.
template <typename E>
void add_pv(const E* P, const E* vc, std::int64_t steps, std::int64_t d, float* O) {
  using Op = Ops<E>;
  constexpr std::int64_t kPair = Op::kPair;
  for (std::int64_t cb = 0; cb < d; cb += 2 * kLanes) {
    F acc[kRows][2];
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = Reg::load(O + r * d + cb);
      acc[r][1] = Reg::load(O + r * d + cb + kLanes);
    }
    for (std::int64_t j = 0; j < steps; ++j) {
      const E* vj = vc + (j * d + cb) * kPair;
      const auto v0 = Op::load(vj), v1 = Op::load(vj + kLanes * kPair);
#pragma GCC unroll 12
      for (int r = 0; r < kRows; ++r) {
        const auto a = Op::broadcast(P + r * kChunk + j * kPair);
        acc[r][0] = Op::madd(acc[r][0], a, v0);
        acc[r][1] = Op::madd(acc[r][1], a, v1);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      Reg::store(O + r * d + cb, acc[r][0]);
      Reg::store(O + r * d + cb + kLanes, acc[r][1]);
    }
  }
}

// Strip st (query rows qs) through chunks [ch0, ch1) of the keys (K^T kt, V vr as block_impl packs
// them): each chunk's O += P V runs after the next chunk's softmax (P in two buffers), so its P is
// never read right after it was stored.
template <typename E>
void strip_span(const E* qs, const E* kt, const E* vr, std::int64_t n, std::int64_t ch0, std::int64_t ch1,
                std::int64_t d, float c, const Strip& st) {
  constexpr std::int64_t kPair = Ops<E>::kPair;
  alignas(64) E P[2][kRows * kChunk];
  const auto valid = [&](std::int64_t ch) { return std::min(kChunk, n - ch * kChunk); };
  for (std::int64_t ch = ch0; ch < ch1; ++ch) {
    E* held = ch > ch0 ? P[(ch - 1) & 1] : nullptr;
    if (valid(ch) == kChunk)
      scores_softmax<E, true>(qs, kt + ch * kChunk * d, kChunk, d, c, st, P[ch & 1], held);
    else
      scores_softmax<E, false>(qs, kt + ch * kChunk * d, valid(ch), d, c, st, P[ch & 1], held);
    if (held) add_pv(held, vr + (ch - 1) * kChunk * d, (valid(ch - 1) + kPair - 1) / kPair, d, st.O);
  }
  add_pv(P[(ch1 - 1) & 1], vr + (ch1 - 1) * kChunk * d, (valid(ch1 - 1) + kPair - 1) / kPair, d, st.O);
}

template <typename E>
void block_impl(const E* q, std::int64_t GB, const E* k, const E* v, std::int64_t n, std::int64_t d, float c,
                float* o, float* m, float* l, VecScratch<E>& w) {
  const DType dtype = Ops<E>::kPair == 1 ? DType::f32 : DType::bf16;
  DIFFCP_CHECK(vec_attention_ready(dtype, d) && n >= 1, "fused ", dtype_name(dtype), " attention: not for d_h = ", d,
               " and ", n, " keys on this CPU (vec_attention_ready: d_h a multiple of ", kVecHeadDim,
               ", bf16 needs avx512_bf16, DIFFCP_CPU_FUSED not 0; at least one key)");
  const std::int64_t chunks = (n + kChunk - 1) / kChunk, n_pad = chunks * kChunk;
  const std::int64_t strips = (GB + kRows - 1) / kRows;
  constexpr std::int64_t kChunksPerSpan = kSpan / kChunk;
  w.kt.resize(static_cast<std::size_t>(n_pad * d));
  w.q.resize(static_cast<std::size_t>(kGroup * kRows * d));
  w.o.resize(static_cast<std::size_t>(kGroup * kRows * d));
  w.lv.resize(static_cast<std::size_t>(kGroup * kRows * kLanes));
  w.m.resize(static_cast<std::size_t>(2 * kGroup * kRows));
  pack_keys(k, n, n_pad, d, w.kt.data());
  const E* vr = v;  // f32: V's dense rows as they are
#if DIFFCP_VEC_KERNEL == 512
  if constexpr (Ops<E>::kPair == 2) {
    w.vp.resize(static_cast<std::size_t>(n_pad * d));
    pack_values(v, n, n_pad, d, w.vp.data());
    vr = w.vp.data();
  }
#endif
  for (std::int64_t g0 = 0; g0 < strips; g0 += kGroup) {
    const std::int64_t group = std::min(kGroup, strips - g0), r0 = g0 * kRows;
    const std::int64_t rows = std::min(group * kRows, GB - r0);
    // The group's query rows, zero past the block's last row (their results are dropped).
    std::memcpy(w.q.data(), q + r0 * d, sizeof(E) * rows * d);
    std::fill(w.q.begin() + rows * d, w.q.end(), E{});
    std::fill(w.o.begin(), w.o.end(), 0.f);
    std::fill(w.lv.begin(), w.lv.end(), 0.f);
    std::fill(w.m.begin(), w.m.end(), kNegInf);  // m, then thr
    for (std::int64_t ch0 = 0; ch0 < chunks; ch0 += kChunksPerSpan)
      for (std::int64_t t = 0; t < group; ++t) {
        const Strip st{w.o.data() + t * kRows * d, w.m.data() + t * kRows, w.m.data() + (kGroup + t) * kRows,
                       w.lv.data() + t * kRows * kLanes};
        strip_span(w.q.data() + t * kRows * d, w.kt.data(), vr, n, ch0, std::min(chunks, ch0 + kChunksPerSpan), d, c,
                   st);
      }
    std::memcpy(o + r0 * d, w.o.data(), sizeof(float) * rows * d);
    for (std::int64_t r = 0; r < rows; ++r) {
      m[r0 + r] = w.m[static_cast<std::size_t>(r)];
      l[r0 + r] = lanes_sum(Reg::load(w.lv.data() + r * kLanes));
    }
  }
}

}  // namespace

bool vec_attention_ready(DType dtype, std::int64_t d) {
  static const bool on = fused_knob_on();
#if DIFFCP_VEC_KERNEL == 512
  static const bool bf16 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16"));
#else
  constexpr bool bf16 = false;  // no bf16 dot product on AVX2
#endif
  static_assert(kVecHeadDim % (2 * kLanes) == 0);
  return on && (dtype == DType::f32 || (dtype == DType::bf16 && bf16)) && d > 0 && d % kVecHeadDim == 0;
}

void vec_attention_block(const float* q, std::int64_t GB, const float* k, const float* v, std::int64_t n,
                         std::int64_t d, float c, float* o, float* m, float* l, VecScratch<float>& w) {
  block_impl(q, GB, k, v, n, d, c, o, m, l, w);
}

void vec_attention_block(const std::uint16_t* q, std::int64_t GB, const std::uint16_t* k, const std::uint16_t* v,
                         std::int64_t n, std::int64_t d, float c, float* o, float* m, float* l,
                         VecScratch<std::uint16_t>& w) {
#if DIFFCP_VEC_KERNEL == 512
  block_impl(q, GB, k, v, n, d, c, o, m, l, w);
#else
  (void)q, (void)GB, (void)k, (void)v, (void)n, (void)d, (void)c, (void)o, (void)m, (void)l, (void)w;
  DIFFCP_FAIL("fused bf16 attention: avx512 kernels only (avx512_bf16's dot products)");
#endif
}

#else  // no fused kernels in this ISA's build

bool vec_attention_ready(DType, std::int64_t) {
  static const bool knob_checked = fused_knob_on();  // a bad value is an error on every ISA
  (void)knob_checked;
  return false;
}

void vec_attention_block(const float*, std::int64_t, const float*, const float*, std::int64_t, std::int64_t, float,
                         float*, float*, float*, VecScratch<float>&) {
  DIFFCP_FAIL("fused attention: not compiled into these kernels (avx512 and avx2 only)");
}
void vec_attention_block(const std::uint16_t*, std::int64_t, const std::uint16_t*, const std::uint16_t*, std::int64_t,
                         std::int64_t, float, float*, float*, float*, VecScratch<std::uint16_t>&) {
  DIFFCP_FAIL("fused attention: not compiled into these kernels (avx512 and avx2 only)");
}

#endif

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA

#if DIFFCP_VEC_KERNEL == 512
#pragma GCC pop_options
#endif
