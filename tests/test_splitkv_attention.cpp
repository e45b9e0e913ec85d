// The Split-KV attention core (cp/splitkv_attention) at P ranks against the fp64 single-process
// reference, forward (o) and backward (dq, dk, dv), on layouts that stress it: P not dividing S or
// N, more ranks than blocks, ranks holding no context, several context chunks per rank; and its
// communication volume against the closed form (P-1)/P * Q-sized tensors, independent of S.
#include <random>

#include <gtest/gtest.h>

#include "attention/mask.hpp"
#include "attention/reference.hpp"
#include "core/compare.hpp"
#include "core/random.hpp"
#include "cp/shard.hpp"
#include "cp/splitkv_attention.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using test::world;

template <typename T>
std::vector<T> gather_rows(const std::vector<T>& x, std::int64_t width, const std::vector<std::int64_t>& rows) {
  std::vector<T> out;
  for (std::int64_t r : rows) out.insert(out.end(), x.begin() + r * width, x.begin() + (r + 1) * width);
  return out;
}

// Context chunks per rank: either one contiguous slice each, or the context cut into many pieces
// dealt to ranks by a seeded shuffle (what a load balancer may produce). Same on every rank.
std::vector<std::vector<PosRange>> context_layout(std::int64_t S, std::int64_t P, bool scattered) {
  std::vector<std::vector<PosRange>> out(static_cast<std::size_t>(P));
  if (!scattered) {
    for (std::int64_t r = 0; r < P; ++r) out[static_cast<std::size_t>(r)].push_back({even_shard(S, P, r).begin, even_shard(S, P, r).end});
    return out;
  }
  std::mt19937_64 rng(99);
  const std::int64_t pieces = 3 * P + 1;
  for (std::int64_t j = 0; j < pieces; ++j) {
    const Shard s = even_shard(S, pieces, j);
    out[rng() % static_cast<std::size_t>(P)].push_back({s.begin, s.end});
  }
  for (auto& ch : out) std::shuffle(ch.begin(), ch.end(), rng);
  return out;
}

struct RunResult {
  CompareResult o, dq, dk, dv;
  OpCounter all_gather, reduce_scatter, all_reduce;
};

RunResult run_splitkv(const PackedBatch& batch, std::int64_t n_q, std::int64_t n_kv, std::int64_t d_h, bool scattered) {
  Communicator& comm = world();
  const std::int64_t P = comm.size(), p = comm.rank();
  const std::int64_t S = batch.context_rows(), N = batch.num_blocks(), B = batch.block, Q = N * B;
  const std::int64_t hq = n_q * d_h, hkv = n_kv * d_h;
  const auto q = random_normal(static_cast<std::size_t>(Q * hq), 21), dout = random_normal(static_cast<std::size_t>(Q * hq), 24);
  const auto k = random_normal(static_cast<std::size_t>((S + Q) * hkv), 22), v = random_normal(static_cast<std::size_t>((S + Q) * hkv), 23);

  const auto chunks = context_layout(S, P, scattered)[static_cast<std::size_t>(p)];
  const Shard blk = even_shard(N, P, p);
  std::vector<std::int64_t> owned;
  for (std::int64_t i = blk.begin; i < blk.end; ++i) owned.push_back(i);
  std::vector<std::int64_t> query_rows;
  for (std::int64_t r = 0; r < P; ++r) query_rows.push_back(even_shard(N, P, r).size() * B);
  const BlockMask mask = local_mask(batch, chunks, owned);
  const auto key_rows = full_rows_of_local(batch, chunks, owned);
  const std::int64_t Qp = blk.size() * B, Lk = mask.key_rows();

  const std::vector<float> q_p(q.begin() + blk.begin * B * hq, q.begin() + blk.end * B * hq),
      do_p(dout.begin() + blk.begin * B * hq, dout.begin() + blk.end * B * hq);
  const auto k_p = gather_rows(k, hkv, key_rows), v_p = gather_rows(v, hkv, key_rows);
  std::vector<float> o_p(q_p.size()), dq_p(q_p.size()), dk_p(k_p.size()), dv_p(v_p.size());

  comm.stats().reset();
  SplitKVAttention attn(comm, mask, n_q, n_kv, d_h, query_rows);
  attn.forward(head_rows(q_p, Qp, n_q, d_h), head_rows(k_p, Lk, n_kv, d_h), head_rows(v_p, Lk, n_kv, d_h),
               head_rows(o_p, Qp, n_q, d_h));
  attn.backward(head_rows(do_p, Qp, n_q, d_h), head_rows(dq_p, Qp, n_q, d_h), head_rows(dk_p, Lk, n_kv, d_h),
                head_rows(dv_p, Lk, n_kv, d_h));
  RunResult res;
  res.all_gather = comm.stats()[CommOp::all_gather];
  res.reduce_scatter = comm.stats()[CommOp::reduce_scatter];
  res.all_reduce = comm.stats()[CommOp::all_reduce];

  const BlockMask full = full_mask(batch);
  const RefShape shape{n_q, n_kv, d_h};
  const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end()), dod(dout.begin(), dout.end());
  std::vector<double> o_ref, lse_ref, dq_ref, dk_ref, dv_ref;
  reference_attention_forward(full, shape, qd, kd, vd, o_ref, lse_ref);
  reference_attention_backward(full, shape, qd, kd, vd, dod, lse_ref, reference_delta(dod, o_ref, Q * n_q, d_h),
                               dq_ref, dk_ref, dv_ref);
  const std::vector<double> o_own(o_ref.begin() + blk.begin * B * hq, o_ref.begin() + blk.end * B * hq),
      dq_own(dq_ref.begin() + blk.begin * B * hq, dq_ref.begin() + blk.end * B * hq);
  res.o = compare<float>(o_p, o_own, kTolF32);
  res.dq = compare<float>(dq_p, dq_own, kTolF32);
  res.dk = compare<float>(dk_p, gather_rows(dk_ref, hkv, key_rows), kTolF32);
  res.dv = compare<float>(dv_p, gather_rows(dv_ref, hkv, key_rows), kTolF32);
  return res;
}

void expect_exact(const RunResult& r) {
  EXPECT_TRUE(r.o.pass()) << "o: max abs err " << r.o.max_abs;
  EXPECT_TRUE(r.dq.pass()) << "dq: max abs err " << r.dq.max_abs;
  EXPECT_TRUE(r.dk.pass()) << "dk: max abs err " << r.dk.max_abs;
  EXPECT_TRUE(r.dv.pass()) << "dv: max abs err " << r.dv.max_abs;
}

struct Config {
  const char* name;
  std::int64_t samples, context, anchors, block, n_q, n_kv, d_h;
  bool scattered;
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

class SplitKV : public ::testing::TestWithParam<Config> {};

TEST_P(SplitKV, MatchesFp64ReferenceForwardAndBackward) {
  const Config& c = GetParam();
  expect_exact(run_splitkv(make_random_batch(c.samples, c.context, c.anchors, c.block, 0.25, 3), c.n_q, c.n_kv,
                           c.d_h, c.scattered));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, SplitKV,
    ::testing::Values(
        // S = 3*331 and N = 7 are prime-ish: no P in {2,3,4,8} divides both evenly.
        Config{"contiguous_uneven", 3, 331, 7, 16, 8, 2, 64, false},
        // 3 blocks in all: at P = 4, 8 some ranks own no block; GQA 8.
        Config{"fewer_blocks_than_ranks", 1, 200, 3, 16, 8, 1, 64, false},
        // Many scattered chunks per rank (several disjoint ranges), d_h = 128.
        Config{"scattered_chunks", 2, 300, 6, 8, 4, 2, 128, true}),
    [](const auto& info) { return std::string(info.param.name); });

// A rank that holds no context rows at all (only its blocks) still gets exact results.
TEST(SplitKVLayout, RankWithoutContextRows) {
  Communicator& comm = world();
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  // S = 5 context rows and P >= 2: with 5 < P some ranks hold none; at P <= 5 use a tiny context
  // so that even_shard leaves the first rank(s) empty only at P = 8. Either way the result is exact.
  expect_exact(run_splitkv(make_random_batch(1, 5 + 16, 1, 16, 0.25, 4), 4, 2, 64, false));
}

// Bytes per call against the closed form: forward all-gather(q) + reduce-scatter(o), backward
// all-gather(do) + reduce-scatter(dq), each moving (P-1)/P of a [Q, n_q*d_h] f32 tensor summed over
// ranks; and three [Q, n_q] all-reduces (lse max, lse sum, D). None of it depends on S.
TEST(SplitKVComm, VolumeIsQSizedAndIndependentOfContext) {
  Communicator& comm = world();
  const std::int64_t P = comm.size(), n_q = 4, n_kv = 2, d_h = 64, B = 16;
  std::vector<OpCounter> ag, rs, ar;
  for (std::int64_t context : {256, 1024}) {
    const PackedBatch batch = make_random_batch(2, context, 5, B, 0.25, 8);
    const RunResult r = run_splitkv(batch, n_q, n_kv, d_h, false);
    expect_exact(r);
    const std::int64_t Q = batch.query_rows(), N = batch.num_blocks();
    const std::int64_t Qp = even_shard(N, P, comm.rank()).size() * B;
    const std::uint64_t row_bytes = static_cast<std::uint64_t>(n_q * d_h) * 4;
    EXPECT_EQ(r.all_gather.calls, 2u);
    EXPECT_EQ(r.all_gather.bytes_sent, 2 * static_cast<std::uint64_t>(Qp * (P - 1)) * row_bytes);
    EXPECT_EQ(r.all_gather.bytes_recv, 2 * static_cast<std::uint64_t>(Q - Qp) * row_bytes);
    EXPECT_EQ(r.reduce_scatter.calls, 2u);
    EXPECT_EQ(r.reduce_scatter.bytes_sent, 2 * static_cast<std::uint64_t>(Q - Qp) * row_bytes);
    EXPECT_EQ(r.reduce_scatter.bytes_recv, 2 * static_cast<std::uint64_t>(Qp * (P - 1)) * row_bytes);
    const std::uint64_t n = static_cast<std::uint64_t>(Q * n_q), share = n / P + (static_cast<std::uint64_t>(comm.rank()) < n % P);
    EXPECT_EQ(r.all_reduce.calls, 3u);
    EXPECT_EQ(r.all_reduce.bytes_sent, 3 * 2 * (n - share) * 4);
    ag.push_back(r.all_gather);
    rs.push_back(r.reduce_scatter);
    ar.push_back(r.all_reduce);
  }
  // Same Q, 4x the context: identical traffic.
  EXPECT_EQ(ag[0].bytes_sent, ag[1].bytes_sent);
  EXPECT_EQ(rs[0].bytes_sent, rs[1].bytes_sent);
  EXPECT_EQ(ar[0].bytes_sent, ar[1].bytes_sent);
}

TEST(SplitKVBadInput, QueryRowCountsMustCoverQ) {
  Communicator& comm = world();
  const PackedBatch batch = make_random_batch(1, 64, 2, 4, 0.25, 1);
  const BlockMask mask = full_mask(batch);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(comm.size()), 0);
  EXPECT_THROW(SplitKVAttention(comm, mask, 2, 1, 8, rows), Error);  // 0 rows in all, Q = 8
  rows[0] = 3;                                                        // not a multiple of B
  EXPECT_THROW(SplitKVAttention(comm, mask, 2, 1, 8, rows), Error);
  EXPECT_THROW(SplitKVAttention(comm, mask, 2, 1, 8, std::vector<std::int64_t>(static_cast<std::size_t>(comm.size()) + 1, 0)), Error);
}

}  // namespace
}  // namespace diffcp
