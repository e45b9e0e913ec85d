#include "diffcp/balance/zigzag.hpp"

#include "diffcp/core/error.hpp"
#include "diffcp/cp/shard.hpp"

namespace diffcp {

Plan ZigzagBalancer::plan(const PackedBatch& batch, const CostModel&, int P, int) const {
  check_plan_args(name(), batch.context_rows(), P, 1);
  Plan plan{name(), P, 2, {}, {}};
  const auto starts = batch.sample_starts();
  for (std::size_t u = 0; u < batch.lengths.size(); ++u)
    for (std::int64_t j = 0; j < 2 * P; ++j) {
      const Shard s = even_shard(batch.lengths[u], 2 * P, j);  // samples shorter than 2P leave empty chunks
      if (s.size() == 0) continue;
      plan.chunks.push_back({starts[u] + s.begin, starts[u] + s.end});
      plan.rank.push_back(static_cast<int>(j < P ? j : 2 * P - 1 - j));
    }
  return plan;
}

}  // namespace diffcp
