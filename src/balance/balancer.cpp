#include "diffcp/balance/balancer.hpp"

#include "diffcp/balance/lpt.hpp"
#include "diffcp/balance/none.hpp"
#include "diffcp/balance/partition.hpp"
#include "diffcp/balance/zigzag.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp {

const std::vector<std::string>& balancer_names() {
  static const std::vector<std::string> names{"none", "zigzag", "lpt", "partition"};
  return names;
}

std::unique_ptr<Balancer> make_balancer(const std::string& name) {
  if (name == "none") return std::make_unique<NoBalancer>();
  if (name == "zigzag") return std::make_unique<ZigzagBalancer>();
  if (name == "lpt") return std::make_unique<LptBalancer>();
  if (name == "partition") return std::make_unique<PartitionBalancer>();
  DIFFCP_FAIL("unknown balancer '", name, "', expected one of none, zigzag, lpt, partition");
}

std::vector<PosRange> equal_chunks(std::int64_t S, std::int64_t n) {
  std::vector<PosRange> out;
  if (n <= 0) return out;
  DIFFCP_CHECK(S >= 0, "equal_chunks: S = ", S, ", expected >= 0");
  out.reserve(static_cast<std::size_t>(n));
  // even_shard(S, n, j) for every j, one division each: chunk j ends where j + 1 begins.
  for (std::int64_t j = 0, begin = 0; j < n; ++j) {
    const std::int64_t end = (j + 1) * S / n;
    out.push_back({begin, end});
    begin = end;
  }
  return out;
}

std::vector<PosRange> loader_slices(std::int64_t S, int P) { return equal_chunks(S, P); }

void check_plan_args(const char* balancer, std::int64_t S, int P, int J) {
  DIFFCP_CHECK(P >= 1, balancer, ": P = ", P, ", expected >= 1");
  DIFFCP_CHECK(J >= 1, balancer, ": J = ", J, ", expected >= 1");
  DIFFCP_CHECK(static_cast<std::int64_t>(P) * J <= S, balancer, ": P*J = ", static_cast<std::int64_t>(P) * J,
               " chunks exceed the ", S, " context rows; lower J");
}

}  // namespace diffcp
