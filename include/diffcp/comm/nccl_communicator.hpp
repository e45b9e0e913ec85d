// NCCL implementation of the Communicator interface (issue #55): the GPU's collectives, on NCCL's
// own stream (c10d's design, issue #65): each operation first makes that stream wait for an event
// recorded on the CUDA backend's compute stream (cuda/backend.hpp, cuda_stream()), so it reads what
// the kernels issued before it wrote, and the compute stream runs on meanwhile: communication
// overlaps the compute issued between an operation and its wait. Built with -DDIFFCP_CUDA=ON only.
//
// Bootstrap: MPI only finds the peers. The constructor duplicates an MPI communicator, rank 0
// makes an ncclUniqueId and broadcasts it over it, and every rank joins on the CUDA backend's
// device (device 0: one GPU per process, so P > 1 on one node needs each rank to see its own GPU,
// e.g. through CUDA_VISIBLE_DEVICES). The MPI duplicate stays for split(), split_node_local() and
// the watchdog's reports.
//
// Memory: reads_device(the CUDA backend's device) is true, so the base class hands device pointers
// over as they are. NCCL cannot read host memory, and host buffers still arrive (the base class's
// own set-up exchanges, the host buffers of a hierarchical operation, callers' std::vectors): each
// goes through a temporary device buffer, copied in when the operation is issued and copied back
// when its Work completes, counted in host_staging() (the base class's staging() stays 0).
//
// Operations: all_gather, reduce_scatter, all_reduce and broadcast are NCCL's own; the v-variants,
// all_to_all and send / recv are ncclSend / ncclRecv in one ncclGroupStart / ncclGroupEnd (a
// rank's block to itself: a device copy); reduce_scatter_v is one ncclReduce per root, grouped;
// barrier is a one-element all-reduce. Data moves as bytes; reductions in the NCCL type.
// Reductions: sum and max on every type but u16 / bf16 (storage types), and bf16 sum (NCCL adds
// in f32 and rounds), as the MPI backend; logsumexp nowhere, so all_reduce_lse (cp/lse_reduce.hpp)
// runs its max + sum fallback.
//
// Works ("ordered completion", communicator.hpp): an operation records a CUDA event on NCCL's
// stream after it; test() queries the event (and NCCL's asynchronous error). wait() makes the
// compute stream wait for the event and returns (no host block): the ops issued after it see the
// data. synchronize() is the host wait (polls test()). Where host memory receives data (copied
// back from a device temporary at completion) and for barrier(), wait() is the host wait too.
//
// Point-to-point is deferred (and exchange_async's hop is one group of its own: the callers in
// cp/ and dit/ use it), because NCCL on one stream would deadlock on diffcp's ring pattern:
// every rank posts recv_async(prev) then send_async(next) and waits later; issued one by one,
// each rank's ncclRecv would block the stream ahead of its own ncclSend. So send_async /
// recv_async only queue the transfer (a host source is copied to the device at once); the queue
// is issued, in order, inside one ncclGroupStart / ncclGroupEnd when any of its Works is waited or
// tested, or before the next collective on this communicator (collectives keep their order after
// the transfers issued before them). Consequences: (1) a lone send_async reaches NCCL's stream only
// then (exchange_async's hop is issued at once, and overlaps the compute after it: Ring, RingX,
// LV-XAttn, USP's ring and the DiT's gathers use it); (2) do not block outside this communicator
// on something that needs the peer to have received a deferred send (wait or test its Work first).
//
// Tags: NCCL has none. Messages between two ranks match in the order they were issued, whatever
// their tags, so a caller must post its receives in the order its peer sends (MPI would match them
// by tag). A group completes as a whole and a send may wait for its receive, so a send and its
// receive must fall in the same group on both ranks. The rendezvous communicator
// (comm/rendezvous_communicator.hpp) models all of this on MPI; the CP suite, the DiT and the
// trainer run on it (ctest -R rendezvous).
//
// Watchdog (comm/watchdog.cpp): an operation past the timeout in synchronize()/test() is caught
// there as with MPI; the reports travel over the MPI duplicate. A wait() hands the operation to a
// thread of this communicator that polls its event: past the deadline it prints the operation
// ("all_gather (collective 12) on 'cp' did not complete after 600 s on the device") and ends the
// process, and mpirun the job (the host thread may be anywhere; the thread never touches the NCCL
// communicator). The destructor waits for the watched operations first. After the exchange the
// NCCL communicator is aborted (ncclCommAbort ends a kernel stuck waiting for a peer); every later
// operation on it throws. An NCCL asynchronous error (a peer lost) is thrown from test()/wait()
// the same way, after aborting the communicator.
//
// Errors: every NCCL, CUDA and MPI call is checked; a failure throws diffcp::Error naming the call
// and NCCL's / CUDA's / MPI's message.
//
// Lifetime: a Work must complete (or be destroyed) before its communicator is destroyed.
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "diffcp/comm/communicator.hpp"

struct ncclComm;    // ncclComm_t
struct CUstream_st; // cudaStream_t
struct CUevent_st;  // cudaEvent_t

namespace diffcp {

class NcclWork;
struct NcclDone;

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap` (every one of its ranks calls it, as MPI_Comm_dup): the NCCL
  // communicator of its ranks, with its rank numbers. An error naming why when the CUDA backend
  // has no device (cuda_device_present).
  NcclCommunicator(MPI_Comm bootstrap, std::string name);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  // sum and max on every type but u16 / bf16, bf16 sum; no logsumexp (see the header comment).
  bool supports_reduce(ReduceOp op, DType type) const override;
  // The CUDA backend's device only: NCCL cannot read host memory (host buffers go through
  // host_staging()).
  bool reads_device(Device d) const override { return d == device_; }
  // Host buffers run through temporary device buffers: calls = operations with a host buffer,
  // bytes_to_device = host data copied in, bytes_to_host = received data copied back.
  const StagingStats& host_staging() const { return host_staging_; }

 protected:
  // send: [count], recv: [size() * count].
  WorkPtr do_all_gather(const void* send, void* recv, std::size_t count, DType type) override;
  // send: [counts[rank()]], recv: [sum(counts)], rank r's block at displs[r].
  WorkPtr do_all_gather_v(const void* send, std::size_t send_count, void* recv, std::span<const std::size_t> counts,
                          std::span<const std::size_t> displs, DType type) override;
  // send: [size() * count], recv: [count].
  WorkPtr do_reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override;
  // send: [sum(counts)], recv: [counts[rank()]].
  WorkPtr do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, DType type,
                              ReduceOp op) override;
  // send, recv: [count]; send == recv in place.
  WorkPtr do_all_reduce(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override;
  // send, recv: [size() * count].
  WorkPtr do_all_to_all(const void* send, void* recv, std::size_t count, DType type) override;
  // send: [sum(send_counts)], recv: [sum(recv_counts)], blocks at the displacements.
  WorkPtr do_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                          std::span<const std::size_t> send_displs, void* recv,
                          std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                          DType type) override;
  // buf: [count].
  WorkPtr do_broadcast(void* buf, std::size_t count, DType type, int root) override;
  // buf: [count]; deferred (see the header comment); the tag is not used.
  WorkPtr do_send(const void* buf, std::size_t count, DType type, int dst, int tag) override;
  WorkPtr do_recv(void* buf, std::size_t count, DType type, int src, int tag) override;
  WorkPtr do_barrier() override;
  // exchange_async's hop: the queue before it, then the hop, each one group.
  void do_group_begin() override { flush(); }
  void do_group_end() override { flush(); }
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;
  std::unique_ptr<Communicator> do_split_node_local(const std::string& name) override;
  std::vector<std::optional<WatchdogReport>> do_watchdog_exchange(const WatchdogReport& mine,
                                                                  std::span<const int> wanted,
                                                                  double grace_s) override;

 private:
  friend class NcclWork;
  NcclCommunicator(MPI_Comm owned, std::string name, bool /*adopt*/);
  void join();  // the NCCL communicator over boot_ (constructors)
  // A Work for one operation on the stream; flushes the deferred transfers first, and orders
  // NCCL's stream after the compute stream.
  std::unique_ptr<NcclWork> start();
  void after_compute();  // NCCL's stream waits for what the compute stream has issued so far
  // The device-side watch of an operation the compute stream waits for (see the header comment).
  void watch(std::shared_ptr<NcclDone> done, std::chrono::steady_clock::time_point deadline, const std::string& what);
  void watch_loop();
  // Issues the deferred transfers in one group (nothing when there are none).
  void flush();
  // Drops the deferred transfer of a Work destroyed before it was issued (during unwinding).
  void cancel(const std::shared_ptr<NcclDone>& done) noexcept;
  // Throws if the communicator was aborted, or aborts it and throws on an NCCL asynchronous error.
  void check_alive();
  void abort_nccl() noexcept;
  // send / recv's pieces in the group (an element count in bytes; 0 bytes: nothing).
  void group_send(const void* buf, std::size_t bytes, int peer);
  void group_recv(void* buf, std::size_t bytes, int peer);
  // A device copy on the stream (a rank's own block of an all-to-all or all-gather).
  void copy_on_stream(void* dst, const void* src, std::size_t bytes);

  struct Deferred {
    bool send;
    void* buf;  // device memory
    std::size_t bytes;
    int peer;
    std::shared_ptr<NcclDone> done;  // recorded when the queue is issued
  };

  MPI_Comm boot_ = MPI_COMM_NULL;  // duplicate of the bootstrap communicator (split, watchdog)
  ncclComm* comm_ = nullptr;        // null once aborted
  CUstream_st* stream_ = nullptr;   // NCCL's own
  CUstream_st* compute_ = nullptr;  // the CUDA backend's
  CUevent_st* ready_ = nullptr;     // recorded on compute_ before each operation, waited by stream_
  Device device_ = Device::host;    // the CUDA backend's
  int rank_ = 0, size_ = 1;
  bool aborted_ = false;
  std::int32_t* barrier_word_ = nullptr;  // [1] on the device: the barrier's all-reduce
  std::vector<Deferred> deferred_;
  StagingStats host_staging_;
  struct Watched {
    std::shared_ptr<NcclDone> done;
    std::chrono::steady_clock::time_point deadline;
    std::string what;
    std::chrono::steady_clock::time_point since;  // when the compute stream began to wait for it
  };
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::vector<Watched> watched_;
  bool stop_watch_ = false;
  std::thread watchdog_;  // started at the first watched wait
};

}  // namespace diffcp
