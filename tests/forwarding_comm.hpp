// A toy second communicator backend for the tests of the communicator seam: it forwards the few
// operations the Split-KV layer needs (all_gather_v, reduce_scatter_v, all_reduce) to an inner
// communicator, leaves every other hook at its default, and has no fused log-sum-exp reduction —
// what a partial backend (NCCL: no user-defined reduction) looks like to the rest of diffcp.
#pragma once

#include "diffcp/comm/communicator.hpp"

namespace diffcp::test {

class ForwardingComm final : public Communicator {
 public:
  explicit ForwardingComm(Communicator& inner) : Communicator("toy"), inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend() const override { return "toy"; }
  bool supports_reduce(ReduceOp op, DType type) const override {
    return op != ReduceOp::logsumexp && inner_.supports_reduce(op, type);
  }

 protected:
  WorkPtr do_all_gather_v(const void* send, std::size_t, void* recv, std::span<const std::size_t> counts,
                          std::span<const std::size_t>, DType type) override {
    return inner_.all_gather_v_async(send, recv, counts, type);
  }
  WorkPtr do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, DType type,
                              ReduceOp op) override {
    return inner_.reduce_scatter_v_async(send, recv, counts, type, op);
  }
  WorkPtr do_all_reduce(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override {
    return inner_.all_reduce_async(send, recv, count, type, op);
  }

 private:
  Communicator& inner_;
};

}  // namespace diffcp::test
