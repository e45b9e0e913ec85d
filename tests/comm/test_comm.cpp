// Multi-rank tests of the Communicator interface on the MPI backend (run at 1, 2, 3, 4, 8 ranks).
//
// Covered, each against closed forms of rank-encoded payloads:
//   * every operation, blocking (typed wrappers) and async (*_async()->wait()): all_gather,
//     all_gather_v (uneven, with empty ranks), reduce_scatter / reduce_scatter_v (sum and max,
//     uneven with zeros), all_reduce (sum and max; in place and out of place), all_to_all,
//     all_to_all_v (uneven with zeros; all empty), broadcast from every root, send/recv (tagged
//     ring), barrier; several async operations in flight at once, Work::test() polling and a
//     handle destroyed without wait(). Data movement runs for f32, f64, i32, i64 and u8,
//     reductions for f32, f64, i32, i64.
//   * the byte counters, exactly, per operation kind, against the accounting rules of
//     communicator.hpp (all other kinds must stay zero, so the v-variants are seen to count
//     under their base kind); stats_json() / CommStats::to_json().
//   * split (reversed key order, opt-out with color < 0, separate counters) and split_node_local.
//   * invalid arguments throw diffcp::Error identically on every rank, before any collective.
//   * the seam for other backends: a partial backend (tests/support/forwarding_comm.hpp) fails naming
//     itself and the operation it lacks; the log-sum-exp merge without the fused reduction (max,
//     then sum of rescaled exponentials) equals the fused one and the fp64 value.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/cp/lse_reduce.hpp"
#include "error_of.hpp"
#include "forwarding_comm.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using u64 = std::uint64_t;
using Counts = std::vector<std::size_t>;

Communicator& world() { return test::world(); }
std::size_t uz(int v) { return static_cast<std::size_t>(v); }

// Element j (< 4) of the message from rank `from` to rank `to` (both < 8): distinct values that
// are exact in every dtype, u8 included.
template <typename T> T enc(int from, int to, std::size_t j) {
  return static_cast<T>((from << 5) | (to << 2) | static_cast<int>(j));
}
template <typename T> T sentinel() { return static_cast<T>(-1); }

Counts counts_of(int P, const std::function<int(int)>& f) {
  Counts c(uz(P));
  for (int q = 0; q < P; ++q) c[uz(q)] = uz(f(q));
  return c;
}
std::size_t total(const Counts& c) { return std::accumulate(c.begin(), c.end(), std::size_t{0}); }
Counts offsets(const Counts& c) {
  Counts o(c.size());
  std::exclusive_scan(c.begin(), c.end(), o.begin(), std::size_t{0});
  return o;
}
// The all_reduce share of rank p: n/P + (p < n%P).
std::size_t share(std::size_t n, int P, int p) { return n / uz(P) + (uz(p) < n % uz(P) ? 1 : 0); }

// The counters of `c` are exactly `expected` for the listed kinds and zero for every other kind;
// total() is their sum.
void expect_stats(const Communicator& c,
                  std::initializer_list<std::pair<CommOp, OpCounter>> expected,
                  std::source_location loc = std::source_location::current()) {
  ::testing::ScopedTrace trace(loc.file_name(), static_cast<int>(loc.line()),
                               "expect_stats on communicator " + c.name());
  std::array<OpCounter, kNumCommOps> want{};
  for (const auto& [op, k] : expected) want[static_cast<std::size_t>(op)] = k;
  OpCounter sum;
  for (std::size_t i = 0; i < kNumCommOps; ++i) {
    const CommOp op = static_cast<CommOp>(i);
    EXPECT_EQ(c.stats()[op].calls, want[i].calls) << comm_op_name(op);
    EXPECT_EQ(c.stats()[op].bytes_sent, want[i].bytes_sent) << comm_op_name(op);
    EXPECT_EQ(c.stats()[op].bytes_recv, want[i].bytes_recv) << comm_op_name(op);
    sum.calls += want[i].calls;
    sum.bytes_sent += want[i].bytes_sent;
    sum.bytes_recv += want[i].bytes_recv;
  }
  EXPECT_EQ(c.stats().total().calls, sum.calls);
  EXPECT_EQ(c.stats().total().bytes_sent, sum.bytes_sent);
  EXPECT_EQ(c.stats().total().bytes_recv, sum.bytes_recv);
}

// Every test starts with zeroed world counters.
class Comm : public ::testing::Test {
 protected:
  void SetUp() override { world().stats().reset(); }
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
};

template <typename T> class CommMove : public Comm {};
template <typename T> class CommReduce : public Comm {};
using MoveTypes = ::testing::Types<float, double, std::int32_t, std::int64_t, std::uint8_t>;
using ReduceTypes = ::testing::Types<float, double, std::int32_t, std::int64_t>;
TYPED_TEST_SUITE(CommMove, MoveTypes);
TYPED_TEST_SUITE(CommReduce, ReduceTypes);

// ---------------------------------------------------------------------------------------------
// Data movement

TYPED_TEST(CommMove, AllGather) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  constexpr std::size_t n = 3;
  std::vector<T> send(n);
  for (std::size_t j = 0; j < n; ++j) send[j] = enc<T>(r, 0, j);
  for (bool async : {false, true}) {
    std::vector<T> recv(n * uz(P), sentinel<T>());
    if (async)
      c.all_gather_async(send.data(), recv.data(), n, dtype_of<T>())->wait();
    else
      c.template all_gather<T>(send, recv);
    for (int q = 0; q < P; ++q)
      for (std::size_t j = 0; j < n; ++j)
        EXPECT_EQ(recv[uz(q) * n + j], enc<T>(q, 0, j)) << "async=" << async << " from " << q;
  }
  const u64 vol = 2 * n * uz(P - 1) * sizeof(T);  // two calls
  expect_stats(c, {{CommOp::all_gather, {2, vol, vol}}});
}

TYPED_TEST(CommMove, AllGatherV) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  const Counts counts = counts_of(P, [](int q) { return (2 * q + 1) % 3; });  // 1, 0, 2, 1, ...
  const Counts off = offsets(counts);
  const std::size_t mine = counts[uz(r)];
  std::vector<T> send(mine);
  for (std::size_t j = 0; j < mine; ++j) send[j] = enc<T>(r, 0, j);
  for (bool async : {false, true}) {
    std::vector<T> recv(total(counts), sentinel<T>());
    if (async)
      c.all_gather_v_async(send.data(), recv.data(), counts, dtype_of<T>())->wait();
    else
      c.template all_gather_v<T>(send, recv, counts);
    for (int q = 0; q < P; ++q)
      for (std::size_t j = 0; j < counts[uz(q)]; ++j)
        EXPECT_EQ(recv[off[uz(q)] + j], enc<T>(q, 0, j)) << "async=" << async << " from " << q;
  }
  // Counted under all_gather.
  expect_stats(c, {{CommOp::all_gather,
                    {2, 2 * mine * uz(P - 1) * sizeof(T), 2 * (total(counts) - mine) * sizeof(T)}}});
}

TYPED_TEST(CommMove, AllToAll) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  constexpr std::size_t n = 2;
  std::vector<T> send(n * uz(P));
  for (int d = 0; d < P; ++d)
    for (std::size_t j = 0; j < n; ++j) send[uz(d) * n + j] = enc<T>(r, d, j);
  for (bool async : {false, true}) {
    std::vector<T> recv(n * uz(P), sentinel<T>());
    if (async)
      c.all_to_all_async(send.data(), recv.data(), n, dtype_of<T>())->wait();
    else
      c.template all_to_all<T>(send, recv);
    for (int s = 0; s < P; ++s)
      for (std::size_t j = 0; j < n; ++j)
        EXPECT_EQ(recv[uz(s) * n + j], enc<T>(s, r, j)) << "async=" << async << " from " << s;
  }
  const u64 vol = 2 * n * uz(P - 1) * sizeof(T);
  expect_stats(c, {{CommOp::all_to_all, {2, vol, vol}}});
}

TYPED_TEST(CommMove, AllToAllV) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  // Number of elements rank `from` sends to rank `to`.
  const std::pair<const char*, std::function<int(int, int)>> patterns[] = {
      {"uneven", [](int from, int to) { return (from + 2 * to) % 3; }},
      {"empty", [](int, int) { return 0; }},
  };
  for (const auto& [what, count] : patterns) {
    SCOPED_TRACE(what);
    c.stats().reset();
    const Counts sc = counts_of(P, [&](int d) { return count(r, d); });
    const Counts rc = counts_of(P, [&](int s) { return count(s, r); });
    const Counts so = offsets(sc), ro = offsets(rc);
    std::vector<T> send(total(sc));
    for (int d = 0; d < P; ++d)
      for (std::size_t j = 0; j < sc[uz(d)]; ++j) send[so[uz(d)] + j] = enc<T>(r, d, j);
    for (bool async : {false, true}) {
      std::vector<T> recv(total(rc), sentinel<T>());
      if (async)
        c.all_to_all_v_async(send.data(), sc, recv.data(), rc, dtype_of<T>())->wait();
      else
        c.template all_to_all_v<T>(send, sc, recv, rc);
      for (int s = 0; s < P; ++s)
        for (std::size_t j = 0; j < rc[uz(s)]; ++j)
          EXPECT_EQ(recv[ro[uz(s)] + j], enc<T>(s, r, j)) << "async=" << async << " from " << s;
    }
    // Counted under all_to_all; the self block is excluded.
    const std::size_t self = uz(count(r, r));
    expect_stats(c, {{CommOp::all_to_all, {2, 2 * (total(sc) - self) * sizeof(T),
                                           2 * (total(rc) - self) * sizeof(T)}}});
  }
}

TYPED_TEST(CommMove, BroadcastFromEveryRoot) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  constexpr std::size_t n = 4;
  for (int root = 0; root < P; ++root) {
    SCOPED_TRACE("root " + std::to_string(root));
    c.stats().reset();
    for (bool async : {false, true}) {
      std::vector<T> buf(n, sentinel<T>());
      if (r == root)
        for (std::size_t j = 0; j < n; ++j) buf[j] = enc<T>(root, 0, j);
      if (async)
        c.broadcast_async(buf.data(), n, dtype_of<T>(), root)->wait();
      else
        c.template broadcast<T>(buf, root);
      for (std::size_t j = 0; j < n; ++j) EXPECT_EQ(buf[j], enc<T>(root, 0, j)) << "async=" << async;
    }
    const u64 sent = r == root ? 2 * n * uz(P - 1) * sizeof(T) : 0;
    const u64 recv = r == root ? 0 : 2 * n * sizeof(T);
    expect_stats(c, {{CommOp::broadcast, {2, sent, recv}}});
  }
}

// Ring exchange: two tagged messages (3 and 2 elements) to the next rank, from the previous one.
// Async: receives posted first, in reverse tag order. Blocking (P >= 2 only; a blocking self-send
// could deadlock): even ranks send first, odd ranks receive first.
TYPED_TEST(CommMove, SendRecvRing) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  constexpr int tag_a = 7, tag_b = 8;
  std::vector<T> a(3), b(2);
  for (std::size_t j = 0; j < a.size(); ++j) a[j] = enc<T>(r, next, j);
  for (std::size_t j = 0; j < b.size(); ++j) b[j] = enc<T>(r, next, 3 - j);
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "blocking");
    c.stats().reset();
    std::vector<T> ra(a.size(), sentinel<T>()), rb(b.size(), sentinel<T>());
    const bool active = async || P >= 2;
    if (async) {
      auto wb = c.recv_async(rb.data(), rb.size(), dtype_of<T>(), prev, tag_b);
      auto wa = c.recv_async(ra.data(), ra.size(), dtype_of<T>(), prev, tag_a);
      auto sa = c.send_async(a.data(), a.size(), dtype_of<T>(), next, tag_a);
      auto sb = c.send_async(b.data(), b.size(), dtype_of<T>(), next, tag_b);
      for (auto* w : {&sa, &sb, &wa, &wb}) (*w)->wait();
    } else if (active) {
      auto sends = [&] { c.template send<T>(a, next, tag_a); c.template send<T>(b, next, tag_b); };
      auto recvs = [&] { c.template recv<T>(ra, prev, tag_a); c.template recv<T>(rb, prev, tag_b); };
      if (r % 2 == 0) { sends(); recvs(); } else { recvs(); sends(); }
    }
    if (active) {
      for (std::size_t j = 0; j < ra.size(); ++j) EXPECT_EQ(ra[j], enc<T>(prev, r, j));
      for (std::size_t j = 0; j < rb.size(); ++j) EXPECT_EQ(rb[j], enc<T>(prev, r, 3 - j));
    }
    // A self-send (P = 1) is counted: it is an explicit message.
    const u64 calls = active ? 2 : 0, vol = active ? (a.size() + b.size()) * sizeof(T) : 0;
    expect_stats(c, {{CommOp::send, {calls, vol, 0}}, {CommOp::recv, {calls, 0, vol}}});
  }
}

// ---------------------------------------------------------------------------------------------
// Reductions. Sum inputs are (r+1) * x, so the sum over ranks is P(P+1)/2 * x. Max inputs are
// built so that the maximum is attained on one rank with a known value.

TYPED_TEST(CommReduce, ReduceScatterAndV) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  const long long tri = static_cast<long long>(P) * (P + 1) / 2;
  // Element j of block b (the block rank b receives), contributed by rank q.
  auto input = [&](ReduceOp op, int q, int b, std::size_t j) {
    const long long jj = static_cast<long long>(j);
    return op == ReduceOp::sum ? static_cast<T>((q + 1) * (10 * b + jj + 1))
                               : static_cast<T>(5 * jj - (q - b) * (q - b));  // max at q == b
  };
  auto expected = [&](ReduceOp op, std::size_t j) {
    const long long jj = static_cast<long long>(j);
    return op == ReduceOp::sum ? static_cast<T>(tri * (10 * r + jj + 1)) : static_cast<T>(5 * jj);
  };
  const std::pair<const char*, Counts> variants[] = {
      {"reduce_scatter", Counts(uz(P), 3)},
      {"reduce_scatter_v", counts_of(P, [](int q) { return (q + 2) % 3; })},  // 2, 0, 1, 2, ...
  };
  for (const auto& [what, counts] : variants) {
    SCOPED_TRACE(what);
    const bool uniform = std::string(what) == "reduce_scatter";
    c.stats().reset();
    const Counts off = offsets(counts);
    const std::size_t mine = counts[uz(r)];
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      std::vector<T> send(total(counts));
      for (int b = 0; b < P; ++b)
        for (std::size_t j = 0; j < counts[uz(b)]; ++j) send[off[uz(b)] + j] = input(op, r, b, j);
      for (bool async : {false, true}) {
        std::vector<T> recv(mine, sentinel<T>());
        if (async && uniform)
          c.reduce_scatter_async(send.data(), recv.data(), mine, dtype_of<T>(), op)->wait();
        else if (async)
          c.reduce_scatter_v_async(send.data(), recv.data(), counts, dtype_of<T>(), op)->wait();
        else if (uniform)
          c.template reduce_scatter<T>(send, recv, op);
        else
          c.template reduce_scatter_v<T>(send, recv, counts, op);
        for (std::size_t j = 0; j < mine; ++j)
          EXPECT_EQ(recv[j], expected(op, j)) << "op=" << (op == ReduceOp::sum ? "sum" : "max")
                                              << " async=" << async << " j=" << j;
      }
    }
    // Four calls (sum/max x blocking/async), all under reduce_scatter.
    expect_stats(c, {{CommOp::reduce_scatter, {4, 4 * (total(counts) - mine) * sizeof(T),
                                               4 * mine * uz(P - 1) * sizeof(T)}}});
  }
}

// n = 7 and 11 are not divisible by P > 1; at P = 8, n = 7 gives rank 7 a zero share.
TYPED_TEST(CommReduce, AllReduce) {
  using T = TypeParam;
  auto& c = this->c;
  const int P = this->P, r = this->r;
  const long long tri = static_cast<long long>(P) * (P + 1) / 2;
  auto input = [&](ReduceOp op, std::size_t j) {
    const long long jj = static_cast<long long>(j);
    // 7 is coprime to every tested P, so (7r + j) % P takes the value P-1 on some rank.
    return op == ReduceOp::sum ? static_cast<T>((r + 1) * (jj + 1))
                               : static_cast<T>(10 * ((7 * r + jj) % P) + jj);
  };
  auto expected = [&](ReduceOp op, std::size_t j) {
    const long long jj = static_cast<long long>(j);
    return op == ReduceOp::sum ? static_cast<T>(tri * (jj + 1)) : static_cast<T>(10 * (P - 1) + jj);
  };
  enum Mode { typed_in_place, async_in_place, async_out_of_place };
  for (std::size_t n : {std::size_t{7}, std::size_t{11}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    c.stats().reset();
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      for (Mode mode : {typed_in_place, async_in_place, async_out_of_place}) {
        std::vector<T> send(n), recv(n, sentinel<T>());
        for (std::size_t j = 0; j < n; ++j) send[j] = input(op, j);
        if (mode == typed_in_place) {
          recv = send;
          c.template all_reduce<T>(recv, op);
        } else if (mode == async_in_place) {
          recv = send;
          c.all_reduce_async(recv.data(), recv.data(), n, dtype_of<T>(), op)->wait();
        } else {
          c.all_reduce_async(send.data(), recv.data(), n, dtype_of<T>(), op)->wait();
          for (std::size_t j = 0; j < n; ++j) EXPECT_EQ(send[j], input(op, j)) << "send modified";
        }
        for (std::size_t j = 0; j < n; ++j)
          EXPECT_EQ(recv[j], expected(op, j))
              << "op=" << (op == ReduceOp::sum ? "sum" : "max") << " mode=" << mode << " j=" << j;
      }
    }
    // Six calls; each moves 2 * (n - share_r) elements each way.
    const u64 vol = 6 * 2 * (n - share(n, P, r)) * sizeof(T);
    expect_stats(c, {{CommOp::all_reduce, {6, vol, vol}}});
  }
}

// ---------------------------------------------------------------------------------------------
// Async behaviour, barrier, statistics

TEST_F(Comm, SeveralAsyncOperationsInFlight) {
  constexpr std::size_t n = 5;
  std::vector<std::int64_t> gsend(2, r), grecv(2 * uz(P), -1);
  std::vector<double> asend(n), arecv(n, -1.0);
  for (std::size_t j = 0; j < n; ++j) asend[j] = (r + 1) * static_cast<double>(j);
  auto gather = c.all_gather_async(gsend.data(), grecv.data(), 2, DType::i64);
  auto reduce = c.all_reduce_async(asend.data(), arecv.data(), n, DType::f64, ReduceOp::sum);
  // Complete the later one first, by polling test().
  while (!reduce->test()) {}
  reduce->wait();  // waiting on a completed handle is a no-op
  gather->wait();
  for (int q = 0; q < P; ++q) {
    EXPECT_EQ(grecv[2 * uz(q)], q);
    EXPECT_EQ(grecv[2 * uz(q) + 1], q);
  }
  const double tri = P * (P + 1) / 2.0;
  for (std::size_t j = 0; j < n; ++j) EXPECT_EQ(arecv[j], tri * static_cast<double>(j));

  // A handle destroyed without wait() completes the operation.
  std::vector<std::int32_t> buf(3, r == 0 ? 42 : -1);
  { auto dropped = c.broadcast_async(buf.data(), buf.size(), DType::i32, 0); }
  EXPECT_EQ(buf, std::vector<std::int32_t>(3, 42));

  const u64 g = 2 * uz(P - 1) * 8, a = 2 * (n - share(n, P, r)) * 8;
  const u64 bsent = r == 0 ? 3 * uz(P - 1) * 4 : 0, brecv = r == 0 ? 0 : 3 * 4;
  expect_stats(c, {{CommOp::all_gather, {1, g, g}},
                   {CommOp::all_reduce, {1, a, a}},
                   {CommOp::broadcast, {1, bsent, brecv}}});
}

// Reduce-scatters in flight at once (the backend's point-to-point messages of two operations must
// not mix), completed in reverse order, next to user point-to-point traffic on the same ring.
TEST_F(Comm, OverlappingReduceScattersAndUserMessages) {
  constexpr std::size_t n = 7;
  std::vector<float> s1(n * uz(P)), s2(n * uz(P)), r1(n, -1.f), r2(n, -1.f);
  for (std::size_t j = 0; j < s1.size(); ++j) {
    s1[j] = static_cast<float>(r + 1) * static_cast<float>(j);
    s2[j] = -static_cast<float>(r) - static_cast<float>(j);
  }
  std::vector<std::int32_t> token{r}, got{-1};
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  auto a = c.reduce_scatter_async(s1.data(), r1.data(), n, DType::f32, ReduceOp::sum);
  auto rx = c.recv_async(got.data(), 1, DType::i32, prev, 5);
  auto b = c.reduce_scatter_async(s2.data(), r2.data(), n, DType::f32, ReduceOp::max);
  auto tx = c.send_async(token.data(), 1, DType::i32, next, 5);
  b->wait();
  a->wait();
  tx->wait();
  rx->wait();
  EXPECT_EQ(got[0], prev);
  const float tri = static_cast<float>(P * (P + 1) / 2);
  for (std::size_t j = 0; j < n; ++j) {
    const float idx = static_cast<float>(uz(r) * n + j);
    EXPECT_EQ(r1[j], tri * idx);
    EXPECT_EQ(r2[j], -idx);  // max over ranks q of -q - idx
  }
}

TEST_F(Comm, BarrierCountsCallsOnly) {
  c.barrier();
  c.barrier_async()->wait();
  expect_stats(c, {{CommOp::barrier, {2, 0, 0}}});
}

TEST_F(Comm, StatsJson) {
  // A known mix of operations; then the JSON must hold exactly the counters' closed forms.
  std::vector<double> x(7, 1.0);
  c.all_reduce<double>(x);
  std::vector<std::int32_t> b(5, 3);
  c.broadcast<std::int32_t>(b, 0);
  c.barrier();
  const Counts counts = counts_of(P, [](int q) { return (2 * q + 1) % 3; });
  const std::size_t mine = counts[uz(r)];
  std::vector<std::uint8_t> gs(mine, 1), gr(total(counts));
  c.all_gather_v<std::uint8_t>(gs, gr, counts);
  EXPECT_EQ(x, std::vector<double>(7, static_cast<double>(P)));

  std::array<OpCounter, kNumCommOps> want{};
  const u64 ar = 2 * (7 - share(7, P, r)) * 8;
  want[static_cast<std::size_t>(CommOp::all_reduce)] = {1, ar, ar};
  want[static_cast<std::size_t>(CommOp::broadcast)] =
      r == 0 ? OpCounter{1, 5 * uz(P - 1) * 4, 0} : OpCounter{1, 0, 5 * 4};
  want[static_cast<std::size_t>(CommOp::barrier)] = {1, 0, 0};
  want[static_cast<std::size_t>(CommOp::all_gather)] = {1, mine * uz(P - 1), total(counts) - mine};
  OpCounter tot;
  for (const OpCounter& k : want) {
    tot.calls += k.calls;
    tot.bytes_sent += k.bytes_sent;
    tot.bytes_recv += k.bytes_recv;
  }

  const nlohmann::json j = c.stats_json();
  EXPECT_EQ(j.at("name"), "world");
  EXPECT_EQ(j.at("backend"), "mpi");
  EXPECT_EQ(j.at("rank").get<int>(), r);
  EXPECT_EQ(j.at("size").get<int>(), P);
  const nlohmann::json& ops = j.at("ops");
  EXPECT_EQ(ops, c.stats().to_json());
  EXPECT_EQ(ops.size(), kNumCommOps + 1);  // every kind, plus "total"
  auto expect_entry = [&](const std::string& key, const OpCounter& k) {
    SCOPED_TRACE(key);
    ASSERT_TRUE(ops.contains(key));
    EXPECT_EQ(ops[key].size(), 4u);
    EXPECT_EQ(ops[key].at("bytes_sent_inter").get<u64>(), 0u);  // no topology: nothing is "inter-node"
    EXPECT_EQ(ops[key].at("calls").get<u64>(), k.calls);
    EXPECT_EQ(ops[key].at("bytes_sent").get<u64>(), k.bytes_sent);
    EXPECT_EQ(ops[key].at("bytes_recv").get<u64>(), k.bytes_recv);
  };
  for (std::size_t i = 0; i < kNumCommOps; ++i)
    expect_entry(comm_op_name(static_cast<CommOp>(i)), want[i]);
  expect_entry("total", tot);
}

// ---------------------------------------------------------------------------------------------
// Sub-communicators

// color = r % 2, key = -r: each parity class, ordered by decreasing world rank.
TEST_F(Comm, SplitByParityReversed) {
  const int color = r % 2;
  auto sub = c.split(color, -r, "parity");
  ASSERT_NE(sub, nullptr);
  const int m = (P + 1 - color) / 2;  // members: color, color + 2, ... < P
  EXPECT_EQ(sub->size(), m);
  EXPECT_EQ(sub->rank(), m - 1 - r / 2);
  EXPECT_EQ(sub->name(), "parity");
  EXPECT_EQ(sub->backend(), "mpi");

  // Sub-rank i is world rank color + 2 (m - 1 - i).
  std::vector<std::int32_t> me{r}, all(uz(sub->size()), -1);
  sub->all_gather<std::int32_t>(me, all);
  for (int i = 0; i < sub->size(); ++i) EXPECT_EQ(all[uz(i)], color + 2 * (m - 1 - i)) << i;

  // Sum of (world rank + 1) over the members = sum_i (2i + color + 1) = m (m + color).
  constexpr std::size_t n = 3;
  std::vector<std::int64_t> v(n, r + 1);
  sub->all_reduce<std::int64_t>(v);
  EXPECT_EQ(v, std::vector<std::int64_t>(n, static_cast<std::int64_t>(m) * (m + color)));

  const u64 g = uz(m - 1) * 4, a = 2 * (n - share(n, m, sub->rank())) * 8;
  expect_stats(*sub, {{CommOp::all_gather, {1, g, g}}, {CommOp::all_reduce, {1, a, a}}});
  expect_stats(c, {});  // split and the sub's traffic leave the parent's counters alone
}

// The last world rank opts out (color -1) and gets nullptr; the others form one group.
TEST_F(Comm, SplitOptOut) {
  const bool out = r == P - 1;
  auto sub = c.split(out ? -1 : 0, r, "all_but_last");
  EXPECT_EQ(sub == nullptr, out);
  if (sub) {
    EXPECT_EQ(sub->size(), P - 1);
    EXPECT_EQ(sub->rank(), r);
    std::vector<double> v{static_cast<double>(r + 1)};
    sub->all_reduce<double>(v);
    EXPECT_EQ(v[0], (P - 1) * P / 2.0);
  }
  c.barrier();  // the world is still in lockstep
  expect_stats(c, {{CommOp::barrier, {1, 0, 0}}});
}

// All ranks of a test run share one machine.
TEST_F(Comm, SplitNodeLocal) {
  auto node = c.split_node_local("node");
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->size(), P);
  EXPECT_EQ(node->rank(), r);
  EXPECT_EQ(node->name(), "node");
  std::vector<std::int32_t> me{r}, all(uz(node->size()), -1);
  node->all_gather<std::int32_t>(me, all);
  for (int q = 0; q < node->size(); ++q) EXPECT_EQ(all[uz(q)], q);
  const u64 g = uz(node->size() - 1) * 4;
  expect_stats(*node, {{CommOp::all_gather, {1, g, g}}});
  expect_stats(c, {});
}

// ---------------------------------------------------------------------------------------------
// Invalid arguments: every rank throws the same way before any traffic (so nobody hangs and no
// counter moves); afterwards the communicator still works.

TEST_F(Comm, BadArgumentsThrowBeforeAnyCollective) {
  std::vector<double> s(4 * uz(P) + 8, 1.0), d(4 * uz(P) + 8, 0.0);
  const Counts more(uz(P) + 1, 1), fewer(uz(P) - 1, 1), ok(uz(P), 1);
  const DType f64 = DType::f64;
  const std::pair<const char*, std::function<void()>> bad[] = {
      {"all_gather_v counts P+1", [&] { c.all_gather_v_async(s.data(), d.data(), more, f64); }},
      {"all_gather_v counts P-1", [&] { c.all_gather_v_async(s.data(), d.data(), fewer, f64); }},
      {"reduce_scatter_v counts P+1",
       [&] { c.reduce_scatter_v_async(s.data(), d.data(), more, f64, ReduceOp::sum); }},
      {"reduce_scatter_v counts P-1",
       [&] { c.reduce_scatter_v_async(s.data(), d.data(), fewer, f64, ReduceOp::max); }},
      {"all_to_all_v send_counts P+1",
       [&] { c.all_to_all_v_async(s.data(), more, d.data(), ok, f64); }},
      {"all_to_all_v recv_counts P-1",
       [&] { c.all_to_all_v_async(s.data(), ok, d.data(), fewer, f64); }},
      {"typed all_gather_v counts P+1",
       [&] { c.all_gather_v<double>(std::span(s).first(1), d, more); }},
      {"typed all_gather_v send != counts[rank]",
       [&] { c.all_gather_v<double>(std::span(s).first(2), d, ok); }},
      {"send dst = P", [&] { c.send_async(s.data(), 1, f64, P, 0); }},
      {"send dst = -1", [&] { c.send_async(s.data(), 1, f64, -1, 0); }},
      {"recv src = P", [&] { c.recv_async(d.data(), 1, f64, P, 0); }},
      {"recv src = -1", [&] { c.recv_async(d.data(), 1, f64, -1, 0); }},
      {"send tag -1", [&] { c.send_async(s.data(), 1, f64, r, -1); }},
      {"recv tag -1", [&] { c.recv_async(d.data(), 1, f64, r, -1); }},
      {"send tag above the user range", [&] { c.send_async(s.data(), 1, f64, r, Communicator::kMaxUserTag + 1); }},
      {"recv tag above the user range", [&] { c.recv_async(d.data(), 1, f64, r, Communicator::kMaxUserTag + 1); }},
      {"broadcast root = P", [&] { c.broadcast_async(d.data(), 1, f64, P); }},
      {"broadcast root = -1", [&] { c.broadcast_async(d.data(), 1, f64, -1); }},
      {"typed broadcast root = P", [&] { c.broadcast<double>(d, P); }},
      {"typed all_gather recv != size() * send",
       [&] { c.all_gather<double>(std::span(s).first(2), std::span(d).first(2 * uz(P) + 1)); }},
      {"typed all_to_all send != recv size",
       [&] { c.all_to_all<double>(std::span(s).first(uz(P)), std::span(d).first(2 * uz(P))); }},
      // Typed v-variants check buffer sizes against the counts (ok: one element per rank).
      {"typed all_gather_v recv != sum(counts)",
       [&] { c.all_gather_v<double>(std::span(s).first(1), std::span(d).first(uz(P) + 1), ok); }},
      {"typed reduce_scatter_v send != sum(counts)",
       [&] { c.reduce_scatter_v<double>(std::span(s).first(uz(P) + 1), std::span(d).first(1), ok); }},
      {"typed reduce_scatter_v recv != counts[rank]",
       [&] { c.reduce_scatter_v<double>(std::span(s).first(uz(P)), std::span(d).first(2), ok); }},
      {"typed all_to_all_v send != sum(send_counts)",
       [&] { c.all_to_all_v<double>(std::span(s).first(uz(P) + 1), ok, std::span(d).first(uz(P)), ok); }},
      {"typed all_to_all_v recv != sum(recv_counts)",
       [&] { c.all_to_all_v<double>(std::span(s).first(uz(P)), ok, std::span(d).first(uz(P) - 1), ok); }},
      // Rejected by the backend itself (after the interface's checks): still not counted.
      {"mpi: reduction on u16",
       [&] {
         std::vector<std::uint16_t> h(1);
         c.all_reduce<std::uint16_t>(h);
       }},
      {"typed all_to_all size not divisible by size()",  // P = 1: an empty recv instead
       [&] {
         const std::size_t k = P > 1 ? uz(P) + 1 : 1;
         c.all_to_all<double>(std::span(s).first(k), std::span(d).first(P > 1 ? k : 0));
       }},
  };
  for (const auto& [what, f] : bad) {
    SCOPED_TRACE(what);
    EXPECT_THROW(f(), Error);
  }
  expect_stats(c, {});

  // Still in lockstep: a real collective gives the right answer.
  std::vector<std::int32_t> v{r + 1};
  c.all_reduce<std::int32_t>(v);
  EXPECT_EQ(v[0], P * (P + 1) / 2);
}

// ---- the seam for other backends ----

// A backend that implements only some hooks fails on the first operation it lacks with a message
// naming itself and the operation (the same on every rank, so no rank is left in a collective),
// and refuses a reduction it does not have before anything is issued.
TEST_F(Comm, PartialBackendFailsNamingItselfAndTheOperation) {
  test::ForwardingComm toy(c);
  std::vector<float> s(uz(P), 1.f), d(uz(P));
  const Counts one(uz(P), 1);
  EXPECT_NE(error_of([&] { toy.all_to_all_v<float>(s, one, d, one); })
                .find("communicator backend 'toy' does not implement all_to_all_v"),
            std::string::npos);
  EXPECT_NE(error_of([&] { toy.all_to_all<float>(s, d); }).find("backend 'toy' does not implement all_to_all"),
            std::string::npos);
  EXPECT_NE(error_of([&] { toy.broadcast<float>(std::span(s).first(1), 0); })
                .find("backend 'toy' does not implement broadcast"),
            std::string::npos);
  EXPECT_NE(error_of([&] { toy.barrier(); }).find("backend 'toy' does not implement barrier"), std::string::npos);
  EXPECT_NE(error_of([&] { toy.all_reduce<float>(std::span(s).first(1), ReduceOp::logsumexp); })
                .find("communicator backend 'toy' does not support logsumexp on f32 (use all_reduce_lse"),
            std::string::npos);
  expect_stats(toy, {});
  expect_stats(c, {});
  // What it has works (and counts on both communicators).
  std::vector<float> v{static_cast<float>(r + 1)};
  toy.all_reduce<float>(v, ReduceOp::max);
  EXPECT_EQ(v[0], static_cast<float>(P));
  EXPECT_EQ(toy.stats()[CommOp::all_reduce].calls, 1u);
}

// lse rows of every kind: spread values, a large magnitude (exp would overflow f32 without the
// max), rows some ranks never saw (-inf) and rows no rank saw. The fused reduction (MPI), the
// max + sum fallback asked for explicitly and the fallback a backend without the fused operator
// runs all equal the fp64 value to f32 rounding; the two fallbacks are bitwise equal.
TEST_F(Comm, LseMergeFallbackEqualsFusedAndFp64) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int n = 61;
  std::vector<std::vector<float>> all(uz(P), std::vector<float>(n));
  for (int p = 0; p < P; ++p) {
    std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(p));
    std::uniform_real_distribution<float> u(-30.f, 30.f);
    for (int i = 0; i < n; ++i) {
      float v = u(rng);
      if (i % 9 == 4) v += 100.f;                    // exp(130) overflows f32
      if (i % 5 == 0 && (p + i) % 3 == 0) v = kNegInf;  // this rank saw no key of row i
      if (i % 7 == 3) v = kNegInf;                   // no rank did
      all[uz(p)][uz(i)] = v;
    }
  }
  std::vector<double> want(n);
  for (int i = 0; i < n; ++i) {
    double m = -std::numeric_limits<double>::infinity();
    for (int p = 0; p < P; ++p) m = std::max(m, static_cast<double>(all[uz(p)][uz(i)]));
    double sum = 0;
    for (int p = 0; p < P; ++p) sum += m == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(all[uz(p)][uz(i)] - m);
    want[uz(i)] = m == -std::numeric_limits<double>::infinity() ? m : m + std::log(sum);
  }
  test::ForwardingComm toy(c);
  EXPECT_EQ(lse_all_reduces(c), 1);
  EXPECT_EQ(lse_all_reduces(c, LseReduce::fallback), 2);
  EXPECT_EQ(lse_all_reduces(toy), 2);
  auto fused = all[uz(r)], fallback = all[uz(r)], partial = all[uz(r)];
  all_reduce_lse(c, fused);
  all_reduce_lse(c, fallback, CollAlgo::flat, LseReduce::fallback);
  all_reduce_lse(toy, partial);
  EXPECT_EQ(c.stats()[CommOp::all_reduce].calls, 5u);  // fused 1, fallback 2, the toy's 2 forwarded
  EXPECT_EQ(toy.stats()[CommOp::all_reduce].calls, 2u);
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE("row " + std::to_string(i));
    const double w = want[uz(i)];
    if (std::isinf(w)) {
      EXPECT_EQ(fused[uz(i)], kNegInf);
      EXPECT_EQ(fallback[uz(i)], kNegInf);
    } else {
      const double tol = 2e-6 * std::max(1.0, std::abs(w));
      EXPECT_NEAR(fused[uz(i)], w, tol);
      EXPECT_NEAR(fallback[uz(i)], w, tol);
    }
    EXPECT_EQ(partial[uz(i)], fallback[uz(i)]);
  }
}

}  // namespace
// The node-local rank a device backend picks its GPU by (comm/mpi_runtime.hpp): every rank of this
// one-machine job shares the node, in world-rank order.
TEST(NodeLocal, EveryRankOfThisMachineInWorldOrder) {
  Communicator& world = test::world();
  const NodeLocal here = node_local();
  EXPECT_EQ(here.size, world.size());
  EXPECT_EQ(here.rank, world.rank());
  find_node_local(MPI_COMM_WORLD);  // a second call changes nothing (and is not collective)
  EXPECT_EQ(node_local().rank, here.rank);
}

}  // namespace diffcp
