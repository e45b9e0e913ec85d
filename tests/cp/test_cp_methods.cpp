// Every CP method of the table (cp/cp_methods.hpp: Split-KV and the four baselines of SPEC A.4) at P ranks
// against the fp64 single-process reference: output and every gradient (dX, d(context), dW_q,
// dW_k, dW_v, dW_o, db_o, q_norm, k_norm), for every method on configurations that stress them
// (GQA 2 and 8, MHA with many heads, overlapping blocks, fewer blocks than ranks, P not dividing
// S or N, H != n_q d_h) and context layouts (contiguous, zigzag, scattered shuffled chunks, a rank
// without context rows); and the communicator's counts of one forward + backward against each
// method's closed form, exactly. Sliding-window layers (KeyWindow) too: causal windows smaller
// than a block and than a sample, wider than every sample, two-sided, anchors at a sample's start. Where a method cannot serve P (Ulysses: P must divide n_kv) the
// constructor must throw before communicating, and the case is skipped.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>

#include <gtest/gtest.h>

#include "diffcp/balance/zigzag.hpp"
#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/cp/ulysses.hpp"
#include "diffcp/testing/layer_problem.hpp"
#include "bf16_gate.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using test::world;

struct Config {
  const char* name;
  std::int64_t samples, context, anchors, block;
  AttnLayerConfig layer;
};

struct Case {
  const CpMethod* method;
  Config config;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.method->name << "_" << c.config.name; }

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

LayerRun run_layer(const CpMethod& m, const Config& c, const LayerProblem& pb, const CpShard& shard,
                   Communicator& comm = world(), DType compute = DType::f32) {
  const auto x_p = pb.x_rows(shard), dy_p = pb.dy_rows(shard), ctx_p = pb.ctx_rows(shard);
  std::vector<float> y_p(x_p.size()), dx_p(x_p.size()), dctx_p(ctx_p.size());
  AttnLayerParams grad(c.layer);
  SplitKVOptions opt;
  opt.compute = compute;
  auto layer = m.make(comm, c.layer, shard, opt);
  EXPECT_STREQ(layer->name(), m.name);
  comm.stats().reset();
  const std::int64_t Qp = shard.own_query_rows(), Cp = shard.context_rows(), H = c.layer.hidden;
  CpSaved saved = layer->forward(pb.w, view_of(x_p, {Qp, H}), view_of(ctx_p, {Cp, H}), view_of(y_p, {Qp, H}));
  layer->backward(std::move(saved), pb.w, view_of(dy_p, {Qp, H}), view_of(dx_p, {Qp, H}), view_of(dctx_p, {Cp, H}), grad);
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
void expect_counted_equals_predicted(const CpMethod& m, const LayerRun& run, const std::string& where) {
  const double P = world().size();
  EXPECT_EQ(run.sent_sum, static_cast<std::uint64_t>(std::llround(run.predicted_bytes * P)))
      << where << ": counted " << static_cast<double>(run.sent_sum) / P << " bytes per rank, predicted "
      << run.predicted_bytes;
  for (std::size_t i = 0; i < kNumCommOps; ++i) {
    const CommOp op = static_cast<CommOp>(i);
    if (std::find(m.ops.begin(), m.ops.end(), op) == m.ops.end()) {
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
  const CpMethod& m = *k.method;
  const std::string why = m.unsupported_reason(c.layer, P);
  if (!why.empty()) {  // must refuse at once, naming the reason, without any communication
    const std::uint64_t calls = world().stats().total().calls;
    EXPECT_THROW(m.make(world(), c.layer, contiguous_shard(batch, P, world().rank())), Error);
    EXPECT_THROW(m.factory(world(), c.layer, contiguous_shard(batch, P, world().rank()), {}), Error);  // the constructor too
    EXPECT_EQ(world().stats().total().calls, calls);
    GTEST_SKIP() << m.name << " cannot run here: " << why;
  }
  const LayerProblem pb(c.layer, batch, 5);
  for (const Layout& l : layouts(batch)) {
    const std::string where = std::string(m.name) + "/" + c.name + "/" + l.name;
    const LayerRun run = run_layer(m, c, pb, l.shard);
    expect_exact(run.check, where);
    expect_counted_equals_predicted(m, run, where);
  }
}

// A sliding-window layer (z-lab's DFlashDraftModel layer_types = sliding_attention): every
// method, contiguous and scattered layouts, exact against the fp64 reference that writes the window rule out itself,
// and the bytes are the same closed form (a window changes no payload: Split-KV stays Q-sized).
struct WindowCase {
  const char* name;
  KeyWindow window;
};
const WindowCase kWindows[] = {
    {"w5_causal_smaller_than_block", {5, true}},
    {"w37_causal_inside_samples", {37, true}},
    {"w9_two_sided", {9, false}},
    {"w4096_wider_than_samples", {4096, true}},
};

class CpWindowTest : public ::testing::TestWithParam<const CpMethod*> {};

TEST_P(CpWindowTest, SlidingLayersMatchFp64ReferenceOnEveryLayout) {
  const CpMethod& m = *GetParam();
  const int P = world().size();
  const Config c{"window", 3, 200, 6, 8, {64, 4, 2, 16}};
  if (!m.unsupported_reason(c.layer, P).empty()) GTEST_SKIP() << m.name << " cannot run at P = " << P;
  PackedBatch batch = make_random_batch(c.samples, c.context, c.anchors, c.block, 0.25, 11);
  batch.anchors[1] = {0, 1, 5, 30};  // anchors at and near the sample's start (little or no context)
  for (const WindowCase& wc : kWindows) {
    LayerProblem pb(c.layer, batch, 5);
    pb.window = wc.window;
    const ReferenceLayerResult ref = pb.reference();
    for (Layout& l : layouts(batch)) {
      if (l.name == "zigzag" || l.name == "rank0_without_context") continue;  // keep np 8 short
      l.shard.window = wc.window;
      const std::string where = std::string(m.name) + "/" + wc.name + "/" + l.name;
      const auto x_p = pb.x_rows(l.shard), dy_p = pb.dy_rows(l.shard), ctx_p = pb.ctx_rows(l.shard);
      std::vector<float> y_p(x_p.size()), dx_p(x_p.size()), dctx_p(ctx_p.size());
      AttnLayerParams grad(c.layer);
      auto layer = m.make(world(), c.layer, l.shard);
      world().stats().reset();
      const std::int64_t Qp = l.shard.own_query_rows(), Cp = l.shard.context_rows(), H = c.layer.hidden;
      CpSaved saved = layer->forward(pb.w, view_of(x_p, {Qp, H}), view_of(ctx_p, {Cp, H}), view_of(y_p, {Qp, H}));
      layer->backward(std::move(saved), pb.w, view_of(dy_p, {Qp, H}), view_of(dx_p, {Qp, H}),
                      view_of(dctx_p, {Cp, H}), grad);
      std::vector<std::uint64_t> sent{world().stats().total().bytes_sent};
      world().all_reduce<std::uint64_t>(sent);
      EXPECT_EQ(sent[0], static_cast<std::uint64_t>(std::llround(layer->predicted_bytes_per_layer() * P))) << where;
      allreduce_grads(world(), grad);
      expect_exact(check_layer(ref, l.shard, H, y_p, dx_p, dctx_p, grad), where);
    }
  }
}

std::vector<const CpMethod*> method_list() {
  std::vector<const CpMethod*> out;
  for (const CpMethod& m : cp_methods()) out.push_back(&m);
  return out;
}
INSTANTIATE_TEST_SUITE_P(Methods, CpWindowTest, ::testing::ValuesIn(method_list()),
                         [](const auto& info) { return std::string(info.param->name); });

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const CpMethod& m : cp_methods())
    for (const Config& c : kConfigs) out.push_back({&m, c});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Methods, CpMethodTest, ::testing::ValuesIn(all_cases()), [](const auto& info) {
  return std::string(info.param.method->name) + "_" + info.param.config.name;
});

// compute = bf16 (issue #14): Ulysses' all-to-alls, Ring's K/V hops, RingX's broadcasts and
// reductions and LV-XAttn's q / do hops carry bf16 and their attention runs the bf16 kernel;
// against fp64, each tensor's max error at P ranks is at most 2.5x that of the same bf16 layer on
// one rank + 2^-12 of the tensor's peak, and the bytes are the closed form in bf16 (Ulysses: half
// of f32's; Ring: 8/12, its dk/dv accumulators stay f32; LV-XAttn: its o and dq accumulators stay
// f32). A compute dtype other than f32 / bf16 is refused by name before any communication.
TEST(CpMethodBf16, EveryMethodWithin2_5xOneRank) {
  const int P = world().size(), p = world().rank();
  auto self = world().split(p, 0, "self");
  for (const char* name : {"ulysses", "ring", "ringx", "lvxattn"})
  for (const Config& c : {kConfigs[3], kConfigs[4]}) {
    SCOPED_TRACE(std::string(name) + "/" + c.name);
    const CpMethod& m = cp_method(name);
    if (!m.unsupported_reason(c.layer, P).empty()) continue;
    if (std::string(name) != "ulysses" && c.name != std::string(kConfigs[3].name)) continue;  // keep the suite short
    const PackedBatch batch = make_random_batch(c.samples, c.context, c.anchors, c.block, 0.25, 3);
    const LayerProblem pb(c.layer, batch, 5);
    const ReferenceLayerResult& ref = reference_of(c, pb);
    const LayerRun one = run_layer(m, c, pb, contiguous_shard(batch, 1, 0), *self, DType::bf16);
    const LayerRun many = run_layer(m, c, pb, contiguous_shard(batch, P, p), world(), DType::bf16);
    const LayerRun f32 = run_layer(m, c, pb, contiguous_shard(batch, P, p));
    test::expect_bf16_like_one_rank(world(), ref, one.check, many.check);
    expect_counted_equals_predicted(m, many, std::string(name) + " bf16/" + c.name);
    if (std::string(name) == "ulysses") {
      EXPECT_EQ(2 * many.sent_sum, f32.sent_sum) << "bf16 halves every all-to-all";
    } else if (std::string(name) == "ring") {
      EXPECT_EQ(12 * many.sent_sum, 8 * f32.sent_sum) << "K/V hops halve, dk/dv accumulators stay f32";
    } else if (P > 1) {
      // RingX: rows halve, the lse all-reduces stay f32; LV-XAttn: q and do halve, the o and dq
      // accumulators and lse / D stay f32: between half and all of f32's (the closed form is exact)
      EXPECT_GT(2 * many.sent_sum, f32.sent_sum);
      EXPECT_LT(many.sent_sum, f32.sent_sum);
    }
  }
  const PackedBatch batch = make_random_batch(1, 120, 3, 16, 0.25, 3);
  SplitKVOptions f64;
  f64.compute = DType::f64;
  for (const CpMethod& m : cp_methods()) {
    if (!m.unsupported_reason(kConfigs[2].layer, P).empty()) continue;
    const std::uint64_t calls = world().stats().total().calls;
    try {
      m.make(world(), kConfigs[2].layer, contiguous_shard(batch, P, p), f64);
      ADD_FAILURE() << m.name << " accepted compute f64";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("compute f64"), std::string::npos) << e.what();
    }
    EXPECT_EQ(world().stats().total().calls, calls) << m.name;
  }
}

// LV-XAttn moves only query-side state: doubling S with Q fixed leaves its traffic unchanged;
// the K/V-moving methods (Ring, RingX) grow with S.
TEST(CpMethodComm, OnlyLvXAttnIgnoresContextLength) {
  const int P = world().size();
  const AttnLayerConfig cfg{80, 4, 2, 16};
  std::map<std::string, std::vector<std::uint64_t>> sent;
  for (std::int64_t context : {256, 512}) {
    const Config c{context == 256 ? "comm_s256" : "comm_s512", 2, context, 5, 16, cfg};
    const PackedBatch batch = make_random_batch(c.samples, c.context, c.anchors, c.block, 0.25, 8);
    const LayerProblem pb(cfg, batch, 5);
    for (const char* name : {"ring", "ringx", "lvxattn"}) {
      const CpMethod& m = cp_method(name);
      const LayerRun run = run_layer(m, c, pb, contiguous_shard(batch, P, world().rank()));
      expect_exact(run.check, std::string(name) + "/" + c.name);
      expect_counted_equals_predicted(m, run, std::string(name) + "/" + c.name);
      sent[name].push_back(run.sent_sum);
    }
  }
  EXPECT_EQ(sent["lvxattn"][0], sent["lvxattn"][1]);
  if (P > 1) {
    EXPECT_LT(sent["ring"][0], sent["ring"][1]);
    EXPECT_LT(sent["ringx"][0], sent["ringx"][1]);
  }
}

TEST(CpMethodBadInput, UlyssesNamesPAndKvHeads) {
  const PackedBatch batch = make_random_batch(1, 64, 2, 4, 0.25, 1);
  const AttnLayerConfig cfg{32, 6, 3, 8};  // n_kv = 3: P = 2, 4, 8 refused; 1, 3 served
  const int P = world().size();
  const std::string why = cp_method("ulysses").unsupported_reason(cfg, P);
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
  for (const CpMethod& m : cp_methods()) {
    if (m.unsupported_reason(cfg, P).empty()) {
      EXPECT_THROW(m.make(world(), cfg, contiguous_shard(batch, P + 1, 0)), Error) << m.name;
    }
  }
  EXPECT_THROW(cp_method("lvxattn").make(world(), {32, 3, 2, 16}, contiguous_shard(batch, P, world().rank())), Error);  // GQA
}

TEST(CpMethodTable, NamesAreUniqueAndUnknownNamesAreListed) {
  std::map<std::string, int> seen;
  for (const CpMethod& m : cp_methods()) EXPECT_EQ(seen[m.name]++, 0) << m.name;
  EXPECT_EQ(seen.size(), 5u);
  EXPECT_STREQ(cp_method("ring").default_layout, "zigzag");
  try {
    cp_method("rings");
    ADD_FAILURE() << "cp_method accepted 'rings'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown CP method 'rings', expected one of splitkv, ulysses, ring, ringx, lvxattn"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace diffcp
