// DCP-style baseline: a real graph partitioner (METIS k-way) on the chunk attention graph. The
// paper's DCP partitions a hypergraph with KaHyPar; here vertices are the P*J equal chunks weighted
// by their price (the cost model), and edges join chunks of one sample weighted by the blocks that
// see both (a clique per sample; cutting an edge splits a block's context across ranks). METIS
// balances vertex weight within its ufactor (0.1 % asked). A baseline: it works and is measured,
// not tuned.
#pragma once

#include "diffcp/balance/balancer.hpp"

namespace diffcp {

class PartitionBalancer final : public Balancer {
 public:
  const char* name() const override { return "partition"; }
  Plan plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const override;
};

}  // namespace diffcp
