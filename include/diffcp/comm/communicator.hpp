// The one communicator interface. Every collective and point-to-point transfer of diffcp goes
// through it, so every byte moved is counted (per operation kind, per communicator).
//
// Backends (MPI; rendezvous: NCCL's semantics on MPI; NCCL in CUDA builds) implement the protected do_* hooks; the public methods validate
// arguments, count bytes and forward (non-virtual interface). Every operation has an async form
// returning a Work handle with wait(); the blocking forms are async + wait.
//
// Call order: like MPI, every rank of a communicator must issue the same sequence of collectives
// with matching sizes; point-to-point sends and receives must pair up. Violations are programming
// errors that a backend may detect (then it throws) or not (then the job hangs or aborts).
//
// Byte accounting (what "bytes_sent"/"bytes_recv" mean; an operation is counted once the backend
// has accepted it, so a rejected call leaves the counters unchanged): the logical volume that crosses between
// this rank and the other ranks, excluding a rank's copy to itself, independent of the algorithm the
// backend picks:
//   all_gather(v):       sent = my_count * (P-1);        recv = sum of the other ranks' counts
//   reduce_scatter(v):   sent = sum of others' counts;   recv = my_count * (P-1)
//   all_reduce(n):       as reduce_scatter + all_gather of near-equal shares (bandwidth-optimal):
//                        sent = recv = 2 * (n - share_p), share_p = n/P + (p < n%P)
//   all_to_all(v):       sent = sum of send counts to other ranks; recv = sum from other ranks
//   send / recv:         the message size (a self-send is counted, it is an explicit message)
//   broadcast(n, root):  root: sent = n * (P-1); others: recv = n
//   barrier:             calls only
// Once the communicator knows its topology (set_topology / discover_topology), bytes_sent_inter
// counts the part of bytes_sent addressed to ranks on other nodes, per peer as above (all_reduce:
// its reduce-scatter + all-gather decomposition, share_r + share_p to peer r).
//
// Hierarchical collectives (CollAlgo::hierarchical, needs a topology; node n has L_n ranks, N
// nodes). A rank r's block is handled in node n by local rank owner(r, n) = local(r) if r is in n,
// else local(r) mod L_n:
//   all_gather_v:     (1, inter) r sends its block to owner(r, n) of every other node n;
//                     (2, intra) an all_gather_v inside each node of what each rank holds.
//   reduce_scatter_v: (1, intra) a reduce_scatter_v inside the node to the owners;
//                     (2, inter) the owner sends the node's sum of block r to r; r adds the
//                     node sums in rank order of the senders. sum only, f32 / f64.
//   all_reduce:       all_reduce inside the node, all_reduce among the nodes' local rank 0,
//                     broadcast inside the node.
// Each node's data crosses to each other node once: summed over ranks, all_gather_v and
// reduce_scatter_v send sum(counts) * (N-1) inter-node and sum(counts) * (P-N) intra-node elements
// (flat: sum(counts) * (P-1) in all, sum_r counts[r] * (P - L_node(r)) of it inter-node);
// all_reduce(n) sends 2n(N-1) inter-node and 3n(P-N) intra-node. They count the bytes they really
// move, under their base kind. Reductions run in another order than flat: sums are equal to
// rounding, not bitwise (N = 1 or P = N: the flat path runs, bitwise). A hierarchical operation's
// later stages are issued inside its test()/wait(): while one is in flight, the communicator
// refuses every other collective and set_topology (it throws), so ranks cannot issue collectives
// in different orders.
//
// Device memory (comm/staging.cpp). A communicator learns where each buffer lives from the buffer
// itself, as CUDA-aware MPI does from a pointer's attributes: memory a registered device backend
// allocated is its device's (ops/backend.hpp backend_of, Backend::device_of), whatever backend is
// active; anything else the host's; a view's device must agree. So
// one operation may move host metadata and the next device rows, with nothing to switch. A
// backend that reads that device's memory itself (reads_device: NCCL will read the GPU's) gets
// the pointers as they are. Otherwise the base class stages: it copies the send data to host
// buffers through the copy of the backend the memory is of, runs the operation on them (a hierarchical one always
// runs on host buffers: its node sums are host code), and copies the received data back when the
// operation completes (wait / test): all of a recv's `count` elements, so a staged recv needs the
// exact size the sender sends. Those copies are counted in staging(), apart from the network
// bytes above, which stay the same.
//
// Watchdog (comm/watchdog.cpp). While watchdog_timeout() > 0, every operation must complete within
// that many seconds of being issued; otherwise its wait()/test() asks the other ranks where they
// are (each rank whose watchdog fires sends a WatchdogReport to all others and listens for up to
// min(2 s, timeout)) and throws diffcp::Error naming the operation, its collective sequence
// number, its size, the communicator and the ranks that had not arrived; under run_mpi_main that
// aborts the whole job. A rank that does not answer is stalled, busy outside the communicator,
// dead or unreachable. Timeout 0 (default, unless DIFFCP_COMM_TIMEOUT is set) is off: operations
// are not wrapped and nothing is checked.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "diffcp/core/dtype.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp {

// Displacements of blocks packed in order: the exclusive prefix sum of `counts`.
std::vector<std::size_t> displacements(std::span<const std::size_t> counts);

// sum and max: every backend. logsumexp: x (+) y = log(exp(x) + exp(y)), computed stably, -inf the
// identity (f32/f64), an OPTIONAL reduction (supports_reduce says whether a backend has it; NCCL
// does not): call it through cp/lse_reduce.hpp's all_reduce_lse, which falls back to max + sum.
enum class ReduceOp : std::uint8_t { sum, max, logsumexp };
const char* reduce_op_name(ReduceOp op);

enum class CommOp : std::uint8_t {
  all_gather, reduce_scatter, all_reduce, all_to_all, send, recv, broadcast, barrier, count_
};
inline constexpr std::size_t kNumCommOps = static_cast<std::size_t>(CommOp::count_);
const char* comm_op_name(CommOp op);

struct OpCounter {
  std::uint64_t calls = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_recv = 0;
  std::uint64_t bytes_sent_inter = 0;  // of bytes_sent, to ranks on other nodes (0 without a topology)
};

// Which node each rank of a communicator is on. Nodes are numbered by their lowest rank; a
// node's ranks are its local ranks 0 .. L_n - 1 in rank order.
struct Topology {
  std::vector<int> node_of;               // [P]
  std::vector<int> local_of;              // [P]
  std::vector<std::vector<int>> members;  // [N][L_n] ranks of node n, ascending
  int nodes() const { return static_cast<int>(members.size()); }
  int node_size(int n) const { return static_cast<int>(members[static_cast<std::size_t>(n)].size()); }
  bool same_node(int a, int b) const { return node_of[static_cast<std::size_t>(a)] == node_of[static_cast<std::size_t>(b)]; }
  // Local rank of node n that holds rank r's block in the hierarchical collectives.
  int owner(int r, int n) const;
  std::string describe() const;  // e.g. "2 nodes (2+2 ranks)"
  // From the node label of every rank (any ints; equal label = same node).
  static Topology from_labels(std::span<const std::int64_t> labels);
};

enum class CollAlgo : std::uint8_t { flat, hierarchical };

// What a rank says about the operation its watchdog caught (sent to every other rank then).
struct WatchdogReport {
  std::uint64_t seq = 0;    // collective sequence number on the communicator (1 = its first)
  std::uint32_t op = 0;     // CommOp
  std::int32_t peer = -1;   // send / recv: the other rank; collectives: -1 (broadcast: root);
                            // kSetup: a set-up exchange (not numbered)
  static constexpr std::int32_t kSetup = -2;
  double waited_s = 0;      // since the operation was issued
};
// "flat" | "hierarchical"; anything else throws naming the choices.
CollAlgo parse_coll_algo(const std::string& name);
const char* coll_algo_name(CollAlgo algo);

// Counters of one communicator. The v-variants count under their base kind
// (all_gather_v under all_gather, all_to_all_v under all_to_all, ...).
class CommStats {
 public:
  const OpCounter& operator[](CommOp op) const { return ops_[static_cast<std::size_t>(op)]; }
  OpCounter& operator[](CommOp op) { return ops_[static_cast<std::size_t>(op)]; }
  OpCounter total() const;
  void reset() { ops_ = {}; }
  // {"all_gather": {"calls":..,"bytes_sent":..,"bytes_recv":..}, ..., "total": {...}}
  nlohmann::json to_json() const;

 private:
  std::array<OpCounter, kNumCommOps> ops_{};
};

// Handle of an operation in flight: "ordered completion". wait() returns once the operation's
// results are ordered before everything this rank issues afterwards and its buffers may be reused
// by later work; it rethrows a backend error. A host backend (MPI) blocks until the data is there;
// a stream backend (NCCL) instead makes the compute stream wait for the communication stream and
// returns at once (c10d's Work::wait): later ops on that stream see the data, the host may not
// read it yet. synchronize() is the host wait: afterwards the operation has completed (timings end
// there; host buffers hold what was received with either call).
// Destroying a handle that was never waited waits for it (except during stack unwinding, when the
// job is about to abort anyway).
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  // Non-blocking completion test; also drives the backend's progress engine.
  virtual bool test() = 0;
  // The host waits for completion. Default: wait(), which is that for a host backend.
  virtual void synchronize() { wait(); }
  // wait()'s stream-ordered form, for wrappers that watch an operation (the watchdog): orders the
  // compute stream after the operation, hands its deadline (time_point::max(): none) and a
  // description to the backend's own watch, and returns true; false when the operation is not on
  // a device stream (the caller then waits on the host). Default: false.
  virtual bool order_stream(std::chrono::steady_clock::time_point deadline, const std::string& what) { return false; }
};
using WorkPtr = std::unique_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "mpi", later "nccl"
  // Whether all_reduce / reduce_scatter take `op` on `type` here. Default: sum and max on every
  // type but u16 / bf16 (storage types); logsumexp nowhere. A backend may add bf16 sum (MPI does:
  // each pairwise step adds in f32 and rounds, as NCCL's bf16 sum).
  virtual bool supports_reduce(ReduceOp op, DType type) const;
  const std::string& name() const { return name_; }
  CommStats& stats() { return stats_; }
  const CommStats& stats() const { return stats_; }
  // {"name":..., "backend":..., "rank":..., "size":..., "ops": stats().to_json()}
  nlohmann::json stats_json() const;

  // ---- device memory (see the header comment) ----
  // Whether the backend reads and writes memory of `d` itself. Default: the host only (MPI
  // without CUDA-awareness).
  virtual bool reads_device(Device d) const { return d == Device::host; }
  struct StagingStats {
    std::uint64_t calls = 0;           // operations staged through host buffers
    std::uint64_t bytes_to_host = 0;   // device -> host copies (send data)
    std::uint64_t bytes_to_device = 0; // host -> device copies (received data)
  };
  const StagingStats& staging() const { return staging_; }
  // Device -> host copies of send data made by every communicator's staging in this process (each
  // is a host sync on a GPU; a communicator that reads device memory, NCCL, makes none).
  static std::int64_t staged_reads();

  // ---- sub-communicators (each has its own counters) ----
  // Ranks with equal color form a group, ordered by (key, old rank). color < 0: this rank joins
  // no group and gets nullptr. Collective over this communicator.
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name);
  // Ranks that share memory (one node), or, when the environment variable DIFFCP_NODE is set (on
  // every rank: scripts/emucluster.sh does), the ranks with the same DIFFCP_NODE. Collective over
  // this communicator.
  std::unique_ptr<Communicator> split_node_local(const std::string& name);

  // ---- topology (inter-node byte counters, hierarchical collectives) ----
  // Collective. node_label: any int naming this rank's node (equal = same node). Creates the node
  // and node-leader sub-communicators the hierarchical collectives use; set-up traffic is uncounted.
  void set_topology(std::int64_t node_label);
  // Collective: set_topology with the nodes of split_node_local (DIFFCP_NODE when set).
  void discover_topology();
  bool has_topology() const { return topology_ != nullptr; }
  const Topology& topology() const;  // throws if none was set
  // Whether CollAlgo::hierarchical runs the two-level path here: more than one node and a node of
  // more than one rank (else it runs the flat one). Throws without a topology.
  bool hierarchy_useful() const;

  // ---- watchdog (process-wide; see the header comment) ----
  // seconds >= 0, finite; 0 = off. Applies to operations issued afterwards.
  static void set_watchdog_timeout(double seconds);
  // The current timeout; until set, DIFFCP_COMM_TIMEOUT (seconds) when set, else 0.
  static double watchdog_timeout();
  // Collectives issued on this communicator so far (the sequence number of the latest).
  std::uint64_t collective_seq() const { return coll_seq_; }

  // ---- collectives; counts are in elements of `type` ----
  // send: [count], recv: [size() * count] (rank r's block at r*count).
  WorkPtr all_gather_async(const void* send, void* recv, std::size_t count, DType type);
  // send: [counts[rank()]], recv: [sum(counts)] (rank r's block at sum(counts[0..r))).
  WorkPtr all_gather_v_async(const void* send, void* recv, std::span<const std::size_t> counts,
                             DType type, CollAlgo algo = CollAlgo::flat);
  // send: [size() * count], recv: [count] = sum over ranks of their block rank().
  WorkPtr reduce_scatter_async(const void* send, void* recv, std::size_t count, DType type,
                               ReduceOp op);
  // send: [sum(counts)], recv: [counts[rank()]].
  WorkPtr reduce_scatter_v_async(const void* send, void* recv,
                                 std::span<const std::size_t> counts, DType type, ReduceOp op,
                                 CollAlgo algo = CollAlgo::flat);
  // send, recv: [count]; send == recv means in place.
  WorkPtr all_reduce_async(const void* send, void* recv, std::size_t count, DType type,
                           ReduceOp op, CollAlgo algo = CollAlgo::flat);
  // send, recv: [size() * count]; block r of send goes to rank r.
  WorkPtr all_to_all_async(const void* send, void* recv, std::size_t count, DType type);
  // send_counts[r] elements go to rank r (packed in rank order in send), recv_counts[r] come from
  // rank r (packed in rank order in recv). Both spans have size() entries; zeros are allowed.
  WorkPtr all_to_all_v_async(const void* send, std::span<const std::size_t> send_counts,
                             void* recv, std::span<const std::size_t> recv_counts, DType type);
  // buf: [count]; root's buffer is copied to every rank.
  WorkPtr broadcast_async(void* buf, std::size_t count, DType type, int root);
  // Tags: 0 ... kMaxUserTag (backends reserve the tags above for their own collectives).
  static constexpr int kMaxUserTag = 32000;
  WorkPtr send_async(const void* buf, std::size_t count, DType type, int dst, int tag = 0);
  WorkPtr recv_async(void* buf, std::size_t count, DType type, int src, int tag = 0);
  WorkPtr barrier_async();

  // ---- the same on tensor views (what the layers call): the dtype comes from the tensors, and the
  // memory they name must be where the pointers are (an error otherwise);
  // counts are in elements, as above; each view holds at least its part ----
  // send: [count], recv: [size() * count].
  WorkPtr all_gather_async(ConstTensorView send, TensorView recv);
  WorkPtr all_gather_v_async(ConstTensorView send, TensorView recv, std::span<const std::size_t> counts,
                             CollAlgo algo = CollAlgo::flat);
  WorkPtr reduce_scatter_v_async(ConstTensorView send, TensorView recv, std::span<const std::size_t> counts,
                                 ReduceOp op, CollAlgo algo = CollAlgo::flat);
  WorkPtr all_to_all_v_async(ConstTensorView send, std::span<const std::size_t> send_counts, TensorView recv,
                             std::span<const std::size_t> recv_counts);
  // In place over all of `inout`.
  WorkPtr all_reduce_async(TensorView inout, ReduceOp op, CollAlgo algo = CollAlgo::flat);
  // root sends all of `root_data`; every other rank receives as many elements into `recv` (each
  // rank passes both; root_data is read on the root only, recv written elsewhere only).
  WorkPtr broadcast_async(ConstTensorView root_data, TensorView recv, int root);
  // All of `buf` (a contiguous view: slice it with prefix()).
  WorkPtr send_async(ConstTensorView buf, int dst, int tag = 0);
  WorkPtr recv_async(TensorView buf, int src, int tag = 0);

  // ---- one hop of point-to-point transfers, issued together (torch's batch_isend_irecv) ----
  // The sends and receives of `ops` form one group: on NCCL one ncclGroupStart / ncclGroupEnd
  // (transfers deferred before it are issued first, in a group of their own), on MPI requests
  // posted together. The returned Work completes when all of them have. Messages between two
  // ranks match in the order they were issued (no tags: tag 0 on MPI), so a caller arranges that
  // a send and its receive fall in the same hop on both ranks and in the same order among the
  // hop's transfers to that peer: then no group waits on a peer's later group (a cycle that NCCL
  // turns into a hang once messages outgrow its buffers; the rendezvous communicator at any size).
  struct P2pOp {
    static P2pOp send(ConstTensorView buf, int dst) { return {true, {buf.data, buf.dtype, buf.device, buf.rank, buf.shape, buf.stride}, dst}; }
    static P2pOp recv(TensorView buf, int src) { return {false, {buf.data, buf.dtype, buf.device, buf.rank, buf.shape, buf.stride}, src}; }
    bool is_send = true;
    ConstTensorView buf;  // contiguous; a receive writes it
    int peer = 0;
  };
  WorkPtr exchange_async(std::span<const P2pOp> ops);

  // ---- blocking, typed conveniences (async + wait) ----
  template <typename T> void all_gather(std::span<const T> send, std::span<T> recv);
  template <typename T>
  void all_gather_v(std::span<const T> send, std::span<T> recv, std::span<const std::size_t> counts);
  template <typename T> void reduce_scatter(std::span<const T> send, std::span<T> recv, ReduceOp op = ReduceOp::sum);
  template <typename T>
  void reduce_scatter_v(std::span<const T> send, std::span<T> recv,
                        std::span<const std::size_t> counts, ReduceOp op = ReduceOp::sum);
  template <typename T>
  void all_reduce(std::span<T> inout, ReduceOp op = ReduceOp::sum, CollAlgo algo = CollAlgo::flat);
  template <typename T> void all_to_all(std::span<const T> send, std::span<T> recv);
  template <typename T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts,
                    std::span<T> recv, std::span<const std::size_t> recv_counts);
  template <typename T> void broadcast(std::span<T> buf, int root);
  template <typename T> void send(std::span<const T> buf, int dst, int tag = 0);
  template <typename T> void recv(std::span<T> buf, int src, int tag = 0);
  void barrier() { barrier_async()->wait(); }

 protected:
  // Reads the watchdog setting first, so a bad DIFFCP_COMM_TIMEOUT fails before any operation.
  explicit Communicator(std::string name) : name_(std::move(name)) { watchdog_timeout(); }

  // Backend hooks. Arguments are already validated (sizes, peers, supports_reduce); counts that
  // exceed the backend's own limits are checked by the backend. Displacements are in elements.
  // Uniform collectives have their own hooks (NCCL has ncclAllGather but no all-gather-v), so a
  // backend implements what it has natively. Every hook has a default that throws diffcp::Error
  // "communicator backend '<backend()>' does not implement <op>": a partial backend fails clearly
  // on the first operation it lacks.
  // send: [count], recv: [size() * count].
  virtual WorkPtr do_all_gather(const void* send, void* recv, std::size_t count, DType type);
  virtual WorkPtr do_all_gather_v(const void* send, std::size_t send_count, void* recv,
                                  std::span<const std::size_t> counts,
                                  std::span<const std::size_t> displs, DType type);
  // send: [size() * count], recv: [count].
  virtual WorkPtr do_reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op);
  virtual WorkPtr do_reduce_scatter_v(const void* send, void* recv,
                                      std::span<const std::size_t> counts, DType type,
                                      ReduceOp op);
  virtual WorkPtr do_all_reduce(const void* send, void* recv, std::size_t count, DType type,
                                ReduceOp op);
  // send, recv: [size() * count].
  virtual WorkPtr do_all_to_all(const void* send, void* recv, std::size_t count, DType type);
  virtual WorkPtr do_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                  std::span<const std::size_t> send_displs, void* recv,
                                  std::span<const std::size_t> recv_counts,
                                  std::span<const std::size_t> recv_displs, DType type);
  virtual WorkPtr do_broadcast(void* buf, std::size_t count, DType type, int root);
  virtual WorkPtr do_send(const void* buf, std::size_t count, DType type, int dst, int tag);
  virtual WorkPtr do_recv(void* buf, std::size_t count, DType type, int src, int tag);
  virtual WorkPtr do_barrier();
  // exchange_async's group bracket around its send_async / recv_async calls. Default: nothing
  // (MPI posts each at once). A deferring backend (NCCL, rendezvous) issues its queue at both.
  virtual void do_group_begin() {}
  virtual void do_group_end() {}
  // A hop that failed part-way (a refused transfer): what was queued of it is dropped where the
  // backend still holds it (rendezvous). NCCL's deferred Works drop theirs as they are destroyed;
  // MPI's requests are already posted.
  virtual void do_group_cancel() {}
  virtual std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name);
  virtual std::unique_ptr<Communicator> do_split_node_local(const std::string& name);
  // The error of every default hook.
  [[noreturn]] void not_implemented(const char* op) const;
  // Watchdog: sends `mine` to every other rank without blocking (best effort: a peer may be dead)
  // and collects the other ranks' reports for up to grace_s seconds, or until every rank in
  // `wanted` answered. Returns size() entries (nullopt: no answer). The default cannot reach the
  // other ranks and returns no answers.
  virtual std::vector<std::optional<WatchdogReport>> do_watchdog_exchange(const WatchdogReport& mine,
                                                                          std::span<const int> wanted,
                                                                          double grace_s);

 private:
  friend class WatchedWork;
  void check_counts(std::span<const std::size_t> counts, const char* what) const;
  void check_peer(int peer, const char* what) const;
  // Throws unless supports_reduce(op, type), naming the backend, the operation and the type.
  void check_reduce(ReduceOp op, DType type, const char* what) const;
  // Counts an operation the backend accepted (elements sent / received by this rank; of the
  // sent, sent_inter to other nodes) and puts it under the watchdog when that is on. peer: the
  // other rank of a send / recv, the root of a broadcast, else -1.
  WorkPtr issued(WorkPtr w, CommOp op, std::size_t sent, std::size_t recvd, DType type,
                 std::size_t sent_inter = 0, int peer = -1);
  // A set-up exchange (split_node_local's agreement, set_topology, discover_topology): watched
  // like any operation, but not counted and not numbered. (MPI_Comm_split itself, a blocking call
  // inside the backend, cannot be watched.)
  WorkPtr setup_op(WorkPtr w, CommOp op);
  // Wraps w in the watchdog when it is on (else returns w): what a rank reports if it expires.
  WorkPtr watch(WorkPtr w, CommOp op, int peer, std::uint64_t sent_bytes, std::uint64_t recv_bytes);
  // The watchdog's verdict on an operation that did not complete in time (comm/watchdog.cpp).
  [[noreturn]] void watchdog_expired(const WatchdogReport& mine, std::uint64_t bytes_sent,
                                     std::uint64_t bytes_recv, double timeout_s);
  // Elements this rank sends to ranks on other nodes when it sends `per_peer[r]` to each rank r
  // (0 without a topology).
  std::size_t inter_part(std::span<const std::size_t> per_peer) const;
  std::size_t off_node_peers() const;  // ranks on other nodes (0 without a topology)
  // The hierarchical collectives (comm/hierarchical.cpp); arguments validated by the callers.
  void check_no_staged_op(const char* what) const;  // throws while a hierarchical op is in flight
  WorkPtr hier_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts, DType type);
  WorkPtr hier_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts, DType type);
  WorkPtr hier_all_reduce(const void* send, void* recv, std::size_t n, DType type, ReduceOp op);

  // Typed v-variants: counts has size() entries summing to `whole`; if check_mine, counts[rank()]
  // equals `mine`. Throws diffcp::Error naming the mismatch.
  void check_v_sizes(const char* what, std::span<const std::size_t> counts, std::size_t mine,
                     std::size_t whole, bool check_mine) const;

  std::string name_;
  CommStats stats_;
  std::unique_ptr<Topology> topology_;
  std::unique_ptr<Communicator> node_comm_, leader_comm_;  // leader_comm_: local rank 0 of each node, else null
  int staged_in_flight_ = 0;  // hierarchical operations not yet complete
  std::uint64_t coll_seq_ = 0;  // collectives issued (all ranks issue the same sequence)
  // Device memory (comm/staging.cpp).
  friend class Staging;
  // Whether an operation on these buffers (null: none) runs on host copies: one of them is device
  // memory that this backend does not read (or any device memory, for a hierarchical operation).
  bool stages(bool hierarchical, const void* a, const void* b = nullptr) const;
  StagingStats staging_;
};


// ---- template definitions ----
template <typename T> void Communicator::all_gather(std::span<const T> send, std::span<T> recv) {
  DIFFCP_CHECK(recv.size() == send.size() * static_cast<std::size_t>(size()),
               "all_gather: recv has ", recv.size(), " elements, expected size() * send = ",
               size(), " * ", send.size());
  all_gather_async(send.data(), recv.data(), send.size(), dtype_of<T>())->wait();
}
template <typename T>
void Communicator::all_gather_v(std::span<const T> send, std::span<T> recv,
                                std::span<const std::size_t> counts) {
  check_v_sizes("all_gather_v", counts, send.size(), recv.size(), true);
  all_gather_v_async(send.data(), recv.data(), counts, dtype_of<T>())->wait();
}
template <typename T>
void Communicator::reduce_scatter(std::span<const T> send, std::span<T> recv, ReduceOp op) {
  DIFFCP_CHECK(send.size() == recv.size() * static_cast<std::size_t>(size()),
               "reduce_scatter: send has ", send.size(), " elements, expected size() * recv = ",
               size(), " * ", recv.size());
  reduce_scatter_async(send.data(), recv.data(), recv.size(), dtype_of<T>(), op)->wait();
}
template <typename T>
void Communicator::reduce_scatter_v(std::span<const T> send, std::span<T> recv,
                                    std::span<const std::size_t> counts, ReduceOp op) {
  check_v_sizes("reduce_scatter_v", counts, recv.size(), send.size(), true);
  reduce_scatter_v_async(send.data(), recv.data(), counts, dtype_of<T>(), op)->wait();
}
template <typename T> void Communicator::all_reduce(std::span<T> inout, ReduceOp op, CollAlgo algo) {
  all_reduce_async(inout.data(), inout.data(), inout.size(), dtype_of<T>(), op, algo)->wait();
}
template <typename T> void Communicator::all_to_all(std::span<const T> send, std::span<T> recv) {
  DIFFCP_CHECK(send.size() == recv.size() && send.size() % static_cast<std::size_t>(size()) == 0,
               "all_to_all: send has ", send.size(), " and recv ", recv.size(),
               " elements; expected equal sizes divisible by size() = ", size());
  all_to_all_async(send.data(), recv.data(), send.size() / static_cast<std::size_t>(size()),
                   dtype_of<T>())->wait();
}
template <typename T>
void Communicator::all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts,
                                std::span<T> recv, std::span<const std::size_t> recv_counts) {
  check_v_sizes("all_to_all_v send", send_counts, 0, send.size(), false);
  check_v_sizes("all_to_all_v recv", recv_counts, 0, recv.size(), false);
  all_to_all_v_async(send.data(), send_counts, recv.data(), recv_counts, dtype_of<T>())->wait();
}
template <typename T> void Communicator::broadcast(std::span<T> buf, int root) {
  broadcast_async(buf.data(), buf.size(), dtype_of<T>(), root)->wait();
}
template <typename T> void Communicator::send(std::span<const T> buf, int dst, int tag) {
  send_async(buf.data(), buf.size(), dtype_of<T>(), dst, tag)->wait();
}
template <typename T> void Communicator::recv(std::span<T> buf, int src, int tag) {
  recv_async(buf.data(), buf.size(), dtype_of<T>(), src, tag)->wait();
}

}  // namespace diffcp
