#include "diffcp/core/stats.hpp"

#include <algorithm>

#include "diffcp/core/error.hpp"

namespace diffcp {

double median(std::vector<double> v) {
  DIFFCP_CHECK(!v.empty(), "median of an empty sample");
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  if (v.size() % 2 == 1) return *mid;
  return 0.5 * (*mid + *std::max_element(v.begin(), mid));
}

}  // namespace diffcp
