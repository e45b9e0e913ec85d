// Open MPI implementation of the Communicator interface: nonblocking MPI calls (MPI_Iallgatherv,
// MPI_Iallgather, MPI_Iallreduce, ...) whose requests are wrapped in a Work handle; reduce-scatter
// (uniform and v) is pairwise point-to-point + a local reduction in rank order (libnbc's is a
// reduce to one rank + scatter).
//
// Watchdog: the reports travel as point-to-point messages on the communicator with a reserved tag.
//
// Progress: Open MPI advances a nonblocking collective only inside MPI calls, so an operation
// overlaps compute only as far as the backend progresses it on its own (shared memory and TCP
// eager messages do; large rendezvous messages may wait for wait()). Work::test() drives progress.
#pragma once

#include <mpi.h>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

class MpiCommunicator final : public Communicator {
 public:
  // Wraps a duplicate of `comm` (so diffcp's traffic never matches user messages) with
  // MPI_ERRORS_RETURN so that MPI errors become diffcp::Error exceptions.
  MpiCommunicator(MPI_Comm comm, std::string name);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  // sum, max and logsumexp (a user-defined MPI operator) on every type but u16 / bf16; bf16 sum
  // (a user-defined operator adding in f32 and rounding each step).
  bool supports_reduce(ReduceOp op, DType type) const override;
  MPI_Comm handle() const { return comm_; }

 protected:
  WorkPtr do_all_gather(const void* send, void* recv, std::size_t count, DType type) override;
  WorkPtr do_reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override;
  WorkPtr do_all_to_all(const void* send, void* recv, std::size_t count, DType type) override;
  WorkPtr do_all_gather_v(const void* send, std::size_t send_count, void* recv,
                          std::span<const std::size_t> counts, std::span<const std::size_t> displs,
                          DType type) override;
  WorkPtr do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts,
                              DType type, ReduceOp op) override;
  WorkPtr do_all_reduce(const void* send, void* recv, std::size_t count, DType type,
                        ReduceOp op) override;
  WorkPtr do_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                          std::span<const std::size_t> send_displs, void* recv,
                          std::span<const std::size_t> recv_counts,
                          std::span<const std::size_t> recv_displs, DType type) override;
  WorkPtr do_broadcast(void* buf, std::size_t count, DType type, int root) override;
  WorkPtr do_send(const void* buf, std::size_t count, DType type, int dst, int tag) override;
  WorkPtr do_recv(void* buf, std::size_t count, DType type, int src, int tag) override;
  WorkPtr do_barrier() override;
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;
  std::unique_ptr<Communicator> do_split_node_local(const std::string& name) override;
  std::vector<std::optional<WatchdogReport>> do_watchdog_exchange(const WatchdogReport& mine,
                                                                  std::span<const int> wanted,
                                                                  double grace_s) override;

 private:
  friend class RendezvousCommunicator;  // its transport: these hooks on its copies of the buffers
  MpiCommunicator(MPI_Comm owned, std::string name, bool /*adopt*/);
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

// A communicator over `comm`'s ranks of the kind `kind` names: "mpi" (an MpiCommunicator),
// "rendezvous" (comm/rendezvous_communicator.hpp) or "nccl" (a CUDA build); anything else throws
// naming the choices (comm_kinds(), comm/mpi_runtime.hpp). Collective over comm.
std::unique_ptr<Communicator> make_communicator(const std::string& kind, MPI_Comm comm, const std::string& name);

// The watchdog's exchange over an MPI communicator (Communicator::do_watchdog_exchange): `mine`
// to every other rank on `tag`, then the others' reports for up to grace_s seconds or until every
// rank in `wanted` answered; never blocking on a peer. [size] entries (nullopt: no answer).
std::vector<std::optional<WatchdogReport>> mpi_watchdog_exchange(MPI_Comm comm, int tag, const WatchdogReport& mine,
                                                                 std::span<const int> wanted, double grace_s);

}  // namespace diffcp
