#include "diffcp/comm/mpi_communicator.hpp"

#include "diffcp/core/half.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <thread>
#include <cmath>
#include <limits>
#include <exception>

namespace diffcp {

namespace {

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<std::size_t>(len));
}

}  // namespace

#define DIFFCP_MPI_CHECK(call)                                                         \
  do {                                                                                 \
    const int diffcp_mpi_rc_ = (call);                                                 \
    DIFFCP_CHECK(diffcp_mpi_rc_ == MPI_SUCCESS, #call, " failed: ",                    \
                 mpi_error_string(diffcp_mpi_rc_));                                    \
  } while (0)

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::u8: return MPI_UINT8_T;
    case DType::u16: return MPI_UINT16_T;
    case DType::bf16: return MPI_UINT16_T;  // moved as its 16 bits; summed by bf16_sum_op
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u64: return MPI_UINT64_T;
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
  }
  DIFFCP_FAIL("unknown DType ", static_cast<int>(t));
}

template <typename T>
void logsumexp_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const T hi = std::max(a[i], b[i]), lo = std::min(a[i], b[i]);
    b[i] = hi == -std::numeric_limits<T>::infinity() ? hi : hi + std::log1p(std::exp(lo - hi));
  }
}

// User-defined MPI ops, created on first use (after MPI_Init) and kept until MPI_Finalize.
MPI_Op logsumexp_op(DType t) {
  static MPI_Op op_f32 = MPI_OP_NULL, op_f64 = MPI_OP_NULL;
  MPI_Op& op = t == DType::f32 ? op_f32 : op_f64;
  if (op == MPI_OP_NULL) {
    MPI_User_function* fn = t == DType::f32 ? &logsumexp_combine<float> : &logsumexp_combine<double>;
    DIFFCP_MPI_CHECK(MPI_Op_create(fn, /*commute=*/1, &op));
  }
  return op;
}

// bf16 sum: each pairwise step adds in f32 and rounds to bf16 (what NCCL's bf16 sum does).
void bf16_sum_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}
MPI_Op bf16_sum_op() {
  static MPI_Op op = MPI_OP_NULL;
  if (op == MPI_OP_NULL) DIFFCP_MPI_CHECK(MPI_Op_create(&bf16_sum_combine, /*commute=*/1, &op));
  return op;
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  DIFFCP_CHECK(t != DType::u16 && (t != DType::bf16 || op == ReduceOp::sum), "mpi backend: ",
               reduce_op_name(op), " on ", dtype_name(t), " is not supported (u16 is storage; bf16 has sum only)");
  if (t == DType::bf16) return bf16_sum_op();
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::logsumexp:
      DIFFCP_CHECK(t == DType::f32 || t == DType::f64, "mpi backend: logsumexp reduction on ", dtype_name(t),
                   ", expected f32 or f64");
      return logsumexp_op(t);
  }
  DIFFCP_FAIL("unknown ReduceOp ", static_cast<int>(op));
}

int to_int(std::size_t n, const char* what) {
  DIFFCP_CHECK(n <= static_cast<std::size_t>(INT_MAX), "mpi backend: ", what, " = ", n,
               " exceeds INT_MAX (MPI-3 counts are int); split the message");
  return static_cast<int>(n);
}

std::vector<int> to_ints(std::span<const std::size_t> v, const char* what) {
  std::vector<int> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_int(v[i], what);
  return out;
}

// One request plus the count/displacement arrays MPI may read until completion.
class MpiWork final : public Work {
 public:
  MpiWork() = default;
  explicit MpiWork(std::vector<std::vector<int>> arrays) : arrays_(std::move(arrays)) {}
  ~MpiWork() override {
    if (req_ != MPI_REQUEST_NULL && std::uncaught_exceptions() == 0) {
      MPI_Wait(&req_, MPI_STATUS_IGNORE);
    }
  }
  void wait() override {
    if (req_ == MPI_REQUEST_NULL) return;
    DIFFCP_MPI_CHECK(MPI_Wait(&req_, MPI_STATUS_IGNORE));
  }
  bool test() override {
    if (req_ == MPI_REQUEST_NULL) return true;
    int flag = 0;
    DIFFCP_MPI_CHECK(MPI_Test(&req_, &flag, MPI_STATUS_IGNORE));
    return flag != 0;
  }
  MPI_Request* request() { return &req_; }
  const int* array(std::size_t i) const { return arrays_[i].data(); }

 private:
  MPI_Request req_ = MPI_REQUEST_NULL;
  std::vector<std::vector<int>> arrays_;
};

// Reduce-scatter as point-to-point exchanges plus a local reduction. Open MPI's nonblocking
// MPI_Ireduce_scatter (libnbc) reduces the whole buffer to one rank and scatters it from there:
// `diffcp bench coll` measured it ~80x slower than MPI_Iallreduce of the same buffer at P = 2 on
// shared memory, and it sends P-1 whole buffers into one rank across a slow link. Here every rank
// sends block r of its input to rank r (the accounting's sent = sum of the others' counts) and
// reduces the P blocks of its own output in rank order 0, 1, ..., P-1 (deterministic).
constexpr int kReduceScatterTag = 0x7ffe;  // reserved: Communicator::send/recv tags stay below
constexpr int kWatchdogTag = 0x7ffd;       // reserved likewise

class ReduceScatterWork final : public Work {
 public:
  ReduceScatterWork(MPI_Comm comm, int rank, const void* send, void* recv, std::span<const std::size_t> counts,
                    DType type, MPI_Op op)
      : recv_(recv), type_(type), op_(op), rank_(rank), size_(static_cast<int>(counts.size())),
        mine_(counts[static_cast<std::size_t>(rank)]) {
    const std::size_t P = counts.size(), es = dtype_size(type);
    const MPI_Datatype mt = mpi_type(type);
    std::size_t offset = 0;
    const auto* src = static_cast<const unsigned char*>(send);
    tmp_.resize(mine_ * es * (P - 1));
    for (std::size_t r = 0; r < P; ++r) {
      const std::size_t n = counts[r];
      if (static_cast<int>(r) == rank) {
        own_ = src + offset * es;
      } else if (n > 0) {
        reqs_.emplace_back();
        DIFFCP_MPI_CHECK(MPI_Isend(src + offset * es, to_int(n, "count"), mt, static_cast<int>(r), kReduceScatterTag,
                                   comm, &reqs_.back()));
      }
      offset += n;
    }
    if (mine_ > 0)
      for (std::size_t r = 0, slot = 0; r < P; ++r) {
        if (static_cast<int>(r) == rank) continue;
        reqs_.emplace_back();
        DIFFCP_MPI_CHECK(MPI_Irecv(tmp_.data() + slot++ * mine_ * es, to_int(mine_, "count"), mt, static_cast<int>(r),
                                   kReduceScatterTag, comm, &reqs_.back()));
      }
  }
  ~ReduceScatterWork() override {
    if (!done_ && std::uncaught_exceptions() == 0) {
      MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE);
    }
  }
  void wait() override {
    if (done_) return;
    DIFFCP_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE));
    finish();
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    DIFFCP_MPI_CHECK(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE));
    if (flag) finish();
    return done_;
  }

 private:
  // recv = block(0) op block(1) op ... in rank order; block(rank) is this rank's own input.
  void finish() {
    done_ = true;
    if (mine_ == 0) return;
    const std::size_t es = dtype_size(type_), bytes = mine_ * es;
    auto block = [&](int r) -> const void* {
      if (r == rank_) return own_;
      return tmp_.data() + static_cast<std::size_t>(r < rank_ ? r : r - 1) * bytes;
    };
    auto* out = static_cast<unsigned char*>(recv_);
    std::copy_n(static_cast<const unsigned char*>(block(0)), bytes, out);
    for (int r = 1; r < size_; ++r)
      DIFFCP_MPI_CHECK(MPI_Reduce_local(block(r), out, to_int(mine_, "count"), mpi_type(type_), op_));
  }

  std::vector<MPI_Request> reqs_;
  std::vector<unsigned char> tmp_;  // the other ranks' blocks of my output, in rank order
  const unsigned char* own_ = nullptr;
  void* recv_;
  DType type_;
  MPI_Op op_;
  int rank_, size_;
  std::size_t mine_;
  bool done_ = false;
};

}  // namespace

bool MpiCommunicator::supports_reduce(ReduceOp op, DType type) const {
  if (type == DType::u16) return false;
  if (type == DType::bf16) return op == ReduceOp::sum;
  return op != ReduceOp::logsumexp || type == DType::f32 || type == DType::f64;
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name) : Communicator(std::move(name)) {
  DIFFCP_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  DIFFCP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DIFFCP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DIFFCP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::MpiCommunicator(MPI_Comm owned, std::string name, bool)
    : Communicator(std::move(name)), comm_(owned) {
  DIFFCP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DIFFCP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DIFFCP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

WorkPtr MpiCommunicator::do_all_gather(const void* send, void* recv, std::size_t count, DType type) {
  auto w = std::make_unique<MpiWork>();
  DIFFCP_MPI_CHECK(MPI_Iallgather(send, to_int(count, "count"), mpi_type(type), recv, to_int(count, "count"),
                                  mpi_type(type), comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) {
  const std::vector<std::size_t> counts(static_cast<std::size_t>(size_), count);
  return do_reduce_scatter_v(send, recv, counts, type, op);  // the same pairwise exchange, equal blocks
}

WorkPtr MpiCommunicator::do_all_to_all(const void* send, void* recv, std::size_t count, DType type) {
  auto w = std::make_unique<MpiWork>();
  DIFFCP_MPI_CHECK(MPI_Ialltoall(send, to_int(count, "count"), mpi_type(type), recv, to_int(count, "count"),
                                 mpi_type(type), comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_all_gather_v(const void* send, std::size_t send_count, void* recv,
                                         std::span<const std::size_t> counts,
                                         std::span<const std::size_t> displs, DType type) {
  auto w = std::make_unique<MpiWork>(
      std::vector<std::vector<int>>{to_ints(counts, "count"), to_ints(displs, "displacement")});
  DIFFCP_MPI_CHECK(MPI_Iallgatherv(send, to_int(send_count, "count"), mpi_type(type), recv,
                                   w->array(0), w->array(1), mpi_type(type), comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_reduce_scatter_v(const void* send, void* recv,
                                             std::span<const std::size_t> counts, DType type,
                                             ReduceOp op) {
  return std::make_unique<ReduceScatterWork>(comm_, rank_, send, recv, counts, type, mpi_op(op, type));
}

WorkPtr MpiCommunicator::do_all_reduce(const void* send, void* recv, std::size_t count, DType type,
                                       ReduceOp op) {
  auto w = std::make_unique<MpiWork>();
  DIFFCP_MPI_CHECK(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, to_int(count, "count"),
                                  mpi_type(type), mpi_op(op, type), comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                         std::span<const std::size_t> send_displs, void* recv,
                                         std::span<const std::size_t> recv_counts,
                                         std::span<const std::size_t> recv_displs, DType type) {
  auto w = std::make_unique<MpiWork>(std::vector<std::vector<int>>{
      to_ints(send_counts, "count"), to_ints(send_displs, "displacement"),
      to_ints(recv_counts, "count"), to_ints(recv_displs, "displacement")});
  DIFFCP_MPI_CHECK(MPI_Ialltoallv(send, w->array(0), w->array(1), mpi_type(type), recv,
                                  w->array(2), w->array(3), mpi_type(type), comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_broadcast(void* buf, std::size_t count, DType type, int root) {
  auto w = std::make_unique<MpiWork>();
  DIFFCP_MPI_CHECK(MPI_Ibcast(buf, to_int(count, "count"), mpi_type(type), root, comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_send(const void* buf, std::size_t count, DType type, int dst, int tag) {
  auto w = std::make_unique<MpiWork>();
  DIFFCP_MPI_CHECK(MPI_Isend(buf, to_int(count, "count"), mpi_type(type), dst, tag, comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_recv(void* buf, std::size_t count, DType type, int src, int tag) {
  auto w = std::make_unique<MpiWork>();
  DIFFCP_MPI_CHECK(MPI_Irecv(buf, to_int(count, "count"), mpi_type(type), src, tag, comm_, w->request()));
  return w;
}

WorkPtr MpiCommunicator::do_barrier() {
  auto w = std::make_unique<MpiWork>();
  DIFFCP_MPI_CHECK(MPI_Ibarrier(comm_, w->request()));
  return w;
}

std::unique_ptr<Communicator> MpiCommunicator::do_split(int color, int key, const std::string& name) {
  MPI_Comm sub = MPI_COMM_NULL;
  DIFFCP_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
  if (sub == MPI_COMM_NULL) return nullptr;
  return std::unique_ptr<Communicator>(new MpiCommunicator(sub, name, true));
}

std::unique_ptr<Communicator> MpiCommunicator::do_split_node_local(const std::string& name) {
  MPI_Comm sub = MPI_COMM_NULL;
  DIFFCP_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &sub));
  return std::unique_ptr<Communicator>(new MpiCommunicator(sub, name, true));
}

std::vector<std::optional<WatchdogReport>> MpiCommunicator::do_watchdog_exchange(const WatchdogReport& mine,
                                                                                 std::span<const int> wanted,
                                                                                 double grace_s) {
  return mpi_watchdog_exchange(comm_, kWatchdogTag, mine, wanted, grace_s);
}

std::vector<std::optional<WatchdogReport>> mpi_watchdog_exchange(MPI_Comm comm, int tag, const WatchdogReport& mine,
                                                                 std::span<const int> wanted, double grace_s) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // Best effort and never blocking: the job is about to end, and a peer may be stopped, dead or
  // behind a link that is down. The send buffer is deliberately never freed (a send to such a peer
  // never completes); errors are ignored.
  auto* out = new WatchdogReport(mine);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(out, sizeof(WatchdogReport), MPI_BYTE, r, tag, comm, &req) == MPI_SUCCESS) MPI_Request_free(&req);
  }
  std::vector<std::optional<WatchdogReport>> got(static_cast<std::size_t>(size));
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  auto all_in = [&] {
    return std::all_of(wanted.begin(), wanted.end(), [&](int r) { return got[static_cast<std::size_t>(r)].has_value(); });
  };
  while (!all_in() && std::chrono::steady_clock::now() < until) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, tag, comm, &flag, &st) != MPI_SUCCESS) break;
    if (!flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    WatchdogReport in;
    if (MPI_Recv(&in, sizeof in, MPI_BYTE, st.MPI_SOURCE, tag, comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    got[static_cast<std::size_t>(st.MPI_SOURCE)] = in;
  }
  return got;
}

}  // namespace diffcp
