// The fp8 wire of the DiT's exchanges (--wire fp8, dit/wire.hpp, ops/fp8.hpp), at P = 1, 2, 3, 4, 8.
//
// Covered:
//   * the e4m3 code: every finite code round-trips exactly; random values (normal, subnormal,
//     beyond 448) encode to the nearest e4m3 value of a plain search over the 254 finite codes
//     (ties to the even code), saturate to +-448, and never give the NaN code (NaN and inf inputs
//     included).
//   * the blocked codec as backend ops (f32 and bf16 values, d = 1, 8, 128, magnitudes from 1e-30 to
//     1e30, all-zero blocks): the decode equals the plain reference bit for bit (f32), stays within
//     ops/fp8.hpp's bound |x' - x| <= 2^-4 |x| + 2^-10 s + 2^-21 |x|, and is exact for values c s
//     with s = amax / 448 a power of two.
//   * a backend that declines the codec: set_wire / set_compute refuse naming the backend and the op,
//     before any communication; --wire values other than auto / fp8 are refused by name.
//   * the exchange in every mode (flat, tapa, vfirst, cocodiff) and USP (U in {P, 1}: Ring's K|V
//     hops in fp8): equals the fp64 attention of the decoded q, k, v within o's codec bound (the only
//     rounding left after the inputs' is o's return trip), genuinely differs from the f32 exchange,
//     and flat / tapa / vfirst (and cocodiff's first, full, exchange) are bitwise equal; the same
//     with bf16 compute (decoded into bf16; a sanity bound, the bf16 kernel's error dominates).
//   * the sampler in every mode with the fp8 wire (cocodiff with selective steps at r = 0, bitwise
//     TAPA's, and with the linear schedule): the bytes per link class and the scale bytes equal the
//     closed forms (vmajor_predicted_bytes, ring_kv_bytes, dit_predicted_bytes with the fp8 wire),
//     the payload (bytes - scales) is exactly half of the bf16 wire's, V-Major's caches hold the fp8
//     blocks, and the latent stays within 2^-3 of the f32 run's peak (measured at P = 2, 4: 2^-8.8;
//     2^-4.7 with V-Major's linear schedule, which itself reuses up to every row by the last step).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/ring_attention.hpp"
#include "diffcp/dit/run.hpp"
#include "diffcp/dit/sampler.hpp"
#include "diffcp/dit/vmajor.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/fp8.hpp"
#include "diffcp/testing/attention_reference.hpp"
#include "error_of.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

Communicator& world() { return test::world(); }

// ---- a plain reference of the codec: nearest value by search, no bit tricks ----

// The non-negative finite e4m3 values by code 0..126 (0x7E = 448), from the format's definition.
std::vector<double> e4m3_values() {
  std::vector<double> v;
  for (int c = 0; c <= 0x7E; ++c) {
    const int e = c >> 3, m = c & 7;
    v.push_back(e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
  }
  return v;
}
// The e4m3 value nearest y (ties: the even code; beyond 448 or NaN: 448 with y's sign).
double ref_e4m3(double y) {
  static const std::vector<double> vals = e4m3_values();
  const double a = std::fabs(y);
  double best = vals.back();
  if (a < vals.back()) {
    int bc = 0;
    for (int c = 1; c < static_cast<int>(vals.size()); ++c) {
      const double dc = std::fabs(vals[static_cast<std::size_t>(c)] - a), db = std::fabs(vals[static_cast<std::size_t>(bc)] - a);
      if (dc < db || (dc == db && c % 2 == 0)) bc = c;
    }
    best = vals[static_cast<std::size_t>(bc)];
  }
  return std::signbit(y) ? -best : best;
}
// One block's round trip by the reference: s = amax / 448 in f32, x' = e4m3(x / s) * s in f32.
std::vector<float> ref_round_trip(const std::vector<float>& x) {
  float amax = 0;
  for (const float v : x) amax = std::max(amax, std::fabs(v));
  const float s = amax / 448.f;
  std::vector<float> out(x.size(), 0.f);
  if (s == 0) return out;
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(ref_e4m3(x[i] / s)) * s;
  return out;
}
// Every block of d of `x` [n, d] round-tripped by the reference.
std::vector<float> ref_blocks(const std::vector<float>& x, std::int64_t d) {
  std::vector<float> out;
  for (std::size_t b = 0; b < x.size(); b += static_cast<std::size_t>(d)) {
    const std::vector<float> r = ref_round_trip({x.begin() + static_cast<std::ptrdiff_t>(b), x.begin() + static_cast<std::ptrdiff_t>(b) + d});
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}
// ops/fp8.hpp's bound for one element of a block of scale s.
double codec_bound(double x, double s) { return 0x1p-4 * std::fabs(x) + 0x1p-10 * s + 0x1p-21 * std::fabs(x); }

// The backend ops' round trip of x [n, d] in `t` (f32 or bf16), on the active backend.
std::vector<float> op_round_trip(const std::vector<float>& x, std::int64_t d, DType t) {
  const std::int64_t n = static_cast<std::int64_t>(x.size()) / d;
  Buffer enc(DType::u8, fp8_encoded_bytes(n, d));
  if (t == DType::f32) {
    Buffer in = to_device(std::span<const float>(x)), out(DType::f32, n * d);
    fp8_encode(in.data(), t, n, d, enc.data());
    fp8_decode(enc.data(), n, d, out.data(), t);
    return to_host<float>(out.view());
  }
  std::vector<bf16_t> xb(x.size());
  convert_to_bf16(x.data(), xb.data(), static_cast<std::int64_t>(x.size()));
  Buffer in = to_device(std::span<const bf16_t>(xb)), out(DType::bf16, n * d);
  fp8_encode(in.data(), t, n, d, enc.data());
  fp8_decode(enc.data(), n, d, out.data(), t);
  const std::vector<bf16_t> back = to_host<bf16_t>(out.view());
  std::vector<float> f(back.size());
  convert_to_f32(back.data(), f.data(), static_cast<std::int64_t>(f.size()));
  return f;
}

TEST(Fp8Codec, E4m3CodesRoundTripAndRoundToNearestEven) {
  for (int c = 0; c < 256; ++c) {
    const std::uint8_t code = static_cast<std::uint8_t>(c);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(e4m3_to_float(code)));
      continue;
    }
    EXPECT_EQ(e4m3_from_float(e4m3_to_float(code)), code) << c;
    EXPECT_EQ(static_cast<double>(e4m3_to_float(code)), ref_e4m3(e4m3_to_float(code))) << c;
  }
  // Edges: zero, the smallest subnormal and half of it (a tie to 0), the subnormal -> normal step,
  // 448 and beyond (saturation), inf, NaN.
  EXPECT_EQ(e4m3_from_float(0.f), 0);
  EXPECT_EQ(e4m3_from_float(0x1p-9f), 1);
  EXPECT_EQ(e4m3_from_float(0x1p-10f), 0);
  EXPECT_EQ(e4m3_from_float(0x1.8p-9f), 2);  // 1.5 x 2^-9: tie, to the even code 2
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(0x1.ep-7f)), 0x1p-6f);  // 7.5 x 2^-9 -> 8 x 2^-9 (the first normal)
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(448.f)), 448.f);
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(-448.f)), -448.f);
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(460.f)), 448.f);
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(1e30f)), 448.f);
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(-std::numeric_limits<float>::infinity())), -448.f);
  EXPECT_FALSE(std::isnan(e4m3_to_float(e4m3_from_float(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(17.f)), 16.f);  // 17 between 16 and 18: tie, to the even mantissa (16)
  EXPECT_EQ(e4m3_to_float(e4m3_from_float(19.f)), 20.f);  // 19 between 18 and 20: tie, to 20 (even)
  // Random values over the whole range, subnormals included: the nearest value of the search.
  const std::vector<float> r = random_normal(20000, 5);
  for (std::size_t i = 0; i < r.size(); ++i) {
    const float y = r[i] * std::ldexp(1.f, static_cast<int>(i % 24) - 14);  // |y| from ~2^-16 to ~2^11
    const std::uint8_t c = e4m3_from_float(y);
    ASSERT_NE(c & 0x7F, 0x7F) << y;
    ASSERT_EQ(static_cast<double>(e4m3_to_float(c)), ref_e4m3(y)) << y;
  }
}

// A non-finite element is not hidden: its whole block decodes non-finite (NaN: a NaN scale; inf: an
// infinite scale, so 0 x inf = NaN and the inf element itself 448 x inf), the other blocks exact.
TEST(Fp8Codec, NonFiniteInputMakesItsBlockNonFinite) {
  const std::int64_t d = 8;
  const float inf = std::numeric_limits<float>::infinity();
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), inf, -inf}) {
    std::vector<float> x(3 * d, 1.f);
    x[d + 3] = bad;
    const std::vector<float> got = op_round_trip(x, d, DType::f32);
    for (std::int64_t i = 0; i < 3 * d; ++i) {
      if (i >= d && i < 2 * d) {
        EXPECT_FALSE(std::isfinite(got[static_cast<std::size_t>(i)])) << "element " << i << " of input " << bad;
      } else {
        EXPECT_EQ(got[static_cast<std::size_t>(i)], 1.f) << "element " << i;
      }
    }
    if (std::isinf(bad)) {
      EXPECT_EQ(got[static_cast<std::size_t>(d + 3)], bad) << "an infinite element keeps its sign";
    }
  }
}

TEST(Fp8Codec, BlocksWithinTheBoundExactWhereRepresentable) {
  for (const std::int64_t d : {1, 8, 128}) {
    std::vector<float> x = random_normal(static_cast<std::size_t>(64 * d), 3 + static_cast<std::uint64_t>(d));
    // Blocks of very different magnitudes (1e-30 .. 1e30), one all-zero block, a lone 448 and a tiny tail.
    for (std::int64_t b = 0; b < 64; ++b) {
      const float m = std::pow(10.f, static_cast<float>(b % 13 - 6) * 5.f);
      for (std::int64_t i = 0; i < d; ++i) x[static_cast<std::size_t>(b * d + i)] *= m;
    }
    std::fill(x.begin() + 5 * d, x.begin() + 6 * d, 0.f);
    x[static_cast<std::size_t>(7 * d)] = 448.f;
    for (const DType t : {DType::f32, DType::bf16}) {
      SCOPED_TRACE("d = " + std::to_string(d) + " " + dtype_name(t));
      std::vector<float> xin = x;
      if (t == DType::bf16)
        for (float& v : xin) v = bf16_to_f32(f32_to_bf16(v));
      const std::vector<float> got = op_round_trip(xin, d, t), ref = ref_blocks(xin, d);
      for (std::int64_t b = 0; b < 64; ++b) {
        float amax = 0;
        for (std::int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(xin[static_cast<std::size_t>(b * d + i)]));
        const double s = amax / 448.f;
        for (std::int64_t i = 0; i < d; ++i) {
          const std::size_t k = static_cast<std::size_t>(b * d + i);
          ASSERT_TRUE(std::isfinite(got[k]));
          // bf16 decode: one more rounding of the decoded value.
          const double extra = t == DType::bf16 ? 0x1p-9 * std::fabs(ref[k]) : 0.0;
          ASSERT_LE(std::fabs(static_cast<double>(got[k]) - xin[k]), codec_bound(xin[k], s) + extra) << "block " << b;
          if (t == DType::f32) {
            ASSERT_EQ(got[k], ref[k]) << "block " << b;
          }
        }
      }
      EXPECT_EQ(got[static_cast<std::size_t>(5 * d)], 0.f);  // the zero block: scale 0, zeros
    }
    // Exact: c s with c e4m3 values and s = amax / 448 a power of two (one element at 448).
    std::vector<float> exact(static_cast<std::size_t>(4 * d));
    for (std::size_t k = 0; k < exact.size(); ++k) {
      const float s = std::ldexp(1.f, static_cast<int>(k / static_cast<std::size_t>(d)) * 7 - 10);
      exact[k] = e4m3_to_float(static_cast<std::uint8_t>((k * 37) % 0x7F)) * s * ((k & 1) ? -1.f : 1.f);
      if (k % static_cast<std::size_t>(d) == 0) exact[k] = 448.f * s;
    }
    EXPECT_EQ(op_round_trip(exact, d, DType::f32), exact);
  }
  EXPECT_NE(error_of([] { fp8_encode(nullptr, DType::f64, 1, 4, nullptr); }).find("f64 values, expected f32 or bf16"),
            std::string::npos);
}

// A backend that runs the host's memory ops but declines the codec.
class NoFp8Backend final : public Backend {
 public:
  const char* name() const override { return "nofp8"; }
  bool supports(OpKind op, DType dtype) const override {
    return op != OpKind::fp8_encode && op != OpKind::fp8_decode && cpu_backend().supports(op, dtype);
  }
};

TEST(Fp8Wire, ParsedByNameAndRefusedOnABackendWithoutTheCodec) {
  EXPECT_EQ(parse_wire("auto"), Wire::compute);
  EXPECT_EQ(parse_wire("fp8"), Wire::fp8);
  EXPECT_STREQ(wire_name(Wire::fp8), "fp8");
  EXPECT_NE(error_of([] { parse_wire("e5m2"); }).find("`wire` 'e5m2': unknown wire format, expected auto"), std::string::npos);
  const auto ex = make_attention_exchange(ExchangeMode::tapa, world(), 1);
  const std::uint64_t calls = world().stats().total().calls;
  {
    NoFp8Backend none;
    ScopedBackend use(none);
    EXPECT_NE(error_of([&] { ex->set_wire(Wire::fp8); }).find("backend 'nofp8' does not support fp8_encode on f32"),
              std::string::npos);
    EXPECT_EQ(ex->wire_kind(), Wire::compute);
    EXPECT_NO_THROW(ex->set_wire(Wire::compute));
  }
  ex->set_wire(Wire::fp8);
  {
    NoFp8Backend none;
    ScopedBackend use(none);
    EXPECT_NE(error_of([&] { ex->set_compute(DType::bf16); }).find("backend 'nofp8' does not support fp8_encode on bf16"),
              std::string::npos);
    EXPECT_EQ(ex->compute(), DType::f32);
  }
  EXPECT_EQ(world().stats().total().calls, calls);  // refused without communicating
  world().barrier();
}

// ---- the exchange: flat, tapa, vfirst, cocodiff and USP with the fp8 wire ----

TEST(Fp8Exchange, EveryModeWithinTheCodecBoundOfTheDecodedReference) {
  const int P = world().size(), p = world().rank();
  const std::int64_t b = 2, n_p = 5, N = P * n_p, heads = 2 * P, d = 8, H = heads * d;
  ExchangeLayout l{b, n_p, heads, d, b * n_p + 3, {}, {}};  // scrambled rows, 3 rows outside the table
  for (std::int64_t i = 0; i < b * n_p; ++i) l.rows.push_back((i * 7 + 3) % (b * n_p + 3));
  // Token t of image j on rank r is global token r n_p + t: qkv_all [b, N, 3H], per-head magnitudes
  // spread over 2^-6 .. 2^6 (what per-(token, head) scales are for).
  std::vector<float> qkv_all = random_normal(static_cast<std::size_t>(b * N * 3 * H), 11);
  for (std::size_t i = 0; i < qkv_all.size(); ++i) qkv_all[i] *= std::ldexp(1.f, static_cast<int>((i / d) % 13) - 6);
  std::vector<float> qkv(static_cast<std::size_t>(l.local_rows * 3 * H), NAN);
  for (std::int64_t j = 0; j < b; ++j)
    for (std::int64_t t = 0; t < n_p; ++t)
      std::memcpy(qkv.data() + l.rows[static_cast<std::size_t>(j * n_p + t)] * 3 * H,
                  qkv_all.data() + (j * N + p * n_p + t) * 3 * H, sizeof(float) * static_cast<std::size_t>(3 * H));
  // The reference: fp64 dense attention per image of the decoded q, k, v (every (token, head) block
  // round-tripped by the plain codec), o [b][N][H].
  // bf16 compute decodes into bf16: the reference of those runs reads the decoded values rounded to bf16.
  const std::vector<float> dec = ref_blocks(qkv_all, d);
  std::vector<float> dec16(dec.size());
  for (std::size_t i = 0; i < dec.size(); ++i) dec16[i] = bf16_to_f32(f32_to_bf16(dec[i]));
  const BlockMask dense(N, N, {}, {{0, 0, 0}});
  const auto reference = [&](const std::vector<float>& in) {  // o [b][N][H]
    std::vector<double> o_all;
    for (std::int64_t j = 0; j < b; ++j) {
      std::vector<double> q, k, v, o, lse;
      for (std::int64_t i = 0; i < N; ++i) {
        const float* row = in.data() + (j * N + i) * 3 * H;
        q.insert(q.end(), row, row + H);
        k.insert(k.end(), row + H, row + 2 * H);
        v.insert(v.end(), row + 2 * H, row + 3 * H);
      }
      reference_attention_forward(dense, {heads, heads, d}, q, k, v, o, lse);
      o_all.insert(o_all.end(), o.begin(), o.end());
    }
    return o_all;
  };
  const std::vector<double> o_ref = reference(dec), o_ref16 = reference(dec16);
  std::vector<double> vmax(static_cast<std::size_t>(b * heads), 0.0);  // per (image, head): max |v| over the keys
  for (std::int64_t j = 0; j < b; ++j)
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t c = 0; c < H; ++c)
        vmax[static_cast<std::size_t>(j * heads + c / d)] =
            std::max<double>(vmax[static_cast<std::size_t>(j * heads + c / d)], std::fabs(dec16[static_cast<std::size_t>((j * N + i) * 3 * H + 2 * H + c)]));
  std::vector<int> degrees{P};
  if (P > 1) degrees.push_back(1);  // USP: Ring attention over all P ranks, its K|V hops in fp8
  for (const int U : degrees) {
    std::vector<float> first, first16;
    for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::tapa, ExchangeMode::vfirst, ExchangeMode::cocodiff}) {
      SCOPED_TRACE(std::string(exchange_mode_name(mode)) + " U = " + std::to_string(U));
      const auto run = [&](Wire wire, DType compute = DType::f32) {
        const auto ex = make_attention_exchange(mode, world(), 1, {CacheScheduleKind::fixed, 0.5, 1, 0}, U);
        ex->set_compute(compute);
        ex->set_wire(wire);
        ex->set_layout(l);
        ex->begin_step(0, 2);
        std::vector<float> out(static_cast<std::size_t>(l.local_rows * H), -1.f);
        ex->attention({qkv.data(), l.local_rows, 3 * heads, d, 3 * H}, {out.data(), l.local_rows, heads, d, H});
        if (wire == Wire::fp8) {  // scales: 4 bytes per (token, head) block sent
          const WireFormat f{DType::f32, Wire::fp8, d};
          EXPECT_EQ(ex->stats().scale_bytes, f.scale_share(ex->stats().bytes_intra + ex->stats().bytes_inter));
          EXPECT_EQ(ex->stats().scale_bytes > 0, P > 1);
        } else {
          EXPECT_EQ(ex->stats().scale_bytes, 0u);
        }
        return out;
      };
      const std::vector<float> got = run(Wire::fp8), f32 = run(Wire::compute);
      if (first.empty())
        first = got;
      else  // flat, tapa, vfirst and cocodiff's (full) first exchange: the same bytes, the same result
        EXPECT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * sizeof(float)));
      double diff_f32 = 0;
      for (std::int64_t j = 0; j < b; ++j)
        for (std::int64_t t = 0; t < n_p; ++t) {
          const std::int64_t row = l.rows[static_cast<std::size_t>(j * n_p + t)];
          const double* r = o_ref.data() + (j * N + p * n_p + t) * H;
          for (std::int64_t h = 0; h < heads; ++h) {
            double amax = 0;
            for (std::int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(r[h * d + c]));
            for (std::int64_t c = 0; c < d; ++c) {
              const double g = got[static_cast<std::size_t>(row * H + h * d + c)], want = r[h * d + c];
              // o's round trip (the reference's o stands for the f32 attention's, 1e-5 apart at most,
              // which moves the scale and the rounding point by that much more).
              ASSERT_LE(std::fabs(g - want), codec_bound(want, amax / 448) + 1e-5 * (1 + std::fabs(want)))
                  << "image " << j << " token " << t << " head " << h;
              diff_f32 = std::max(diff_f32, std::fabs(g - f32[static_cast<std::size_t>(row * H + h * d + c)]));
            }
          }
        }
      EXPECT_GT(diff_f32, 0.0);  // genuinely rounded
      for (std::int64_t r = 0; r < l.local_rows; ++r)
        if (std::find(l.rows.begin(), l.rows.end(), r) == l.rows.end()) {
          EXPECT_EQ(got[static_cast<std::size_t>(r * H)], -1.f);
        }
      // bf16 compute: decoded into bf16 (Ring's hops too), the bf16 kernel. Bitwise across the modes;
      // against the fp64 attention of the bf16-rounded decoded inputs within o's codec bound plus
      // 2^-3 of the head's largest |v|: a sanity bound, not a derived one (a lost scale is off by
      // ~|v| itself). The bf16 kernel's own error dominates here: in the heads scaled by up to 2^6
      // the logits reach ~10^4 and its roundings move near-tie probabilities (measured: up to
      // 2^-4.8 of |v| at P = 8).
      const std::vector<float> got16 = run(Wire::fp8, DType::bf16);
      if (first16.empty())
        first16 = got16;
      else
        EXPECT_EQ(0, std::memcmp(first16.data(), got16.data(), got16.size() * sizeof(float)));
      for (std::int64_t j = 0; j < b; ++j)
        for (std::int64_t t = 0; t < n_p; ++t)
          for (std::int64_t h = 0; h < heads; ++h) {
            const std::int64_t row = l.rows[static_cast<std::size_t>(j * n_p + t)];
            const double* r = o_ref16.data() + (j * N + p * n_p + t) * H + h * d;
            double amax = 0;
            for (std::int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(r[c]));
            for (std::int64_t c = 0; c < d; ++c)
              ASSERT_LE(std::fabs(got16[static_cast<std::size_t>(row * H + h * d + c)] - r[c]),
                        codec_bound(r[c], amax / 448) + 0x1p-3 * vmax[static_cast<std::size_t>(j * heads + h)] + 1e-5)
                  << "bf16: image " << j << " token " << t << " head " << h;
          }
    }
  }
}

// ---- the sampler: bytes against the closed forms, payload half of bf16's ----

DitConfig fp8_config() {
  DitConfig c = dit_preset("tiny");
  c.heads = 12;
  c.head_dim = 8;
  c.rope_axes = flux_rope_axes(8);
  c.mlp_hidden = 64;
  c.text_dim = 16;
  c.pooled_dim = 16;
  c.time_dim = 32;
  return c;
}

std::vector<float> run_sampler(Communicator& comm, const DitWeights& w, const DitShape& shape, AttentionExchange& ex,
                               int steps, Wire wire, DType compute = DType::f32) {
  ex.set_wire(wire);
  DitModel model(w, shape, ex);
  std::vector<float> x_p = shard_latent(initial_noise(w.config(), shape, 7), w.config(), shape, model.shard());
  euler_sample(model, x_p, prompt_conditioning(w.config(), shape, "an fp8 prompt"), {flow_schedule(steps), 3.5, {}, compute});
  return gather_latent(comm, x_p, w.config(), shape, model.shard());
}

TEST(Fp8Sampler, BytesAreTheClosedFormsAndThePayloadHalfOfBf16) {
  const int P = world().size(), steps = 3;
  const DitConfig cfg = fp8_config();
  if (cfg.heads % P != 0) GTEST_SKIP() << "P = " << P << " does not divide the heads";
  DitWeights w(cfg);
  w.init_random(9);
  const DitShape shape{1, 96, 96, 12};  // 36 image + 12 text tokens: divisible by P = 1, 2, 3, 4 (P = 8: skipped above)
  const std::int64_t layers = cfg.double_blocks + cfg.single_blocks, n = shape.tokens() / P, hd = cfg.hidden() / P;
  const CacheSchedule r0{CacheScheduleKind::fixed, 0.0, 0, 0};  // step 0 full, steps 1, 2 selective
  const CacheSchedule lin{CacheScheduleKind::linear, 1.0, 1, 0};
  const WireFormat fp8{DType::f32, Wire::fp8, cfg.head_dim};
  auto self = world().split(world().rank(), 0, "self");
  const auto ex1 = make_attention_exchange(ExchangeMode::flat, *self, 1);
  const std::vector<float> f32 = run_sampler(*self, w, shape, *ex1, steps, Wire::compute);
  double peak = 0;
  for (const float v : f32) peak = std::max(peak, std::fabs(static_cast<double>(v)));
  const auto expect_close = [&](const std::vector<float>& got) {
    double err = 0;
    for (std::size_t i = 0; i < f32.size(); ++i) err = std::max(err, std::fabs(static_cast<double>(got[i]) - f32[i]));
    EXPECT_GT(err, 0.0);
    EXPECT_LE(err, 0x1p-3 * peak) << "fp8 latent error " << err << " of peak " << peak;
  };
  for (const int L : {1, P}) {
    SCOPED_TRACE("L = " + std::to_string(L));
    std::vector<float> tapa_ref;
    for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::tapa, ExchangeMode::vfirst, ExchangeMode::cocodiff}) {
      SCOPED_TRACE(exchange_mode_name(mode));
      const bool vmajor = mode == ExchangeMode::cocodiff;
      const auto ex = make_attention_exchange(mode, world(), mode == ExchangeMode::flat ? 1 : L, r0);
      const std::vector<float> got = run_sampler(world(), w, shape, *ex, steps, Wire::fp8);
      if (mode == ExchangeMode::flat) {
        expect_close(got);
      } else if (mode == ExchangeMode::tapa) {
        tapa_ref = got;
      } else {  // vfirst: TAPA's exchange; cocodiff at r = 0 (selective steps 1, 2): bitwise TAPA's
        EXPECT_EQ(0, std::memcmp(got.data(), tapa_ref.data(), got.size() * sizeof(float)));
      }
      const int Lm = mode == ExchangeMode::flat ? 1 : L;
      const VMajorBytes pred = vmajor_predicted_bytes(P, Lm, n, hd, layers, r0, steps, vmajor, fp8);
      const VMajorBytes bf16 = vmajor_predicted_bytes(P, Lm, n, hd, layers, r0, steps, vmajor, DType::bf16);
      EXPECT_EQ(ex->stats().bytes_intra, pred.intra);
      EXPECT_EQ(ex->stats().bytes_inter, pred.inter);
      EXPECT_EQ(ex->stats().scale_bytes, pred.scales);
      if (vmajor) {
        EXPECT_EQ(ex->stats().selective, static_cast<std::uint64_t>(2 * layers));
      }
      // The payload: exactly half of the bf16 wire's. V-Major's f32 L1 partials and i32 indices are
      // no payload and the same in every wire: meta = 2 bf16 - f32 (payload f32 = 2 payload bf16).
      const VMajorBytes f32b = vmajor_predicted_bytes(P, Lm, n, hd, layers, r0, steps, vmajor, DType::f32);
      const std::uint64_t meta = 2 * (bf16.intra + bf16.inter) - (f32b.intra + f32b.inter);
      EXPECT_EQ(meta > 0, vmajor && P > 1);
      EXPECT_EQ(2 * (ex->stats().bytes_intra + ex->stats().bytes_inter - ex->stats().scale_bytes - meta),
                bf16.intra + bf16.inter - meta);
      if (mode == ExchangeMode::flat) {  // the run's closed form (dit/run.hpp), per step
        const DitBytesPrediction b = dit_predicted_bytes(cfg, shape, make_dit_shard(cfg, shape, P, world().rank()), {P, 1}, P,
                                                         mode, r0, steps, 1, 1, DType::f32, Wire::fp8);
        EXPECT_DOUBLE_EQ(b.scales * steps, static_cast<double>(ex->stats().scale_bytes));
        EXPECT_DOUBLE_EQ(b.inter * steps, static_cast<double>(ex->stats().bytes_inter));
      }
    }
    // A schedule that caches rows: bytes, and caches holding the fp8 blocks (4 n (H + 4 n_h) bytes per layer).
    const auto cc = make_attention_exchange(ExchangeMode::cocodiff, world(), L, lin);
    expect_close(run_sampler(world(), w, shape, *cc, steps, Wire::fp8));
    const VMajorBytes pred = vmajor_predicted_bytes(P, L, n, hd, layers, lin, steps, true, fp8);
    EXPECT_EQ(cc->stats().bytes_intra, pred.intra);
    EXPECT_EQ(cc->stats().bytes_inter, pred.inter);
    EXPECT_EQ(cc->stats().scale_bytes, pred.scales);
    EXPECT_GT(cc->stats().selective, 0u);
    EXPECT_EQ(cc->cache_bytes(), static_cast<std::uint64_t>(layers * 4 * n * (cfg.hidden() + 4 * cfg.heads)));
  }
  // USP over all ranks (U = 1, R = P): Ring's K|V hops carry the blocks.
  if (P > 1) {
    const auto ex = make_attention_exchange(ExchangeMode::flat, world(), 1, {}, 1);
    expect_close(run_sampler(world(), w, shape, *ex, steps, Wire::fp8));
    const std::uint64_t ring = static_cast<std::uint64_t>(steps * layers) * ring_kv_bytes(P, n, cfg.hidden(), fp8);
    EXPECT_EQ(ex->stats().ring_bytes, ring);
    EXPECT_EQ((*ex->ring_comm_stats())[CommOp::send].bytes_sent, ring);
    EXPECT_EQ(ex->stats().scale_bytes, fp8.scale_share(ring));
    EXPECT_EQ(2 * (ring - fp8.scale_share(ring)), static_cast<std::uint64_t>(steps * layers) * ring_kv_bytes(P, n, cfg.hidden(), DType::bf16));
    const DitBytesPrediction b = dit_predicted_bytes(cfg, shape, make_dit_shard(cfg, shape, P, world().rank(), 1), {1, P}, P,
                                                     ExchangeMode::flat, {}, steps, 1, 1, DType::f32, Wire::fp8);
    EXPECT_DOUBLE_EQ(b.ring * steps, static_cast<double>(ring));
    EXPECT_DOUBLE_EQ(b.scales * steps, static_cast<double>(ex->stats().scale_bytes));
  }
  // USP with V-Major's selective steps: the ring hops carry this layer's K|V (V-Major's cache on a
  // selective step, not the last full exchange's buffer), so cocodiff at r = 0 stays bitwise TAPA's.
  std::vector<int> rings;
  if (P > 1) rings.push_back(1);
  if (P > 2 && P % 2 == 0) rings.push_back(P / 2);
  for (const int U : rings) {
    SCOPED_TRACE("USP U = " + std::to_string(U));
    const auto tapa = make_attention_exchange(ExchangeMode::tapa, world(), 1, r0, U);
    const auto coco = make_attention_exchange(ExchangeMode::cocodiff, world(), 1, r0, U);
    const std::vector<float> a = run_sampler(world(), w, shape, *tapa, steps, Wire::fp8);
    const std::vector<float> c = run_sampler(world(), w, shape, *coco, steps, Wire::fp8);
    EXPECT_GT(coco->stats().selective, 0u);
    EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)));
  }
}

}  // namespace
}  // namespace diffcp
