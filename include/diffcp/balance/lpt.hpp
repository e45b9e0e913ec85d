// Cost-aware LPT (SPEC A.3, the paper's balancer): P*J global chunks priced by the cost model,
// longest price first to the least-loaded rank that has fewer than J chunks; then a locality
// matching maps the P bundles to physical ranks so that as many rows as possible stay where the
// loader put them (loads unchanged). O(PJ log P + A) for A anchors: prices in one sweep, one
// log2 P tree climb per chunk, and the price order and the matching's pair order by radix sort,
// O(PJ) per 12 bits of key.
#pragma once

#include "diffcp/balance/balancer.hpp"

namespace diffcp {

class LptBalancer final : public Balancer {
 public:
  const char* name() const override { return "lpt"; }
  Plan plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const override;
};

}  // namespace diffcp
