// Zigzag (ring-flash-attention's causal balancing, applied per sample): each sample is cut into
// 2P chunks and rank p takes chunks p and 2P-1-p of every sample. Position-based: it ignores
// where the anchors are.
#pragma once

#include "diffcp/balance/balancer.hpp"

namespace diffcp {

class ZigzagBalancer final : public Balancer {
 public:
  const char* name() const override { return "zigzag"; }
  Plan plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const override;
};

}  // namespace diffcp
