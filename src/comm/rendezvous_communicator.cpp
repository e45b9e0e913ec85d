// The rendezvous communicator (comm/rendezvous_communicator.hpp): every operation is a unit on a
// per-family stream; a unit starts when the one before it completed, reads its send data into
// copies as it starts, and writes the received data into the caller's buffers as it completes.
#include "diffcp/comm/rendezvous_communicator.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <sstream>
#include <thread>

#include "diffcp/comm/mpi_communicator.hpp"

namespace diffcp {

namespace {
constexpr int kP2pTag = 0;            // every user transfer: messages match in issue order
constexpr int kWatchdogTag = 0x7ffc;  // reserved (MpiCommunicator's reserved tags are above it)
constexpr unsigned char kPoison = 0xFF;

// A wait that makes no progress backs off: spins first, then sleeps a little, so that ranks
// oversubscribing the cores (the tests' P = 8 on 2) leave the CPU to the peer they wait for.
void back_off(int& idle) {
  if (++idle < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool all_poison(const unsigned char* p, std::size_t n) {
  return std::all_of(p, p + n, [](unsigned char c) { return c == kPoison; });
}

std::string mpi_error(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<std::size_t>(len));
}
}  // namespace

// Caller memory an operation reads (in) or writes (out), and its copy: [0, bytes) or, for the
// v-collectives, only the blocks the counts and displacements name.
struct Region {
  void* user;
  std::size_t bytes;
  bool in, out;
  std::vector<unsigned char> copy;  // in: what was read at start; out: what arrives
  std::vector<std::pair<std::size_t, std::size_t>> pieces;  // (offset, length) in bytes; empty: all
  bool poisoned = false;            // out: the caller's buffer holds kPoison since issue / start
  bool copied = false;              // in: copied at issue (then checked unchanged at start)

  unsigned char* at(std::size_t off) const { return static_cast<unsigned char*>(user) + off; }
  template <typename F> bool all(F f) const {  // f(offset, length) over the pieces
    if (pieces.empty()) return f(std::size_t{0}, bytes);
    return std::all_of(pieces.begin(), pieces.end(), [&](const auto& pc) { return f(pc.first, pc.second); });
  }
  bool overlaps(const void* p, std::size_t n) const {
    const auto* b = static_cast<const unsigned char*>(p);
    return !all([&](std::size_t off, std::size_t len) { return !(at(off) < b + n && b < at(off) + len); });
  }
  void poison() {
    all([&](std::size_t off, std::size_t len) { return std::memset(at(off), kPoison, len), true; });
    poisoned = true;
  }
  void read() {
    all([&](std::size_t off, std::size_t len) { return std::memcpy(copy.data() + off, at(off), len), true; });
  }
  void deliver() {
    all([&](std::size_t off, std::size_t len) { return std::memcpy(at(off), copy.data() + off, len), true; });
  }
  bool unchanged() const {
    return all([&](std::size_t off, std::size_t len) { return std::memcmp(at(off), copy.data() + off, len) == 0; });
  }
  bool still_poisoned() const {
    return all([&](std::size_t off, std::size_t len) { return all_poison(at(off), len); });
  }
};

// One operation on the stream: a collective, or a group of sends and receives.
struct RendezvousUnit {
  RendezvousCommunicator* owner;
  std::string what;  // for errors: "all_gather", "group of 3 (send to rank 1, ...)"
  std::vector<Region> regions;
  // Starts the transport on the regions' copies (collectives; null for a group).
  std::function<WorkPtr(RendezvousUnit&)> start_fn;
  struct P2p {
    bool send;
    std::size_t region;
    int peer;
  };
  std::vector<P2p> p2p;  // a group's transfers, in issue order
  WorkPtr inner;                   // a collective in flight
  std::vector<MPI_Request> reqs;   // a group's requests in flight
  bool started = false, done = false;
  std::string error;  // why the unit failed: the next of its other Works to be tested throws it too

  void* buf(std::size_t i) { return regions[i].copy.data(); }
  std::size_t add(const void* user, std::size_t bytes, bool in, bool out) {
    regions.push_back({const_cast<void*>(user), bytes, in, out, std::vector<unsigned char>(bytes), {}});
    return regions.size() - 1;
  }
  // A v-collective's buffer: the blocks of counts / displs (elements of es bytes).
  void add_blocks(const void* user, std::span<const std::size_t> counts, std::span<const std::size_t> displs,
                  std::size_t es, bool in) {
    std::size_t extent = 0;
    std::vector<std::pair<std::size_t, std::size_t>> pieces;
    for (std::size_t i = 0; i < counts.size(); ++i)
      if (counts[i] > 0) {
        pieces.emplace_back(displs[i] * es, counts[i] * es);
        extent = std::max(extent, (displs[i] + counts[i]) * es);
      }
    regions[add(user, extent, in, !in)].pieces = std::move(pieces);
  }
  std::string describe() const {
    return "'" + what + "' on rendezvous communicator '" + owner->name() + "'";
  }

  // Whether this unit, not yet complete, still needs the caller's bytes [p, p + n).
  bool reads(const void* p, std::size_t n) const {
    return !done && std::any_of(regions.begin(), regions.end(), [&](const Region& r) { return r.in && r.overlaps(p, n); });
  }
  // Whether this unit, not yet complete, writes the caller's bytes [p, p + n).
  bool writes(const void* p, std::size_t n) const {
    return !done && std::any_of(regions.begin(), regions.end(), [&](const Region& r) { return r.out && r.overlaps(p, n); });
  }
  void written_in_flight(const Region& r, const char* when) const {
    DIFFCP_FAIL(describe(), ": its send buffer (", r.bytes, " bytes) was written ", when,
                " (the transfer may read it at any time until it completes)");
  }
  void start() {
    started = true;
    for (Region& r : regions) {
      if (!r.in) continue;
      if (r.copied && !r.unchanged()) written_in_flight(r, "between its issue and its start");
      r.read();  // as the kernel would, now
    }
    for (Region& r : regions)  // an output not poisoned at issue (in place, or read by an earlier unit)
      if (r.out && !r.poisoned) r.poison();
    if (start_fn) {
      inner = start_fn(*this);
      return;
    }
    MPI_Comm comm = owner->mpi_->handle();
    for (const P2p& t : p2p) {
      Region& r = regions[t.region];
      DIFFCP_CHECK(r.bytes <= static_cast<std::size_t>(INT_MAX), describe(), ": a transfer of ", r.bytes,
                   " bytes exceeds INT_MAX (split the message)");
      reqs.emplace_back();
      const int n = static_cast<int>(r.bytes), rc = t.send ? MPI_Issend(r.copy.data(), n, MPI_BYTE, t.peer, kP2pTag, comm, &reqs.back())
                                                           : MPI_Irecv(r.copy.data(), n, MPI_BYTE, t.peer, kP2pTag, comm, &reqs.back());
      DIFFCP_CHECK(rc == MPI_SUCCESS, describe(), ": ", t.send ? "MPI_Issend" : "MPI_Irecv", " failed: ", mpi_error(rc));
    }
  }
  // Whether the transport finished; on completion checks the caller's buffers and delivers.
  bool poll() {
    if (inner) {
      if (!inner->test()) return false;
    } else if (!reqs.empty()) {
      int flag = 0;
      std::vector<MPI_Status> st(reqs.size());
      const int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, st.data());
      if (rc == MPI_ERR_IN_STATUS) {
        for (std::size_t i = 0; i < st.size(); ++i)
          if (st[i].MPI_ERROR != MPI_SUCCESS && st[i].MPI_ERROR != MPI_ERR_PENDING) {
            const P2p& t = p2p[i];
            DIFFCP_FAIL(describe(), ": the ", t.send ? "send to" : "receive from", " rank ", t.peer, " of ",
                        regions[t.region].bytes, " bytes failed: ", mpi_error(st[i].MPI_ERROR),
                        t.send ? "" : " (a longer message was sent: NCCL needs equal sizes on both sides)");
          }
      }
      DIFFCP_CHECK(rc == MPI_SUCCESS || rc == MPI_ERR_IN_STATUS, describe(), ": MPI_Testall failed: ", mpi_error(rc));
      if (!flag) return false;
      for (std::size_t i = 0; i < p2p.size(); ++i) {
        if (p2p[i].send) continue;
        int got = 0;
        MPI_Get_count(&st[i], MPI_BYTE, &got);
        DIFFCP_CHECK(static_cast<std::size_t>(got) == regions[p2p[i].region].bytes, describe(), ": the receive from rank ",
                     p2p[i].peer, " expected ", regions[p2p[i].region].bytes, " bytes and the matching send had ", got,
                     " (messages between two ranks match in issue order, whatever their tags, and NCCL needs equal "
                     "sizes)");
      }
    }
    finish();
    return true;
  }
  void finish() {
    for (std::size_t i = 0; i < regions.size(); ++i) {
      const Region& r = regions[i];
      if (r.out) {
        DIFFCP_CHECK(r.still_poisoned(), describe(), ": its receive buffer (", r.bytes,
                     " bytes) was written while the operation was in flight (only its completion may touch it)");
      } else if (r.in && !writes(r.user, r.bytes) && !r.unchanged()) {
        written_in_flight(r, "while the operation was in flight");
      }
    }
    for (Region& r : regions)
      if (r.out) r.deliver();
    done = true;
    regions.clear();
    regions.shrink_to_fit();
  }
};

// The one stream of a communicator family: units run one at a time, in issue order.
struct RendezvousStream {
  std::deque<std::shared_ptr<RendezvousUnit>> queue;  // not yet complete, in issue order
  // A receive buffer is undefined from its issue on: poisoned now, unless an operation before it
  // on the stream still reads or writes those bytes (stream order lets it: then at its start).
  // (The unit's own other regions are its caller's to check: reads() / writes() on it.)
  void poison_at_issue(Region& r) {
    if (std::none_of(queue.begin(), queue.end(),
                     [&](const auto& e) { return e->reads(r.user, r.bytes) || e->writes(r.user, r.bytes); }))
      r.poison();
  }
  // Send data is copied at issue too (and checked unchanged at start), unless an operation before
  // it on the stream still writes those bytes (then the data is the one it will have).
  void copy_at_issue(Region& r) {
    if (r.copied || std::any_of(queue.begin(), queue.end(), [&](const auto& e) { return e->writes(r.user, r.bytes); }))
      return;
    r.read();
    r.copied = true;
  }
  void push(std::shared_ptr<RendezvousUnit> u) {
    for (Region& r : u->regions) {
      if (r.in && !r.out && !u->writes(r.user, r.bytes)) copy_at_issue(r);
      if (r.out && !r.in && !r.poisoned && !u->reads(r.user, r.bytes)) poison_at_issue(r);
    }
    queue.push_back(std::move(u));
    progress();
  }
  void progress() {
    while (!queue.empty()) {
      RendezvousUnit& head = *queue.front();
      try {
        if (!head.started) head.start();
        if (!head.poll()) return;
      } catch (const std::exception& e) {  // the unit failed: it leaves the stream, the error goes up
        head.done = true;                    // (and to every other Work of the unit)
        head.error = e.what();
        queue.pop_front();
        throw;
      }
      queue.pop_front();
    }
  }
};

// The Work of one operation: done when its unit is.
class RendezvousWork final : public Work {
 public:
  RendezvousWork(RendezvousCommunicator& c, std::shared_ptr<RendezvousUnit> u) : c_(c), u_(std::move(u)) {}
  ~RendezvousWork() override {
    if (u_->done || std::uncaught_exceptions() != 0) return;
    try {
      wait();
    } catch (const std::exception& e) {  // a destructor cannot throw: end the process (the job with it)
      std::fprintf(stderr, "diffcp: error: %s\n", e.what());
      std::fflush(stderr);
      std::abort();
    }
  }
  void wait() override {
    for (int idle = 0; !test();) back_off(idle);
  }
  bool test() override {
    if (!u_->done) {
      if (c_.open_ == u_) c_.flush();  // a deferred transfer: its group goes now
      c_.stream_->progress();
    }
    if (u_->done && !u_->error.empty()) {
      const std::string e = std::move(u_->error);  // once per Work: the next test() reports done
      u_->error.clear();
      throw Error(e);
    }
    return u_->done;
  }

 private:
  RendezvousCommunicator& c_;
  std::shared_ptr<RendezvousUnit> u_;
};

RendezvousCommunicator::RendezvousCommunicator(MPI_Comm comm, std::string name)
    : RendezvousCommunicator(std::make_unique<MpiCommunicator>(comm, name + ".mpi"),
                             std::make_shared<RendezvousStream>(), std::move(name)) {}

RendezvousCommunicator::RendezvousCommunicator(std::unique_ptr<MpiCommunicator> mpi,
                                               std::shared_ptr<RendezvousStream> stream, std::string name)
    : Communicator(std::move(name)), mpi_(std::move(mpi)), stream_(std::move(stream)) {}

RendezvousCommunicator::~RendezvousCommunicator() {
  if (std::uncaught_exceptions() != 0) {  // unwinding: what never started must not outlive this communicator
    std::erase_if(stream_->queue, [&](const auto& u) { return u->owner == this && !u->started; });
    return;
  }
  // This communicator's units must not outlive its MPI handle.
  try {
    flush();
    for (int idle = 0; std::any_of(stream_->queue.begin(), stream_->queue.end(), [&](const auto& u) { return u->owner == this; });) {
      stream_->progress();
      back_off(idle);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diffcp: error: %s\n", e.what());
    std::fflush(stderr);
    std::abort();
  }
}

int RendezvousCommunicator::rank() const { return mpi_->rank(); }
int RendezvousCommunicator::size() const { return mpi_->size(); }

bool RendezvousCommunicator::supports_reduce(ReduceOp op, DType type) const {
  if (type == DType::u16) return false;
  if (type == DType::bf16) return op == ReduceOp::sum;
  return op != ReduceOp::logsumexp;
}

void RendezvousCommunicator::flush() {
  if (!open_) return;
  std::shared_ptr<RendezvousUnit> g = std::move(open_);
  open_.reset();
  std::ostringstream what;
  what << "group of " << g->p2p.size() << " (";
  for (std::size_t i = 0; i < g->p2p.size(); ++i)
    what << (i ? ", " : "") << (g->p2p[i].send ? "send to rank " : "recv from rank ") << g->p2p[i].peer << " "
         << g->regions[g->p2p[i].region].bytes << " B";
  what << ")";
  g->what = what.str();
  stream_->push(std::move(g));
}

WorkPtr RendezvousCommunicator::enqueue(std::shared_ptr<RendezvousUnit> u) {
  flush();  // transfers deferred before this operation go first
  u->owner = this;
  stream_->push(u);
  return std::make_unique<RendezvousWork>(*this, std::move(u));
}

namespace {
std::shared_ptr<RendezvousUnit> unit(const char* what) {
  auto u = std::make_shared<RendezvousUnit>();
  u->what = what;
  return u;
}
}  // namespace

WorkPtr RendezvousCommunicator::do_all_gather(const void* send, void* recv, std::size_t count, DType type) {
  auto u = unit("all_gather");
  const std::size_t es = dtype_size(type), P = static_cast<std::size_t>(size());
  u->add(send, count * es, true, false);
  u->add(recv, P * count * es, false, true);
  u->start_fn = [this, count, type](RendezvousUnit& x) { return mpi_->do_all_gather(x.buf(0), x.buf(1), count, type); };
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_all_gather_v(const void* send, std::size_t send_count, void* recv,
                                                std::span<const std::size_t> counts,
                                                std::span<const std::size_t> displs, DType type) {
  auto u = unit("all_gather_v");
  const std::size_t es = dtype_size(type);
  u->add(send, send_count * es, true, false);
  u->add_blocks(recv, counts, displs, es, false);
  u->start_fn = [this, send_count, c = std::vector<std::size_t>(counts.begin(), counts.end()),
                 d = std::vector<std::size_t>(displs.begin(), displs.end()), type](RendezvousUnit& x) {
    return mpi_->do_all_gather_v(x.buf(0), send_count, x.buf(1), c, d, type);
  };
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_reduce_scatter(const void* send, void* recv, std::size_t count, DType type,
                                                  ReduceOp op) {
  const std::vector<std::size_t> counts(static_cast<std::size_t>(size()), count);
  return do_reduce_scatter_v(send, recv, counts, type, op);
}

WorkPtr RendezvousCommunicator::do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts,
                                                    DType type, ReduceOp op) {
  auto u = unit("reduce_scatter");
  const std::size_t es = dtype_size(type);
  std::size_t all = 0;
  for (std::size_t c : counts) all += c;
  u->add(send, all * es, true, false);
  u->add(recv, counts[static_cast<std::size_t>(rank())] * es, false, true);
  u->start_fn = [this, c = std::vector<std::size_t>(counts.begin(), counts.end()), type, op](RendezvousUnit& x) {
    return mpi_->do_reduce_scatter_v(x.buf(0), x.buf(1), c, type, op);
  };
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_all_reduce(const void* send, void* recv, std::size_t count, DType type,
                                              ReduceOp op) {
  auto u = unit("all_reduce");
  const std::size_t bytes = count * dtype_size(type);
  if (send == recv) {
    u->add(recv, bytes, true, true);
    u->start_fn = [this, count, type, op](RendezvousUnit& x) {
      return mpi_->do_all_reduce(x.buf(0), x.buf(0), count, type, op);
    };
  } else {
    u->add(send, bytes, true, false);
    u->add(recv, bytes, false, true);
    u->start_fn = [this, count, type, op](RendezvousUnit& x) {
      return mpi_->do_all_reduce(x.buf(0), x.buf(1), count, type, op);
    };
  }
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_all_to_all(const void* send, void* recv, std::size_t count, DType type) {
  auto u = unit("all_to_all");
  const std::size_t bytes = count * dtype_size(type) * static_cast<std::size_t>(size());
  u->add(send, bytes, true, false);
  u->add(recv, bytes, false, true);
  u->start_fn = [this, count, type](RendezvousUnit& x) { return mpi_->do_all_to_all(x.buf(0), x.buf(1), count, type); };
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                                std::span<const std::size_t> send_displs, void* recv,
                                                std::span<const std::size_t> recv_counts,
                                                std::span<const std::size_t> recv_displs, DType type) {
  auto u = unit("all_to_all_v");
  const std::size_t es = dtype_size(type);
  u->add_blocks(send, send_counts, send_displs, es, true);
  u->add_blocks(recv, recv_counts, recv_displs, es, false);
  const auto vec = [](std::span<const std::size_t> s) { return std::vector<std::size_t>(s.begin(), s.end()); };
  u->start_fn = [this, sc = vec(send_counts), sd = vec(send_displs), rc = vec(recv_counts), rd = vec(recv_displs),
                 type](RendezvousUnit& x) { return mpi_->do_all_to_all_v(x.buf(0), sc, sd, x.buf(1), rc, rd, type); };
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_broadcast(void* buf, std::size_t count, DType type, int root) {
  auto u = unit("broadcast");
  const bool me = rank() == root;
  u->add(buf, count * dtype_size(type), me, !me);
  u->start_fn = [this, count, type, root](RendezvousUnit& x) { return mpi_->do_broadcast(x.buf(0), count, type, root); };
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_barrier() {
  auto u = unit("barrier");
  u->start_fn = [this](RendezvousUnit&) { return mpi_->do_barrier(); };
  return enqueue(std::move(u));
}

WorkPtr RendezvousCommunicator::do_send(const void* buf, std::size_t count, DType type, int dst, int) {
  if (!open_) {
    open_ = std::make_shared<RendezvousUnit>();
    open_->owner = this;
  }
  const std::size_t bytes = count * dtype_size(type);
  if (bytes > 0) {  // 0 bytes: nothing, as NCCL
    open_->p2p.push_back({true, open_->add(buf, bytes, true, false), dst});
    if (!open_->writes(buf, bytes)) stream_->copy_at_issue(open_->regions.back());
  }
  return std::make_unique<RendezvousWork>(*this, open_);
}

WorkPtr RendezvousCommunicator::do_recv(void* buf, std::size_t count, DType type, int src, int) {
  if (!open_) {
    open_ = std::make_shared<RendezvousUnit>();
    open_->owner = this;
  }
  const std::size_t bytes = count * dtype_size(type);
  if (bytes > 0) {
    open_->p2p.push_back({false, open_->add(buf, bytes, false, true), src});
    if (!open_->reads(buf, bytes)) stream_->poison_at_issue(open_->regions.back());
  }
  return std::make_unique<RendezvousWork>(*this, open_);
}

void RendezvousCommunicator::drain() {
  flush();
  for (int idle = 0; !stream_->queue.empty();) {
    stream_->progress();
    back_off(idle);
  }
}

std::unique_ptr<Communicator> RendezvousCommunicator::do_split(int color, int key, const std::string& name) {
  drain();
  std::unique_ptr<Communicator> sub = mpi_->do_split(color, key, name + ".mpi");
  if (!sub) return nullptr;
  return std::unique_ptr<Communicator>(new RendezvousCommunicator(
      std::unique_ptr<MpiCommunicator>(static_cast<MpiCommunicator*>(sub.release())), stream_, name));
}

std::unique_ptr<Communicator> RendezvousCommunicator::do_split_node_local(const std::string& name) {
  drain();
  std::unique_ptr<Communicator> sub = mpi_->do_split_node_local(name + ".mpi");
  return std::unique_ptr<Communicator>(new RendezvousCommunicator(
      std::unique_ptr<MpiCommunicator>(static_cast<MpiCommunicator*>(sub.release())), stream_, name));
}

std::vector<std::optional<WatchdogReport>> RendezvousCommunicator::do_watchdog_exchange(const WatchdogReport& mine,
                                                                                       std::span<const int> wanted,
                                                                                       double grace_s) {
  return mpi_watchdog_exchange(mpi_->handle(), kWatchdogTag, mine, wanted, grace_s);
}

}  // namespace diffcp
