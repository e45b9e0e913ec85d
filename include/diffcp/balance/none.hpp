// No balance: contiguous S/P slices (the loader's layout, so nothing moves).
#pragma once

#include "diffcp/balance/balancer.hpp"

namespace diffcp {

class NoBalancer final : public Balancer {
 public:
  const char* name() const override { return "none"; }
  Plan plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const override;
};

}  // namespace diffcp
