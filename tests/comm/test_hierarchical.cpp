// Topology and the hierarchical collectives of Communicator (comm/hierarchical.cpp), at 1, 2, 3,
// 4 and 8 ranks, for several node groupings of the ranks (even, uneven, one rank alone,
// interleaved in rank order, one rank per node):
//   * results equal the flat collectives': all_gather_v bitwise; reduce_scatter_v and all_reduce
//     on integer-valued data bitwise (the sums are exact in any order), logsumexp to rounding;
//   * Work::test() alone drives a hierarchical operation to completion;
//   * the byte counters, summed over ranks, equal the closed forms of comm/communicator.hpp, for
//     bytes sent and bytes sent to other nodes, hierarchical and flat;
//   * bad use throws diffcp::Error (no topology; a reduction other than sum; another collective
//     while a hierarchical one is in flight).
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/half.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using u64 = std::uint64_t;
using Counts = std::vector<std::size_t>;
std::size_t uz(int v) { return static_cast<std::size_t>(v); }

// Sums a counter over the ranks.
u64 summed(u64 v) {
  std::vector<u64> s{v};
  test::world().all_reduce<u64>(s);
  return s[0];
}

struct Grouping {
  const char* name;
  std::function<int(int r, int P)> node;  // node label of rank r
};
void PrintTo(const Grouping& g, std::ostream* os) { *os << g.name; }

class Hier : public ::testing::TestWithParam<Grouping> {
 protected:
  void SetUp() override {
    comm = test::world().split(0, test::world().rank(), "hier");
    P = comm->size(), r = comm->rank();
    comm->set_topology(GetParam().node(r, P));
    const Topology& t = comm->topology();
    N = t.nodes();
    useful = N > 1 && N < P;
  }
  std::unique_ptr<Communicator> comm;
  int P = 0, r = 0, N = 0;
  bool useful = false;
};

// Uneven counts with zeros.
Counts block_counts(int P) {
  Counts c(uz(P));
  for (int q = 0; q < P; ++q) c[uz(q)] = uz((q * 3 + 1) % 5);
  return c;
}

TEST_P(Hier, TopologyDescribesTheGrouping) {
  const Topology& t = comm->topology();
  int members = 0;
  for (int n = 0; n < t.nodes(); ++n) {
    members += t.node_size(n);
    for (int k = 0; k < t.node_size(n); ++k) {
      const int q = t.members[uz(n)][uz(k)];
      EXPECT_EQ(t.node_of[uz(q)], n);
      EXPECT_EQ(t.local_of[uz(q)], k);
      EXPECT_EQ(GetParam().node(q, P), GetParam().node(t.members[uz(n)][0], P));
    }
  }
  EXPECT_EQ(members, P);
}

TEST_P(Hier, AllGatherVEqualsFlatBitwiseAndCountsClosedForm) {
  const Counts c = block_counts(P);
  const std::size_t total = std::accumulate(c.begin(), c.end(), std::size_t{0});
  for (CollAlgo algo : {CollAlgo::hierarchical, CollAlgo::flat}) {
    SCOPED_TRACE(coll_algo_name(algo));
    std::vector<double> send(c[uz(r)]), got(total, -1.0);
    for (std::size_t j = 0; j < send.size(); ++j) send[j] = r * 1000.0 + static_cast<double>(j) + 0.25;
    comm->stats().reset();
    WorkPtr w = comm->all_gather_v_async(send.data(), got.data(), c, DType::f64, algo);
    while (!w->test()) {}  // test() alone must finish it
    std::size_t off = 0;
    for (int q = 0; q < P; ++q)
      for (std::size_t j = 0; j < c[uz(q)]; ++j) ASSERT_EQ(got[off++], q * 1000.0 + static_cast<double>(j) + 0.25) << q;
    const OpCounter k = comm->stats()[CommOp::all_gather];
    EXPECT_EQ(k.calls, 1u);
    const Topology& t = comm->topology();
    u64 flat_inter = 0;
    for (int q = 0; q < P; ++q) flat_inter += c[uz(q)] * uz(P - t.node_size(t.node_of[uz(q)]));
    EXPECT_EQ(summed(k.bytes_sent), total * uz(P - 1) * 8);  // equal for both algorithms
    const bool hier = algo == CollAlgo::hierarchical && useful;
    EXPECT_EQ(summed(k.bytes_sent_inter), (hier ? total * uz(N - 1) : flat_inter) * 8);
    EXPECT_EQ(summed(k.bytes_recv), summed(k.bytes_sent));
  }
}

template <typename T> void reduce_scatter_case(Communicator& comm, int P, int r, int N, bool useful) {
  const Counts c = block_counts(P);
  const std::size_t total = std::accumulate(c.begin(), c.end(), std::size_t{0});
  std::vector<T> send(total);
  for (std::size_t i = 0; i < total; ++i) send[i] = static_cast<T>((r + 1) * 3 + static_cast<int>(i % 7));
  std::vector<T> flat(c[uz(r)]), hier(c[uz(r)]);
  comm.stats().reset();
  comm.reduce_scatter_v_async(send.data(), hier.data(), c, dtype_of<T>(), ReduceOp::sum, CollAlgo::hierarchical)->wait();
  const OpCounter k = comm.stats()[CommOp::reduce_scatter];
  comm.reduce_scatter_v_async(send.data(), flat.data(), c, dtype_of<T>(), ReduceOp::sum, CollAlgo::flat)->wait();
  std::size_t off = 0;
  for (int q = 0; q < r; ++q) off += c[uz(q)];
  for (std::size_t j = 0; j < flat.size(); ++j) {
    T want = 0;
    for (int s = 0; s < P; ++s) want += static_cast<T>((s + 1) * 3 + static_cast<int>((off + j) % 7));
    ASSERT_EQ(hier[j], want) << j;  // integer-valued: exact in any order
    ASSERT_EQ(flat[j], want) << j;
  }
  const Topology& t = comm.topology();
  u64 flat_inter = 0;
  for (int q = 0; q < P; ++q) flat_inter += c[uz(q)] * uz(P - t.node_size(t.node_of[uz(q)]));
  EXPECT_EQ(summed(k.bytes_sent), total * uz(P - 1) * sizeof(T));
  EXPECT_EQ(summed(k.bytes_sent_inter), (useful ? total * uz(N - 1) : flat_inter) * sizeof(T));
  EXPECT_EQ(summed(k.bytes_recv), summed(k.bytes_sent));
}

TEST_P(Hier, ReduceScatterVSumsExactlyAndCountsClosedForm) {
  reduce_scatter_case<float>(*comm, P, r, N, useful);
  reduce_scatter_case<double>(*comm, P, r, N, useful);
}

// bf16 payloads (what Split-KV's bf16 mode reduce-scatters): integer values whose sums stay below
// 256 are exact in bf16, so flat and hierarchical sums are exact; bytes are 2 per element. Each
// pairwise step adds in f32 and rounds (the MPI user op, the hierarchical node sums).
TEST_P(Hier, ReduceScatterVSumsBf16AndCountsTwoBytes) {
  const Counts c = block_counts(P);
  const std::size_t total = std::accumulate(c.begin(), c.end(), std::size_t{0});
  auto value = [](int rank, std::size_t i) { return static_cast<float>((rank + 1) * 3 + static_cast<int>(i % 7)); };
  std::vector<std::uint16_t> send(total);
  for (std::size_t i = 0; i < total; ++i) send[i] = f32_to_bf16(value(r, i));
  std::size_t off = 0;
  for (int q = 0; q < r; ++q) off += c[uz(q)];
  for (CollAlgo algo : {CollAlgo::hierarchical, CollAlgo::flat}) {
    SCOPED_TRACE(coll_algo_name(algo));
    std::vector<std::uint16_t> got(c[uz(r)]);
    comm->stats().reset();
    comm->reduce_scatter_v_async(send.data(), got.data(), c, DType::bf16, ReduceOp::sum, algo)->wait();
    for (std::size_t j = 0; j < got.size(); ++j) {
      float want = 0;
      for (int s = 0; s < P; ++s) want += value(s, off + j);
      ASSERT_EQ(bf16_to_f32(got[j]), want) << j;
    }
    EXPECT_EQ(summed(comm->stats()[CommOp::reduce_scatter].bytes_sent), total * uz(P - 1) * 2);
  }
}

TEST_P(Hier, AllReduceSumMaxLogsumexp) {
  const std::size_t n = 11;
  std::vector<double> v(n), m(n), l(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = static_cast<double>(r * 7 + static_cast<int>(i));
    m[i] = static_cast<double>((r * 5 + static_cast<int>(i)) % 9);
    l[i] = 0.1 * static_cast<double>(r) - 0.3 * static_cast<double>(i);
  }
  comm->stats().reset();
  comm->all_reduce<double>(v, ReduceOp::sum, CollAlgo::hierarchical);
  const OpCounter k = comm->stats()[CommOp::all_reduce];
  comm->all_reduce<double>(m, ReduceOp::max, CollAlgo::hierarchical);
  comm->all_reduce<double>(l, ReduceOp::logsumexp, CollAlgo::hierarchical);
  for (std::size_t i = 0; i < n; ++i) {
    double sum = 0, mx = -1, se = 0;
    for (int s = 0; s < P; ++s) {
      sum += s * 7 + static_cast<int>(i);
      mx = std::max(mx, static_cast<double>((s * 5 + static_cast<int>(i)) % 9));
      se += std::exp(0.1 * s - 0.3 * static_cast<double>(i));
    }
    EXPECT_EQ(v[i], sum);
    EXPECT_EQ(m[i], mx);
    EXPECT_NEAR(l[i], std::log(se), 1e-12);
  }
  if (useful) {
    EXPECT_EQ(summed(k.bytes_sent), (2 * n * uz(N - 1) + 3 * n * uz(P - N)) * 8);
    EXPECT_EQ(summed(k.bytes_sent_inter), 2 * n * uz(N - 1) * 8);
  } else {
    EXPECT_EQ(summed(k.bytes_sent), 2 * n * uz(P - 1) * 8);
  }
}

TEST_P(Hier, BadUseThrows) {
  std::vector<double> a(uz(P)), b(1);
  const Counts ones(uz(P), 1);
  EXPECT_THROW(comm->reduce_scatter_v_async(a.data(), b.data(), ones, DType::f64, ReduceOp::max, CollAlgo::hierarchical),
               Error);
  std::vector<std::int32_t> ia(uz(P)), ib(1);
  EXPECT_THROW(comm->reduce_scatter_v_async(ia.data(), ib.data(), ones, DType::i32, ReduceOp::sum, CollAlgo::hierarchical),
               Error);
  auto plain = test::world().split(0, r, "plain");  // no topology
  EXPECT_FALSE(plain->has_topology());
  EXPECT_THROW(plain->topology(), Error);
  EXPECT_THROW(plain->all_gather_v_async(a.data(), a.data(), ones, DType::f64, CollAlgo::hierarchical), Error);
  EXPECT_THROW(plain->all_reduce<double>(a, ReduceOp::sum, CollAlgo::hierarchical), Error);
  EXPECT_THROW(parse_coll_algo("ring"), Error);
  comm->barrier();  // still in lockstep
}

// While a hierarchical operation is in flight (its later stages start inside test()/wait()), every
// other collective and set_topology are refused on every rank alike; after wait() all is normal.
TEST_P(Hier, NoOtherCollectiveWhileOneIsInFlight) {
  if (!useful) GTEST_SKIP() << "the flat path runs: nothing staged";
  const Counts c(uz(P), 3);
  std::vector<float> send(3, 1.f), got(3 * uz(P));
  WorkPtr w = comm->all_gather_v_async(send.data(), got.data(), c, DType::f32, CollAlgo::hierarchical);
  EXPECT_THROW(comm->barrier(), Error);
  EXPECT_THROW(comm->all_reduce<float>(send), Error);
  EXPECT_THROW(comm->set_topology(0), Error);
  w->wait();
  comm->barrier();
  for (float x : got) EXPECT_EQ(x, 1.f);
}

INSTANTIATE_TEST_SUITE_P(
    Groupings, Hier,
    ::testing::Values(Grouping{"pairs", [](int r, int) { return r / 2; }},
                      Grouping{"triples", [](int r, int) { return r / 3; }},  // 3+1 at P = 4, 3+3+2 at P = 8
                      Grouping{"first_alone", [](int r, int) { return r == 0 ? 0 : 1; }},
                      Grouping{"interleaved", [](int r, int) { return r % 2; }},
                      Grouping{"one_per_node", [](int r, int) { return r; }},
                      Grouping{"one_node", [](int, int) { return 7; }}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace diffcp
