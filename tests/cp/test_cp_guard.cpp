// The CP methods (cp/cp_methods.hpp) on the guard device (testing/guard_backend.hpp): inputs, parameters, outputs,
// gradients, saved activations and every scratch buffer live in guard memory, which the host
// cannot touch outside the backend's ops and copies, and the communicator stages the collectives
// through host buffers (comm/communicator.hpp, "Device memory"). Forward + backward at every rank
// count, f32 and bf16 (Split-KV: --oproj all and owned, flat and hierarchical collectives): the results equal
// the same layer's on the CPU backend bit for bit (and, in f32, the fp64 reference). A host loop
// over device memory left anywhere in the method faults the test. DIFFCP_TEST_DEVICE=cuda runs
// the same on a GPU (tests/support/device_under_test.hpp): within bounds of the CPU's run, and the f32
// layer against the fp64 reference.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/cp/lse_reduce.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "diffcp/testing/layer_problem.hpp"
#include "error_of.hpp"
#include "device_under_test.hpp"
#include "forwarding_comm.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

struct Result {
  std::vector<float> y, dx, dctx, grad;
};

// One forward + backward of `method` on backend b (its memory holds every tensor), grads summed.
Result run(Backend& b, Communicator& comm, const CpMethod& method, const LayerProblem& pb, const CpShard& shard,
           const SplitKVOptions& opt) {
  ScopedBackend use(b);
  const AttnLayerConfig& cfg = pb.cfg;
  const std::int64_t Qp = shard.own_query_rows(), Cp = shard.context_rows(), H = cfg.hidden;
  const auto up = [&](const std::vector<float>& v) { return to_device(std::span<const float>(v), b); };
  const Buffer x = up(pb.x_rows(shard)), ctx = up(pb.ctx_rows(shard)), dy = up(pb.dy_rows(shard));
  const Buffer w_mem = to_device(pb.w.all(), b);
  Buffer grad_mem(DType::f32, AttnLayerParams::count(cfg), b), y(DType::f32, Qp * H, b), dx(DType::f32, Qp * H, b),
      dctx(DType::f32, Cp * H, b);
  fill(grad_mem.view(), 0.f);
  const AttnLayerParams w = AttnLayerParams::view(cfg, w_mem.ptr<float>());
  AttnLayerParams grad(cfg, grad_mem.ptr<float>());
  {
    std::unique_ptr<CpAttentionLayer> layer = method.make(comm, cfg, shard, opt);
    CpSaved saved = layer->forward(w, x.view({Qp, H}), ctx.view({Cp, H}), y.view({Qp, H}));
    layer->backward(std::move(saved), w, dy.view({Qp, H}), dx.view({Qp, H}), dctx.view({Cp, H}), grad);
  }
  allreduce_grads(comm, grad);
  return {to_host<float>(y.view()), to_host<float>(dx.view()), to_host<float>(dctx.view()),
          to_host<float>(grad_mem.view())};
}

struct Mode {
  DType compute;
  OProj oproj;
  CollAlgo collectives;
  std::string name() const {
    return std::string(dtype_name(compute)) + " oproj " + oproj_name(oproj) + " " + coll_algo_name(collectives);
  }
};

class CpOnGuardDevice : public ::testing::TestWithParam<const char*> {};

TEST_P(CpOnGuardDevice, EqualsTheCpuRunBitForBit) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  std::unique_ptr<Communicator> comm = test::world().split(0, test::world().rank(), "cp");
  const int P = comm->size(), p = comm->rank();
  comm->set_topology(p < (P + 1) / 2 ? 0 : 1);
  AttnLayerConfig cfg;
  cfg.hidden = 48, cfg.n_q = 4, cfg.n_kv = 2, cfg.d_h = 16;
  const PackedBatch batch = make_random_batch(3, 150, 5, 4, 0.25, 3);
  const LayerProblem pb(cfg, batch, 5);
  const CpShard shard = contiguous_shard(batch, P, p);
  const ReferenceLayerResult ref = pb.reference();
  const CpMethod& method = cp_method(GetParam());
  const std::string why = method.unsupported_reason(cfg, P);
  if (!why.empty()) GTEST_SKIP() << why;
  // Split-KV reads oproj and collectives; the others run their one way in each compute dtype.
  const std::vector<OProj> oprojs = method.splitkv_options ? std::vector{OProj::all, OProj::owned} : std::vector{OProj::all};
  const std::vector<CollAlgo> colls = method.splitkv_options ? std::vector{CollAlgo::flat, CollAlgo::hierarchical}
                                                             : std::vector{CollAlgo::flat};
  for (DType compute : {DType::f32, DType::bf16})
    for (OProj oproj : oprojs)
      for (CollAlgo coll : colls) {
        const Mode m{compute, oproj, coll};
        SCOPED_TRACE(m.name());
        const SplitKVOptions opt{oproj, coll, compute};
        const Result cpu = run(cpu_backend(), *comm, method, pb, shard, opt);
        const std::uint64_t staged = comm->staging().calls;
        const Result guard = run(dev, *comm, method, pb, shard, opt);
        EXPECT_GT(comm->staging().calls, staged);  // the collectives really ran on device memory
        const double bound = test::device_bound(compute);
        EXPECT_TRUE(test::matches_cpu(cpu.y, guard.y, bound));
        EXPECT_TRUE(test::matches_cpu(cpu.dx, guard.dx, bound));
        EXPECT_TRUE(test::matches_cpu(cpu.dctx, guard.dctx, bound));
        EXPECT_TRUE(test::matches_cpu(cpu.grad, guard.grad, bound));
        if (compute == DType::f32) {
          const AttnLayerParams g = AttnLayerParams::view(cfg, guard.grad.data());
          EXPECT_TRUE(check_layer(ref, shard, cfg.hidden, guard.y, guard.dx, guard.dctx, g).pass());
        }
      }
}

// A communicator without the fused log-sum-exp reduction (NCCL's case, tests/support/forwarding_comm.hpp):
// Split-KV's lse all-reduce then runs as max + sum with the lse_shift op in between, on guard memory.
TEST(CpOnGuardDevice, SplitKVWithoutAFusedLseReductionEqualsTheCpuRun) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  test::ForwardingComm comm(test::world());
  ASSERT_EQ(lse_all_reduces(comm), 2);
  AttnLayerConfig cfg;
  cfg.hidden = 48, cfg.n_q = 4, cfg.n_kv = 2, cfg.d_h = 16;
  const PackedBatch batch = make_random_batch(3, 150, 5, 4, 0.25, 3);
  const LayerProblem pb(cfg, batch, 5);
  const CpShard shard = contiguous_shard(batch, comm.size(), comm.rank());
  for (DType compute : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(compute));
    const SplitKVOptions opt{OProj::all, CollAlgo::flat, compute};
    const Result cpu = run(cpu_backend(), comm, cp_method("splitkv"), pb, shard, opt);
    const Result guard = run(dev, comm, cp_method("splitkv"), pb, shard, opt);
    const double bound = test::device_bound(compute);
    EXPECT_TRUE(test::matches_cpu(cpu.y, guard.y, bound));
    EXPECT_TRUE(test::matches_cpu(cpu.dx, guard.dx, bound));
    EXPECT_TRUE(test::matches_cpu(cpu.dctx, guard.dctx, bound));
    EXPECT_TRUE(test::matches_cpu(cpu.grad, guard.grad, bound));
  }
}

// Ring and LV-XAttn over a tagless transport (NCCL's point-to-point: messages between two ranks
// match in posting order): each rank posts its receives in the order its peer sends, so the layer
// still equals the fp64 reference (at P >= 4 the accumulators and the next K/V or queries interleave).
TEST(CpMethodsTagless, RingAndLvxattnReceiveInTheOrderTheirPeersSend) {
  test::TaglessComm comm(test::world());
  AttnLayerConfig cfg;
  cfg.hidden = 48, cfg.n_q = 4, cfg.n_kv = 2, cfg.d_h = 16;
  const PackedBatch batch = make_random_batch(3, 150, 5, 4, 0.25, 3);
  const LayerProblem pb(cfg, batch, 5);
  const CpShard shard = contiguous_shard(batch, comm.size(), comm.rank());
  const ReferenceLayerResult ref = pb.reference();
  for (const char* name : {"ring", "lvxattn"}) {
    SCOPED_TRACE(name);
    const Result r = run(cpu_backend(), comm, cp_method(name), pb, shard, SplitKVOptions{});
    const AttnLayerParams g = AttnLayerParams::view(cfg, r.grad.data());
    EXPECT_TRUE(check_layer(ref, shard, cfg.hidden, r.y, r.dx, r.dctx, g).pass());
  }
}

// A layer runs on the backend it was sized on.
TEST(CpOnGuardDevice, ALayerRefusesAnotherBackend) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  std::unique_ptr<Communicator> comm = test::world().split(0, test::world().rank(), "cp");
  AttnLayerConfig cfg;
  cfg.hidden = 48, cfg.n_q = 4, cfg.n_kv = 2, cfg.d_h = 16;
  const PackedBatch batch = make_random_batch(2, 60, 2, 4, 0.25, 3);
  const LayerProblem pb(cfg, batch, 5);
  const CpShard shard = contiguous_shard(batch, comm->size(), comm->rank());
  const std::int64_t Qp = shard.own_query_rows(), Cp = shard.context_rows(), H = cfg.hidden;
  std::vector<float> x = pb.x_rows(shard), ctx = pb.ctx_rows(shard), y(x.size());
  std::unique_ptr<CpAttentionLayer> layer = cp_method("splitkv").make(*comm, cfg, shard);  // on the CPU
  const auto forward = [&] { layer->forward(pb.w, view_of(x, {Qp, H}), view_of(ctx, {Cp, H}), view_of(y, {Qp, H})); };
  {
    ScopedBackend guard(dev);
    EXPECT_NE(error_of(forward).find(std::string("the active backend is '") + dev.name() + "', but the layer's buffers were sized on 'cpu'"),
              std::string::npos);
  }
  EXPECT_EQ(error_of(forward), "");
}

INSTANTIATE_TEST_SUITE_P(Method, CpOnGuardDevice, ::testing::Values("splitkv", "ulysses", "ring", "ringx", "lvxattn"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace diffcp
