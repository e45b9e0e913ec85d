#include "diffcp/comm/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/cuda/backend.hpp"

namespace diffcp {

namespace {

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<std::size_t>(len));
}

// NCCL's own account of its last error on this thread ("" when it has none).
std::string nccl_detail() {
  const char* s = ncclGetLastError(nullptr);
  return s != nullptr ? s : "";
}

}  // namespace

// Each names the call and the library's own message.
#define DIFFCP_NCCL_CHECK(call)                                                                        \
  do {                                                                                                 \
    const ncclResult_t diffcp_nccl_rc_ = (call);                                                       \
    DIFFCP_CHECK(diffcp_nccl_rc_ == ncclSuccess, "nccl: ", #call, " failed: ",                         \
                 ncclGetErrorString(diffcp_nccl_rc_), " (", nccl_detail(), ")");                       \
  } while (0)
#define DIFFCP_CUDA_CHECK(call)                                                                        \
  do {                                                                                                 \
    const cudaError_t diffcp_cuda_rc_ = (call);                                                        \
    DIFFCP_CHECK(diffcp_cuda_rc_ == cudaSuccess, "nccl: ", #call, " failed: ",                         \
                 cudaGetErrorString(diffcp_cuda_rc_));                                                 \
  } while (0)
#define DIFFCP_MPI_CHECK(call)                                                                         \
  do {                                                                                                 \
    const int diffcp_mpi_rc_ = (call);                                                                 \
    DIFFCP_CHECK(diffcp_mpi_rc_ == MPI_SUCCESS, "nccl: ", #call, " failed: ", mpi_error_string(diffcp_mpi_rc_)); \
  } while (0)

namespace {

constexpr int kWatchdogTag = 1;  // the MPI duplicate carries nothing else but collectives

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::u8: return ncclUint8;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u64: return ncclUint64;
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::u16: break;
  }
  DIFFCP_FAIL("nccl backend: no reduction on ", dtype_name(t), " (a storage type)");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::logsumexp: break;
  }
  DIFFCP_FAIL("nccl backend: no ", reduce_op_name(op), " reduction (use all_reduce_lse, cp/lse_reduce.hpp)");
}

// Whether NCCL can read p: device (or managed) memory by its CUDA attributes; host memory is not.
bool device_memory(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // a pointer CUDA never saw: clear the error
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

// ncclGroupStart ... end(); an exception inside closes the group on the way out.
class Group {
 public:
  Group() { DIFFCP_NCCL_CHECK(ncclGroupStart()); }
  ~Group() {
    if (open_) (void)ncclGroupEnd();  // already failing: the error in flight is the one to report
  }
  void end() {
    open_ = false;
    DIFFCP_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

}  // namespace

// The completion of one operation: an event recorded on the stream after it (null until a
// deferred transfer is issued).
struct NcclDone {
  cudaEvent_t event = nullptr;
  ~NcclDone() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
  void record(cudaStream_t s) {
    DIFFCP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    DIFFCP_CUDA_CHECK(cudaEventRecord(event, s));
  }
};

// One operation in flight, with the temporary device buffers of its host memory.
class NcclWork final : public Work {
 public:
  explicit NcclWork(NcclCommunicator& c) : c_(c), done_(std::make_shared<NcclDone>()) {}
  ~NcclWork() override {
    if (!finished_ && !ordered_ && !c_.aborted_ && std::uncaught_exceptions() == 0) {
      try {
        wait();
      } catch (const std::exception& e) {  // a destructor cannot throw: end the process (the job with it)
        std::fprintf(stderr, "diffcp: error: %s\n", e.what());
        std::fflush(stderr);
        std::abort();
      }
    }
    if (done_->event == nullptr) c_.cancel(done_);  // never issued (unwinding): its buffers are going away
    release();
  }
  // The device memory the operation reads `bytes` of p from: p itself, or a copy of host memory.
  const void* in(const void* p, std::size_t bytes) {
    if (bytes == 0 || device_memory(p)) return p;
    void* d = temporary(bytes);
    DIFFCP_CUDA_CHECK(cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, c_.stream_));
    temps_.push_back({d, p, nullptr, bytes, cuda_page_locked(p)});
    c_.host_staging_.bytes_to_device += bytes;
    return d;
  }
  // The device memory it writes `bytes` of p into: p itself, or a temporary copied back to p at
  // completion (the in() copy of p when the operation reads p too: in place).
  void* out(void* p, std::size_t bytes) {
    if (bytes == 0 || device_memory(p)) return p;
    for (Temp& t : temps_)
      if (t.src == p && t.bytes == bytes) {
        t.back = p;
        return t.dev;
      }
    void* d = temporary(bytes);
    temps_.push_back({d, nullptr, p, bytes, false});
    return d;
  }
  void record() { done_->record(c_.stream_); }
  const std::shared_ptr<NcclDone>& done() const { return done_; }
  // The barrier's Work: its wait() is a host wait (what a barrier is for).
  void host_wait() { host_wait_ = true; }

  void wait() override {
    if (!order_stream(std::chrono::steady_clock::time_point::max(), "")) synchronize();
  }
  void synchronize() override {
    while (!test()) std::this_thread::yield();
  }
  // The compute stream waits for the operation's event (no host block), unless host memory
  // receives data (copied back at completion: the host waits), a source is page-locked host memory
  // (copied in asynchronously: reusable only after completion), or this is a barrier.
  bool order_stream(std::chrono::steady_clock::time_point deadline, const std::string& what) override {
    if (finished_ || ordered_) return true;
    if (host_wait_ ||
        std::any_of(temps_.begin(), temps_.end(), [](const Temp& t) { return t.back != nullptr || t.pinned_src; }))
      return false;
    if (done_->event == nullptr) c_.flush();  // a deferred transfer: issue the queue now
    DIFFCP_CHECK(done_->event != nullptr, "nccl communicator '", c_.name(),
                 "': a transfer was lost (its group failed to issue earlier)");
    c_.check_alive();
    DIFFCP_CUDA_CHECK(cudaStreamWaitEvent(c_.compute_, done_->event, 0));
    if (deadline != std::chrono::steady_clock::time_point::max()) c_.watch(done_, deadline, what);
    release();  // its temporaries (device copies of host sources) go in stream order
    ordered_ = true;
    return true;
  }
  bool test() override {
    if (finished_) return true;
    if (done_->event == nullptr) c_.flush();  // a deferred transfer: issue the queue now
    DIFFCP_CHECK(done_->event != nullptr, "nccl communicator '", c_.name(),
                 "': a transfer was lost (its group failed to issue earlier)");
    const cudaError_t e = cudaEventQuery(done_->event);
    if (e == cudaErrorNotReady) {
      c_.check_alive();
      return false;
    }
    DIFFCP_CHECK(e == cudaSuccess, "nccl: cudaEventQuery failed: ", cudaGetErrorString(e));
    for (const Temp& t : temps_)
      if (t.back != nullptr) {  // the event is done: the data is there; a synchronous copy to pageable memory
        DIFFCP_CUDA_CHECK(cudaMemcpy(t.back, t.dev, t.bytes, cudaMemcpyDeviceToHost));
        c_.host_staging_.bytes_to_host += t.bytes;
      }
    release();
    finished_ = true;
    return true;
  }

 private:
  struct Temp {
    void* dev;
    const void* src;  // host memory copied in (null: none)
    void* back;       // host memory copied back at completion (null: none)
    std::size_t bytes;
    bool pinned_src;  // src is page-locked: its copy runs asynchronously
  };
  void* temporary(std::size_t bytes) {
    if (temps_.empty()) ++c_.host_staging_.calls;
    void* d = nullptr;
    DIFFCP_CUDA_CHECK(cudaMallocAsync(&d, bytes, c_.stream_));
    return d;
  }
  // Freed in stream order: after the operation, even when it has not completed.
  void release() noexcept {
    for (const Temp& t : temps_) (void)cudaFreeAsync(t.dev, c_.stream_);
    temps_.clear();
  }

  NcclCommunicator& c_;
  std::shared_ptr<NcclDone> done_;
  std::vector<Temp> temps_;
  bool finished_ = false;
  bool ordered_ = false;    // the compute stream waits for it (wait() without a host block)
  bool host_wait_ = false;  // wait() blocks the host (the barrier)
};

// ---- set-up ----

NcclCommunicator::NcclCommunicator(MPI_Comm bootstrap, std::string name) : Communicator(std::move(name)) {
  std::string why;
  DIFFCP_CHECK(cuda_device_present(&why), "nccl communicator '", this->name(), "': no CUDA device: ", why);
  DIFFCP_MPI_CHECK(MPI_Comm_dup(bootstrap, &boot_));
  join();
}

NcclCommunicator::NcclCommunicator(MPI_Comm owned, std::string name, bool) : Communicator(std::move(name)), boot_(owned) {
  join();
}

void NcclCommunicator::join() {
  DIFFCP_MPI_CHECK(MPI_Comm_set_errhandler(boot_, MPI_ERRORS_RETURN));
  DIFFCP_MPI_CHECK(MPI_Comm_rank(boot_, &rank_));
  DIFFCP_MPI_CHECK(MPI_Comm_size(boot_, &size_));
  device_ = cuda_backend().device();  // opens the backend: its device is current on this thread
  compute_ = static_cast<cudaStream_t>(cuda_stream());
  // NCCL's own stream (c10d's): it waits for the compute stream at each operation; the compute
  // stream waits for it only where a Work is waited.
  cudaStream_t own = nullptr;
  DIFFCP_CUDA_CHECK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  stream_ = own;
  cudaEvent_t ready = nullptr;
  DIFFCP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  ready_ = ready;
  ncclUniqueId id{};
  if (rank_ == 0) DIFFCP_NCCL_CHECK(ncclGetUniqueId(&id));
  DIFFCP_MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, boot_));
  ncclComm_t comm = nullptr;
  cuda_release_cached_memory();  // NCCL's buffers come from outside the backend's pool
  DIFFCP_NCCL_CHECK(ncclCommInitRank(&comm, size_, id, rank_));
  comm_ = comm;
  DIFFCP_CUDA_CHECK(cudaMalloc(&barrier_word_, sizeof *barrier_word_));
  DIFFCP_CUDA_CHECK(cudaMemset(barrier_word_, 0, sizeof *barrier_word_));
}

NcclCommunicator::~NcclCommunicator() {
  {
    // Operations the compute stream waits for keep their deadlines until they complete (the thread
    // ends the job past one): only then is it safe to destroy the communicator without a watch.
    std::unique_lock<std::mutex> lock(watch_mu_);
    watch_cv_.wait(lock, [&] { return watched_.empty(); });
    stop_watch_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  // Destroying waits for the operations in flight; nothing to report to from a destructor.
  if (comm_ != nullptr) (void)ncclCommDestroy(comm_);
  if (stream_ != nullptr) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
  if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
  if (barrier_word_ != nullptr) (void)cudaFree(barrier_word_);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (boot_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&boot_);
}

bool NcclCommunicator::supports_reduce(ReduceOp op, DType type) const {
  if (op == ReduceOp::logsumexp || type == DType::u16) return false;
  return type != DType::bf16 || op == ReduceOp::sum;
}

// ---- the machinery: works, the deferred queue, errors ----

void NcclCommunicator::check_alive() {
  DIFFCP_CHECK(!aborted_, "nccl communicator '", name(),
               "' was aborted (after a watchdog timeout or an NCCL error): it runs no more operations");
  ncclResult_t async = ncclSuccess;
  DIFFCP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
  if (async == ncclSuccess || async == ncclInProgress) return;
  const char* last = ncclGetLastError(comm_);
  const std::string detail = last != nullptr ? last : "";
  abort_nccl();
  DIFFCP_FAIL("nccl communicator '", name(), "' (rank ", rank_, " of ", size_, "): asynchronous error: ",
              ncclGetErrorString(async), " (", detail, "); the communicator is aborted");
}

void NcclCommunicator::abort_nccl() noexcept {
  if (comm_ != nullptr) (void)ncclCommAbort(comm_);  // ends kernels stuck waiting for a peer
  comm_ = nullptr;
  aborted_ = true;
}

std::unique_ptr<NcclWork> NcclCommunicator::start() {
  check_alive();
  flush();  // transfers queued before this operation go first
  after_compute();
  return std::make_unique<NcclWork>(*this);
}

void NcclCommunicator::after_compute() {
  DIFFCP_CUDA_CHECK(cudaEventRecord(ready_, compute_));
  DIFFCP_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
}

// The device-side watch (the watchdog's part for stream-ordered waits): a thread polls the events
// of the operations the compute stream waits for; one past its deadline ends the job with a
// message naming it (an exception cannot reach the host thread, which may be anywhere).
void NcclCommunicator::watch(std::shared_ptr<NcclDone> done, std::chrono::steady_clock::time_point deadline,
                             const std::string& what) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  watched_.push_back({std::move(done), deadline, what, std::chrono::steady_clock::now()});
  if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watch_loop(); });
}

// The thread only reads events and prints: it never touches the NCCL communicator (the host thread
// owns it); past a deadline the process ends (mpirun then ends the job), which frees the GPU.
void NcclCommunicator::watch_loop() {
  (void)cudaSetDevice(cuda_device_ordinal());
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!stop_watch_) {
    watch_cv_.wait_for(lock, std::chrono::milliseconds(20));
    const auto now = std::chrono::steady_clock::now();
    std::erase_if(watched_, [&](const Watched& w) {
      const cudaError_t e = cudaEventQuery(w.done->event);
      if (e == cudaErrorNotReady && now < w.deadline) return false;
      if (e == cudaSuccess) return true;
      std::fprintf(stderr,
                   "diffcp: error: nccl communicator '%s' (rank %d of %d): %s %s after %.3g s on the device (the "
                   "compute stream waits for it; a peer that never joined it?); ending the job\n",
                   name().c_str(), rank_, size_, w.what.c_str(),
                   e == cudaErrorNotReady ? "did not complete" : cudaGetErrorString(e),
                   std::chrono::duration<double>(now - w.since).count());
      std::fflush(stderr);
      std::_Exit(1);
    });
    watch_cv_.notify_all();  // the destructor waits for the list to empty
  }
}

void NcclCommunicator::flush() {
  if (deferred_.empty()) return;
  check_alive();
  after_compute();
  std::vector<Deferred> queue;
  queue.swap(deferred_);
  Group g;
  for (const Deferred& d : queue) {
    if (d.send) group_send(d.buf, d.bytes, d.peer);
    else group_recv(d.buf, d.bytes, d.peer);
  }
  g.end();
  for (const Deferred& d : queue) d.done->record(stream_);  // each Work's event, after the group
}

void NcclCommunicator::cancel(const std::shared_ptr<NcclDone>& done) noexcept {
  std::erase_if(deferred_, [&](const Deferred& d) { return d.done == done; });
}

void NcclCommunicator::group_send(const void* buf, std::size_t bytes, int peer) {
  if (bytes > 0) DIFFCP_NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, peer, comm_, stream_));
}

void NcclCommunicator::group_recv(void* buf, std::size_t bytes, int peer) {
  if (bytes > 0) DIFFCP_NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, peer, comm_, stream_));
}

void NcclCommunicator::copy_on_stream(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0 && dst != src) DIFFCP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

// ---- the operations ----

WorkPtr NcclCommunicator::do_all_gather(const void* send, void* recv, std::size_t count, DType type) {
  auto w = start();
  const std::size_t b = count * dtype_size(type);
  const void* s = w->in(send, b);
  void* r = w->out(recv, b * static_cast<std::size_t>(size_));
  if (b > 0) DIFFCP_NCCL_CHECK(ncclAllGather(s, r, b, ncclUint8, comm_, stream_));
  w->record();
  return w;
}

WorkPtr NcclCommunicator::do_all_gather_v(const void* send, std::size_t send_count, void* recv,
                                          std::span<const std::size_t> counts, std::span<const std::size_t> displs,
                                          DType type) {
  auto w = start();
  const std::size_t es = dtype_size(type), all = displs.back() + counts.back();
  const void* s = w->in(send, send_count * es);
  auto* r = static_cast<unsigned char*>(w->out(recv, all * es));
  const auto me = static_cast<std::size_t>(rank_);
  copy_on_stream(r + displs[me] * es, s, send_count * es);
  Group g;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    group_send(s, send_count * es, p);
    group_recv(r + displs[static_cast<std::size_t>(p)] * es, counts[static_cast<std::size_t>(p)] * es, p);
  }
  g.end();
  w->record();
  return w;
}

WorkPtr NcclCommunicator::do_reduce_scatter(const void* send, void* recv, std::size_t count, DType type,
                                            ReduceOp op) {
  auto w = start();
  const std::size_t b = count * dtype_size(type);
  const void* s = w->in(send, b * static_cast<std::size_t>(size_));
  void* r = w->out(recv, b);
  if (count > 0) DIFFCP_NCCL_CHECK(ncclReduceScatter(s, r, count, nccl_type(type), nccl_op(op), comm_, stream_));
  w->record();
  return w;
}

WorkPtr NcclCommunicator::do_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts,
                                              DType type, ReduceOp op) {
  auto w = start();
  const std::vector<std::size_t> displs = displacements(counts);
  const std::size_t es = dtype_size(type), me = static_cast<std::size_t>(rank_);
  const auto* s = static_cast<const unsigned char*>(w->in(send, (displs.back() + counts.back()) * es));
  void* r = w->out(recv, counts[me] * es);
  // Block p of every rank reduced to rank p: one ncclReduce per root (the same on every rank).
  Group g;
  for (int p = 0; p < size_; ++p) {
    const std::size_t n = counts[static_cast<std::size_t>(p)];
    if (n > 0)
      DIFFCP_NCCL_CHECK(ncclReduce(s + displs[static_cast<std::size_t>(p)] * es, p == rank_ ? r : nullptr, n,
                                   nccl_type(type), nccl_op(op), p, comm_, stream_));
  }
  g.end();
  w->record();
  return w;
}

WorkPtr NcclCommunicator::do_all_reduce(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) {
  auto w = start();
  const std::size_t b = count * dtype_size(type);
  const void* s = w->in(send, b);
  void* r = w->out(recv, b);  // send == recv: the same temporary (in place)
  if (count > 0) DIFFCP_NCCL_CHECK(ncclAllReduce(s, r, count, nccl_type(type), nccl_op(op), comm_, stream_));
  w->record();
  return w;
}

WorkPtr NcclCommunicator::do_all_to_all(const void* send, void* recv, std::size_t count, DType type) {
  // The v-variant with equal blocks (ncclAlltoAll is new in NCCL 2.28; this runs on older ones).
  const std::vector<std::size_t> counts(static_cast<std::size_t>(size_), count);
  const std::vector<std::size_t> displs = displacements(counts);
  return do_all_to_all_v(send, counts, displs, recv, counts, displs, type);
}

WorkPtr NcclCommunicator::do_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                          std::span<const std::size_t> send_displs, void* recv,
                                          std::span<const std::size_t> recv_counts,
                                          std::span<const std::size_t> recv_displs, DType type) {
  auto w = start();
  const std::size_t es = dtype_size(type), me = static_cast<std::size_t>(rank_);
  const auto* s = static_cast<const unsigned char*>(w->in(send, (send_displs.back() + send_counts.back()) * es));
  auto* r = static_cast<unsigned char*>(w->out(recv, (recv_displs.back() + recv_counts.back()) * es));
  copy_on_stream(r + recv_displs[me] * es, s + send_displs[me] * es, send_counts[me] * es);
  Group g;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const auto q = static_cast<std::size_t>(p);
    group_send(s + send_displs[q] * es, send_counts[q] * es, p);
    group_recv(r + recv_displs[q] * es, recv_counts[q] * es, p);
  }
  g.end();
  w->record();
  return w;
}

WorkPtr NcclCommunicator::do_broadcast(void* buf, std::size_t count, DType type, int root) {
  auto w = start();
  const std::size_t b = count * dtype_size(type);
  // The root reads its buffer (unchanged), the others write theirs.
  void* d = rank_ == root ? const_cast<void*>(w->in(buf, b)) : w->out(buf, b);
  if (b > 0) DIFFCP_NCCL_CHECK(ncclBroadcast(d, d, b, ncclUint8, root, comm_, stream_));
  w->record();
  return w;
}

WorkPtr NcclCommunicator::do_send(const void* buf, std::size_t count, DType type, int dst, int) {
  check_alive();
  auto w = std::make_unique<NcclWork>(*this);
  const std::size_t b = count * dtype_size(type);
  deferred_.push_back({true, const_cast<void*>(w->in(buf, b)), b, dst, w->done()});
  return w;
}

WorkPtr NcclCommunicator::do_recv(void* buf, std::size_t count, DType type, int src, int) {
  check_alive();
  auto w = std::make_unique<NcclWork>(*this);
  const std::size_t b = count * dtype_size(type);
  deferred_.push_back({false, w->out(buf, b), b, src, w->done()});
  return w;
}

WorkPtr NcclCommunicator::do_barrier() {
  // Complete once every rank has contributed: a max of one word (the value stays 0).
  auto w = start();
  w->host_wait();
  DIFFCP_NCCL_CHECK(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclMax, comm_, stream_));
  w->record();
  return w;
}

// ---- sub-communicators: split the MPI duplicate, join a new NCCL communicator over it ----

std::unique_ptr<Communicator> NcclCommunicator::do_split(int color, int key, const std::string& name) {
  flush();
  MPI_Comm sub = MPI_COMM_NULL;
  DIFFCP_MPI_CHECK(MPI_Comm_split(boot_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
  if (sub == MPI_COMM_NULL) return nullptr;
  return std::unique_ptr<Communicator>(new NcclCommunicator(sub, name, true));
}

std::unique_ptr<Communicator> NcclCommunicator::do_split_node_local(const std::string& name) {
  flush();
  MPI_Comm sub = MPI_COMM_NULL;
  DIFFCP_MPI_CHECK(MPI_Comm_split_type(boot_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &sub));
  return std::unique_ptr<Communicator>(new NcclCommunicator(sub, name, true));
}

// ---- the watchdog: reports over the MPI duplicate, as MpiCommunicator sends them ----

std::vector<std::optional<WatchdogReport>> NcclCommunicator::do_watchdog_exchange(const WatchdogReport& mine,
                                                                                  std::span<const int> wanted,
                                                                                  double grace_s) {
  auto got = mpi_watchdog_exchange(boot_, kWatchdogTag, mine, wanted, grace_s);
  abort_nccl();  // the operation fails next (watchdog_expired); a kernel stuck in it must end
  return got;
}

}  // namespace diffcp
