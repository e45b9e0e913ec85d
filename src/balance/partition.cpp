#include "diffcp/balance/partition.hpp"

#include <algorithm>

#include <metis.h>

#include "diffcp/core/error.hpp"

namespace diffcp {

Plan PartitionBalancer::plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const {
  const std::int64_t S = batch.context_rows();
  check_plan_args(name(), S, P, J);
  Plan plan{name(), P, J, equal_chunks(S, static_cast<std::int64_t>(P) * J), {}};
  const std::size_t n = plan.chunks.size();
  plan.rank.assign(n, 0);
  if (P == 1) return plan;

  // Vertex weights: chunk prices scaled so their sum fits METIS' 32-bit idx_t; +1 keeps every
  // weight positive (zero-cost chunks still hold rows).
  std::vector<std::int64_t> price(n);
  std::int64_t total = 0;
  for (std::size_t j = 0; j < n; ++j) total += price[j] = cost.range_cost(plan.chunks[j].begin, plan.chunks[j].end);
  const std::int64_t scale = std::max<std::int64_t>(1, total / (std::int64_t{1} << 28));
  std::vector<idx_t> vwgt(n);
  for (std::size_t j = 0; j < n; ++j) vwgt[j] = static_cast<idx_t>(price[j] / scale + 1);

  // Edges: the chunk co-access graph (the chunk/block attention graph projected onto chunks).
  // Two chunks of one sample are joined with weight = the blocks that see both = the blocks that
  // see the later chunk's first row (c(x) / B; +1 keeps it positive; with several layers or
  // sliding windows, c(x) / B is that count weighted by the rows that reach x). A clique per sample:
  // O((PJ/b)^2) edges, DCP-like planning cost.
  const auto starts = batch.sample_starts();
  auto sample_of = [&](std::int64_t x) { return std::upper_bound(starts.begin(), starts.end(), x) - starts.begin(); };
  std::vector<idx_t> xadj(n + 1, 0), adjncy, adjwgt;
  std::vector<std::vector<std::pair<idx_t, idx_t>>> nbr(n);
  std::size_t first = 0;  // first chunk of the current sample
  for (std::size_t k = 0; k < n; ++k) {
    if (plan.chunks[k].begin == plan.chunks[k].end) continue;
    if (sample_of(plan.chunks[k].begin) != sample_of(plan.chunks[first].begin)) first = k;
    const auto w = static_cast<idx_t>(cost.position_cost(plan.chunks[k].begin) / batch.block + 1);
    for (std::size_t j = first; j < k; ++j) {
      nbr[j].push_back({static_cast<idx_t>(k), w});
      nbr[k].push_back({static_cast<idx_t>(j), w});
    }
  }
  for (std::size_t j = 0; j < n; ++j) {
    for (const auto& [v, w] : nbr[j]) adjncy.push_back(v), adjwgt.push_back(w);
    xadj[j + 1] = static_cast<idx_t>(adjncy.size());
  }
  idx_t nvtxs = static_cast<idx_t>(n), ncon = 1, nparts = P, objval = 0;
  idx_t options[METIS_NOPTIONS];
  METIS_SetDefaultOptions(options);
  options[METIS_OPTION_UFACTOR] = 1;   // allow 0.1 % imbalance
  options[METIS_OPTION_SEED] = 1;      // deterministic: every rank computes the same plan
  std::vector<idx_t> part(n, 0);
  const int rc = METIS_PartGraphKway(&nvtxs, &ncon, xadj.data(), adjncy.empty() ? nullptr : adjncy.data(),
                                     vwgt.data(), nullptr, adjwgt.empty() ? nullptr : adjwgt.data(), &nparts,
                                     nullptr, nullptr, options, &objval, part.data());
  DIFFCP_CHECK(rc == METIS_OK, "partition: METIS_PartGraphKway failed with status ", rc, " (P = ", P, ", ", n,
               " chunks)");
  for (std::size_t j = 0; j < n; ++j) plan.rank[j] = static_cast<int>(part[j]);
  return plan;
}

}  // namespace diffcp
