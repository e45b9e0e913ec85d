#include "diffcp/cp/lse_reduce.hpp"

#include "diffcp/attention/merge.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

int lse_all_reduces(const Communicator& comm, LseReduce how) {
  return how == LseReduce::best && comm.supports_reduce(ReduceOp::logsumexp, DType::f32) ? 1 : 2;
}

void all_reduce_lse(Communicator& comm, std::span<float> lse, CollAlgo algo, LseReduce how) {
  const TensorView lse_v = device_view(lse);
  if (lse_all_reduces(comm, how) == 1) {
    comm.all_reduce_async(lse_v, ReduceOp::logsumexp, algo)->wait();
    return;
  }
  // In the backend's memory (as lse): the max, then exp(lse_p - m) in [0, 1] (no overflow; a row
  // no rank saw, m = -inf, contributes 0), summed, then m + log(sum).
  thread_local DeviceVector<float> m;
  m.resize(static_cast<std::int64_t>(lse.size()));
  device_copy(m.data(), lse.data(), static_cast<std::int64_t>(lse.size()));
  comm.all_reduce_async(m.view(), ReduceOp::max, algo)->wait();
  lse_shift_to_exp(lse, std::span<const float>(m.data(), lse.size()));
  comm.all_reduce_async(lse_v, ReduceOp::sum, algo)->wait();
  lse_shift_from_exp(lse, std::span<const float>(m.data(), lse.size()));
}

}  // namespace diffcp
