// A program that uses the installed diffcp package (find_package(diffcp) or pkg-config): plan a
// packed batch with the LPT balancer, hand each rank its chunks, and run one Split-KV attention
// layer forward and backward under MPI.
//
//   mpirun -np 2 ./splitkv_layer            prints each rank's load and the bytes moved
//
// Every rank plans alike (planning needs no communication), builds its shard from the plan, and
// the layer's collectives move only Q-sized tensors: the bytes do not grow with the context.
#include <cstdio>
#include <vector>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/workload/batch.hpp"

int main(int argc, char** argv) {
  return diffcp::run_mpi_main(argc, argv, [](diffcp::Communicator& world) {
    using namespace diffcp;
    const int P = world.size(), p = world.rank();
    // 2 samples of 2048 tokens, 16 anchors each (blocks of B = 16), 25 % prompt; seeded.
    const PackedBatch batch = make_random_batch(2, 2048, 16, 16, 0.25, 1);
    const CostModel cost(batch);
    const Plan plan = make_balancer("lpt")->plan(batch, cost, P, /*J=*/4);
    const PlanLoad load = plan_load(batch, cost, plan);
    const CpShard shard = chunked_shard(batch, P, p, plan.chunks_of_rank());

    const AttnLayerConfig cfg{/*hidden=*/128, /*n_q=*/4, /*n_kv=*/2, /*d_h=*/32};
    AttnLayerParams w(cfg), grad(cfg);
    w.init_random(7);
    SplitKVLayer layer(world, cfg, shard);
    const std::int64_t Qp = shard.own_query_rows(), Cp = shard.context_rows(), H = cfg.hidden;
    std::vector<float> x(Qp * H, 0.5f), ctx(Cp * H, 0.25f), y(Qp * H), dy(Qp * H, 1.f), dx(Qp * H), dctx(Cp * H);

    world.stats().reset();
    CpSaved saved = layer.forward(w, view_of(x, {Qp, H}), view_of(ctx, {Cp, H}), view_of(y, {Qp, H}));
    layer.backward(std::move(saved), w, view_of(dy, {Qp, H}), view_of(dx, {Qp, H}), view_of(dctx, {Cp, H}), grad);
    std::printf("rank %d/%d: %lld context rows, %lld query rows, work %lld (rho %.3f), sent %llu bytes "
                "(closed form, mean over ranks: %.0f)\n",
                p, P, static_cast<long long>(Cp), static_cast<long long>(Qp),
                static_cast<long long>(load.rank_work[static_cast<std::size_t>(p)]), load.rho,
                static_cast<unsigned long long>(world.stats().total().bytes_sent), layer.predicted_bytes_per_layer());
    return 0;
  });
}
