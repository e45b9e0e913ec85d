#include "diffcp/balance/redistribute.hpp"

#include <algorithm>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp {

std::vector<float> redistribute_rows(Communicator& comm, const PackedBatch& batch, const Plan& plan,
                                     const std::vector<float>& rows, std::int64_t width) {
  const int P = comm.size(), p = comm.rank();
  const std::int64_t S = batch.context_rows();
  DIFFCP_CHECK(plan.P == P, "redistribute: plan for ", plan.P, " ranks on a communicator of ", P);
  plan.validate(S);
  const auto slices = loader_slices(S, P);
  const PosRange mine = slices[static_cast<std::size_t>(p)];
  DIFFCP_CHECK(static_cast<std::int64_t>(rows.size()) == (mine.end - mine.begin) * width, "redistribute: got ",
               rows.size(), " values, expected this rank's loader slice [", mine.begin, ", ", mine.end, ") x ", width);
  const auto owned = plan.chunks_of_rank();
  auto overlap = [](PosRange a, PosRange b) { return PosRange{std::max(a.begin, b.begin), std::min(a.end, b.end)}; };

  // To rank d: my slice intersected with d's chunks, in packed order.
  std::vector<std::size_t> send_counts(static_cast<std::size_t>(P), 0), recv_counts(static_cast<std::size_t>(P), 0);
  std::vector<float> send;
  send.reserve(rows.size());
  for (int d = 0; d < P; ++d)
    for (const PosRange& c : owned[static_cast<std::size_t>(d)]) {
      const PosRange o = overlap(c, mine);
      if (o.end <= o.begin) continue;
      send.insert(send.end(), rows.begin() + (o.begin - mine.begin) * width, rows.begin() + (o.end - mine.begin) * width);
      send_counts[static_cast<std::size_t>(d)] += static_cast<std::size_t>((o.end - o.begin) * width);
    }
  // From rank r: r's slice intersected with my chunks. Sources in rank order cover increasing
  // positions, so the concatenation is my chunks' rows in packed order.
  std::int64_t total = 0;
  for (int r = 0; r < P; ++r)
    for (const PosRange& c : owned[static_cast<std::size_t>(p)]) {
      const PosRange o = overlap(c, slices[static_cast<std::size_t>(r)]);
      if (o.end > o.begin) recv_counts[static_cast<std::size_t>(r)] += static_cast<std::size_t>((o.end - o.begin) * width);
    }
  for (std::size_t c : recv_counts) total += static_cast<std::int64_t>(c);
  std::vector<float> out(static_cast<std::size_t>(total));
  comm.all_to_all_v<float>(send, send_counts, out, recv_counts);
  return out;
}

}  // namespace diffcp
