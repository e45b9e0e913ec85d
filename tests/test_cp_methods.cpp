// The four CP baselines of SPEC A.4 (cp/ulysses, cp/ring, cp/ringx, cp/lvxattn) at P ranks
// against the fp64 single-process reference: output and every gradient (dX, d(context), dW_q,
// dW_k, dW_v, dW_o, db_o, q_norm, k_norm), for every method on configurations that stress them
// (GQA 2 and 8, MHA with many heads, overlapping blocks, fewer blocks than ranks, P not dividing
// S or N, H != n_q d_h) and context layouts (contiguous, zigzag, scattered shuffled chunks, a rank
// without context rows); and the communicator's counts of one forward + backward against each
// method's closed form, exactly. Where a method cannot serve P (Ulysses: P must divide n_kv) the
// constructor must throw before communicating, and the case is skipped.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>

#include <gtest/gtest.h>

#include "diffcp/balance/zigzag.hpp"
#include "diffcp/testing/layer_problem.hpp"
#include "diffcp/cp/lvxattn.hpp"
#include "diffcp/cp/ring.hpp"
#include "diffcp/cp/ringx.hpp"
#include "diffcp/cp/ulysses.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using test::world;

enum class Method { ulysses, ring, ringx, lvxattn };
const char* method_name(Method m) {
  switch (m) {
    case Method::ulysses: return "ulysses";
    case Method::ring: return "ring";
    case Method::ringx: return "ringx";
    case Method::lvxattn: return "lvxattn";
  }
  return "?";
}

std::unique_ptr<CpAttentionLayer> make_layer(Method m, const AttnLayerConfig& cfg, const CpShard& shard) {
  switch (m) {
    case Method::ulysses: return std::make_unique<UlyssesLayer>(world(), cfg, shard);
    case Method::ring: return std::make_unique<RingLayer>(world(), cfg, shard);
    case Method::ringx: return std::make_unique<RingXLayer>(world(), cfg, shard);
    case Method::lvxattn: return std::make_unique<LvXAttnLayer>(world(), cfg, shard);
  }
  return nullptr;
}

std::string unsupported_reason(Method m, const AttnLayerConfig& cfg, int P) {
  switch (m) {
    case Method::ulysses: return UlyssesLayer::unsupported_reason(cfg, P);
    case Method::ring: return RingLayer::unsupported_reason(cfg, P);
    case Method::ringx: return RingXLayer::unsupported_reason(cfg, P);
    case Method::lvxattn: return LvXAttnLayer::unsupported_reason(cfg, P);
  }
  return "?";
}

// The operation kinds a method may use (anything else is a sign it is not the method it claims).
std::vector<CommOp> allowed_ops(Method m) {
  switch (m) {
    case Method::ulysses: return {CommOp::all_to_all};
    case Method::ring: return {CommOp::send, CommOp::recv};
    case Method::ringx: return {CommOp::broadcast, CommOp::all_reduce, CommOp::reduce_scatter};
    case Method::lvxattn: return {CommOp::send, CommOp::recv};
  }
  return {};
}

struct Config {
  const char* name;
  std::int64_t samples, context, anchors, block;
  AttnLayerConfig layer;
};

struct Case {
  Method method;
  Config config;
};
void PrintTo(const Case& c, std::ostream* os) { *os << method_name(c.method) << "_" << c.config.name; }

const Config kConfigs[] = {
    // S = 3*331 and N = 21: no P in {2,3,4,8} divides both. H != n_q*d_h. Ulysses: P | 2 only.
    {"uneven_gqa2", 3, 331, 7, 16, {96, 4, 2, 32}},
    // 12 anchors of B = 8 in ~150 response positions: overlapping blocks; GQA 8; theta 1e4.
    {"overlapping_gqa8", 2, 200, 12, 8, {64, 8, 1, 16, 1e4, 1e-6}},
    // 3 blocks in all: at P = 4, 8 some ranks own no block.
    {"fewer_blocks_than_ranks", 1, 120, 3, 16, {48, 2, 2, 16}},
    // 24 heads (MHA): Ulysses serves every P tested; 6 blocks, so at P = 8 some ranks own none.
    {"mha_24_heads", 2, 150, 3, 8, {72, 24, 24, 4}},
    // GQA 8 with 8 kv heads: Ulysses at P = 1, 2, 4, 8.
    {"gqa8_8_kv_heads", 2, 180, 5, 8, {100, 64, 8, 4}},
};

// One layout of the context over the ranks (the blocks are always even and contiguous).
struct Layout {
  std::string name;
  CpShard shard;
};

std::vector<Layout> layouts(const PackedBatch& batch) {
  const int P = world().size(), p = world().rank();
  std::vector<Layout> out;
  out.push_back({"contiguous", contiguous_shard(batch, P, p)});
  const Plan zz = ZigzagBalancer().plan(batch, CostModel(batch), P, 1);
  out.push_back({"zigzag", chunked_shard(batch, P, p, zz.chunks_of_rank())});
  // 3P+1 pieces dealt by a seeded shuffle, in shuffled order: what a load balancer hands over.
  std::vector<std::vector<PosRange>> scattered(static_cast<std::size_t>(P));
  std::mt19937_64 rng(17);
  const std::int64_t pieces = 3 * P + 1;
  for (std::int64_t j = 0; j < pieces; ++j) {
    const Shard s = even_shard(batch.context_rows(), pieces, j);
    scattered[rng() % static_cast<std::size_t>(P)].push_back({s.begin, s.end});
  }
  for (auto& l : scattered) std::shuffle(l.begin(), l.end(), rng);
  out.push_back({"scattered", chunked_shard(batch, P, p, scattered)});
  if (P >= 2) {  // rank 0 holds no context row
    std::vector<std::vector<PosRange>> chunks(static_cast<std::size_t>(P));
    for (int r = 1; r < P; ++r) {
      const Shard s = even_shard(batch.context_rows(), P - 1, r - 1);
      chunks[static_cast<std::size_t>(r)].push_back({s.begin, s.end});
    }
    out.push_back({"rank0_without_context", chunked_shard(batch, P, p, chunks)});
  }
  return out;
}

// The fp64 reference of a config's problem, computed once per process.
const ReferenceLayerResult& reference_of(const Config& c, const LayerProblem& pb) {
  static std::map<std::string, ReferenceLayerResult> cache;
  auto it = cache.find(c.name);
  if (it == cache.end()) it = cache.emplace(c.name, pb.reference()).first;
  return it->second;
}

struct LayerRun {
  LayerCheck check;
  CommStats layer_stats;      // this rank's counters of forward + backward only
  std::uint64_t sent_sum = 0;  // bytes sent, summed over ranks
  double predicted_bytes = 0;
};

LayerRun run_layer(Method m, const Config& c, const LayerProblem& pb, const CpShard& shard) {
  Communicator& comm = world();
  const auto x_p = pb.x_rows(shard), dy_p = pb.dy_rows(shard), ctx_p = pb.ctx_rows(shard);
  std::vector<float> y_p(x_p.size()), dx_p(x_p.size()), dctx_p(ctx_p.size());
  AttnLayerParams grad(c.layer);
  auto layer = make_layer(m, c.layer, shard);
  EXPECT_STREQ(layer->name(), method_name(m));
  comm.stats().reset();
  layer->forward(pb.w, x_p.data(), ctx_p.data(), y_p.data());
  layer->backward(pb.w, dy_p.data(), dx_p.data(), dctx_p.data(), grad);
  LayerRun run;
  run.layer_stats = comm.stats();
  run.predicted_bytes = layer->predicted_bytes_per_layer();
  std::vector<std::uint64_t> sent{run.layer_stats.total().bytes_sent};
  comm.all_reduce<std::uint64_t>(sent);
  run.sent_sum = sent[0];
  allreduce_grads(comm, grad);
  run.check = check_layer(reference_of(c, pb), shard, c.layer.hidden, y_p, dx_p, dctx_p, grad);
  return run;
}

void expect_exact(const LayerCheck& c, const std::string& where) {
  EXPECT_TRUE(c.y.pass()) << where << " y: " << c.y.mismatched << " mismatches, max abs err " << c.y.max_abs;
  EXPECT_TRUE(c.dx.pass()) << where << " dx: " << c.dx.mismatched << " mismatches, max abs err " << c.dx.max_abs;
  EXPECT_TRUE(c.dctx.pass()) << where << " dctx: " << c.dctx.mismatched << " mismatches, max abs err " << c.dctx.max_abs;
  EXPECT_TRUE(c.grad.pass()) << where << " param grads: " << c.grad.mismatched << " mismatches, max abs err "
                             << c.grad.max_abs << " at flat index " << c.grad.worst;
}

// Mean bytes per rank = the closed form, exactly (the sum over ranks is an integer).
void expect_counted_equals_predicted(Method m, const LayerRun& run, const std::string& where) {
  const double P = world().size();
  EXPECT_EQ(run.sent_sum, static_cast<std::uint64_t>(std::llround(run.predicted_bytes * P)))
      << where << ": counted " << static_cast<double>(run.sent_sum) / P << " bytes per rank, predicted "
      << run.predicted_bytes;
  const auto ok = allowed_ops(m);
  for (std::size_t i = 0; i < kNumCommOps; ++i) {
    const CommOp op = static_cast<CommOp>(i);
    if (std::find(ok.begin(), ok.end(), op) == ok.end()) {
      EXPECT_EQ(run.layer_stats[op].calls, 0u) << where << ": unexpected " << comm_op_name(op);
    }
  }
}

class CpMethodTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpMethodTest, MatchesFp64ReferenceAndClosedFormOnEveryLayout) {
  const Case& k = GetParam();
  const Config& c = k.config;
  const int P = world().size();
  const PackedBatch batch = make_random_batch(c.samples, c.context, c.anchors, c.block, 0.25, 3);
  const std::string why = unsupported_reason(k.method, c.layer, P);
  if (!why.empty()) {  // must refuse at once, naming the reason, without any communication
    const std::uint64_t calls = world().stats().total().calls;
    EXPECT_THROW(make_layer(k.method, c.layer, contiguous_shard(batch, P, world().rank())), Error);
    EXPECT_EQ(world().stats().total().calls, calls);
    GTEST_SKIP() << method_name(k.method) << " cannot run here: " << why;
  }
  const LayerProblem pb(c.layer, batch, 5);
  for (const Layout& l : layouts(batch)) {
    const std::string where = std::string(method_name(k.method)) + "/" + c.name + "/" + l.name;
    const LayerRun run = run_layer(k.method, c, pb, l.shard);
    expect_exact(run.check, where);
    expect_counted_equals_predicted(k.method, run, where);
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Method m : {Method::ulysses, Method::ring, Method::ringx, Method::lvxattn})
    for (const Config& c : kConfigs) out.push_back({m, c});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Methods, CpMethodTest, ::testing::ValuesIn(all_cases()), [](const auto& info) {
  return std::string(method_name(info.param.method)) + "_" + info.param.config.name;
});

// LV-XAttn moves only query-side state: doubling S with Q fixed leaves its traffic unchanged;
// the K/V-moving methods (Ring, RingX) grow with S.
TEST(CpMethodComm, OnlyLvXAttnIgnoresContextLength) {
  const int P = world().size();
  const AttnLayerConfig cfg{80, 4, 2, 16};
  std::map<Method, std::vector<std::uint64_t>> sent;
  for (std::int64_t context : {256, 512}) {
    const Config c{context == 256 ? "comm_s256" : "comm_s512", 2, context, 5, 16, cfg};
    const PackedBatch batch = make_random_batch(c.samples, c.context, c.anchors, c.block, 0.25, 8);
    const LayerProblem pb(cfg, batch, 5);
    for (Method m : {Method::ring, Method::ringx, Method::lvxattn}) {
      const LayerRun run = run_layer(m, c, pb, contiguous_shard(batch, P, world().rank()));
      expect_exact(run.check, std::string(method_name(m)) + "/" + c.name);
      expect_counted_equals_predicted(m, run, std::string(method_name(m)) + "/" + c.name);
      sent[m].push_back(run.sent_sum);
    }
  }
  EXPECT_EQ(sent[Method::lvxattn][0], sent[Method::lvxattn][1]);
  if (P > 1) {
    EXPECT_LT(sent[Method::ring][0], sent[Method::ring][1]);
    EXPECT_LT(sent[Method::ringx][0], sent[Method::ringx][1]);
  }
}

TEST(CpMethodBadInput, UlyssesNamesPAndKvHeads) {
  const PackedBatch batch = make_random_batch(1, 64, 2, 4, 0.25, 1);
  const AttnLayerConfig cfg{32, 6, 3, 8};  // n_kv = 3: P = 2, 4, 8 refused; 1, 3 served
  const int P = world().size();
  const std::string why = UlyssesLayer::unsupported_reason(cfg, P);
  EXPECT_EQ(why.empty(), 3 % P == 0);
  if (!why.empty()) {
    try {
      UlyssesLayer layer(world(), cfg, contiguous_shard(batch, P, world().rank()));
      ADD_FAILURE() << "constructor accepted P = " << P << " with n_kv = 3";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("P = " + std::to_string(P)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("n_kv = 3"), std::string::npos) << e.what();
    }
  }
}

TEST(CpMethodBadInput, ShardMustMatchCommunicator) {
  const PackedBatch batch = make_random_batch(1, 64, 2, 4, 0.25, 1);
  const AttnLayerConfig cfg{32, 2, 1, 16};
  const int P = world().size();
  for (Method m : {Method::ring, Method::ringx, Method::lvxattn})
    EXPECT_THROW(make_layer(m, cfg, contiguous_shard(batch, P + 1, 0)), Error) << method_name(m);
  EXPECT_THROW(make_layer(Method::lvxattn, {32, 3, 2, 16}, contiguous_shard(batch, P, world().rank())), Error);  // GQA
}

}  // namespace
}  // namespace diffcp
