// Even contiguous sharding of n items over P ranks: rank p owns [p*n/P, (p+1)*n/P). Sizes differ
// by at most one; ranks may own nothing when n < P.
#pragma once

#include <cstdint>

#include "diffcp/core/error.hpp"

namespace diffcp {

struct Shard {
  std::int64_t begin, end;
  std::int64_t size() const { return end - begin; }
};

inline Shard even_shard(std::int64_t n, std::int64_t P, std::int64_t p) {
  DIFFCP_CHECK(n >= 0 && P >= 1 && 0 <= p && p < P, "even_shard: n = ", n, ", P = ", P, ", p = ", p,
               "; expected n >= 0, P >= 1, 0 <= p < P");
  return {p * n / P, (p + 1) * n / P};
}

}  // namespace diffcp
