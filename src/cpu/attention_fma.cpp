// The f32 attention of one dense block fused on the FMA units (issue #54): the DiT's attention,
// where a block is one image's tokens and every query row sees the same keys. The tile-GEMM path
// (attention.cpp) writes each [128, keys] f32 score tile to L2 through oneDNN's sgemm and reads it
// back twice; oneDNN packs the short-K operands of every call again. Here a strip of kRows query
// rows walks the keys in chunks of kChunk: S = q K^T in 12 x 2 vector accumulators (24 of the 32
// zmm registers; K^T packed once per block so each step of the dot product loads two vectors of
// keys and broadcasts one q element per row), the online softmax on those registers (a stale max
// that moves only when a chunk's exceeds it by 2^kStaleMax, checked in the score domain without a
// horizontal reduction; P = 2^(c s - m) by vreduceps + a degree-5 fit + vscalefps), P stored as a
// 12 x 32 L1 tile, then O += P V with O's rows loaded into the accumulators 32 columns at a time.
// kGroup strips take each span of kSpan keys in turn (their K^T and V stay in L2: at FLUX's width
// a head's K and V, 4.7 MB in f32, outgrow it).
// Same math as the tile path: f32 operands and accumulation, base-2 online softmax on c * scores,
// exp to 1.5e-7 (the tile path's simd::exp2: 2e-7); only the order of the f32 sums differs. A query
// row's result depends only on the ordered keys it sees (never on the other rows of its strip or
// on where the keys were stored), so P = 1 and the shards of P = 2 give the same bits.
//
// Only on the avx512 kernels (and a native build on such a CPU). DIFFCP_CPU_FUSED_F32=0 turns it
// off (the tile path then runs these blocks). Shapes: q [GB, d] (dense rows: the block's packed
// query tile), k, v [n, d] (dense rows, the keys the block sees, in order), d a multiple of 32;
// outputs o [GB, d] f32 (unnormalised, as the tile path's accumulator), m [GB] (base-2 row max of
// c * scores), l [GB] (the row sums at that max).
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
#define DIFFCP_FMA_KERNEL 1
#endif

namespace diffcp::cpu::DIFFCP_CPU_ISA {

namespace {

// DIFFCP_CPU_FUSED_F32: unset or 1 = the fused kernel where these kernels carry it, 0 = off;
// anything else is an error.
bool fused_f32_knob_on() {
  const auto knob = env_value(EnvKnob::cpu_fused_f32);
  if (knob && *knob != "0" && *knob != "1")
    DIFFCP_FAIL(env_name(EnvKnob::cpu_fused_f32), "=", *knob, ": expected 0 (off) or 1 (on: the avx512 kernels)");
  return !(knob && *knob == "0");
}

}  // namespace

#if defined(DIFFCP_FMA_KERNEL)

namespace {

constexpr std::int64_t kRows = 12;   // query rows per strip: 12 x 2 score accumulators
constexpr std::int64_t kChunk = 32;  // keys per online-softmax step: two vectors of scores per row
constexpr std::int64_t kSpan = 256;  // keys whose K^T and V a group of strips shares in cache
constexpr std::int64_t kGroup = 8;   // strips that take each span in turn
constexpr std::int64_t kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kStaleMax = 8.f;  // base 2
constexpr __mmask16 kAll = 0xffff;

// Masked forms with a full mask: GCC 12's unmasked ones warn on their undefined pass-through.
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

// 2^x for x <= kStaleMax (a softmax argument), relative error 1.5e-7, clamped at 2^-126 (the
// smallest normal: no denormal reaches the sums or the products). f = x - floor(x) in [0, 1) by
// vreduceps, 2^f by a degree-5 fit of relative error on [0, 1), then vscalefps multiplies by
// 2^floor(x): 8 vector operations.
inline __m512 exp2_clamped(__m512 x) {
  x = _mm512_mask_max_ps(x, kAll, x, _mm512_set1_ps(-126.f));
  const __m512 f = _mm512_mask_reduce_ps(x, kAll, x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.8775753e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.98934435e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.58263138e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40153626e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93153083e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999994f));
  return _mm512_mask_scalef_ps(p, kAll, p, x);
}

// K^T by chunks: kt[(ch * d + e) * kChunk + j] = k[ch * kChunk + j][e]; keys n..n_pad are zero.
void pack_keys(const float* k, std::int64_t n, std::int64_t n_pad, std::int64_t d, float* kt) {
  for (std::int64_t j0 = 0; j0 < n_pad; j0 += kChunk) {
    float* chunk = kt + j0 * d;
    for (std::int64_t j = 0; j < kChunk; ++j) {
      const float* row = j0 + j < n ? k + (j0 + j) * d : nullptr;
      for (std::int64_t e = 0; e < d; ++e) chunk[e * kChunk + j] = row ? row[e] : 0.f;
    }
  }
}

// The per-strip state: O [kRows, d] (unnormalised), each row's base-2 max m, its threshold in the
// score domain thr = (m + kStaleMax) / c (a score above it moves the max), and 16 partial row
// sums lv at m.
struct Strip {
  float* O;
  float* m;
  float* thr;
  float* lv;
};

// One step: strip st (query rows qs [kRows, d]) on the chunk of keys [j0, j0 + valid) (K^T chunk
// kc [d, kChunk], V rows vc [valid, d]): the scores, the online softmax, O += P V.
void strip_step(const float* qs, const float* kc, const float* vc, std::int64_t valid, std::int64_t d, float c,
                const Strip& st) {
  __m512 s[kRows][2];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (std::int64_t e = 0; e < d; ++e) {
    const __m512 b0 = _mm512_load_ps(kc + e * kChunk), b1 = _mm512_load_ps(kc + e * kChunk + kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const __m512 a = _mm512_set1_ps(qs[r * d + e]);
      s[r][0] = _mm512_fmadd_ps(a, b0, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(a, b1, s[r][1]);
    }
  }
  // The real keys' lanes (the last chunk may hold fewer than kChunk).
  const __mmask16 live0 = valid >= kLanes ? kAll : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 live1 =
      valid >= kChunk ? kAll : valid > kLanes ? static_cast<__mmask16>((1u << (valid - kLanes)) - 1) : 0;
  alignas(64) float P[kRows * kChunk];
  const __m512 cv = _mm512_set1_ps(c), neg_inf = _mm512_set1_ps(kNegInf);
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    const __m512 s0 = _mm512_mask_blend_ps(live0, neg_inf, s[r][0]);
    const __m512 s1 = _mm512_mask_blend_ps(live1, neg_inf, s[r][1]);
    const __m512 vmax = _mm512_mask_max_ps(s0, kAll, s0, s1);
    if (__builtin_expect(_mm512_cmp_ps_mask(vmax, _mm512_set1_ps(st.thr[r]), _CMP_GT_OQ) != 0, 0)) {
      // The max moves: O and the sums so far are rescaled to the new one (the first chunk: by 0).
      const float mx = c * lanes_max(vmax), m_old = st.m[r];
      const float alpha = m_old == kNegInf ? 0.f : _mm512_cvtss_f32(exp2_clamped(_mm512_set1_ps(m_old - mx)));
      float* orow = st.O + r * d;
      for (std::int64_t e = 0; e < d; e += kLanes)
        _mm512_store_ps(orow + e, _mm512_mul_ps(_mm512_load_ps(orow + e), _mm512_set1_ps(alpha)));
      _mm512_store_ps(st.lv + r * kLanes, _mm512_mul_ps(_mm512_load_ps(st.lv + r * kLanes), _mm512_set1_ps(alpha)));
      st.m[r] = mx;
      st.thr[r] = (mx + kStaleMax) / c;
    }
    float* pr = P + r * kChunk;
    if (__builtin_expect(st.m[r] == kNegInf, 0)) {  // every score so far -inf or NaN: nothing to add
      _mm512_store_ps(pr, _mm512_setzero_ps());
      _mm512_store_ps(pr + kLanes, _mm512_setzero_ps());
      continue;
    }
    const __m512 sh = _mm512_set1_ps(st.m[r]);
    const __m512 e0 = _mm512_maskz_mov_ps(live0, exp2_clamped(_mm512_fmsub_ps(s0, cv, sh)));
    const __m512 e1 = _mm512_maskz_mov_ps(live1, exp2_clamped(_mm512_fmsub_ps(s1, cv, sh)));
    _mm512_store_ps(pr, e0);
    _mm512_store_ps(pr + kLanes, e1);
    _mm512_store_ps(st.lv + r * kLanes, _mm512_add_ps(_mm512_load_ps(st.lv + r * kLanes), _mm512_add_ps(e0, e1)));
  }
  // O += P V, 32 columns of O at a time in the accumulators.
  for (std::int64_t cb = 0; cb < d; cb += 2 * kLanes) {
    __m512 acc[kRows][2];
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = _mm512_load_ps(st.O + r * d + cb);
      acc[r][1] = _mm512_load_ps(st.O + r * d + cb + kLanes);
    }
    for (std::int64_t j = 0; j < valid; ++j) {
      const __m512 v0 = _mm512_loadu_ps(vc + j * d + cb), v1 = _mm512_loadu_ps(vc + j * d + cb + kLanes);
#pragma GCC unroll 12
      for (int r = 0; r < kRows; ++r) {
        const __m512 a = _mm512_set1_ps(P[r * kChunk + j]);
        acc[r][0] = _mm512_fmadd_ps(a, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, v1, acc[r][1]);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      _mm512_store_ps(st.O + r * d + cb, acc[r][0]);
      _mm512_store_ps(st.O + r * d + cb + kLanes, acc[r][1]);
    }
  }
}

}  // namespace

bool fma_attention_ready(std::int64_t d) {
  static const bool ready = fused_f32_knob_on();
  static_assert(2 * kLanes == kFmaHeadDim);
  return ready && d > 0 && d % kFmaHeadDim == 0;
}

void fma_attention_block(const float* q, std::int64_t GB, const float* k, const float* v, std::int64_t n,
                         std::int64_t d, float c, float* o, float* m, float* l, FmaScratch& w) {
  DIFFCP_CHECK(d % kFmaHeadDim == 0 && n >= 1, "fused f32 attention: d_h = ", d, " (a multiple of ", kFmaHeadDim,
               " expected), ", n, " keys");
  const std::int64_t chunks = (n + kChunk - 1) / kChunk, n_pad = chunks * kChunk;
  const std::int64_t strips = (GB + kRows - 1) / kRows;
  constexpr std::int64_t kChunksPerSpan = kSpan / kChunk;
  w.kt.resize(static_cast<std::size_t>(n_pad * d));
  w.q.resize(static_cast<std::size_t>(kGroup * kRows * d));
  w.o.resize(static_cast<std::size_t>(kGroup * kRows * d));
  w.lv.resize(static_cast<std::size_t>(kGroup * kRows * kLanes));
  w.m.resize(static_cast<std::size_t>(2 * kGroup * kRows));
  pack_keys(k, n, n_pad, d, w.kt.data());
  for (std::int64_t g0 = 0; g0 < strips; g0 += kGroup) {
    const std::int64_t group = std::min(kGroup, strips - g0), r0 = g0 * kRows;
    const std::int64_t rows = std::min(group * kRows, GB - r0);
    // The group's query rows, zero past the block's last row (their results are dropped).
    std::memcpy(w.q.data(), q + r0 * d, sizeof(float) * rows * d);
    std::fill(w.q.begin() + rows * d, w.q.end(), 0.f);
    std::fill(w.o.begin(), w.o.end(), 0.f);
    std::fill(w.lv.begin(), w.lv.end(), 0.f);
    std::fill(w.m.begin(), w.m.end(), kNegInf);  // m, then thr
    for (std::int64_t ch0 = 0; ch0 < chunks; ch0 += kChunksPerSpan)
      for (std::int64_t t = 0; t < group; ++t) {
        const Strip st{w.o.data() + t * kRows * d, w.m.data() + t * kRows, w.m.data() + (kGroup + t) * kRows,
                       w.lv.data() + t * kRows * kLanes};
        for (std::int64_t ch = ch0; ch < std::min(chunks, ch0 + kChunksPerSpan); ++ch)
          strip_step(w.q.data() + t * kRows * d, w.kt.data() + ch * kChunk * d, v + ch * kChunk * d,
                     std::min(kChunk, n - ch * kChunk), d, c, st);
      }
    std::memcpy(o + r0 * d, w.o.data(), sizeof(float) * rows * d);
    for (std::int64_t r = 0; r < rows; ++r) {
      m[r0 + r] = w.m[static_cast<std::size_t>(r)];
      l[r0 + r] = lanes_sum(_mm512_load_ps(w.lv.data() + r * kLanes));
    }
  }
}

#else  // no fused f32 kernel in this ISA's build

bool fma_attention_ready(std::int64_t) {
  static const bool knob_checked = fused_f32_knob_on();  // a bad value is an error on every ISA
  (void)knob_checked;
  return false;
}

void fma_attention_block(const float*, std::int64_t, const float*, const float*, std::int64_t, std::int64_t, float,
                         float*, float*, float*, FmaScratch&) {
  DIFFCP_FAIL("fused f32 attention: not compiled into these kernels (avx512 only)");
}

#endif

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
