// CPU block-sparse attention (attention/attention.hpp, SPEC A.1/A.2): flash-attention tiling with
// online softmax over the visible key ranges of the DFlash mask; tile GEMMs call oneDNN (gemm.cpp)
// directly. Shapes: q, o, do, dq: [Q, n_q, d_h]  k, v, dk, dv: [L_k, n_kv, d_h]  lse, delta: [Q*n_q].
// One kernel for both storage types T: f32, and bf16 as FlashAttention runs it (bf16 operands
// of every tile GEMM, f32 accumulation, f32 softmax, P and dS rounded to bf16 only as GEMM
// operands, f32 lse / delta, dk / dv accumulated in f32 and rounded once at the end).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "cpu_backend.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/parallel.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

namespace {

constexpr std::int64_t kKeyTile = 512;  // keys per tile (bench/history/2026-12-03-issue-39-avx2-portable-build.md)
// Forward: query rows per tile, so that a [rows, kKeyTile] score tile stays in L2 when a block has
// many query rows (the DiT's dense attention: a block is one image's tokens of this rank). Blocks
// of at most this many rows (DFlash: G*B <= 128) run as one tile, as before (issue #54).
constexpr std::int64_t kQueryTile = 128;
constexpr std::int64_t kDenseKeyTileMax = 1152;  // keys per tile at most, in such blocks
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// p[j] = 2^(p[j] - shift) for j < n; returns their sum. On the SIMD layer (isa.hpp): written as a
// plain loop, GCC 12 vectorised it for AVX-512 but not for AVX2 (its clamp became branches).
// The tail's spare lanes hold -inf, whose 2^ is exactly 0. kScaled: 2^(c p[j] - shift) (c > 0), for
// score tiles whose GEMM left the scale out (bf16: oneDNN's bf16 matmul with an output scale runs
// ~8x slower, issue #54). lo: the values rounded to bf16 there instead of written back to p (the
// bf16 tiles' P operand in the same pass; simd::store_bf16).
template <bool kScaled = false>
float exp2_shifted(float* __restrict p, std::int64_t n, float shift, float c = 1.f, std::uint16_t* __restrict lo = nullptr) {
  using namespace simd;
  const vf sh = broadcast(shift), cv = broadcast(c);
  const auto arg = [&](vf x) { return kScaled ? x * cv - sh : x - sh; };
  vf acc{};
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf e = exp2(arg(load(p + j)));
    if (lo)
      store_bf16(lo + j, e);
    else
      store(p + j, e);
    acc += e;
  }
  if (j < n) {
    const vf e = exp2(arg(load_part(p + j, n - j, kNegInf)));
    if (lo)
      store_bf16(lo + j, e, n - j);
    else
      store_part(p + j, e, n - j);
    acc += e;
  }
  return hsum(acc);
}

// max(init, p[0..n)).
float row_max(const float* __restrict p, std::int64_t n, float init) {
  using namespace simd;
  vf m = broadcast(init);
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) m = max(m, load(p + j));
  if (j < n) m = max(m, load_part(p + j, n - j, kNegInf));
  return hmax(m);
}

// p[j, t] = 2^(p[j, t] - shift[t]) for j < rows, t < cols (dense rows of cols): the backward's
// key-major P^T, each column its query row's lse. Spare tail lanes: shift +inf, 2^-inf = 0.
[[maybe_unused]] void exp2_shifted_cols(float* __restrict p, std::int64_t rows, std::int64_t cols,
                                        const float* __restrict shift) {
  using namespace simd;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (std::int64_t j = 0; j < rows; ++j) {
    float* r = p + j * cols;
    std::int64_t t = 0;
    for (; t + kLanes <= cols; t += kLanes) store(r + t, exp2(load(r + t) - load(shift + t)));
    if (t < cols)
      store_part(r + t, exp2(load_part(r + t, cols - t, 0.f) - load_part(shift + t, cols - t, kInf)), cols - t);
  }
}

// ---- storage type T (float or bf16_t): tile GEMMs with f32 C, conversions ----

// C[M, N] (f32) = alpha * op(A) * op(B) + beta * C, A and B of T (shapes as sgemm). full: a tile of
// kKeyTile keys, whose few shapes get fixed-shape bf16 kernels; a range's last, shorter tile (any
// length) gets the run-time-shape one instead of a new primitive per length.
void tile_gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
               std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc, bool) {
  sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void tile_gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const bf16_t* A,
               std::int64_t lda, const bf16_t* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc, bool full) {
  gemm_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, DType::f32, /*fixed_shape=*/full);
}

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return bf16_to_f32(x.bits); }

// dst[c] = T(src[c] * mul) for c < n.
inline void store_row(const float* __restrict src, float mul, float* __restrict dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t c = 0; c < n; ++c) dst[c] = src[c] * mul;
}
inline void store_row(const float* __restrict src, float mul, bf16_t* __restrict dst, std::int64_t n) {
  float tmp[256];
  for (std::int64_t c0 = 0; c0 < n; c0 += 256) {
    const std::int64_t m = std::min<std::int64_t>(256, n - c0);
#pragma omp simd
    for (std::int64_t c = 0; c < m; ++c) tmp[c] = src[c0 + c] * mul;
    simd::to_bf16(tmp, reinterpret_cast<std::uint16_t*>(dst + c0), m);
  }
}

// The f32 tile x ([rows, cols], row stride ld) as a GEMM operand of type T: x itself for f32,
// else rounded into `lo` (same layout).
template <typename T>
const T* operand(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, LineVector<T>& lo) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    for (std::int64_t r = 0; r < rows; ++r)
      simd::to_bf16(x + r * ld, reinterpret_cast<std::uint16_t*>(lo.data() + r * ld), cols);
    return lo.data();
  }
}

struct Dims {
  std::int64_t Q, Lk, n_q, n_kv, d, G, B, GB;
  float scale;
};

template <typename T>
void check_rows(const char* name, HeadRows<const T> t, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  DIFFCP_CHECK(t.rows == rows && t.heads == heads && t.dim == dim, "attention: ", name, " has shape [",
               t.rows, ", ", t.heads, ", ", t.dim, "], expected [", rows, ", ", heads, ", ", dim, "]");
  DIFFCP_CHECK(t.row_stride >= heads * dim, "attention: ", name, " row_stride ", t.row_stride,
               " < heads*dim = ", heads * dim);
  DIFFCP_CHECK(rows == 0 || t.data != nullptr, "attention: ", name, " is null");
}

template <typename T>
Dims make_dims(const BlockMask& mask, HeadRows<const T> q, HeadRows<const T> k, HeadRows<const T> v,
               float softmax_scale) {
  Dims s{};
  s.Q = mask.query_rows();
  s.Lk = mask.key_rows();
  s.n_q = q.heads;
  s.n_kv = k.heads;
  s.d = q.dim;
  s.B = mask.block();
  DIFFCP_CHECK(s.n_q >= 1 && s.n_kv >= 1 && s.d >= 1, "attention: n_q = ", s.n_q, ", n_kv = ", s.n_kv,
               ", d_h = ", s.d, "; expected all >= 1");
  DIFFCP_CHECK(s.n_q % s.n_kv == 0, "attention: n_q = ", s.n_q, " is not a multiple of n_kv = ", s.n_kv,
               " (GQA needs n_q % n_kv == 0)");
  check_rows("q", q, s.Q, s.n_q, s.d);
  check_rows("k", k, s.Lk, s.n_kv, s.d);
  check_rows("v", v, s.Lk, s.n_kv, s.d);
  s.G = s.n_q / s.n_kv;
  s.GB = s.G * s.B;
  s.scale = softmax_scale > 0.f ? softmax_scale : 1.f / std::sqrt(static_cast<float>(s.d));
  return s;
}

// Packs the (G*B) x d tile of block i, kv head h: tile row t = g*B + r is query row i*B + r,
// query head h*G + g.
template <typename T>
void pack_tile(HeadRows<const T> x, const Dims& s, std::int64_t i, std::int64_t h, T* tile) {
  for (std::int64_t g = 0; g < s.G; ++g)
    for (std::int64_t r = 0; r < s.B; ++r)
      std::memcpy(tile + (g * s.B + r) * s.d, x.at(i * s.B + r, h * s.G + g), sizeof(T) * s.d);
}

// lse/delta entry of tile row t of block i, kv head h.
inline std::int64_t stat_index(const Dims& s, std::int64_t i, std::int64_t h, std::int64_t t) {
  return (i * s.B + t % s.B) * s.n_q + h * s.G + t / s.B;
}

// A tile of keys at positions [y0, y0 + kt) of block i (anchor a): whether a KeyWindow's edge
// crosses it (some of its (row, key) pairs are masked). Every tile of visible_ranges has a
// visible pair for some row, so no tile is wholly masked.
bool window_edge(const KeyWindow& w, std::int64_t B, std::int64_t a, std::int64_t y0, std::int64_t kt) {
  return w.active() && !(w.sees(a + B - 1, y0) && w.sees(a, y0 + kt - 1));
}

// Scores S of such a tile (tile row t = g*B + r: the query at position a + r; key j at y0 + j)
// set to -inf outside each row's window. key_major: S is [kt, GB] (ld GB), else [GB, kt] (ld ld);
// S may hold tile rows [t0, t0 + rows) only (row t of S is tile row t0 + t; key_major: all rows).
void mask_window(const KeyWindow& w, const Dims& s, std::int64_t a, std::int64_t y0, std::int64_t kt, float* S,
                 std::int64_t ld, bool key_major, std::int64_t t0 = 0, std::int64_t rows = -1) {
  for (std::int64_t t = 0; t < (rows < 0 ? s.GB : rows); ++t) {
    const std::int64_t q = a + (t0 + t) % s.B;
    const std::int64_t lo = std::clamp<std::int64_t>(w.first(q) - y0, 0, kt);
    const std::int64_t hi = std::clamp<std::int64_t>(w.last(q) + 1 - y0, lo, kt);
    for (std::int64_t j = 0; j < kt; ++j)
      if (j < lo || j >= hi) (key_major ? S[j * s.GB + t] : S[t * ld + j]) = kNegInf;
  }
}

template <typename T>
struct ForwardScratch {
  LineVector<T> q, p_lo, kc, vc;  // kc, vc: a head's visible K / V rows, contiguous (many query tiles)
  LineVector<float> o, p;
  std::vector<float> m, l;
  std::vector<RowRange> ranges;
  explicit ForwardScratch(const Dims& s)
      : q(s.GB * s.d), p_lo(std::is_same_v<T, float> ? 0 : std::min(s.GB, kQueryTile) * kKeyTile), o(s.GB * s.d),
        p(std::min(s.GB, kQueryTile) * kKeyTile), m(s.GB), l(s.GB) {}
};

// kv head h's rows of k and v that w.ranges hold, in order, into w.kc and w.vc as dense [n, d_h].
template <typename T>
void copy_visible_rows(HeadRows<const T> k, HeadRows<const T> v, std::int64_t h, ForwardScratch<T>& w) {
  std::int64_t n = 0;
  for (const RowRange& rr : w.ranges) n += rr.end - rr.begin;
  const std::int64_t d = k.dim;
  w.kc.resize(n * d);
  w.vc.resize(n * d);
  n = 0;
  for (const RowRange& rr : w.ranges)
    for (std::int64_t j = rr.begin; j < rr.end; ++j, ++n) {
      std::memcpy(w.kc.data() + n * d, k.at(j, h), sizeof(T) * d);
      std::memcpy(w.vc.data() + n * d, v.at(j, h), sizeof(T) * d);
    }
}

template <typename T>
void forward_item(const BlockMask& mask, const Dims& s, HeadRows<const T> q, HeadRows<const T> k,
                  HeadRows<const T> v, HeadRows<T> o, std::span<float> lse, std::int64_t i, std::int64_t h,
                  ForwardScratch<T>& w) {
  mask.visible_ranges(i, w.ranges);
  const std::int64_t GB = s.GB, d = s.d;
  if (w.ranges.empty()) {
    for (std::int64_t t = 0; t < GB; ++t) {
      std::memset(static_cast<void*>(o.at(i * s.B + t % s.B, h * s.G + t / s.B)), 0, sizeof(T) * d);
      lse[stat_index(s, i, h, t)] = kNegInf;
    }
    return;
  }
  // Scores in base 2: S = (scale * log2(e)) q k^T, so p = 2^(S - max).
  pack_tile(q, s, i, h, w.q.data());
  std::fill(w.o.begin(), w.o.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), kNegInf);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const KeyWindow& win = mask.window();
  const std::int64_t a = mask.blocks()[static_cast<std::size_t>(i)].ctx_end;
  // f32: the GEMM scales the scores; bf16: the softmax does (c), as oneDNN's bf16 matmul is slow
  // with an output scale. max(c x) = c max(x) exactly for c > 0, so both find the same row max.
  constexpr bool kScaleInGemm = std::is_same_v<T, float>;
  const float c = s.scale * kLog2e;
  // Several query tiles read every key tile: the head's visible K and V rows are copied once into
  // dense [rows, d] tiles (strided rows of the fused q|k|v layout cost the GEMMs TLB and cache
  // misses; dense bf16 ones get oneDNN's brgemm, AMX here: issue #54).
  const bool dense_kv = GB > kQueryTile;
  if (dense_kv) copy_visible_rows(k, v, h, w);
  // Dense blocks: key tiles as long as L2 holds a [kQueryTile, tile] score tile (the whole row of a
  // 1088-token image in one tile: no online rescaling; 1.1x the attention of 512-key tiles here).
  std::int64_t key_tile = kKeyTile;
  if (dense_kv) {
    std::int64_t longest = 0;
    for (const RowRange& rr : w.ranges) longest = std::max(longest, rr.end - rr.begin);
    const std::int64_t tiles = (longest + kDenseKeyTileMax - 1) / kDenseKeyTileMax;
    key_tile = (longest + tiles - 1) / tiles;
    key_tile = (key_tile + 15) / 16 * 16;
  }
  const std::int64_t ldp = key_tile;  // P's row stride
  if (w.p.size() < static_cast<std::size_t>(std::min(GB, kQueryTile) * ldp)) {
    w.p.resize(std::min(GB, kQueryTile) * ldp);
    if constexpr (!std::is_same_v<T, float>) w.p_lo.resize(w.p.size());
  }
  for (std::int64_t t0 = 0; t0 < GB; t0 += kQueryTile) {  // tile rows [t0, t0 + tq)
    const std::int64_t tq = std::min(kQueryTile, GB - t0);
    float* m = w.m.data() + t0;
    float* l = w.l.data() + t0;
    float* o_rows = w.o.data() + t0 * d;
    std::int64_t dense_row = 0;  // the range's first row in kc / vc
    for (const RowRange& rr : w.ranges) {
      for (std::int64_t j0 = rr.begin; j0 < rr.end; j0 += key_tile) {
        const std::int64_t kt = std::min(key_tile, rr.end - j0);
        const T* kt_rows = dense_kv ? w.kc.data() + (dense_row + j0 - rr.begin) * d : k.at(j0, h);
        const T* vt_rows = dense_kv ? w.vc.data() + (dense_row + j0 - rr.begin) * d : v.at(j0, h);
        const std::int64_t ldk = dense_kv ? d : k.row_stride, ldv = dense_kv ? d : v.row_stride;
        // Fixed-shape kernels for the few tile shapes (a dense block's tails repeat in every item too)
        const bool full = dense_kv || (kt == key_tile && (tq == GB || tq == kQueryTile));
        tile_gemm(false, true, tq, kt, d, kScaleInGemm ? c : 1.f, w.q.data() + t0 * d, d, kt_rows, ldk,
                  0.f, w.p.data(), ldp, full);
        const std::int64_t y0 = rr.pos + (j0 - rr.begin);
        if (window_edge(win, s.B, a, y0, kt)) mask_window(win, s, a, y0, kt, w.p.data(), ldp, false, t0, tq);
        for (std::int64_t t = 0; t < tq; ++t) {
          float* pr = w.p.data() + t * ldp;
          const float mx = kScaleInGemm ? row_max(pr, kt, m[t]) : std::max(m[t], c * row_max(pr, kt, kNegInf));
          if (mx == kNegInf) {  // a window hides every key of this row so far: nothing to add
            std::fill_n(pr, kt, 0.f);
            if constexpr (!std::is_same_v<T, float>) std::fill_n(w.p_lo.data() + t * ldp, kt, T{});
            continue;
          }
          // bf16: P's row goes straight to the PV GEMM's bf16 operand (one pass, no f32 row written)
          float sum;
          if constexpr (kScaleInGemm)
            sum = exp2_shifted(pr, kt, mx);
          else
            sum = exp2_shifted<true>(pr, kt, mx, c, &w.p_lo[static_cast<std::size_t>(t * ldp)].bits);
          const float alpha = simd::exp2(m[t] - mx);  // m = -inf on the first tile -> 0
          if (alpha != 1.f) {
            float* orow = o_rows + t * d;
            for (std::int64_t e = 0; e < d; ++e) orow[e] *= alpha;
          }
          l[t] = l[t] * alpha + sum;
          m[t] = mx;
        }
        const T* P = std::is_same_v<T, float> ? reinterpret_cast<const T*>(w.p.data()) : w.p_lo.data();
        tile_gemm(false, false, tq, d, kt, 1.f, P, ldp, vt_rows, ldv, 1.f, o_rows, d, full);
      }
      dense_row += rr.end - rr.begin;
    }
  }
  for (std::int64_t t = 0; t < GB; ++t) {
    // l = 0: a window hid every key this call holds from the row (lse -inf, o 0, as above).
    store_row(w.o.data() + t * d, w.l[t] > 0.f ? 1.f / w.l[t] : 0.f, o.at(i * s.B + t % s.B, h * s.G + t / s.B), d);
    lse[stat_index(s, i, h, t)] = w.l[t] > 0.f ? (w.m[t] + std::log2(w.l[t])) * kLn2 : kNegInf;
  }
}

// Block i, kv head h's o rows and lse from the accumulators w.o, w.m (base-2 max), w.l; l = 0
// where a row saw no key (a window) or every score was -inf (non-finite inputs): o 0, lse -inf.
template <typename T>
void store_item(const Dims& s, const ForwardScratch<T>& w, HeadRows<T> o, std::span<float> lse, std::int64_t i,
                std::int64_t h) {
  for (std::int64_t t = 0; t < s.GB; ++t) {
    store_row(w.o.data() + t * s.d, w.l[t] > 0.f ? 1.f / w.l[t] : 0.f, o.at(i * s.B + t % s.B, h * s.G + t / s.B),
              s.d);
    lse[stat_index(s, i, h, t)] = w.l[t] > 0.f ? (w.m[t] + std::log2(w.l[t])) * kLn2 : kNegInf;
  }
}

// forward_item fused in one kernel, for dense blocks of more than kQueryTile rows without a window
// (the DiT's attention: every key of an image visible): bf16 on AMX tiles where the CPU has them
// (attention_amx.cpp), else on AVX-512 (f32, bf16) or AVX2 (f32) registers (attention_vec.cpp). The q tile
// and the visible K, V rows packed as there, then the kernel, then o and lse from its
// accumulators. Kernel scratch per thread, on 64-byte lines.
template <typename T>
bool fused_ready(std::int64_t d) {
  if constexpr (std::is_same_v<T, float>)
    return vec_attention_ready(DType::f32, d);
  else
    return amx_attention_ready(d) || vec_attention_ready(DType::bf16, d);
}

template <typename T>
void fused_item(const BlockMask& mask, const Dims& s, HeadRows<const T> q, HeadRows<const T> k, HeadRows<const T> v,
                HeadRows<T> o, std::span<float> lse, std::int64_t i, std::int64_t h, ForwardScratch<T>& w) {
  mask.visible_ranges(i, w.ranges);
  std::int64_t n = 0;
  for (const RowRange& rr : w.ranges) n += rr.end - rr.begin;
  const std::int64_t d = s.d;
  if (n == 0) {
    for (std::int64_t t = 0; t < s.GB; ++t) {
      std::memset(static_cast<void*>(o.at(i * s.B + t % s.B, h * s.G + t / s.B)), 0, sizeof(T) * d);
      lse[stat_index(s, i, h, t)] = kNegInf;
    }
    return;
  }
  pack_tile(q, s, i, h, w.q.data());
  copy_visible_rows(k, v, h, w);
  const float c = s.scale * kLog2e;
  if constexpr (std::is_same_v<T, float>) {
    thread_local VecScratch<float> vec;
    vec_attention_block(w.q.data(), s.GB, w.kc.data(), w.vc.data(), n, d, c, w.o.data(), w.m.data(), w.l.data(), vec);
  } else if (amx_attention_ready(d)) {
    thread_local AmxScratch amx;
    amx_attention_block(&w.q[0].bits, s.GB, &w.kc[0].bits, &w.vc[0].bits, n, d, c, w.o.data(), w.m.data(),
                        w.l.data(), amx);
  } else {
    thread_local VecScratch<std::uint16_t> vec;
    vec_attention_block(&w.q[0].bits, s.GB, &w.kc[0].bits, &w.vc[0].bits, n, d, c, w.o.data(), w.m.data(),
                        w.l.data(), vec);
  }
  store_item(s, w, o, lse, i, h);
}

// Whether bf16 attention of blocks of GB query rows under `mask` runs on the block-sparse AMX
// kernels (issue #69), forward and backward: where the CPU has them, for the drafter's blocks (G*B
// <= kQueryTile) and windowed ones. The DiT's dense blocks keep their own fused forward
// (fused_item) and the tile path's backward (inference only: measured there).
bool amx_block_sparse(const BlockMask& mask, std::int64_t GB, std::int64_t d) {
  return amx_attention_ready(d) && (GB <= kQueryTile || mask.window().active());
}

// Each tile row's visible key positions [lo, hi) under the window, for block anchor a (tile row t is
// the query at position a + t % B): the AMX kernels' AmxRowWindow.
void window_rows(const KeyWindow& win, const Dims& s, std::int64_t a, std::vector<std::int64_t>& lo,
                 std::vector<std::int64_t>& hi) {
  lo.resize(static_cast<std::size_t>(s.GB));
  hi.resize(lo.size());
  for (std::int64_t t = 0; t < s.GB; ++t) {
    lo[static_cast<std::size_t>(t)] = win.first(a + t % s.B);
    hi[static_cast<std::size_t>(t)] = win.last(a + t % s.B) + 1;
  }
}

// The bf16 block-sparse forward on AMX tiles (issue #69; amx_block_sparse). Every kv head's K
// and V are packed once as the kernel's B tiles (AmxHeads; a sample's blocks all read its context
// prefix, so packing per block would repeat it for every anchor); a block's visible ranges become
// 64-key chunks of those packs, each range's ends not on a 32-key boundary packed per block (at
// most 31 keys each side).
struct AmxHeads {
  LineVector<std::uint16_t> kp, vp;  // [n_kv][n_pad * d]
  std::int64_t n_pad = 0;
};

AmxHeads amx_pack_heads(const Dims& s, HeadRows<const bf16_t> k, HeadRows<const bf16_t> v) {
  AmxHeads p;
  p.n_pad = (s.Lk + kAmxHeadDim - 1) / kAmxHeadDim * kAmxHeadDim;
  p.kp.resize(static_cast<std::size_t>(s.n_kv * p.n_pad * s.d));
  p.vp.resize(p.kp.size());
  const std::int64_t pieces = p.n_pad / kAmxHeadDim;
#pragma omp parallel for schedule(static)
  for (std::int64_t it = 0; it < s.n_kv * pieces; ++it) {
    const std::int64_t h = it / pieces, j0 = it % pieces * kAmxHeadDim, n = std::min(kAmxHeadDim, s.Lk - j0);
    const std::size_t at = static_cast<std::size_t>((h * p.n_pad + j0) * s.d);
    amx_pack_keys(&k.at(j0, h)->bits, k.row_stride, n, kAmxHeadDim, s.d, p.kp.data() + at);
    amx_pack_values(&v.at(j0, h)->bits, v.row_stride, n, kAmxHeadDim, s.d, p.vp.data() + at);
  }
  return p;
}

struct AmxItemScratch {
  AmxScratch amx;
  LineVector<std::uint16_t> kp, vp;  // the ranges' unaligned ends, packed per block
  std::vector<std::int64_t> lo, hi;  // the window's visible positions per tile row
};

void amx_sparse_item(const BlockMask& mask, const Dims& s, const AmxHeads& heads, HeadRows<const bf16_t> q,
                     HeadRows<const bf16_t> k, HeadRows<const bf16_t> v, HeadRows<bf16_t> o, std::span<float> lse,
                     std::int64_t i, std::int64_t h, ForwardScratch<bf16_t>& w, AmxItemScratch& x) {
  constexpr std::int64_t kAlign = kAmxHeadDim;
  mask.visible_ranges(i, w.ranges);
  const std::int64_t d = s.d;
  const KeyWindow& win = mask.window();
  const std::int64_t a = mask.blocks()[static_cast<std::size_t>(i)].ctx_end;
  x.kp.resize(2 * w.ranges.size() * kAlign * d);
  x.vp.resize(x.kp.size());
  std::vector<AmxChunk>& chunks = x.amx.chunks;
  chunks.clear();
  std::int64_t local = 0;  // keys packed into x.kp, x.vp so far (32 per piece)
  const auto add = [&](const std::uint16_t* kp, const std::uint16_t* vp, std::int64_t keys, std::int64_t valid,
                       std::int64_t pos) {
    chunks.push_back({kp, vp, keys, valid, pos, window_edge(win, s.B, a, pos, valid)});
  };
  const auto add_local = [&](const RowRange& rr, std::int64_t j0, std::int64_t j1) {
    std::uint16_t* kp = x.kp.data() + local * d;
    std::uint16_t* vp = x.vp.data() + local * d;
    amx_pack_keys(&k.at(j0, h)->bits, k.row_stride, j1 - j0, kAlign, d, kp);
    amx_pack_values(&v.at(j0, h)->bits, v.row_stride, j1 - j0, kAlign, d, vp);
    local += kAlign;
    add(kp, vp, kAlign, j1 - j0, rr.pos + (j0 - rr.begin));
  };
  const std::uint16_t* kp_h = heads.kp.data() + h * heads.n_pad * d;
  const std::uint16_t* vp_h = heads.vp.data() + h * heads.n_pad * d;
  for (const RowRange& rr : w.ranges) {
    std::int64_t j = rr.begin;
    const std::int64_t head_end = std::min(rr.end, (j + kAlign - 1) / kAlign * kAlign);
    if (j < head_end) add_local(rr, j, head_end), j = head_end;
    const std::int64_t body_end = std::max(j, rr.end / kAlign * kAlign);
    for (std::int64_t n = 0; j < body_end; j += n) {
      n = std::min(kAmxChunk, body_end - j);
      add(kp_h + j * d, vp_h + j * d, n, n, rr.pos + (j - rr.begin));
    }
    if (j < rr.end) add_local(rr, j, rr.end);
  }
  if (chunks.empty()) {
    std::fill(w.o.begin(), w.o.end(), 0.f);
    std::fill(w.l.begin(), w.l.end(), 0.f);
    return store_item(s, w, o, lse, i, h);
  }
  const AmxRowWindow* rows = nullptr;
  AmxRowWindow row_window{};
  if (win.active()) {
    window_rows(win, s, a, x.lo, x.hi);
    row_window = {x.lo.data(), x.hi.data()};
    rows = &row_window;
  }
  pack_tile(q, s, i, h, w.q.data());
  amx_attention_chunks(&w.q[0].bits, s.GB, d, s.scale * kLog2e, chunks, rows, w.o.data(), w.m.data(), w.l.data(),
                       x.amx);
  store_item(s, w, o, lse, i, h);
}

template <typename T>
struct BackwardScratch {
  LineVector<T> q, dout, p_lo;
  LineVector<float> dq, p, dp;
  std::vector<float> lse2, delta;
  std::vector<RowRange> ranges;
  explicit BackwardScratch(const Dims& s)
      : q(s.GB * s.d), dout(s.GB * s.d), p_lo(std::is_same_v<T, float> ? 0 : s.GB * kKeyTile), dq(s.GB * s.d),
        p(s.GB * kKeyTile), dp(s.GB * kKeyTile), lse2(s.GB), delta(s.GB) {}
};

// Key-major backward tiles (P^T, dS^T: [kt, GB]) make every GEMM but dQ's 'N' x 'N' or 'N' x 'T':
// oneDNN's AVX2 sgemm ran the row-major form's P^T dO and dS^T q ('T' x 'N', K = G*B) at ~60 % of
// its other tile shapes (512 x 128 x 64, one thread), which held the d_h = 128 backward to 62 % of
// GEMM. On AVX-512 the row-major form was as fast or faster (f32), and oneDNN's bf16 matmul ran
// key-major ~12 % slower: there, and for bf16 everywhere, tiles stay row-major ([GB, kt]).
// Measured: bench/history/2026-12-03-issue-39-avx2-portable-build.md.
constexpr bool kKeyMajorF32Backward = DIFFCP_SIMD_BYTES < 64;

// One key tile [j0, j0 + kt) of a block's backward (kv head h): dV, dK += (rows j0..), w.dq +=.
// `edge`: the window's edge crosses the tile (block anchor a, keys at positions y0 + j).
template <typename T>
void backward_tile(const Dims& s, HeadRows<const T> k, HeadRows<const T> v, HeadRows<float> dk,
                   HeadRows<float> dv, std::int64_t h, std::int64_t j0, std::int64_t kt, const KeyWindow* edge,
                   std::int64_t a, std::int64_t y0, BackwardScratch<T>& w) {
  const std::int64_t GB = s.GB, d = s.d;
  const bool full = kt == kKeyTile;
  float* P = w.p.data();
  float* dP = w.dp.data();
  if constexpr (std::is_same_v<T, float> && kKeyMajorF32Backward) {
    // S^T = (scale log2(e)) K q^T, then P^T = 2^(S^T - lse2) column by column
    tile_gemm(false, true, kt, GB, d, s.scale * kLog2e, k.at(j0, h), k.row_stride, w.q.data(), d, 0.f, P, GB, full);
    if (edge != nullptr) mask_window(*edge, s, a, y0, kt, P, GB, true);
    exp2_shifted_cols(P, kt, GB, w.lse2.data());
    // dV += P^T dO ; dP^T = V dO^T ; dS^T = P^T (dP^T - D)
    tile_gemm(false, false, kt, d, GB, 1.f, P, GB, w.dout.data(), d, 1.f, dv.at(j0, h), dv.row_stride, full);
    tile_gemm(false, true, kt, GB, d, 1.f, v.at(j0, h), v.row_stride, w.dout.data(), d, 0.f, dP, GB, full);
    for (std::int64_t j = 0; j < kt; ++j) {
      float* __restrict pr = P + j * GB;
      const float* __restrict dpr = dP + j * GB;
      const float* __restrict D = w.delta.data();
#pragma omp simd
      for (std::int64_t t = 0; t < GB; ++t) pr[t] = pr[t] * (dpr[t] - D[t]);
    }
    // dQ += scale (dS^T)^T K ; dK += scale dS^T q
    tile_gemm(true, false, GB, d, kt, s.scale, P, GB, k.at(j0, h), k.row_stride, 1.f, w.dq.data(), d, full);
    tile_gemm(false, false, kt, d, GB, s.scale, P, GB, w.q.data(), d, 1.f, dk.at(j0, h), dk.row_stride, full);
  } else {
    // S = (scale log2(e)) q K^T, then P = 2^(S - lse2) row by row. bf16: the scales are applied
    // outside the GEMMs, to the scores in the exp and to dS before it is rounded (oneDNN's bf16
    // matmul with an output scale runs ~8x slower; issue #54).
    constexpr bool kBf16 = !std::is_same_v<T, float>;
    const float c = s.scale * kLog2e;
    tile_gemm(false, true, GB, kt, d, kBf16 ? 1.f : c, w.q.data(), d, k.at(j0, h), k.row_stride, 0.f, P, kKeyTile,
              full);
    if (edge != nullptr) mask_window(*edge, s, a, y0, kt, P, kKeyTile, false);
    for (std::int64_t t = 0; t < GB; ++t) exp2_shifted<kBf16>(P + t * kKeyTile, kt, w.lse2[t], c);
    // dV += P^T dO ; dP = dO V^T ; dS = P (dP - D)
    tile_gemm(true, false, kt, d, GB, 1.f, operand(P, GB, kt, kKeyTile, w.p_lo), kKeyTile, w.dout.data(), d, 1.f,
              dv.at(j0, h), dv.row_stride, full);
    tile_gemm(false, true, GB, kt, d, 1.f, w.dout.data(), d, v.at(j0, h), v.row_stride, 0.f, dP, kKeyTile, full);
    for (std::int64_t t = 0; t < GB; ++t) {
      float* __restrict pr = P + t * kKeyTile;
      const float* __restrict dpr = dP + t * kKeyTile;
      const float D = w.delta[t];
      if constexpr (kBf16) {
        const float sc = s.scale;
#pragma omp simd
        for (std::int64_t j = 0; j < kt; ++j) pr[j] = pr[j] * (dpr[j] - D) * sc;
      } else {
#pragma omp simd
        for (std::int64_t j = 0; j < kt; ++j) pr[j] = pr[j] * (dpr[j] - D);
      }
    }
    // dQ += scale dS K ; dK += scale dS^T q (bf16: dS holds the scale)
    const T* dS = operand(P, GB, kt, kKeyTile, w.p_lo);
    const float ds_scale = kBf16 ? 1.f : s.scale;
    tile_gemm(false, false, GB, d, kt, ds_scale, dS, kKeyTile, k.at(j0, h), k.row_stride, 1.f, w.dq.data(), d, full);
    tile_gemm(true, false, kt, d, GB, ds_scale, dS, kKeyTile, w.q.data(), d, 1.f, dk.at(j0, h), dk.row_stride, full);
  }
}

// Backward of block i, kv head h: accumulates into the f32 dk, dv (rows this block sees) and
// writes dq.
template <typename T>
void backward_block(const BlockMask& mask, const Dims& s, HeadRows<const T> q, HeadRows<const T> k,
                    HeadRows<const T> v, HeadRows<const T> dout, std::span<const float> lse,
                    std::span<const float> delta, HeadRows<T> dq, HeadRows<float> dk, HeadRows<float> dv,
                    std::int64_t i, std::int64_t h, BackwardScratch<T>& w) {
  mask.visible_ranges(i, w.ranges);
  const std::int64_t GB = s.GB, d = s.d;
  std::fill(w.dq.begin(), w.dq.end(), 0.f);
  if (!w.ranges.empty()) {
    pack_tile(q, s, i, h, w.q.data());
    pack_tile(dout, s, i, h, w.dout.data());
    for (std::int64_t t = 0; t < GB; ++t) {
      const float l = lse[stat_index(s, i, h, t)];
      // A row whose global lse is -inf saw no key anywhere: its probabilities are 0.
      w.lse2[t] = std::isfinite(l) ? l * kLog2e : std::numeric_limits<float>::infinity();
      w.delta[t] = delta[stat_index(s, i, h, t)];
    }
  }
  const KeyWindow& win = mask.window();
  const std::int64_t a = mask.blocks()[static_cast<std::size_t>(i)].ctx_end;
  for (const RowRange& rr : w.ranges)
    for (std::int64_t j0 = rr.begin; j0 < rr.end; j0 += kKeyTile) {
      const std::int64_t kt = std::min(kKeyTile, rr.end - j0), y0 = rr.pos + (j0 - rr.begin);
      backward_tile(s, k, v, dk, dv, h, j0, kt, window_edge(win, s.B, a, y0, kt) ? &win : nullptr, a, y0, w);
    }
  for (std::int64_t t = 0; t < GB; ++t) store_row(w.dq.data() + t * d, 1.f, dq.at(i * s.B + t % s.B, h * s.G + t / s.B), d);
}

// The bf16 backward on AMX tiles (issue #69; amx_block_sparse): each kv head's K and V rows copied
// once into dense rows and K^T into [d, n_pad] (the kernel's A operands; the blocks of a sample all
// read its context prefix); a block's visible ranges split at 64-key chunk boundaries, each piece
// an entry that covers rows [r0, r1) of its chunk.
struct AmxBackHeads {
  LineVector<std::uint16_t> kd, vd, kt;  // [n_kv][n_pad * d] each (kt: [d, n_pad] per head)
  std::int64_t n_pad = 0;
};

// rows [j0, j0 + n) of kv head h into kd, vd (dense [32, d], zero past n) and kt ([d, ldt] from
// column c0: K^T, zero past n).
void amx_copy_keys(HeadRows<const bf16_t> k, HeadRows<const bf16_t> v, std::int64_t h, std::int64_t j0,
                   std::int64_t n, std::uint16_t* kd, std::uint16_t* vd, std::uint16_t* kt, std::int64_t ldt,
                   std::int64_t c0) {
  const std::int64_t d = k.dim;
  for (std::int64_t r = 0; r < kAmxHeadDim; ++r) {
    if (r < n) {
      std::memcpy(kd + r * d, k.at(j0 + r, h), sizeof(std::uint16_t) * d);
      std::memcpy(vd + r * d, v.at(j0 + r, h), sizeof(std::uint16_t) * d);
    } else {
      std::fill_n(kd + r * d, d, std::uint16_t{0});
      std::fill_n(vd + r * d, d, std::uint16_t{0});
    }
  }
  for (std::int64_t e = 0; e < d; ++e)
    for (std::int64_t r = 0; r < kAmxHeadDim; ++r) kt[e * ldt + c0 + r] = kd[r * d + e];
}

AmxBackHeads amx_back_heads(const Dims& s, HeadRows<const bf16_t> k, HeadRows<const bf16_t> v) {
  AmxBackHeads p;
  p.n_pad = (s.Lk + kAmxHeadDim - 1) / kAmxHeadDim * kAmxHeadDim;
  const std::size_t per_head = static_cast<std::size_t>(p.n_pad * s.d);
  p.kd.resize(s.n_kv * per_head);
  p.vd.resize(p.kd.size());
  p.kt.resize(p.kd.size());
  const std::int64_t pieces = p.n_pad / kAmxHeadDim;
#pragma omp parallel for schedule(static)
  for (std::int64_t it = 0; it < s.n_kv * pieces; ++it) {
    const std::int64_t h = it / pieces, j0 = it % pieces * kAmxHeadDim;
    const std::size_t at = h * per_head + static_cast<std::size_t>(j0 * s.d);
    amx_copy_keys(k, v, h, j0, std::min(kAmxHeadDim, s.Lk - j0), p.kd.data() + at, p.vd.data() + at,
                  p.kt.data() + h * per_head, p.n_pad, j0);
  }
  return p;
}

struct AmxBackItemScratch {
  AmxBackScratch amx;
  std::vector<AmxBackBlock> blocks;
  std::vector<char> has_keys;  // per block: whether it sees any key (else its dq is 0)
  std::vector<std::vector<std::int64_t>> lo, hi;  // per block: the window's visible positions per tile row
  std::vector<AmxRowWindow> windows;
  std::vector<std::pair<std::int64_t, AmxBackEntry>> entries;  // (chunk, entry)
  std::vector<AmxBackEntry> chunk_entries;
  LineVector<bf16_t> q, dout;
  std::vector<float> lse2, delta, dq;
  std::vector<RowRange> ranges;
};

// The backward of one sample group's blocks for kv head h (the tile path's work item) on AMX tiles:
// every block's operands packed, then key chunk by key chunk (64 rows of the head's copies) the
// blocks that see it, in block order; then each block's dq.
void amx_backward_group(const BlockMask& mask, const Dims& s, const AmxBackHeads& heads,
                        std::span<const std::int64_t> group, HeadRows<const bf16_t> q, HeadRows<const bf16_t> dout,
                        std::span<const float> lse, std::span<const float> delta, HeadRows<bf16_t> dq,
                        HeadRows<float> dk, HeadRows<float> dv, std::int64_t h, AmxBackItemScratch& x) {
  const std::int64_t GB = s.GB, d = s.d, nb = static_cast<std::int64_t>(group.size());
  const KeyWindow& win = mask.window();
  const auto at = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  if (static_cast<std::int64_t>(x.blocks.size()) < nb) {
    x.blocks.resize(at(nb));
    x.lo.resize(at(nb));
    x.hi.resize(at(nb));
    x.windows.resize(at(nb));
  }
  x.has_keys.assign(at(nb), 0);
  x.entries.clear();
  x.q.resize(at(GB * d));
  x.dout.resize(x.q.size());
  x.lse2.resize(at(GB));
  x.delta.resize(at(GB));
  for (std::int64_t bi = 0; bi < nb; ++bi) {
    const std::int64_t i = group[at(bi)];
    const std::int64_t a = mask.blocks()[at(i)].ctx_end;
    mask.visible_ranges(i, x.ranges);
    if (x.ranges.empty()) continue;
    x.has_keys[at(bi)] = 1;
    pack_tile(q, s, i, h, x.q.data());
    pack_tile(dout, s, i, h, x.dout.data());
    for (std::int64_t t = 0; t < GB; ++t) {
      const float l = lse[stat_index(s, i, h, t)];
      x.lse2[at(t)] = std::isfinite(l) ? l * kLog2e : std::numeric_limits<float>::infinity();
      x.delta[at(t)] = delta[stat_index(s, i, h, t)];
    }
    AmxBackBlock& b = x.blocks[at(bi)];
    amx_backward_block_begin(&x.q[0].bits, &x.dout[0].bits, GB, d, x.lse2.data(), x.delta.data(), b);
    if (win.active()) {
      window_rows(win, s, a, x.lo[at(bi)], x.hi[at(bi)]);
      x.windows[at(bi)] = {x.lo[at(bi)].data(), x.hi[at(bi)].data()};
    }
    for (const RowRange& rr : x.ranges)
      for (std::int64_t j = rr.begin; j < rr.end;) {
        const std::int64_t c = j / kAmxChunk, r0 = j - c * kAmxChunk;
        const std::int64_t r1 = std::min(rr.end, (c + 1) * kAmxChunk) - c * kAmxChunk;
        const std::int64_t pos = rr.pos + (j - rr.begin);
        const bool edge = window_edge(win, s.B, a, pos, r1 - r0);
        x.entries.push_back({c, {&b, r0, r1, pos, edge ? &x.windows[at(bi)] : nullptr}});
        j += r1 - r0;
      }
  }
  std::stable_sort(x.entries.begin(), x.entries.end(), [](const auto& l, const auto& r) { return l.first < r.first; });
  const std::size_t per_head = static_cast<std::size_t>(heads.n_pad * d);
  const float c2 = s.scale * kLog2e;
  for (std::size_t e0 = 0; e0 < x.entries.size();) {
    const std::int64_t c = x.entries[e0].first, j0 = c * kAmxChunk;
    x.chunk_entries.clear();
    for (; e0 < x.entries.size() && x.entries[e0].first == c; ++e0) x.chunk_entries.push_back(x.entries[e0].second);
    const std::int64_t n = std::min(kAmxChunk, heads.n_pad - j0);
    const AmxBackKeys keys{heads.kd.data() + h * per_head + j0 * d, heads.vd.data() + h * per_head + j0 * d,
                           heads.kt.data() + h * per_head + j0, heads.n_pad, n, std::min(n, s.Lk - j0)};
    amx_backward_chunk(keys, x.chunk_entries, c2, s.scale, dk.at(j0, h), dv.at(j0, h), dk.row_stride, x.amx);
  }
  x.dq.resize(at(GB * d));
  for (std::int64_t bi = 0; bi < nb; ++bi) {
    const std::int64_t i = group[at(bi)];
    if (x.has_keys[at(bi)])
      amx_backward_block_end(x.blocks[at(bi)], x.dq.data());
    else
      std::fill(x.dq.begin(), x.dq.end(), 0.f);
    for (std::int64_t t = 0; t < GB; ++t)
      store_row(x.dq.data() + t * d, 1.f, dq.at(i * s.B + t % s.B, h * s.G + t / s.B), d);
  }
}

void zero_rows(HeadRows<float> x) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < x.rows; ++r) std::memset(x.at(r, 0), 0, sizeof(float) * x.heads * x.dim);
}

template <typename T>
void forward_impl(const BlockMask& mask, ConstTensorView q_v, ConstTensorView k_v, ConstTensorView v_v,
                  TensorView o_v, TensorView lse_v, float softmax_scale) {
  const auto q = HeadRows<const T>::from(q_v), k = HeadRows<const T>::from(k_v), v = HeadRows<const T>::from(v_v);
  const auto o = HeadRows<T>::from(o_v);
  const auto lse = span_f32(lse_v);
  const Dims s = make_dims(mask, q, k, v, softmax_scale);
  check_rows<T>("o", o, s.Q, s.n_q, s.d);
  DIFFCP_CHECK(static_cast<std::int64_t>(lse.size()) == s.Q * s.n_q, "attention: lse has ", lse.size(),
               " entries, expected Q*n_q = ", s.Q * s.n_q);
  const std::int64_t items = mask.num_blocks() * s.n_kv;
  ParallelErrors errors;
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (amx_block_sparse(mask, s.GB, s.d) && items > 0) {
      const AmxHeads heads = amx_pack_heads(s, k, v);
#pragma omp parallel
      {
        ForwardScratch<T> w(s);
        AmxItemScratch x;
#pragma omp for schedule(dynamic, 1)
        for (std::int64_t it = 0; it < items; ++it)
          errors.run([&] { amx_sparse_item(mask, s, heads, q, k, v, o, lse, it / s.n_kv, it % s.n_kv, w, x); });
      }
      return errors.rethrow();
    }
  }
  // Dense blocks (forward_item's dense_kv) without a window: fused where these kernels can
  // (fused_item: bf16 on AMX tiles, else on AVX-512 or AVX2 registers).
  if (s.GB > kQueryTile && !mask.window().active() && fused_ready<T>(s.d)) {
#pragma omp parallel
    {
      ForwardScratch<T> w(s);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t it = 0; it < items; ++it)
        errors.run([&] { fused_item(mask, s, q, k, v, o, lse, it / s.n_kv, it % s.n_kv, w); });
    }
    return errors.rethrow();
  }
#pragma omp parallel
  {
    ForwardScratch<T> w(s);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t it = 0; it < items; ++it)
      errors.run([&] { forward_item(mask, s, q, k, v, o, lse, it / s.n_kv, it % s.n_kv, w); });
  }
  errors.rethrow();
}

template <typename T>
void delta_impl(ConstTensorView do_v, ConstTensorView o_v, TensorView delta_v) {
  const auto do_ = HeadRows<const T>::from(do_v), o = HeadRows<const T>::from(o_v);
  const auto delta = span_f32(delta_v);
  check_rows("o", o, do_.rows, do_.heads, do_.dim);
  DIFFCP_CHECK(static_cast<std::int64_t>(delta.size()) == do_.rows * do_.heads, "attention_delta: delta has ",
               delta.size(), " entries, expected rows*heads = ", do_.rows * do_.heads);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < do_.rows; ++r)
    for (std::int64_t h = 0; h < do_.heads; ++h) {
      const T* a = do_.at(r, h);
      const T* b = o.at(r, h);
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (std::int64_t c = 0; c < do_.dim; ++c) acc += to_f32(a[c]) * to_f32(b[c]);
      delta[static_cast<std::size_t>(r * do_.heads + h)] = acc;
    }
}

template <typename T>
void backward_impl(const BlockMask& mask, ConstTensorView q_v, ConstTensorView k_v, ConstTensorView v_v,
                   ConstTensorView do_v, ConstTensorView lse_v, ConstTensorView delta_v, TensorView dq_v,
                   TensorView dk_v, TensorView dv_v, float softmax_scale) {
  const auto q = HeadRows<const T>::from(q_v), k = HeadRows<const T>::from(k_v), v = HeadRows<const T>::from(v_v);
  const auto do_ = HeadRows<const T>::from(do_v);
  const auto dq = HeadRows<T>::from(dq_v), dk = HeadRows<T>::from(dk_v), dv = HeadRows<T>::from(dv_v);
  const auto lse = span_f32(lse_v), delta = span_f32(delta_v);
  const Dims s = make_dims(mask, q, k, v, softmax_scale);
  check_rows<T>("do", do_, s.Q, s.n_q, s.d);
  check_rows<T>("dq", dq, s.Q, s.n_q, s.d);
  check_rows<T>("dk", dk, s.Lk, s.n_kv, s.d);
  check_rows<T>("dv", dv, s.Lk, s.n_kv, s.d);
  DIFFCP_CHECK(static_cast<std::int64_t>(lse.size()) == s.Q * s.n_q &&
                   static_cast<std::int64_t>(delta.size()) == s.Q * s.n_q,
               "attention backward: lse has ", lse.size(), " and delta ", delta.size(),
               " entries, expected Q*n_q = ", s.Q * s.n_q);
  // dk, dv accumulate over the blocks that see a key row: in place for f32, in f32 buffers
  // rounded once at the end for bf16.
  std::vector<float> dk32, dv32;
  HeadRows<float> dk_acc, dv_acc;
  if constexpr (std::is_same_v<T, float>) {
    dk_acc = dk;
    dv_acc = dv;
  } else {
    dk32.resize(static_cast<std::size_t>(s.Lk * s.n_kv * s.d));
    dv32.resize(dk32.size());
    dk_acc = head_rows(dk32, s.Lk, s.n_kv, s.d);
    dv_acc = head_rows(dv32, s.Lk, s.n_kv, s.d);
  }
  zero_rows(dk_acc);
  zero_rows(dv_acc);
  // Work item = (sample group, kv head). Groups touch disjoint key rows and their blocks own
  // disjoint query rows, so items never write the same dq/dk/dv element: no atomics, no
  // per-thread copies. Largest items first for the dynamic schedule.
  const auto& groups = mask.sample_groups();
  std::vector<std::int64_t> cost(groups.size(), 0);
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::int64_t i : groups[g]) cost[g] += mask.visible_pairs(i) + 1;
  std::vector<std::int64_t> order(groups.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return cost[a] > cost[b]; });
  const std::int64_t items = static_cast<std::int64_t>(groups.size()) * s.n_kv;
  ParallelErrors errors;
  bool amx = false;  // the bf16 backward on AMX tiles (amx_backward_group)
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (amx_block_sparse(mask, s.GB, s.d) && items > 0) {
      const AmxBackHeads heads = amx_back_heads(s, k, v);
#pragma omp parallel
      {
        AmxBackItemScratch x;
#pragma omp for schedule(dynamic, 1)
        for (std::int64_t it = 0; it < items; ++it)
          errors.run([&] {
            const auto& group = groups[static_cast<std::size_t>(order[static_cast<std::size_t>(it / s.n_kv)])];
            amx_backward_group(mask, s, heads, group, q, do_, lse, delta, dq, dk_acc, dv_acc, it % s.n_kv, x);
          });
      }
      amx = true;
    }
  }
  if (!amx) {
#pragma omp parallel
    {
      BackwardScratch<T> w(s);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t it = 0; it < items; ++it)
        errors.run([&] {
          const auto& group = groups[static_cast<std::size_t>(order[static_cast<std::size_t>(it / s.n_kv)])];
          for (std::int64_t i : group)
            backward_block(mask, s, q, k, v, do_, lse, delta, dq, dk_acc, dv_acc, i, it % s.n_kv, w);
        });
    }
  }
  errors.rethrow();
  if constexpr (!std::is_same_v<T, float>) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < s.Lk; ++r)
      for (std::int64_t h = 0; h < s.n_kv; ++h) {
        store_row(dk_acc.at(r, h), 1.f, dk.at(r, h), s.d);
        store_row(dv_acc.at(r, h), 1.f, dv.at(r, h), s.d);
      }
  }
}

// Heads narrower than this run bf16 by widening: q, k, v (and do) converted to f32 once, the f32
// kernel, the outputs rounded to bf16. On tiles of G*B x 256 x d_h with d_h < 64 oneDNN's bf16
// kernels lose to its sgemm (measured, bench_attention: d_h = 32 forward 1.08x, backward 0.82x of
// f32; d_h = 16, the tiny drafter, 2.7x slower); the result is bf16 storage with f32 compute all
// through (P and dS not rounded): at least as accurate as the tiled bf16 path.
constexpr std::int64_t kMinBf16TileHeadDim = 64;
// Except in a forward whose blocks fill whole query tiles (G*B >= kQueryTile: the DiT's dense
// attention, a block per image) with d_h >= 32: there the fixed-shape bf16 tiles run 2.2x the f32
// ones (kQueryTile x 512 x 32 measured, AMX; issue #54), and the widening pass costs a copy of q, k, v.
constexpr std::int64_t kMinBf16WideBlockHeadDim = 32;
// Neither where the AMX kernels run (d_h a multiple of 32: their tiles keep bf16 ahead of the
// widened f32 kernel at d_h 32 too, issue #69).
bool widen_bf16_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k) {
  const std::int64_t d = q.shape[2], G = k.shape[1] > 0 ? q.shape[1] / k.shape[1] : 1;
  if (d >= kMinBf16TileHeadDim || amx_attention_ready(d)) return false;
  return !(d >= kMinBf16WideBlockHeadDim && G * mask.block() >= kQueryTile);
}

struct Widened {
  std::vector<float> data;
  HeadRows<float> rows;
};
Widened widen_rows(HeadRows<const bf16_t> x) {
  Widened w;
  w.data.resize(static_cast<std::size_t>(x.rows * x.heads * x.dim));
  w.rows = head_rows(w.data, x.rows, x.heads, x.dim);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < x.rows; ++r)
    simd::to_f32(reinterpret_cast<const std::uint16_t*>(x.at(r, 0)), w.rows.at(r, 0), x.heads * x.dim);
  return w;
}
Widened f32_rows_like(HeadRows<bf16_t> x) {
  Widened w;
  w.data.resize(static_cast<std::size_t>(x.rows * x.heads * x.dim));
  w.rows = head_rows(w.data, x.rows, x.heads, x.dim);
  return w;
}
void round_rows(const Widened& w, HeadRows<bf16_t> out) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < out.rows; ++r) store_row(w.rows.at(r, 0), 1.f, out.at(r, 0), out.heads * out.dim);
}

}  // namespace

void CpuBackend::attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                   TensorView o, TensorView lse, float softmax_scale) {
  if (q.dtype == DType::bf16 && widen_bf16_forward(mask, q, k)) {
    const auto q32 = widen_rows(HeadRows<const bf16_t>::from(q)), k32 = widen_rows(HeadRows<const bf16_t>::from(k));
    const auto v32 = widen_rows(HeadRows<const bf16_t>::from(v));
    const auto o16 = HeadRows<bf16_t>::from(o);
    const auto o32 = f32_rows_like(o16);
    forward_impl<float>(mask, q32.rows.view(), k32.rows.view(), v32.rows.view(), o32.rows.view(), lse, softmax_scale);
    return round_rows(o32, o16);
  }
  if (q.dtype == DType::bf16) return forward_impl<bf16_t>(mask, q, k, v, o, lse, softmax_scale);
  forward_impl<float>(mask, q, k, v, o, lse, softmax_scale);
}

void CpuBackend::attention_delta(ConstTensorView do_, ConstTensorView o, TensorView delta) {
  if (do_.dtype == DType::bf16) return delta_impl<bf16_t>(do_, o, delta);
  delta_impl<float>(do_, o, delta);
}

void CpuBackend::attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                    ConstTensorView do_, ConstTensorView lse, ConstTensorView delta, TensorView dq,
                                    TensorView dk, TensorView dv, float softmax_scale) {
  const std::int64_t G = k.shape[1] > 0 ? q.shape[1] / k.shape[1] : 1;
  if (q.dtype == DType::bf16 && q.shape[2] < kMinBf16TileHeadDim &&
      !amx_block_sparse(mask, G * mask.block(), q.shape[2])) {
    const auto q32 = widen_rows(HeadRows<const bf16_t>::from(q)), k32 = widen_rows(HeadRows<const bf16_t>::from(k));
    const auto v32 = widen_rows(HeadRows<const bf16_t>::from(v)), do32 = widen_rows(HeadRows<const bf16_t>::from(do_));
    const auto dq16 = HeadRows<bf16_t>::from(dq), dk16 = HeadRows<bf16_t>::from(dk), dv16 = HeadRows<bf16_t>::from(dv);
    const auto dq32 = f32_rows_like(dq16), dk32 = f32_rows_like(dk16), dv32 = f32_rows_like(dv16);
    backward_impl<float>(mask, q32.rows.view(), k32.rows.view(), v32.rows.view(), do32.rows.view(), lse, delta,
                         dq32.rows.view(), dk32.rows.view(), dv32.rows.view(), softmax_scale);
    round_rows(dq32, dq16);
    round_rows(dk32, dk16);
    return round_rows(dv32, dv16);
  }
  if (q.dtype == DType::bf16)
    return backward_impl<bf16_t>(mask, q, k, v, do_, lse, delta, dq, dk, dv, softmax_scale);
  backward_impl<float>(mask, q, k, v, do_, lse, delta, dq, dk, dv, softmax_scale);
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
