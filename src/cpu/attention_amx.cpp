// The bf16 attention forward fused on AMX tiles: a dense block (issue #54: the DiT's attention, where a
// block is one image's tokens and every query row sees the same keys), and any block over a list
// of packed key chunks (issue #69: the drafter's block-sparse attention, whose blocks share their
// sample's context prefix, packed once per head; a window masks the chunks its edge crosses). The tile-GEMM path
// (attention.cpp) writes each [128, keys] f32 score tile to memory through oneDNN and reads it
// back twice; at the DiT's d_h = 32 that traffic and the softmax passes were the attention's time.
// Here a tile of 32 query rows walks the keys in chunks of kChunk: S = q K^T in a 2 x 2 block of
// AMX accumulators (each 16 x 16 f32), stored to a 32 x kChunk tile that stays in L1; the online
// softmax on it (chunk_row_max, then exp_row: P rounded to bf16 in the exp pass, as the tile path
// does) with a stale max that moves only by more than 2^kStaleMax, so O is rarely rescaled; P's
// columns held over spans of kSpan keys, then O += P V with O's f32 rows loaded into the
// accumulators and stored back. kGroup query tiles take each span in turn (its K and V stay in
// cache), and each step issues the next one's score tiles before its own softmax. Every tile
// buffer starts on a 64-byte line (LineVector: a tile row across two lines halves the rate).
// Same math as the tile path: bf16 operands, f32 accumulation, f32 softmax, P rounded only as an
// operand; only the order of the f32 sums differs. A query row's result depends only on the
// ordered keys it sees (never on the other rows of its tile or on where the keys were stored).
//
// Only on the avx512 kernels (and a native build on such a CPU), and only when the CPU has AMX
// (amx_tile, amx_bf16) and avx512_bf16 and the kernel grants this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM): amx_attention_ready() says so. DIFFCP_CPU_AMX=0 turns it off.
// Shapes: q [GB, d] (dense rows, the block's packed query tile), k, v [n, d] (dense rows, the keys
// the block sees, in order), d a multiple of 32; outputs o [GB, d] f32 (unnormalised, as the tile
// path's accumulator), m [GB] (base-2 row max of c * scores), l [GB] (the row sums at that max).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_backend.hpp"
#include "diffcp/core/env.hpp"
#include "diffcp/core/error.hpp"
#include "isa.hpp"  // last (isa.hpp)

#if defined(__x86_64__) && (defined(DIFFCP_CPU_ISA_AVX512) || (defined(DIFFCP_CPU_ISA_NATIVE) && defined(__AVX512F__)))
#define DIFFCP_AMX_KERNEL 1
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")
#endif

namespace diffcp::cpu::DIFFCP_CPU_ISA {

namespace {

// DIFFCP_CPU_AMX: unset or 1 = AMX where the CPU has it, 0 = off; anything else is an error.
bool amx_knob_on() { return env_switch(EnvKnob::cpu_amx, "on where the CPU has AMX"); }

}  // namespace

#if defined(DIFFCP_AMX_KERNEL)

namespace {

constexpr std::int64_t kRows = 32;   // query rows per tile (two AMX tiles of 16 rows)
constexpr std::int64_t kChunk = kAmxChunk;  // keys per online-softmax step (measured best of 32-256 at d_h 32 and 128)
constexpr std::int64_t kSpan = 256;  // keys whose P columns are held before O += P V (4 chunks)
constexpr std::int64_t kGroup = 4;   // query tiles that take each span of K and V in turn (in cache)
constexpr std::int64_t kDot = 32;    // bf16 elements of one tile row (64 bytes): the K of one tdpbf16ps
constexpr std::int64_t kCols = 16;   // f32 columns of an accumulator
constexpr std::int64_t kTile = 512;  // bf16 elements of one packed B tile (16 rows x 64 bytes)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kStaleMax = 8.f;  // base 2 (exp_row)

// Palette 1, every tile 16 rows x 64 bytes: tmm0-3 accumulators (scores, then O), tmm4 / tmm5 the
// A operand's two row halves (q, then P), tmm6 / tmm7 the B operands (K^T, then V): dot_2x2.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

TileConfig tile_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}

bool cpu_grants_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), amx_bf16 = d & (1u << 22), avx512f = b & (1u << 16);
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  const bool avx512_bf16 = a & (1u << 5);
  if (!(tile && amx_bf16 && avx512f && avx512_bf16)) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  std::uint32_t xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG, XTILEDATA enabled by the OS
  // Linux >= 5.16 hands out the tile data state per process on request (oneDNN asks the same way).
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

// K^T as B tiles: for each block of 16 keys and each 32-wide slice of d, 16 rows of (d pair) x
// (16 keys x 2): kp[((kb * d/32 + s) * 16 + r) * 32 + 2n + i] = k[kb*16 + n][s*32 + 2r + i]. A d
// pair is one 32-bit word, so each tile is a 16 x 16 transpose of words. Keys n..n_pad are zero.
void amx_pack_keys(const std::uint16_t* k, std::int64_t ld, std::int64_t n, std::int64_t n_pad, std::int64_t d,
                   std::uint16_t* kp) {
  const std::int64_t slices = d / kDot;
  std::uint32_t block[kCols * kCols];
  for (std::int64_t kb = 0; kb < n_pad / kCols; ++kb)
    for (std::int64_t s = 0; s < slices; ++s) {
      for (std::int64_t key = 0; key < kCols; ++key) {  // block[key][r]: the slice's words of each key
        const std::int64_t j = kb * kCols + key;
        if (j < n)
          std::memcpy(block + key * kCols, k + j * ld + s * kDot, sizeof(std::uint32_t) * kCols);
        else
          std::fill_n(block + key * kCols, kCols, 0u);
      }
      std::uint32_t tile[kCols * kCols];
      for (std::int64_t r = 0; r < kCols; ++r)
        for (std::int64_t key = 0; key < kCols; ++key) tile[r * kCols + key] = block[key * kCols + r];
      std::memcpy(kp + (kb * slices + s) * kTile, tile, sizeof tile);
    }
}

// V as B tiles: for each block of 32 keys and each 16-wide column slice of d, 16 rows of (key
// pair) x (16 columns x 2): vp[((vb * d/16 + cs) * 16 + r) * 32 + 2c + i] = v[vb*32 + 2r + i][cs*16 + c]:
// rows 2r and 2r + 1 interleaved. Keys n..n_pad are zero (their P is 0, and 0 * 0 stays 0).
void amx_pack_values(const std::uint16_t* v, std::int64_t ld, std::int64_t n, std::int64_t n_pad, std::int64_t d,
                     std::uint16_t* vp) {
  const std::int64_t slices = d / kCols;
  for (std::int64_t vb = 0; vb < n_pad / kDot; ++vb)
    for (std::int64_t r = 0; r < kDot / 2; ++r) {
      const std::int64_t j = vb * kDot + 2 * r;
      const std::uint16_t* a = j < n ? v + j * ld : nullptr;
      const std::uint16_t* b = j + 1 < n ? v + (j + 1) * ld : nullptr;
      for (std::int64_t cs = 0; cs < slices; ++cs) {
        std::uint32_t* row = reinterpret_cast<std::uint32_t*>(vp + ((vb * slices + cs) * kCols + r) * kDot);
        for (std::int64_t c = 0; c < kCols; ++c)
          row[c] = (a ? a[cs * kCols + c] : 0u) | (b ? static_cast<std::uint32_t>(b[cs * kCols + c]) << 16 : 0u);
      }
    }
}

namespace {

// The 2 x 2 register block of every product here: accumulators tmm0 / tmm1 (rows 0-15, B0 / B1),
// tmm2 / tmm3 (rows 16-31, B0 / B1); A rows 0-15 in tmm4, rows 16-31 in tmm5; B0 in tmm6, B1 in tmm7.
// Each B tile serves both halves of the 32 query rows, and the four accumulators are independent.
// b_stride: the B tiles' row stride in bytes (64: packed tiles).
inline void dot_2x2(const void* a, std::int64_t a_stride_bytes, std::int64_t a_half, const void* b0, const void* b1,
                    std::int64_t b_stride = 64) {
  _tile_loadd(4, a, a_stride_bytes);
  _tile_loadd(6, b0, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, b1, b_stride);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(5, static_cast<const char*>(a) + a_half, a_stride_bytes);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// c rows [0, 32), columns [0, 32) (f32, row stride `stride` bytes) <-> the four accumulators.
inline void store_2x2(float* c, std::int64_t stride) {
  const std::int64_t half = 16 * stride / 4;
  _tile_stored(0, c, stride);
  _tile_stored(1, c + kCols, stride);
  _tile_stored(2, c + half, stride);
  _tile_stored(3, c + half + kCols, stride);
}
inline void load_2x2(const float* c, std::int64_t stride) {
  const std::int64_t half = 16 * stride / 4;
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + kCols, stride);
  _tile_loadd(2, c + half, stride);
  _tile_loadd(3, c + half + kCols, stride);
}

using simd::kAll;
using simd::lanes_max;
using simd::lanes_sum;
// 2^x for a softmax argument x <= kStaleMax, P rounded to bf16 (2^-9) right after: the degree-4
// form, relative error 2.7e-6, 7 vector operations where simd::exp2's bit-level form takes 14.
inline __m512 exp2_clamped(__m512 x) { return simd::exp2_floor<4>(x); }

// The largest of a row's scores s[0, valid) (the real keys of a chunk).
inline float chunk_row_max(const float* s, std::int64_t valid) {
  const std::int64_t full = valid / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (valid - full)) - 1);
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (std::int64_t j = 0; j < full; j += 16) vmax = _mm512_mask_max_ps(vmax, kAll, vmax, _mm512_loadu_ps(s + j));
  if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + full));
  return lanes_max(vmax);
}

// A row's base-2 max after a chunk whose largest score is s_max: it moves to c s_max only when
// that exceeds the current max m by more than kStaleMax (P's values then stay below 2^kStaleMax:
// no overflow, the same relative rounding in bf16; and most chunks leave O unscaled).
inline float moved_max(float m, float s_max, float c) {
  const float chunk_max = c * s_max;
  return chunk_max > m + kStaleMax ? chunk_max : m;
}

// One row of a chunk's scores s[0, valid) (the real keys; P's columns past them are zero) at the
// row's new max mx (moved_max): P = bf16(2^(c s - mx)) into p, and lv = lv * 2^(m - mx) + the P
// values before rounding (16 partial sums, reduced once per query tile); m becomes mx. Returns
// 2^(m - mx), the factor for the row's O (the first chunk: 2^-inf = 0).
inline float exp_row(const float* s, std::int64_t valid, float c, float mx, float& m, float* lv, std::uint16_t* p) {
  if (mx == kNegInf) {  // every score so far -inf (non-finite inputs): nothing to add
    std::fill_n(p, valid, std::uint16_t{0});
    return 1.f;
  }
  const std::int64_t full = valid / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (valid - full)) - 1);
  const __m512 cv = _mm512_set1_ps(c), sh = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (std::int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp2_clamped(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), cv, sh));
    acc = _mm512_add_ps(acc, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  if (tail) {
    const __m512 e = exp2_clamped(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, s + full), cv, sh));
    acc = _mm512_mask_add_ps(acc, tail, acc, e);
    _mm256_mask_storeu_epi16(p + full, tail, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  const float alpha = mx == m ? 1.f : m == kNegInf ? 0.f : _mm512_cvtss_f32(exp2_clamped(_mm512_set1_ps(m - mx)));
  _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(alpha), acc));
  m = mx;
  return alpha;
}

}  // namespace

bool amx_attention_ready(std::int64_t d) {
  static const bool ready = amx_knob_on() && cpu_grants_amx();
  static_assert(kDot == kAmxHeadDim);
  return ready && d > 0 && d % kDot == 0;
}

void amx_attention_chunks(const std::uint16_t* q, std::int64_t GB, std::int64_t d, float c,
                          std::span<const AmxChunk> chunk_list, const AmxRowWindow* window, float* o, float* m,
                          float* l, AmxScratch& w) {
  DIFFCP_CHECK(d % kDot == 0 && !chunk_list.empty(), "amx attention: d_h = ", d, " (a multiple of 32 expected), ",
               chunk_list.size(), " key chunks");
  const std::int64_t slices = d / kDot, col_slices = d / kCols;
  w.q.resize(static_cast<std::size_t>(2 * kGroup * kRows * d));
  w.s.resize(static_cast<std::size_t>(2 * kRows * kChunk));
  w.p.resize(static_cast<std::size_t>(kRows * kSpan));
  w.o.resize(static_cast<std::size_t>(kGroup * kRows * d));
  w.lv.resize(static_cast<std::size_t>(kGroup * kRows * 16));
  w.m.resize(static_cast<std::size_t>(kGroup * kRows));
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
  std::uint16_t* P = w.p.data();
  const std::int64_t q_half = 16 * d * 2, p_half = 16 * kSpan * 2;  // bytes to rows 16-31
  const std::int64_t chunks = static_cast<std::int64_t>(chunk_list.size()), tiles = (GB + kRows - 1) / kRows;
  const auto chunk = [&](std::int64_t ch) -> const AmxChunk& { return chunk_list[static_cast<std::size_t>(ch)]; };
  const auto query_tile = [&](std::int64_t t) { return w.q.data() + t % (2 * kGroup) * kRows * d; };
  // Query tile t into its buffer, zero past the block's last row.
  const auto load_query = [&](std::int64_t t) {
    const std::int64_t rows = std::min(kRows, GB - t * kRows);
    std::memcpy(query_tile(t), q + t * kRows * d, sizeof(std::uint16_t) * rows * d);
    std::fill(query_tile(t) + rows * d, query_tile(t) + kRows * d, std::uint16_t{0});
  };
  // S = query tile t's q K^T on chunk ch, 32 keys at a time.
  const auto scores = [&](std::int64_t t, std::int64_t ch, float* S) {
    const std::uint16_t* qt = query_tile(t);
    for (std::int64_t pb = 0; pb < chunk(ch).keys / kDot; ++pb) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const std::uint16_t* kt = chunk(ch).kp + 2 * pb * slices * kTile;
      for (std::int64_t s = 0; s < slices; ++s)
        dot_2x2(qt + s * kDot, d * 2, q_half, kt + s * kTile, kt + (slices + s) * kTile);
      store_2x2(S + 2 * pb * kCols, kChunk * 4);
    }
  };
  // O += P V over the P columns held (chunks [ch0, ch1), in column order), 32 columns of O at a
  // time in the accumulators: once per span of kSpan keys, or before O is rescaled.
  const auto add_pv = [&](float* O, std::int64_t ch0, std::int64_t ch1) {
    for (std::int64_t cs = 0; cs < col_slices; cs += 2) {
      load_2x2(O + cs * kCols, d * 4);
      std::int64_t col = 0;
      for (std::int64_t ch = ch0; ch < ch1; ++ch)
        for (std::int64_t vb = 0; vb < chunk(ch).keys / kDot; ++vb, col += kDot) {
          const std::uint16_t* vt = chunk(ch).vp + (vb * col_slices + cs) * kTile;
          dot_2x2(P + col, kSpan * 2, p_half, vt, vt + kTile);
        }
      store_2x2(O + cs * kCols, d * 4);
    }
  };
  // The steps (query tile, chunk): groups of kGroup query tiles; in a group, span by span (kSpan
  // keys: their K and V stay in cache for all the group's tiles; at FLUX's width a head's packed
  // K and V, 2.4 MB, outgrow L2), each tile of the group through the span's chunks.
  std::vector<std::pair<std::int64_t, std::int64_t>>& order = w.order;
  order.clear();
  constexpr std::int64_t kChunksPerSpan = kSpan / kChunk;
  for (std::int64_t g0 = 0; g0 < tiles; g0 += kGroup)
    for (std::int64_t c0 = 0; c0 < chunks; c0 += kChunksPerSpan)
      for (std::int64_t t = g0; t < std::min(tiles, g0 + kGroup); ++t)
        for (std::int64_t ch = c0; ch < std::min(chunks, c0 + kChunksPerSpan); ++ch) order.emplace_back(t, ch);
  // Each step issues the next step's score tiles before its own softmax (two S buffers, by the
  // step's parity; measured: as fast as spreading them among the exp passes, the tile unit and
  // the vector units overlap little here).
  const std::int64_t steps = static_cast<std::int64_t>(order.size());
  load_query(0);
  scores(0, 0, w.s.data());
  std::int64_t held = 0, held_ch0 = 0;  // the P columns that wait for add_pv, of chunks from held_ch0
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto [t, ch] = order[static_cast<std::size_t>(step)];
    const AmxChunk& kc = chunk(ch);  // kc.keys: a multiple of 32, at most kChunk
    float* O = w.o.data() + t % kGroup * kRows * d;
    float* lv = w.lv.data() + t % kGroup * kRows * 16;
    float* mt = w.m.data() + t % kGroup * kRows;
    if (ch == 0) {
      std::fill_n(O, kRows * d, 0.f);
      std::fill_n(lv, kRows * 16, 0.f);
      std::fill_n(mt, kRows, kNegInf);
    }
    if (ch % kChunksPerSpan == 0) held = 0, held_ch0 = ch;
    if (step + 1 < steps) {
      const auto [next_t, next_ch] = order[static_cast<std::size_t>(step + 1)];
      if (next_ch == 0) load_query(next_t);
      scores(next_t, next_ch, w.s.data() + ((step + 1) & 1) * kRows * kChunk);
    }
    float* S = w.s.data() + (step & 1) * kRows * kChunk;
    const std::int64_t valid = kc.valid;  // >= 1
    // A window's edge in the chunk: each row's keys outside [lo, hi) (chunk columns) to -inf for
    // the max, and their P to exactly 0 after the exp pass.
    std::int64_t lo[kRows], hi[kRows];
    const bool edge = window != nullptr && kc.edge;
    if (edge)
      for (std::int64_t r = 0; r < kRows; ++r) {
        const std::int64_t row = std::min(t * kRows + r, GB - 1);  // rows past GB: any real row's
        lo[r] = std::clamp<std::int64_t>(window->lo[row] - kc.pos, 0, valid);
        hi[r] = std::clamp<std::int64_t>(window->hi[row] - kc.pos, lo[r], valid);
        float* sr = S + r * kChunk;
        std::fill(sr, sr + lo[r], kNegInf);
        std::fill(sr + hi[r], sr + valid, kNegInf);
      }
    // The online softmax on the chunk, P rounded to bf16 in the exp pass. Every row's max first
    // (independent rows: their horizontal reductions overlap), then the exp passes.
    float mx[kRows];
    bool moved = false;
    for (std::int64_t r = 0; r < kRows; ++r) {
      mx[r] = moved_max(mt[r], chunk_row_max(S + r * kChunk, valid), c);
      moved |= mx[r] != mt[r];
    }
    if (moved && held > 0) {  // O must take the held columns at the old max before it is rescaled
      add_pv(O, held_ch0, ch);
      held = 0, held_ch0 = ch;
    }
    std::uint16_t* Pc = P + held;  // this chunk's columns
    if (valid < kc.keys)  // the padding keys' columns
      for (std::int64_t r = 0; r < kRows; ++r)
        std::fill(Pc + r * kSpan + valid, Pc + r * kSpan + kc.keys, std::uint16_t{0});
    for (std::int64_t r = 0; r < kRows; ++r) {
      const float alpha = exp_row(S + r * kChunk, valid, c, mx[r], mt[r], lv + r * 16, Pc + r * kSpan);
      if (alpha != 1.f)
        for (std::int64_t e = 0; e < d; ++e) O[r * d + e] *= alpha;
      if (edge) {
        std::fill(Pc + r * kSpan, Pc + r * kSpan + lo[r], std::uint16_t{0});
        std::fill(Pc + r * kSpan + hi[r], Pc + r * kSpan + valid, std::uint16_t{0});
      }
    }
    held += kc.keys;
    if (ch == chunks - 1 || (ch + 1) % kChunksPerSpan == 0) add_pv(O, held_ch0, ch + 1);
    if (ch == chunks - 1) {
      const std::int64_t t0 = t * kRows, rows = std::min(kRows, GB - t0);
      std::memcpy(o + t0 * d, O, sizeof(float) * rows * d);
      for (std::int64_t r = 0; r < rows; ++r) {
        m[t0 + r] = mt[r];
        l[t0 + r] = lanes_sum(_mm512_loadu_ps(lv + r * 16));
      }
    }
  }
  _tile_release();
}

void amx_attention_block(const std::uint16_t* q, std::int64_t GB, const std::uint16_t* k, const std::uint16_t* v,
                         std::int64_t n, std::int64_t d, float c, float* o, float* m, float* l, AmxScratch& w) {
  DIFFCP_CHECK(d % kDot == 0 && n >= 1, "amx attention: d_h = ", d, " (a multiple of 32 expected), ", n, " keys");
  const std::int64_t n_pad = (n + kDot - 1) / kDot * kDot;
  w.kp.resize(static_cast<std::size_t>(n_pad * d));
  w.vp.resize(static_cast<std::size_t>(n_pad * d));
  amx_pack_keys(k, d, n, n_pad, d, w.kp.data());
  amx_pack_values(v, d, n, n_pad, d, w.vp.data());
  w.chunks.clear();
  for (std::int64_t j = 0; j < n_pad; j += kChunk)
    w.chunks.push_back({w.kp.data() + j * d, w.vp.data() + j * d, std::min(kChunk, n_pad - j),
                        std::min(kChunk, n - j), j, false});
  amx_attention_chunks(q, GB, d, c, w.chunks, nullptr, o, m, l, w);
}

// The backward on tiles, key-major so that no product needs a transposed operand, and chunk by
// chunk over the blocks that see it, so that a chunk's dK and dV stay in an L1 scratch and reach
// the f32 rows once (block by block, every block re-read and re-wrote its context prefix's rows:
// measured, 42 % of the backward). For each (chunk, block): S^T = K q^T and dP^T = V dO^T ([keys,
// GBp] f32; A = the chunk's K / V rows, B = q / dO packed as keys); P^T = 2^(c S^T - lse2) and
// dS^T = scale P^T (dP^T - D) column by column (the query rows are the columns), rounded to bf16;
// dV += P^T dO and dK += dS^T q (A = P^T / dS^T, B = dO / q packed as values); dQ^T += K^T dS^T
// (B = dS^T with key pairs interleaved) in the block's f32 [d, GBp] accumulator.

void amx_backward_block_begin(const std::uint16_t* q, const std::uint16_t* dout, std::int64_t GB, std::int64_t d,
                              const float* lse2, const float* delta, AmxBackBlock& b) {
  DIFFCP_CHECK(d % kDot == 0 && GB >= 1, "amx attention backward: d_h = ", d, " (a multiple of 32 expected), ", GB,
               " query rows");
  const auto sz = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  b.GB = GB;
  b.GBp = (GB + kDot - 1) / kDot * kDot;
  b.d = d;
  for (auto* x : {&b.qt, &b.dot, &b.qv, &b.dov}) x->resize(sz(b.GBp * d));
  amx_pack_keys(q, d, GB, b.GBp, d, b.qt.data());
  amx_pack_keys(dout, d, GB, b.GBp, d, b.dot.data());
  amx_pack_values(q, d, GB, b.GBp, d, b.qv.data());
  amx_pack_values(dout, d, GB, b.GBp, d, b.dov.data());
  b.dqt.assign(sz(d * b.GBp), 0.f);
  // Per column (query row): the shift and D, 0 on padding and on rows that see no key (masked).
  b.shift.assign(sz(b.GBp), 0.f);
  b.delta.assign(sz(b.GBp), 0.f);
  b.live.assign(sz(b.GBp / 16), 0);
  for (std::int64_t t = 0; t < GB; ++t)
    if (std::isfinite(lse2[t])) {
      b.shift[sz(t)] = lse2[t];
      b.delta[sz(t)] = delta[t];
      b.live[sz(t / 16)] |= static_cast<std::uint16_t>(1u << (t % 16));
    }
}

void amx_backward_block_end(const AmxBackBlock& b, float* dq) {
  for (std::int64_t t = 0; t < b.GB; ++t)
    for (std::int64_t e = 0; e < b.d; ++e) dq[t * b.d + e] = b.dqt[static_cast<std::size_t>(e * b.GBp + t)];
}

void amx_backward_chunk(const AmxBackKeys& keys, std::span<const AmxBackEntry> entries, float c, float scale,
                        float* dk, float* dv, std::int64_t ld_kv, AmxBackScratch& w) {
  if (entries.empty()) return;
  const std::int64_t d = entries.front().block->d, n = keys.keys;
  DIFFCP_CHECK(n % kDot == 0 && n <= kChunk, "amx attention backward: a chunk of ", n, " keys");
  const std::int64_t slices = d / kDot, col_slices = d / kCols;
  const auto sz = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  std::int64_t GBp_max = 0;
  for (const AmxBackEntry& e : entries) GBp_max = std::max(GBp_max, e.block->GBp);
  w.s.resize(sz(kChunk * GBp_max));
  w.dp.resize(w.s.size());
  w.p.resize(w.s.size());
  w.ds.resize(w.s.size());
  w.dsv.resize(w.s.size());
  w.dks.assign(sz(kChunk * d), 0.f);
  w.dvs.assign(sz(kChunk * d), 0.f);
  w.dkp.resize(sz(kChunk * d));
  w.dvp.resize(sz(kChunk * d));
  w.kt.resize(sz(d * kChunk));
  w.lo.resize(sz(GBp_max));
  w.hi.resize(sz(GBp_max));
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
  // The 32 bf16 of words (a[t], b[t]) for t < 16: a pair of dS^T rows interleaved.
  const __m512i pair_index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                               6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512 cv = _mm512_set1_ps(c), sv = _mm512_set1_ps(scale);
  std::uint64_t touched = 0;  // the chunk's key rows some entry sees
  for (const AmxBackEntry& e : entries) {
    AmxBackBlock& b = *e.block;
    const std::int64_t GBp = b.GBp, qblocks = GBp / kDot;
    const std::int64_t ld_s = GBp * 4, ld_p = GBp * 2;  // bytes per key row of S^T / dP^T and of P^T / dS^T
    const std::int64_t rb0 = e.r0 / kDot, rb1 = (e.r1 + kDot - 1) / kDot;  // the 32-row groups it touches
    touched |= (e.r1 - e.r0 == 64 ? ~0ull : ((1ull << (e.r1 - e.r0)) - 1)) << e.r0;
    for (std::int64_t rb = rb0; rb < rb1; ++rb)
      for (std::int64_t qb = 0; qb < qblocks; ++qb) {
        const std::int64_t b0 = 2 * qb * slices * kTile, b1 = (2 * qb + 1) * slices * kTile;
        for (int which = 0; which < 2; ++which) {  // S^T from K and q, then dP^T from V and dO
          const std::uint16_t* a = (which == 0 ? keys.kd : keys.vd) + rb * kDot * d;
          const std::uint16_t* bt = which == 0 ? b.qt.data() : b.dot.data();
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (std::int64_t sl = 0; sl < slices; ++sl)
            dot_2x2(a + sl * kDot, d * 2, 16 * d * 2, bt + b0 + sl * kTile, bt + b1 + sl * kTile);
          store_2x2((which == 0 ? w.s.data() : w.dp.data()) + rb * kDot * GBp + qb * kDot, ld_s);
        }
      }
    const bool edge = e.window != nullptr;
    if (edge)
      for (std::int64_t t = 0; t < GBp; ++t) {
        const std::int64_t row = std::min(t, b.GB - 1);
        const std::int64_t lo = std::clamp<std::int64_t>(e.window->lo[row] - e.pos + e.r0, e.r0, e.r1);
        w.lo[sz(t)] = static_cast<std::int32_t>(lo);
        w.hi[sz(t)] = static_cast<std::int32_t>(std::clamp<std::int64_t>(e.window->hi[row] - e.pos + e.r0, lo, e.r1));
      }
    // P^T and dS^T, two key rows at a time (dS^T's interleaved pair row); rows outside [r0, r1) 0.
    for (std::int64_t r = rb0 * kDot; r < rb1 * kDot; r += 2) {
      std::uint16_t* pair = w.dsv.data() + r / 2 * GBp * 2;
      for (std::int64_t tb = 0; tb < GBp; tb += 16) {
        // Key row rr, columns [tb, tb + 16): P^T and dS^T stored as bf16; returns dS^T's.
        const auto key_row = [&](std::int64_t rr) {
          __mmask16 m = rr >= e.r0 && rr < e.r1 ? static_cast<__mmask16>(b.live[sz(tb / 16)]) : 0;
          if (edge && m) {
            const __m512i rv = _mm512_set1_epi32(static_cast<int>(rr));
            m &= _mm512_cmple_epi32_mask(_mm512_loadu_si512(w.lo.data() + tb), rv) &
                 _mm512_cmplt_epi32_mask(rv, _mm512_loadu_si512(w.hi.data() + tb));
          }
          const float* srow = w.s.data() + rr * GBp + tb;
          const float* dprow = w.dp.data() + rr * GBp + tb;
          const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(srow), cv, _mm512_loadu_ps(b.shift.data() + tb));
          const __m512 p = _mm512_maskz_mov_ps(m, simd::exp2_floor<5>(x));
          const __m512 ds = _mm512_maskz_mul_ps(
              m, _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dprow), _mm512_loadu_ps(b.delta.data() + tb))), sv);
          const __m256i ds_bf = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(ds));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.p.data() + rr * GBp + tb),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.ds.data() + rr * GBp + tb), ds_bf);
          return ds_bf;
        };
        const __m256i even = key_row(r), odd = key_row(r + 1);  // the index reads their low halves only
        _mm512_storeu_si512(pair + tb * 2, _mm512_permutex2var_epi16(_mm512_castsi256_si512(even), pair_index,
                                                                     _mm512_castsi256_si512(odd)));
      }
    }
    // dV += P^T dO and dK += dS^T q in the chunk's scratch. An entry that covers only part of its
    // 32-row groups computes them apart and adds its own rows: the other rows' products are
    // 0 * dO and 0 * q, NaN where the block's dO or q is not finite, and must not reach rows of
    // keys it does not see.
    const bool part_rows = e.r0 > rb0 * kDot || e.r1 < rb1 * kDot;
    for (std::int64_t rb = rb0; rb < rb1; ++rb)
      for (std::int64_t cs = 0; cs < col_slices; cs += 2)
        for (int which = 0; which < 2; ++which) {
          const std::uint16_t* a = (which == 0 ? w.p.data() : w.ds.data()) + rb * kDot * GBp;
          const std::uint16_t* bt = which == 0 ? b.dov.data() : b.qv.data();
          float* acc = (part_rows ? (which == 0 ? w.dvp.data() : w.dkp.data())
                                  : (which == 0 ? w.dvs.data() : w.dks.data())) +
                       rb * kDot * d + cs * kCols;
          if (part_rows) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            load_2x2(acc, d * 4);
          }
          for (std::int64_t kb = 0; kb < qblocks; ++kb) {
            const std::uint16_t* bk = bt + (kb * col_slices + cs) * kTile;
            dot_2x2(a + kb * kDot, ld_p, 16 * ld_p, bk, bk + kTile);
          }
          store_2x2(acc, d * 4);
        }
    if (part_rows)
      for (std::int64_t r = e.r0; r < e.r1; ++r)
        for (std::int64_t x = 0; x < d; x += 16) {
          float* dv_r = w.dvs.data() + r * d + x;
          float* dk_r = w.dks.data() + r * d + x;
          _mm512_storeu_ps(dv_r, _mm512_add_ps(_mm512_loadu_ps(dv_r), _mm512_loadu_ps(w.dvp.data() + r * d + x)));
          _mm512_storeu_ps(dk_r, _mm512_add_ps(_mm512_loadu_ps(dk_r), _mm512_loadu_ps(w.dkp.data() + r * d + x)));
        }
    // dQ^T += K^T dS^T; K^T with the columns outside [r0, r1) zeroed where the entry has such
    // (their dS^T is 0, and a hidden key's K never reaches dq, even a non-finite one).
    const std::uint16_t* kt = keys.kt;
    std::int64_t ldt = keys.ldt;
    const std::int64_t c0 = rb0 * kDot, c1 = rb1 * kDot;
    if (e.r0 > c0 || e.r1 < std::min(c1, keys.valid)) {
      for (std::int64_t r = 0; r < d; ++r) {
        std::uint16_t* dst = w.kt.data() + r * kChunk;
        std::fill(dst + c0, dst + c1, std::uint16_t{0});
        std::memcpy(dst + e.r0, keys.kt + r * keys.ldt + e.r0, sizeof(std::uint16_t) * (e.r1 - e.r0));
      }
      kt = w.kt.data(), ldt = kChunk;
    }
    for (std::int64_t db = 0; db < slices; ++db)
      for (std::int64_t qb = 0; qb < qblocks; ++qb) {
        float* acc = b.dqt.data() + db * kDot * GBp + qb * kDot;
        load_2x2(acc, ld_s);
        for (std::int64_t g = rb0; g < rb1; ++g) {
          const std::uint16_t* bg = w.dsv.data() + g * kDot / 2 * GBp * 2 + qb * 2 * kDot;
          dot_2x2(kt + db * kDot * ldt + g * kDot, ldt * 2, 16 * ldt * 2, bg, bg + kDot, GBp * 4);
        }
        store_2x2(acc, ld_s);
      }
  }
  _tile_release();
  for (std::int64_t r = 0; r < n; ++r) {
    if (!(touched >> r & 1)) continue;
    float* dvr = dv + r * ld_kv;
    float* dkr = dk + r * ld_kv;
    const float* sv_r = w.dvs.data() + r * d;
    const float* sk_r = w.dks.data() + r * d;
    for (std::int64_t x = 0; x < d; x += 16) {
      _mm512_storeu_ps(dvr + x, _mm512_add_ps(_mm512_loadu_ps(dvr + x), _mm512_loadu_ps(sv_r + x)));
      _mm512_storeu_ps(dkr + x, _mm512_add_ps(_mm512_loadu_ps(dkr + x), _mm512_loadu_ps(sk_r + x)));
    }
  }
}

#else  // no AMX kernel in this ISA's build

bool amx_attention_ready(std::int64_t) {
  static const bool knob_checked = amx_knob_on();  // a bad value is an error on every ISA
  (void)knob_checked;
  return false;
}

void amx_attention_block(const std::uint16_t*, std::int64_t, const std::uint16_t*, const std::uint16_t*, std::int64_t,
                         std::int64_t, float, float*, float*, float*, AmxScratch&) {
  DIFFCP_FAIL("amx attention: not compiled into these kernels (avx512 only)");
}
void amx_attention_chunks(const std::uint16_t*, std::int64_t, std::int64_t, float, std::span<const AmxChunk>,
                          const AmxRowWindow*, float*, float*, float*, AmxScratch&) {
  DIFFCP_FAIL("amx attention: not compiled into these kernels (avx512 only)");
}
void amx_backward_block_begin(const std::uint16_t*, const std::uint16_t*, std::int64_t, std::int64_t, const float*,
                              const float*, AmxBackBlock&) {
  DIFFCP_FAIL("amx attention: not compiled into these kernels (avx512 only)");
}
void amx_backward_block_end(const AmxBackBlock&, float*) {
  DIFFCP_FAIL("amx attention: not compiled into these kernels (avx512 only)");
}
void amx_backward_chunk(const AmxBackKeys&, std::span<const AmxBackEntry>, float, float, float*, float*, std::int64_t,
                        AmxBackScratch&) {
  DIFFCP_FAIL("amx attention: not compiled into these kernels (avx512 only)");
}
void amx_pack_keys(const std::uint16_t*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::uint16_t*) {
  DIFFCP_FAIL("amx attention: not compiled into these kernels (avx512 only)");
}
void amx_pack_values(const std::uint16_t*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::uint16_t*) {
  DIFFCP_FAIL("amx attention: not compiled into these kernels (avx512 only)");
}

#endif

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA

#if defined(DIFFCP_AMX_KERNEL)
#pragma GCC pop_options
#endif
