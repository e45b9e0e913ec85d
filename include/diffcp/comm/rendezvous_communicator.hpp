// The rendezvous communicator: NCCL's semantics made strict, on MPI, so that code written for the
// GPU's communicator is proven on a CPU (issue #65). `--comm rendezvous`, DIFFCP_COMM=rendezvous.
//
// What NCCL guarantees, and no more, is what a caller gets here:
//   1. A send completes only when its receive is posted (MPI_Issend, never an eager buffer), so a
//      pattern that works over MPI because small messages are buffered hangs here at any size.
//   2. Point-to-point is deferred and grouped as the NCCL communicator does it
//      (nccl_communicator.hpp): send_async / recv_async only queue; the queue is issued as ONE
//      group when one of its Works is waited or tested, before the next collective, or at the end
//      of an exchange_async hop. A group completes as a whole: none of its Works completes before
//      all its sends and receives have (NCCL's group is one kernel).
//   3. One stream: the groups and collectives of a communicator and of every communicator split
//      from it run one at a time, in the order this rank issued them (the NCCL communicator issues
//      them all on one CUDA stream). An operation starts only when the one before it completed.
//   4. No tags: messages between two ranks match in the order they were issued, whatever their
//      tags. Byte counts must agree exactly (NCCL's do); a mismatch is an error naming both.
//   5. A Work's completion is all the receiver may rely on. A receive buffer is filled with 0xFF
//      bytes (NaN for floats) when the operation is issued and gets the data only at completion;
//      send data is read when the operation starts (as a kernel reads it), from a copy checked
//      against the caller's buffer at completion. A buffer written while its operation is in
//      flight is an error naming the operation.
//   6. Reductions as NCCL has them: sum and max, bf16 sum, no logsumexp (all_reduce_lse falls back).
// Progress: an operation advances only inside a Work's wait() / test() on this rank (of any
// communicator of the family), as MPI progresses; split() first runs the stream empty (a GPU's
// stream would go on while the host blocks in the split). A cycle (each rank waiting on a group that needs
// a peer's later group) hangs, and the watchdog (DIFFCP_COMM_TIMEOUT / --comm-timeout) names it.
// Memory: host only (device buffers are staged by the base class, as for MPI).
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

class MpiCommunicator;
struct RendezvousStream;
struct RendezvousUnit;

class RendezvousCommunicator final : public Communicator {
 public:
  // Collective over `comm` (MPI_Comm_dup).
  RendezvousCommunicator(MPI_Comm comm, std::string name);
  ~RendezvousCommunicator() override;

  int rank() const override;
  int size() const override;
  std::string backend() const override { return "rendezvous"; }
  // As NCCL: sum and max on every type but u16 / bf16; bf16 sum; no logsumexp.
  bool supports_reduce(ReduceOp op, DType type) const override;

 protected:
  WorkPtr do_all_gather(const void* send, void* recv, std::size_t count, DType type) override;
  WorkPtr do_all_gather_v(const void* send, std::size_t send_count, void* recv, std::span<const std::size_t> counts,
                          std::span<const std::size_t> displs, DType type) override;
  WorkPtr do_reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override;
  WorkPtr do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, DType type,
                              ReduceOp op) override;
  WorkPtr do_all_reduce(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override;
  WorkPtr do_all_to_all(const void* send, void* recv, std::size_t count, DType type) override;
  WorkPtr do_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                          std::span<const std::size_t> send_displs, void* recv,
                          std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                          DType type) override;
  WorkPtr do_broadcast(void* buf, std::size_t count, DType type, int root) override;
  // Deferred into the open group (see the header comment); the tag is not used.
  WorkPtr do_send(const void* buf, std::size_t count, DType type, int dst, int tag) override;
  WorkPtr do_recv(void* buf, std::size_t count, DType type, int src, int tag) override;
  WorkPtr do_barrier() override;
  void do_group_begin() override { flush(); }
  void do_group_end() override { flush(); }
  void do_group_cancel() override { open_.reset(); }
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;
  std::unique_ptr<Communicator> do_split_node_local(const std::string& name) override;
  std::vector<std::optional<WatchdogReport>> do_watchdog_exchange(const WatchdogReport& mine,
                                                                  std::span<const int> wanted,
                                                                  double grace_s) override;

 private:
  friend struct RendezvousUnit;
  friend class RendezvousWork;
  RendezvousCommunicator(std::unique_ptr<MpiCommunicator> mpi, std::shared_ptr<RendezvousStream> stream,
                         std::string name);
  // Issues the open group (nothing when it is empty) onto the stream.
  void flush();
  // Runs the stream empty: before a blocking MPI call outside it (a split), where a GPU's stream
  // would go on by itself but this one advances only inside wait() / test().
  void drain();
  // A collective: the open group first, then the unit; returns its Work.
  WorkPtr enqueue(std::shared_ptr<RendezvousUnit> u);

  std::unique_ptr<MpiCommunicator> mpi_;     // the transport: its collectives, its MPI handle
  std::shared_ptr<RendezvousStream> stream_;  // shared with the communicators split from this one
  std::shared_ptr<RendezvousUnit> open_;      // the deferred send / recv group (null: none)
};

}  // namespace diffcp
