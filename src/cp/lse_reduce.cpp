#include "diffcp/cp/lse_reduce.hpp"

#include <cmath>
#include <limits>
#include <vector>

namespace diffcp {

int lse_all_reduces(const Communicator& comm, LseReduce how) {
  return how == LseReduce::best && comm.supports_reduce(ReduceOp::logsumexp, DType::f32) ? 1 : 2;
}

void all_reduce_lse(Communicator& comm, std::span<float> lse, CollAlgo algo, LseReduce how) {
  if (lse_all_reduces(comm, how) == 1) {
    comm.all_reduce<float>(lse, ReduceOp::logsumexp, algo);
    return;
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> m(lse.begin(), lse.end());
  comm.all_reduce<float>(std::span<float>(m), ReduceOp::max, algo);
  // exp(lse_p - m) in [0, 1]: no overflow; a row no rank saw (m = -inf) contributes 0.
  for (std::size_t i = 0; i < lse.size(); ++i) lse[i] = m[i] == kNegInf ? 0.f : std::exp(lse[i] - m[i]);
  comm.all_reduce<float>(lse, ReduceOp::sum, algo);
  for (std::size_t i = 0; i < lse.size(); ++i) lse[i] = m[i] == kNegInf ? kNegInf : m[i] + std::log(lse[i]);
}

}  // namespace diffcp
