// A toy second communicator backend for the tests of the communicator seam: it forwards the few
// operations the Split-KV layer needs (all_gather_v, reduce_scatter_v, all_reduce) to an inner
// communicator, leaves every other hook at its default, and has no fused log-sum-exp reduction —
// what a partial backend (NCCL: no user-defined reduction) looks like to the rest of diffcp.
#pragma once

#include <string>

#include "diffcp/comm/communicator.hpp"

namespace diffcp::test {

class ForwardingComm : public Communicator {
 public:
  explicit ForwardingComm(Communicator& inner, std::string name = "toy") : Communicator(name), inner_(inner), name_(name) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend() const override { return name_; }
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
  Communicator& inner_;

 private:
  std::string name_;
};

// ForwardingComm plus all_gather, send and recv, with every point-to-point tag replaced by 0:
// messages between two ranks then match in the order they were posted, as on a tagless transport
// (NCCL's send / recv). A method whose receives are posted in another order than its peer's sends
// gets the wrong message (or a size error) here.
class TaglessComm final : public ForwardingComm {
 public:
  explicit TaglessComm(Communicator& inner) : ForwardingComm(inner, "tagless") {}

 protected:
  WorkPtr do_all_gather(const void* send, void* recv, std::size_t count, DType type) override {
    return inner_.all_gather_async(send, recv, count, type);
  }
  WorkPtr do_send(const void* buf, std::size_t count, DType type, int dst, int) override {
    return inner_.send_async(buf, count, type, dst, 0);
  }
  WorkPtr do_recv(void* buf, std::size_t count, DType type, int src, int) override {
    return inner_.recv_async(buf, count, type, src, 0);
  }
};

}  // namespace diffcp::test
