// Multi-rank tests of TAPA, the two-phase all-to-all (SPEC B.2), at P = 1, 2, 3, 4, 8 and every
// group size L dividing P.
//
// Covered:
//   * TAPA's result is bitwise identical (memcmp) to the flat Communicator::all_to_all_v, for
//     uniform, uneven (count (src + 3*dst) % 5), all-zero and one-sender payloads, in f32, f64,
//     i32 and u8; through the one-call form, the split API (phase1_async + test() polling +
//     phase2) and phase2_async; and against the independently computed expected payload.
//   * the per-link-class counters, exactly: intra (phase 1 send/recv + count exchange) and inter
//     (phase 2) for uneven counts from first principles, and the uniform closed form
//     tapa_uniform_bytes() for both plan kinds; the flat communicator's counters do not move.
//   * plan reuse and two exchanges in phase 1 at once (the V-First pattern, SPEC B.3).
//   * P % L != 0 (and L < 1) throws on every rank, naming P and L, before any communication;
//     the communicator still works afterwards. Bad counts / mismatched plans throw too.
//   * the node-local constructor: all test ranks share one machine, so L = P.
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/comm/tapa.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using u64 = std::uint64_t;
using Counts = std::vector<std::size_t>;
// Elements flat rank `src` sends to flat rank `dst`.
using CountFn = std::function<std::size_t(int src, int dst)>;

Communicator& world() { return test::world(); }
std::size_t uz(int v) { return static_cast<std::size_t>(v); }

std::vector<int> divisors(int P) {
  std::vector<int> d;
  for (int L = 1; L <= P; ++L)
    if (P % L == 0) d.push_back(L);
  return d;
}

// Element j of the block src -> dst. Floats get a fraction and a sign so mantissa and sign bits
// move too; u8 wraps modulo 256 (still a fixed bit pattern; the memcmp against flat decides).
template <typename T> T payload(int src, int dst, std::size_t j) {
  const std::int64_t v = (static_cast<std::int64_t>(src) * 64 + dst) * 16 + static_cast<std::int64_t>(j);
  if constexpr (std::is_floating_point_v<T>)
    return static_cast<T>(-(static_cast<double>(v) + 0.375));
  else
    return static_cast<T>(v);
}

// One rank's side of an all-to-all-v: counts, send buffer and expected receive buffer, both
// [sum(counts)] packed in flat rank order.
template <typename T> struct Exchange {
  Counts sc, rc;
  std::vector<T> send, expected;
  Exchange(int P, int r, const CountFn& n) : sc(uz(P)), rc(uz(P)) {
    for (int q = 0; q < P; ++q) {
      sc[uz(q)] = n(r, q);
      rc[uz(q)] = n(q, r);
      for (std::size_t j = 0; j < sc[uz(q)]; ++j) send.push_back(payload<T>(r, q, j));
      for (std::size_t j = 0; j < rc[uz(q)]; ++j) expected.push_back(payload<T>(q, r, j));
    }
  }
  std::vector<T> fresh_recv() const { return std::vector<T>(expected.size(), static_cast<T>(99)); }
};

template <typename T> bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  // Empty vectors may hold null data(), which memcmp must not see (UBSan).
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// `s` holds exactly the listed counters and zero for every other kind.
void expect_stats(const CommStats& s, std::initializer_list<std::pair<CommOp, OpCounter>> expected,
                  const std::string& where) {
  SCOPED_TRACE(where);
  std::array<OpCounter, kNumCommOps> want{};
  for (const auto& [op, k] : expected) want[static_cast<std::size_t>(op)] = k;
  for (std::size_t i = 0; i < kNumCommOps; ++i) {
    const CommOp op = static_cast<CommOp>(i);
    EXPECT_EQ(s[op].calls, want[i].calls) << comm_op_name(op);
    EXPECT_EQ(s[op].bytes_sent, want[i].bytes_sent) << comm_op_name(op);
    EXPECT_EQ(s[op].bytes_recv, want[i].bytes_recv) << comm_op_name(op);
  }
}

// The counters of ONE TAPA exchange with counts n, derived from the definition of the phases
// (not from the implementation): phase 1 moves block (g, j) -> (h, i) from mate j to mate i,
// one message per non-empty block; phase 2 moves it from (g, i) to (h, i) for h != g.
void expect_tapa_stats(const TapaAllToAll& t, const CountFn& n, std::size_t elem_bytes,
                       bool count_exchange) {
  const int L = t.group_size(), G = t.num_groups(), g = t.group(), i = t.local_index();
  const int r = g * L + i;
  OpCounter send, recv, p2;
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < L; ++j) {
      if (j != i) {
        const std::size_t out = n(r, h * L + j), in = n(g * L + j, h * L + i);
        send.calls += out > 0;
        send.bytes_sent += out * elem_bytes;
        recv.calls += in > 0;
        recv.bytes_recv += in * elem_bytes;
      }
      if (h != g) {
        p2.bytes_sent += n(g * L + j, h * L + i) * elem_bytes;
        p2.bytes_recv += n(h * L + j, r) * elem_bytes;
      }
    }
  p2.calls = 1;
  const u64 cx = uz(L - 1) * uz(G) * sizeof(u64);
  if (count_exchange)
    expect_stats(t.intra_stats(), {{CommOp::send, send}, {CommOp::recv, recv}, {CommOp::all_to_all, {1, cx, cx}}},
                 "intra (phase 1 + count exchange)");
  else
    expect_stats(t.intra_stats(), {{CommOp::send, send}, {CommOp::recv, recv}}, "intra (phase 1)");
  expect_stats(t.inter_stats(), {{CommOp::all_to_all, p2}}, "inter (phase 2)");
}

const std::pair<const char*, CountFn> kPatterns[] = {
    {"uniform", [](int, int) -> std::size_t { return 3; }},
    {"uneven", [](int s, int d) { return uz((s + 3 * d) % 5); }},
    {"all-zero", [](int, int) -> std::size_t { return 0; }},
    {"one sender", [](int s, int d) { return s == 0 ? uz(d + 1) : 0; }},
};

class Tapa : public ::testing::Test {
 protected:
  void SetUp() override { world().stats().reset(); }
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
};

template <typename T> class TapaMove : public Tapa {};
using MoveTypes = ::testing::Types<float, double, std::int32_t, std::uint8_t>;
TYPED_TEST_SUITE(TapaMove, MoveTypes);

// ---------------------------------------------------------------------------------------------
// Bitwise equality with the flat all-to-all-v

TYPED_TEST(TapaMove, MatchesFlatBitwise) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  for (int L : divisors(P)) {
    TapaAllToAll t(c, L);
    for (const auto& [what, n] : kPatterns) {
      SCOPED_TRACE(std::string(what) + ", L = " + std::to_string(L));
      const Exchange<T> x(P, r, n);
      std::vector<T> flat = x.fresh_recv();
      c.template all_to_all_v<T>(x.send, x.sc, flat, x.rc);
      EXPECT_TRUE(same_bits(flat, x.expected)) << "flat all_to_all_v disagrees with the payload";

      // One call; its counters, exactly.
      c.stats().reset();
      t.reset_stats();
      std::vector<T> got = x.fresh_recv();
      t.template all_to_all_v<T>(x.send, x.sc, got, x.rc);
      EXPECT_TRUE(same_bits(got, flat)) << "one-call TAPA";
      expect_tapa_stats(t, n, sizeof(T), /*count_exchange=*/true);
      expect_stats(c.stats(), {}, "flat communicator untouched");

      // Split API: phase 1 polled to completion (as a compute loop would), then phase 2.
      const TapaPlan plan = t.plan(x.sc, x.rc);
      got = x.fresh_recv();
      TapaPhase1 p1 = t.phase1_async(plan, x.send.data(), dtype_of<T>());
      while (!p1.test()) {}
      EXPECT_EQ(p1.output().size(), plan.phase1_output_count() * sizeof(T));
      t.phase2(std::move(p1), got.data());
      EXPECT_TRUE(same_bits(got, flat)) << "phase1_async + phase2";

      got = x.fresh_recv();
      WorkPtr w = t.phase2_async(t.phase1_async(plan, x.send.data(), dtype_of<T>()), got.data());
      w->wait();
      EXPECT_TRUE(same_bits(got, flat)) << "phase2_async";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The uniform closed form

TEST(TapaBytes, ClosedFormValues) {
  // Aurora node: 12 tiles, L = 2 (two tiles per GPU); 48,000 bytes per rank.
  const TapaBytes b = tapa_uniform_bytes(12, 2, 1000, 4, true);
  EXPECT_EQ(b.phase1, 24000u);         // (L-1)/L = 1/2 of the data stays inside the GPU
  EXPECT_EQ(b.phase2, 40000u);         // (G-1)/G = 5/6 crosses GPUs
  EXPECT_EQ(b.count_exchange, 48u);    // 1 mate x 6 groups x 8 bytes
  EXPECT_EQ(tapa_uniform_bytes(12, 2, 1000, 4, false).count_exchange, 0u);
  EXPECT_EQ(tapa_uniform_bytes(8, 1, 5, 8, true).phase1, 0u);   // L = 1: no phase 1
  EXPECT_EQ(tapa_uniform_bytes(8, 8, 5, 8, true).phase2, 0u);   // L = P: no phase 2
  EXPECT_THROW(tapa_uniform_bytes(8, 3, 1, 1, true), Error);
}

TEST_F(Tapa, UniformCountersMatchClosedForm) {
  constexpr std::size_t count = 5;
  const CountFn uniform = [](int, int) { return count; };
  for (int L : divisors(P)) {
    SCOPED_TRACE("L = " + std::to_string(L));
    TapaAllToAll t(c, L);
    const int G = P / L;
    const Exchange<double> x(P, r, uniform);
    std::vector<double> flat = x.fresh_recv();
    c.all_to_all<double>(x.send, flat);

    for (bool with_counts : {false, true}) {
      SCOPED_TRACE(with_counts ? "all_to_all_v (count exchange)" : "all_to_all (plan_uniform)");
      t.reset_stats();
      std::vector<double> got = x.fresh_recv();
      if (with_counts)
        t.all_to_all_v<double>(x.send, x.sc, got, x.rc);
      else
        t.all_to_all(x.send.data(), got.data(), count, DType::f64);
      EXPECT_TRUE(same_bits(got, flat));

      const TapaBytes b = tapa_uniform_bytes(P, L, count, sizeof(double), with_counts);
      // The fractions of the data volume V = P * count * 8 that the closed form claims.
      const u64 V = uz(P) * count * sizeof(double);
      EXPECT_EQ(b.phase1 * uz(L), uz(L - 1) * V);
      EXPECT_EQ(b.phase2 * uz(G), uz(G - 1) * V);
      EXPECT_EQ(t.intra_stats()[CommOp::send].bytes_sent, b.phase1);
      EXPECT_EQ(t.intra_stats()[CommOp::recv].bytes_recv, b.phase1);
      EXPECT_EQ(t.intra_stats()[CommOp::send].calls, uz(L - 1) * uz(G));  // one per block
      EXPECT_EQ(t.intra_stats()[CommOp::all_to_all].bytes_sent, b.count_exchange);
      EXPECT_EQ(t.intra_stats()[CommOp::all_to_all].bytes_recv, b.count_exchange);
      EXPECT_EQ(t.inter_stats()[CommOp::all_to_all].bytes_sent, b.phase2);
      EXPECT_EQ(t.inter_stats()[CommOp::all_to_all].bytes_recv, b.phase2);
      EXPECT_EQ(t.inter_stats().total().bytes_sent, b.phase2);
      expect_tapa_stats(t, uniform, sizeof(double), with_counts);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Overlap pattern: plans reused, two exchanges in phase 1 at once (V-First: V's phase 1 flies
// while K is produced), phase 2 in the same order on every rank.

TEST_F(Tapa, TwoExchangesInFlightWithReusedPlan) {
  const CountFn n = [](int s, int d) { return uz((s + 3 * d) % 5); };
  for (int L : divisors(P)) {
    SCOPED_TRACE("L = " + std::to_string(L));
    TapaAllToAll t(c, L);
    const Exchange<float> v(P, r, n);
    const Exchange<std::int32_t> k(P, r, n);
    std::vector<float> v_flat = v.fresh_recv();
    std::vector<std::int32_t> k_flat = k.fresh_recv();
    c.all_to_all_v<float>(v.send, v.sc, v_flat, v.rc);
    c.all_to_all_v<std::int32_t>(k.send, k.sc, k_flat, k.rc);

    const TapaPlan plan = t.plan(v.sc, v.rc);  // same counts for both: planned once
    for (int step = 0; step < 2; ++step) {
      std::vector<float> v_got = v.fresh_recv();
      std::vector<std::int32_t> k_got = k.fresh_recv();
      TapaPhase1 v1 = t.phase1_async(plan, v.send.data(), DType::f32);
      TapaPhase1 k1 = t.phase1_async(plan, k.send.data(), DType::i32);
      WorkPtr v2 = t.phase2_async(std::move(v1), v_got.data());
      t.phase2(std::move(k1), k_got.data());
      v2->wait();
      EXPECT_TRUE(same_bits(v_got, v_flat)) << "step " << step;
      EXPECT_TRUE(same_bits(k_got, k_flat)) << "step " << step;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Invalid use: every rank throws the same way before any traffic; the communicator still works.

TEST_F(Tapa, GroupSizeNotDividingPThrowsBeforeCommunicating) {
  std::vector<int> bad = {0, -1, P + 1, 2 * P};
  for (int L = 2; L < P; ++L)
    if (P % L != 0) bad.push_back(L);
  for (int L : bad) {
    SCOPED_TRACE("L = " + std::to_string(L));
    try {
      TapaAllToAll t(c, L);
      ADD_FAILURE() << "no exception";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("L = " + std::to_string(L)), std::string::npos) << msg;
      EXPECT_NE(msg.find("P = " + std::to_string(P)), std::string::npos) << msg;
    }
    EXPECT_THROW(tapa_uniform_bytes(P, L, 1, 4, true), Error);
  }
  expect_stats(c.stats(), {}, "no communication on the flat communicator");
  std::vector<std::int32_t> v{r + 1};
  c.all_reduce<std::int32_t>(v);
  EXPECT_EQ(v[0], P * (P + 1) / 2);
}

TEST_F(Tapa, BadCountsAndPlansThrowBeforeCommunicating) {
  TapaAllToAll t(c, P);  // L = P: at P = 1 also L = 1
  const Counts ok(uz(P), 1), more(uz(P) + 1, 1);
  std::vector<float> s(uz(P) + 1, 1.0f), d(uz(P) + 1, 0.0f);
  auto bad_plan = [&] { (void)t.plan(more, ok); };
  auto bad_send = [&] { t.all_to_all_v<float>(std::span(s).first(uz(P) + 1), ok, std::span(d).first(uz(P)), ok); };
  auto bad_recv = [&] { t.all_to_all_v<float>(std::span(s).first(uz(P)), ok, std::span(d).first(uz(P) - 1), ok); };
  EXPECT_THROW(bad_plan(), Error);
  EXPECT_THROW(bad_send(), Error);
  EXPECT_THROW(bad_recv(), Error);
  if (P > 1) {  // a plan made for another group size
    TapaAllToAll t1(c, 1);
    const TapaPlan other = t1.plan_uniform(1);
    EXPECT_THROW((void)t.phase1_async(other, s.data(), DType::f32), Error);
  }
  expect_stats(t.intra_stats(), {}, "intra");
  expect_stats(t.inter_stats(), {}, "inter");

  // A consumed phase-1 handle cannot run phase 2 twice (local check, same on every rank).
  const TapaPlan plan = t.plan_uniform(1);
  TapaPhase1 p1 = t.phase1_async(plan, s.data(), DType::f32);
  t.phase2(std::move(p1), d.data());
  EXPECT_THROW(t.phase2(std::move(p1), d.data()), Error);  // NOLINT(bugprone-use-after-move)
  for (int q = 0; q < P; ++q) EXPECT_EQ(d[uz(q)], 1.0f);
}

// ---------------------------------------------------------------------------------------------
// Node-local grouping: every test rank runs on this machine, so L = P and G = 1.

TEST_F(Tapa, NodeLocalGroupIsTheWholeJob) {
  TapaAllToAll t = TapaAllToAll::node_local(c);
  EXPECT_EQ(t.group_size(), P);
  EXPECT_EQ(t.num_groups(), 1);
  EXPECT_EQ(t.group(), 0);
  EXPECT_EQ(t.local_index(), r);
  EXPECT_EQ(t.intra().size(), P);
  EXPECT_EQ(t.inter().size(), 1);
  const CountFn n = [](int s, int d) { return uz((s + 3 * d) % 5); };
  const Exchange<double> x(P, r, n);
  std::vector<double> flat = x.fresh_recv(), got = x.fresh_recv();
  c.all_to_all_v<double>(x.send, x.sc, flat, x.rc);
  t.all_to_all_v<double>(x.send, x.sc, got, x.rc);
  EXPECT_TRUE(same_bits(got, flat));
  expect_tapa_stats(t, n, sizeof(double), true);
}

}  // namespace
}  // namespace diffcp
