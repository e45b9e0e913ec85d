#include "diffcp/balance/none.hpp"

namespace diffcp {

Plan NoBalancer::plan(const PackedBatch& batch, const CostModel&, int P, int) const {
  check_plan_args(name(), batch.context_rows(), P, 1);
  Plan plan{name(), P, 1, loader_slices(batch.context_rows(), P), {}};
  for (int p = 0; p < P; ++p) plan.rank.push_back(p);
  return plan;
}

}  // namespace diffcp
