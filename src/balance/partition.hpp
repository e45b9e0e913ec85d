// DCP-style baseline: a real graph partitioner (METIS k-way) on the chunk attention graph. The
// paper's DCP partitions a hypergraph with KaHyPar; here vertices are the P*J equal chunks weighted
// by their price (the cost model), and edges join consecutive chunks of the same sample weighted
// by the blocks that see both (cutting them splits a sample's context across ranks). METIS
// balances vertex weight within its ufactor (1 %). A baseline: it works and is measured, not tuned.
#pragma once

#include "balance/balancer.hpp"

namespace diffcp {

class PartitionBalancer final : public Balancer {
 public:
  const char* name() const override { return "partition"; }
  Plan plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const override;
};

}  // namespace diffcp
