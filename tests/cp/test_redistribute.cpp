// Balancing end to end at P ranks: the once-per-step all-to-all-v delivers exactly the planned
// rows; the Split-KV layer on redistributed rows stays exact for every balancer; bucket padding
// never changes a result (bitwise) and lets steps of equal shape reuse buffers.
#include <gtest/gtest.h>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/balance/redistribute.hpp"
#include "diffcp/testing/layer_problem.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using test::world;

std::vector<float> loader_rows(const LayerProblem& pb, int P, int p) {
  const PosRange s = loader_slices(pb.batch.context_rows(), P)[static_cast<std::size_t>(p)];
  return {pb.ctx.begin() + s.begin * pb.cfg.hidden, pb.ctx.begin() + s.end * pb.cfg.hidden};
}

class EveryBalancer : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryBalancer, RedistributedLayerIsExact) {
  Communicator& comm = world();
  const int P = comm.size(), p = comm.rank();
  // Uneven sample lengths: the plan differs from the loader's slices.
  const PackedBatch batch = make_random_batch(3, 150, 6, 8, 0.25, 11, 400);
  const AttnLayerConfig cfg{48, 4, 2, 16};
  const LayerProblem pb(cfg, batch, 3);
  const CostModel cost(batch);
  const Plan plan = make_balancer(GetParam())->plan(batch, cost, P, 4);
  const CpShard shard = chunked_shard(batch, P, p, plan.chunks_of_rank());

  auto redist = comm.split(0, p, "redistribute");
  const auto ctx_p = redistribute_rows(*redist, batch, plan, loader_rows(pb, P, p), cfg.hidden);
  EXPECT_EQ(ctx_p, pb.ctx_rows(shard));  // exactly the planned rows, in the shard's order
  // One all-to-all-v, on its own communicator; the bytes are the rows that changed rank.
  EXPECT_EQ(redist->stats()[CommOp::all_to_all].calls, 1u);
  EXPECT_EQ(redist->stats().total().calls, 1u);

  const auto x_p = pb.x_rows(shard), dy_p = pb.dy_rows(shard);
  std::vector<float> y_p(x_p.size()), dx_p(x_p.size()), dctx_p(ctx_p.size());
  AttnLayerParams grad(cfg);
  SplitKVLayer layer(comm, cfg, shard);
  const std::int64_t Qp = shard.own_query_rows(), Cp = shard.context_rows(), H = cfg.hidden;
  CpSaved saved = layer.forward(pb.w, view_of(x_p, {Qp, H}), view_of(ctx_p, {Cp, H}), view_of(y_p, {Qp, H}));
  layer.backward(std::move(saved), pb.w, view_of(dy_p, {Qp, H}), view_of(dx_p, {Qp, H}), view_of(dctx_p, {Cp, H}), grad);
  allreduce_grads(comm, grad);
  const LayerCheck c = check_layer(pb.reference(), shard, cfg.hidden, y_p, dx_p, dctx_p, grad);
  EXPECT_TRUE(c.pass()) << "max abs err " << c.all().max_abs << ", " << c.all().mismatched << " mismatches";
}

INSTANTIATE_TEST_SUITE_P(Balancers, EveryBalancer, ::testing::ValuesIn(balancer_names()),
                         [](const auto& info) { return info.param; });

// Padding the local K/V length to a bucket changes nothing, bitwise; and a second step of the same
// padded shape (a different plan, same bucket) allocates no buffer.
TEST(Buckets, PaddingNeverChangesResultsAndBuffersAreReused) {
  Communicator& comm = world();
  const int P = comm.size(), p = comm.rank();
  const PackedBatch batch = make_random_batch(2, 300, 5, 8, 0.25, 12);
  const AttnLayerConfig cfg{40, 4, 1, 16};
  const LayerProblem pb(cfg, batch, 4);
  const CostModel cost(batch);
  struct Out {
    std::vector<float> y, dx, dctx, grad;
  };
  auto run = [&](SplitKVLayer& layer, const CpShard& shard) {
    const auto x_p = pb.x_rows(shard), dy_p = pb.dy_rows(shard), ctx_p = pb.ctx_rows(shard);
    Out o{std::vector<float>(x_p.size()), std::vector<float>(x_p.size()), std::vector<float>(ctx_p.size()), {}};
    AttnLayerParams grad(cfg);
    layer.reshard(shard);
    const std::int64_t Qp = shard.own_query_rows(), Cp = shard.context_rows(), H = cfg.hidden;
    CpSaved saved = layer.forward(pb.w, view_of(x_p, {Qp, H}), view_of(ctx_p, {Cp, H}), view_of(o.y, {Qp, H}));
    layer.backward(std::move(saved), pb.w, view_of(dy_p, {Qp, H}), view_of(o.dx, {Qp, H}), view_of(o.dctx, {Cp, H}), grad);
    o.grad.assign(grad.all().begin(), grad.all().end());
    return o;
  };
  CpShard plain = chunked_shard(batch, P, p, make_balancer("lpt")->plan(batch, cost, P, 4).chunks_of_rank());
  CpShard padded = plain;
  padded.bucket = 256;
  EXPECT_EQ(padded.mask().key_rows() % 256, 0);
  SplitKVLayer a(comm, cfg, plain), b(comm, cfg, padded);
  const Out x = run(a, plain), y = run(b, padded);
  EXPECT_EQ(x.y, y.y);
  EXPECT_EQ(x.dx, y.dx);
  EXPECT_EQ(x.dctx, y.dctx);
  EXPECT_EQ(x.grad, y.grad);

  // Next step: another plan (zigzag), same bucket -> same padded length on this small problem.
  CpShard next = chunked_shard(batch, P, p, make_balancer("zigzag")->plan(batch, cost, P, 4).chunks_of_rank());
  next.bucket = 256;
  if (next.mask().key_rows() == padded.mask().key_rows()) {
    const std::int64_t before = b.allocations();
    run(b, next);
    EXPECT_EQ(b.allocations(), before);
  }
}

}  // namespace
}  // namespace diffcp
