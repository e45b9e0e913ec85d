// The NCCL communicator (comm/nccl_communicator.hpp), where every rank has a GPU of its own (one
// GPU: P = 1 only); skipped, saying why, elsewhere (no CUDA device, or ranks sharing a GPU).
//
// Covered, against closed forms of rank-encoded payloads:
//   * every operation, on device memory (what NCCL reads) and on host memory (its temporary device
//     buffers, counted in host_staging()): all_gather (f32, u8), all_gather_v (uneven, with empty
//     ranks), reduce_scatter, reduce_scatter_v (sum, max), all_reduce (f32 sum in place, f32 max,
//     i64 max, bf16 sum), all_to_all, all_to_all_v (uneven with zeros), broadcast from every root,
//     send / recv around the ring, barrier;
//   * the byte counters equal an MpiCommunicator's for the same calls, kind by kind;
//   * supports_reduce equals the MPI backend's but for logsumexp, which is refused, and
//     all_reduce_lse falls back to max + sum and gives the log-sum-exp;
//   * the ring pattern that one NCCL stream would deadlock on (recv_async, send_async, then wait
//     the recv first): deferred until a wait, completed by test() alone, flushed (in order) by a
//     collective; run under the watchdog, so a regression fails instead of hanging;
//   * split (reversed key order, opt-out with color < 0, own counters) and split_node_local.
// Without a device, the constructor's error says why (that test runs everywhere).
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/comm/nccl_communicator.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/cp/lse_reduce.hpp"
#include "diffcp/cuda/backend.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "error_of.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using Counts = std::vector<std::size_t>;
std::size_t uz(int v) { return static_cast<std::size_t>(v); }

// Element j (< 4) of the message from rank `from` to rank `to` (both < 8): exact in every dtype.
template <typename T> T enc(int from, int to, std::size_t j) {
  return static_cast<T>((from << 5) | (to << 2) | static_cast<int>(j));
}

// Why this job cannot run the NCCL tests ("" when it can), the same on every rank: each rank
// needs a CUDA device, and a different one (the CUDA backend uses device 0 of what it sees).
// Collective over the world (MPI) communicator, once.
const std::string& why_not() {
  static const std::string why = [] {
    Communicator& world = test::world();
    constexpr std::size_t kBusId = 32;  // "0000:3b:00.0" or with an 8-digit domain, and its end
    std::string mine;
    char bus[kBusId] = {};  // the last byte stays 0
    if (cuda_device_present(&mine) && cudaDeviceGetPCIBusId(bus, kBusId - 1, cuda_device_ordinal()) != cudaSuccess)
      mine = "cudaDeviceGetPCIBusId failed";
    int have = mine.empty() ? 1 : 0;
    world.all_reduce(std::span<int>(&have, 1), ReduceOp::sum);
    std::vector<std::uint8_t> ids(kBusId * uz(world.size()));
    world.all_gather(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(bus), kBusId),
                     std::span<std::uint8_t>(ids));
    const auto id = [&](int r) { return std::string(reinterpret_cast<const char*>(&ids[uz(r) * kBusId])); };
    if (!mine.empty()) return "no CUDA device: " + mine;
    if (have < world.size()) return std::string("no CUDA device: not on every rank");
    for (int a = 0; a < world.size(); ++a)
      for (int b = 0; b < a; ++b)
        if (id(a) == id(b))
          return "needs one GPU per rank: ranks " + std::to_string(b) + " and " + std::to_string(a) + " share GPU " + id(a) +
                 " (a rank computes on its node-local rank modulo the GPUs it sees: more ranks than GPUs)";
    return std::string();
  }();
  return why;
}

#define DIFFCP_SKIP_WITHOUT_GPUS()                          \
  do {                                                      \
    if (!why_not().empty()) GTEST_SKIP() << why_not();      \
  } while (0)

// The world's NCCL communicator, made by the first test that needs it and destroyed after the
// last test (before MPI_Finalize).
std::unique_ptr<NcclCommunicator>& nccl_slot() {
  static std::unique_ptr<NcclCommunicator> c;
  return c;
}
NcclCommunicator& nccl() {
  if (!nccl_slot()) nccl_slot() = std::make_unique<NcclCommunicator>(MPI_COMM_WORLD, "nccl_world");
  return *nccl_slot();
}
class NcclEnvironment : public ::testing::Environment {
 public:
  void TearDown() override { nccl_slot().reset(); }
};
[[maybe_unused]] const auto* const kNcclEnvironment = ::testing::AddGlobalTestEnvironment(new NcclEnvironment);

// `n` elements in host memory, or in the CUDA backend's device memory (copied there from `init`).
template <typename T>
class Array {
 public:
  Array(std::vector<T> init, bool device) : host_(std::move(init)), device_(device) {
    if (device_ && bytes() > 0) {
      dev_ = cuda_backend().allocate(bytes());
      cuda_backend().copy(dev_, cuda_backend().device(), host_.data(), Device::host, bytes());
    }
  }
  Array(std::size_t n, T fill, bool device) : Array(std::vector<T>(n, fill), device) {}
  ~Array() {
    if (dev_ != nullptr) cuda_backend().deallocate(dev_, bytes());
  }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  T* data() { return dev_ != nullptr ? static_cast<T*>(dev_) : host_.data(); }
  // The contents, on the host.
  const std::vector<T>& read() {
    if (dev_ != nullptr) cuda_backend().copy(host_.data(), Device::host, dev_, cuda_backend().device(), bytes());
    return host_;
  }

 private:
  std::size_t bytes() const { return host_.size() * sizeof(T); }
  std::vector<T> host_;
  bool device_;
  void* dev_ = nullptr;
};

// Every operation once on `c`, with its buffers on the device or the host, each result checked.
// Every rank makes the same calls in the same order.
void run_every_op(Communicator& c, bool device) {
  const int P = c.size(), me = c.rank(), next = (me + 1) % P, prev = (me + P - 1) % P;
  SCOPED_TRACE(c.backend() + (device ? " on device memory" : " on host memory"));
  const Counts cv = [&] {  // 2, 0, 1, 2, 0, ...: uneven, with empty ranks
    Counts v(uz(P));
    for (int r = 0; r < P; ++r) v[uz(r)] = uz((r + 2) % 3);
    return v;
  }();
  const Counts cv_off = displacements(cv);
  const std::size_t cv_all = std::accumulate(cv.begin(), cv.end(), std::size_t{0}), cv_me = cv[uz(me)];

  {  // all_gather, f32 and u8
    std::vector<float> s(3);
    std::vector<std::uint8_t> s8(4);
    for (std::size_t j = 0; j < 3; ++j) s[j] = enc<float>(me, 0, j);
    for (std::size_t j = 0; j < 4; ++j) s8[j] = enc<std::uint8_t>(me, 1, j);
    Array<float> send(s, device), recv(3 * uz(P), -1.f, device);
    Array<std::uint8_t> send8(s8, device), recv8(4 * uz(P), 0, device);
    c.all_gather_async(send.data(), recv.data(), 3, DType::f32)->wait();
    c.all_gather_async(send8.data(), recv8.data(), 4, DType::u8)->wait();
    for (int r = 0; r < P; ++r) {
      for (std::size_t j = 0; j < 3; ++j) EXPECT_EQ(recv.read()[uz(r) * 3 + j], enc<float>(r, 0, j)) << "all_gather";
      for (std::size_t j = 0; j < 4; ++j) EXPECT_EQ(recv8.read()[uz(r) * 4 + j], enc<std::uint8_t>(r, 1, j)) << "all_gather u8";
    }
  }
  {  // all_gather_v
    std::vector<float> s(cv_me);
    for (std::size_t j = 0; j < cv_me; ++j) s[j] = enc<float>(me, 0, j);
    Array<float> send(s, device), recv(cv_all, -1.f, device);
    c.all_gather_v_async(send.data(), recv.data(), cv, DType::f32)->wait();
    for (int r = 0; r < P; ++r)
      for (std::size_t j = 0; j < cv[uz(r)]; ++j) EXPECT_EQ(recv.read()[cv_off[uz(r)] + j], enc<float>(r, 0, j)) << "all_gather_v";
  }
  {  // reduce_scatter (sum): block r of every rank's send summed on rank r
    std::vector<float> s(2 * uz(P));
    for (int r = 0; r < P; ++r)
      for (std::size_t j = 0; j < 2; ++j) s[uz(r) * 2 + j] = enc<float>(me, r, j);
    Array<float> send(s, device), recv(2, -1.f, device);
    c.reduce_scatter_async(send.data(), recv.data(), 2, DType::f32, ReduceOp::sum)->wait();
    for (std::size_t j = 0; j < 2; ++j) {
      float want = 0;
      for (int r = 0; r < P; ++r) want += enc<float>(r, me, j);
      EXPECT_EQ(recv.read()[j], want) << "reduce_scatter";
    }
  }
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {  // reduce_scatter_v
    std::vector<float> s(cv_all);
    for (int r = 0; r < P; ++r)
      for (std::size_t j = 0; j < cv[uz(r)]; ++j) s[cv_off[uz(r)] + j] = enc<float>(me, r, j);
    Array<float> send(s, device), recv(cv_me, -1.f, device);
    c.reduce_scatter_v_async(send.data(), recv.data(), cv, DType::f32, op)->wait();
    for (std::size_t j = 0; j < cv_me; ++j) {
      float want = op == ReduceOp::max ? enc<float>(P - 1, me, j) : 0.f;
      if (op == ReduceOp::sum)
        for (int r = 0; r < P; ++r) want += enc<float>(r, me, j);
      EXPECT_EQ(recv.read()[j], want) << "reduce_scatter_v " << reduce_op_name(op);
    }
  }
  {  // all_reduce: f32 sum in place, f32 max, i64 max, bf16 sum (small integers: exact)
    std::vector<float> x(7), y(5);
    std::vector<std::int64_t> z(3);
    std::vector<std::uint16_t> h(4);
    for (std::size_t i = 0; i < 7; ++i) x[i] = static_cast<float>(uz(me) * 7 + i);
    for (std::size_t i = 0; i < 5; ++i) y[i] = enc<float>(me, 0, i % 4);
    for (std::size_t i = 0; i < 3; ++i) z[i] = -static_cast<std::int64_t>(uz(me) * 10 + i);
    for (std::size_t i = 0; i < 4; ++i) h[i] = f32_to_bf16(static_cast<float>(uz(me) + 1 + i));
    Array<float> inout(x, device), send(y, device), recv(5, -1.f, device);
    Array<std::int64_t> zz(z, device);
    Array<std::uint16_t> hh(h, device);
    c.all_reduce_async(inout.data(), inout.data(), 7, DType::f32, ReduceOp::sum)->wait();
    c.all_reduce_async(send.data(), recv.data(), 5, DType::f32, ReduceOp::max)->wait();
    c.all_reduce_async(zz.data(), zz.data(), 3, DType::i64, ReduceOp::max)->wait();
    c.all_reduce_async(hh.data(), hh.data(), 4, DType::bf16, ReduceOp::sum)->wait();
    for (std::size_t i = 0; i < 7; ++i) {
      float want = 0;
      for (int r = 0; r < P; ++r) want += static_cast<float>(uz(r) * 7 + i);
      EXPECT_EQ(inout.read()[i], want) << "all_reduce sum";
    }
    for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(recv.read()[i], enc<float>(P - 1, 0, i % 4)) << "all_reduce max";
    for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(zz.read()[i], -static_cast<std::int64_t>(i)) << "all_reduce i64 max";
    for (std::size_t i = 0; i < 4; ++i)
      EXPECT_EQ(bf16_to_f32(hh.read()[i]), static_cast<float>(P * (P + 1) / 2 + P * static_cast<int>(i))) << "bf16 sum";
  }
  {  // all_to_all: block r of my send goes to rank r
    std::vector<float> s(2 * uz(P));
    for (int r = 0; r < P; ++r)
      for (std::size_t j = 0; j < 2; ++j) s[uz(r) * 2 + j] = enc<float>(me, r, j);
    Array<float> send(s, device), recv(2 * uz(P), -1.f, device);
    c.all_to_all_async(send.data(), recv.data(), 2, DType::f32)->wait();
    for (int r = 0; r < P; ++r)
      for (std::size_t j = 0; j < 2; ++j) EXPECT_EQ(recv.read()[uz(r) * 2 + j], enc<float>(r, me, j)) << "all_to_all";
  }
  {  // all_to_all_v: (me + r) % 3 elements to rank r (zeros included)
    Counts sc(uz(P)), rc(uz(P));
    for (int r = 0; r < P; ++r) sc[uz(r)] = rc[uz(r)] = uz((me + r) % 3);
    const Counts so = displacements(sc), ro = displacements(rc);
    std::vector<float> s(so.back() + sc.back());
    for (int r = 0; r < P; ++r)
      for (std::size_t j = 0; j < sc[uz(r)]; ++j) s[so[uz(r)] + j] = enc<float>(me, r, j);
    Array<float> send(s, device), recv(ro.back() + rc.back(), -1.f, device);
    c.all_to_all_v_async(send.data(), sc, recv.data(), rc, DType::f32)->wait();
    for (int r = 0; r < P; ++r)
      for (std::size_t j = 0; j < rc[uz(r)]; ++j) EXPECT_EQ(recv.read()[ro[uz(r)] + j], enc<float>(r, me, j)) << "all_to_all_v";
  }
  for (int root = 0; root < P; ++root) {  // broadcast
    std::vector<float> b(4, -1.f);
    if (me == root)
      for (std::size_t j = 0; j < 4; ++j) b[j] = enc<float>(root, 0, j);
    Array<float> buf(b, device);
    c.broadcast_async(buf.data(), 4, DType::f32, root)->wait();
    for (std::size_t j = 0; j < 4; ++j) EXPECT_EQ(buf.read()[j], enc<float>(root, 0, j)) << "broadcast from " << root;
  }
  {  // send / recv around the ring (P = 1: to itself)
    std::vector<float> s(4);
    for (std::size_t j = 0; j < 4; ++j) s[j] = enc<float>(me, next, j);
    Array<float> send(s, device), recv(4, -1.f, device);
    WorkPtr r = c.recv_async(recv.data(), 4, DType::f32, prev, 3);
    WorkPtr w = c.send_async(send.data(), 4, DType::f32, next, 3);
    r->wait();
    w->wait();
    for (std::size_t j = 0; j < 4; ++j) EXPECT_EQ(recv.read()[j], enc<float>(prev, me, j)) << "recv";
  }
  c.barrier();
}

// ---------------------------------------------------------------------------------------------

TEST(NcclComm, WithoutADeviceTheConstructorSaysWhy) {
  std::string why;
  if (cuda_device_present(&why)) GTEST_SKIP() << "this rank has a CUDA device";
  // Throws before any MPI call, so ranks without a device need not agree.
  const std::string err = error_of([] { NcclCommunicator c(MPI_COMM_WORLD, "no_device"); });
  EXPECT_NE(err.find("nccl communicator 'no_device': no CUDA device: " + why), std::string::npos) << err;
}

TEST(NcclComm, EveryOperationOnDeviceAndHostMemoryCountsAsMpi) {
  DIFFCP_SKIP_WITHOUT_GPUS();
  NcclCommunicator& c = nccl();
  EXPECT_EQ(c.backend(), "nccl");
  EXPECT_EQ(c.rank(), test::world().rank());
  EXPECT_EQ(c.size(), test::world().size());
  EXPECT_TRUE(c.reads_device(cuda_backend().device()));
  EXPECT_FALSE(c.reads_device(Device::host));

  MpiCommunicator mpi(MPI_COMM_WORLD, "mpi_reference");
  run_every_op(mpi, false);
  const nlohmann::json want = mpi.stats().to_json();
  EXPECT_GT(mpi.stats().total().calls, 0u);

  {  // device memory: NCCL reads it, nothing goes through the host
    ScopedBackend cuda(cuda_backend());
    c.stats().reset();
    const auto staged = c.host_staging().calls;
    run_every_op(c, true);
    EXPECT_EQ(c.stats().to_json(), want);
    EXPECT_EQ(c.host_staging().calls, staged);
    EXPECT_EQ(c.staging().calls, 0u);
  }
  {  // host memory: through temporary device buffers, the same results and counters
    c.stats().reset();
    const auto staged = c.host_staging();
    run_every_op(c, false);
    EXPECT_EQ(c.stats().to_json(), want);
    EXPECT_GT(c.host_staging().calls, staged.calls);
    EXPECT_GT(c.host_staging().bytes_to_device, staged.bytes_to_device);
    EXPECT_GT(c.host_staging().bytes_to_host, staged.bytes_to_host);
  }
  // A closed form too: the ring's one send of 4 f32.
  EXPECT_EQ(c.stats()[CommOp::send].calls, 1u);
  EXPECT_EQ(c.stats()[CommOp::send].bytes_sent, 16u);
  EXPECT_EQ(c.stats()[CommOp::barrier].calls, 1u);
}

TEST(NcclComm, ReductionsAsMpiButLogsumexpFallsBack) {
  DIFFCP_SKIP_WITHOUT_GPUS();
  NcclCommunicator& c = nccl();
  Communicator& mpi = test::world();
  for (DType t : {DType::u8, DType::u16, DType::bf16, DType::i32, DType::i64, DType::u64, DType::f32, DType::f64}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max})
      EXPECT_EQ(c.supports_reduce(op, t), mpi.supports_reduce(op, t)) << reduce_op_name(op) << " on " << dtype_name(t);
    EXPECT_FALSE(c.supports_reduce(ReduceOp::logsumexp, t)) << dtype_name(t);
  }
  EXPECT_EQ(lse_all_reduces(c), 2);
  float x = 0;
  const std::string err = error_of([&] { c.all_reduce(std::span<float>(&x, 1), ReduceOp::logsumexp); });
  EXPECT_NE(err.find("communicator backend 'nccl' does not support logsumexp on f32"), std::string::npos) << err;

  // all_reduce_lse: lse_p[i] = 0.5 (p + 1) + i, row 0 seen by no rank (-inf).
  ScopedBackend cuda(cuda_backend());
  const int P = c.size(), me = c.rank();
  constexpr std::size_t n = 6;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i)
    host[i] = i == 0 ? -std::numeric_limits<float>::infinity() : 0.5f * static_cast<float>(me + 1) + static_cast<float>(i);
  DeviceVector<float> lse;
  lse.resize(static_cast<std::int64_t>(n));
  cuda_backend().copy(lse.data(), cuda_backend().device(), host.data(), Device::host, n * sizeof(float));
  all_reduce_lse(c, std::span<float>(lse.data(), n));
  cuda_backend().copy(host.data(), Device::host, lse.data(), cuda_backend().device(), n * sizeof(float));
  EXPECT_EQ(host[0], -std::numeric_limits<float>::infinity());
  for (std::size_t i = 1; i < n; ++i) {
    double s = 0;
    for (int r = 0; r < P; ++r) s += std::exp(0.5 * (r + 1) + static_cast<double>(i));
    EXPECT_NEAR(host[i], std::log(s), 1e-5 * std::abs(std::log(s))) << "row " << i;
  }
}

// The pattern of Ring and LV-XAttn: each rank posts recv_async(prev) then send_async(next) and
// waits later. Under the watchdog: a deadlock fails the test after 60 s instead of hanging.
TEST(NcclComm, RingTransfersAreDeferredSoTheyCannotDeadlock) {
  DIFFCP_SKIP_WITHOUT_GPUS();
  NcclCommunicator& c = nccl();
  const int P = c.size(), me = c.rank(), next = (me + 1) % P, prev = (me + P - 1) % P;
  const double timeout = Communicator::watchdog_timeout();
  Communicator::set_watchdog_timeout(60);
  ScopedBackend cuda(cuda_backend());
  std::vector<float> s(5);
  for (std::size_t j = 0; j < 4; ++j) s[j] = enc<float>(me, next, j);
  s[4] = static_cast<float>(me);
  const auto expect_from_prev = [&](Array<float>& recv, const char* what) {
    for (std::size_t j = 0; j < 4; ++j) EXPECT_EQ(recv.read()[j], enc<float>(prev, me, j)) << what;
  };
  {  // queued, not issued: the stream is free and the receive buffer untouched until a wait
    Array<float> send(s, true), recv(4, -1.f, true);
    WorkPtr r = c.recv_async(recv.data(), 4, DType::f32, prev, 0);
    WorkPtr w = c.send_async(send.data(), 4, DType::f32, next, 0);
    cuda_backend().synchronize();  // would block forever on an issued ncclRecv at P = 1
    EXPECT_EQ(recv.read()[0], -1.f);
    r->wait();  // the receive first: its send is in the same group
    expect_from_prev(recv, "recv waited first");
    w->wait();
  }
  {  // test() alone issues and completes a deferred transfer
    Array<float> send(s, true), recv(4, -1.f, true);
    WorkPtr r = c.recv_async(recv.data(), 4, DType::f32, prev, 0);
    WorkPtr w = c.send_async(send.data(), 4, DType::f32, next, 0);
    while (!r->test()) {
    }
    expect_from_prev(recv, "recv by test()");
    while (!w->test()) {
    }
  }
  {  // a collective issued while transfers are queued goes after them
    Array<float> send(s, true), recv(4, -1.f, true), sum(std::vector<float>{1.f}, true);
    WorkPtr r = c.recv_async(recv.data(), 4, DType::f32, prev, 0);
    WorkPtr w = c.send_async(send.data(), 4, DType::f32, next, 0);
    c.all_reduce_async(sum.data(), sum.data(), 1, DType::f32, ReduceOp::sum)->synchronize();  // the host waits
    EXPECT_TRUE(r->test()) << "the transfers were issued before the all_reduce, on the same stream";
    EXPECT_TRUE(w->test());
    EXPECT_EQ(sum.read()[0], static_cast<float>(P));
    expect_from_prev(recv, "recv before a collective");
  }
  {  // two rounds in flight, waited in reverse order
    Array<float> send(s, true), recv_a(4, -1.f, true), recv_b(4, -1.f, true);
    WorkPtr ra = c.recv_async(recv_a.data(), 4, DType::f32, prev, 0);
    WorkPtr wa = c.send_async(send.data(), 4, DType::f32, next, 0);
    WorkPtr rb = c.recv_async(recv_b.data(), 4, DType::f32, prev, 0);
    WorkPtr wb = c.send_async(send.data(), 4, DType::f32, next, 0);
    wb->wait();
    rb->wait();
    wa->wait();
    ra->wait();
    expect_from_prev(recv_a, "first of two");
    expect_from_prev(recv_b, "second of two");
  }
  Communicator::set_watchdog_timeout(timeout);
}

// NCCL runs on its own stream: wait() makes the compute stream wait (the next op on it sees the
// data, the host does not block), synchronize() is the host wait (the Work has completed).
TEST(NcclComm, WaitOrdersTheComputeStreamSynchronizeWaitsOnTheHost) {
  DIFFCP_SKIP_WITHOUT_GPUS();
  NcclCommunicator& c = nccl();
  const int P = c.size();
  ScopedBackend cuda(cuda_backend());
  Array<float> x(std::vector<float>(1 << 20, 1.f), true);
  WorkPtr w = c.all_reduce_async(x.data(), x.data(), 1 << 20, DType::f32, ReduceOp::sum);
  w->wait();
  add_into(x.data(), x.data(), 1 << 20);  // on the compute stream, after the all-reduce
  for (float v : x.read()) ASSERT_EQ(v, 2.f * static_cast<float>(P));
  WorkPtr g = c.all_reduce_async(x.data(), x.data(), 1 << 20, DType::f32, ReduceOp::max);
  g->synchronize();
  EXPECT_TRUE(g->test());
}

TEST(NcclComm, SplitAndNodeLocal) {
  DIFFCP_SKIP_WITHOUT_GPUS();
  NcclCommunicator& c = nccl();
  const int P = c.size(), me = c.rank();
  c.stats().reset();
  ScopedBackend cuda(cuda_backend());
  {  // one group in reversed key order
    auto rev = c.split(0, -me, "nccl_reversed");
    ASSERT_NE(rev, nullptr);
    EXPECT_EQ(rev->backend(), "nccl");
    EXPECT_EQ(rev->name(), "nccl_reversed");
    EXPECT_EQ(rev->size(), P);
    EXPECT_EQ(rev->rank(), P - 1 - me);
    Array<std::int32_t> mine(std::vector<std::int32_t>{me}, true), all(uz(P), -1, true);
    rev->all_gather_async(mine.data(), all.data(), 1, DType::i32)->wait();
    for (int q = 0; q < P; ++q) EXPECT_EQ(all.read()[uz(q)], P - 1 - q);
    EXPECT_EQ(rev->stats()[CommOp::all_gather].calls, 1u);
  }
  {  // odd ranks opt out
    auto even = c.split(me % 2 == 0 ? 0 : -1, me, "nccl_even");
    EXPECT_EQ(even == nullptr, me % 2 != 0);
    if (even) {
      EXPECT_EQ(even->size(), (P + 1) / 2);
      Array<float> one(std::vector<float>{1.f}, true);
      even->all_reduce_async(one.data(), one.data(), 1, DType::f32, ReduceOp::sum)->wait();
      EXPECT_EQ(one.read()[0], static_cast<float>((P + 1) / 2));
    }
  }
  {  // node-local: its agreement is a host all_reduce, uncounted
    const auto staged = c.host_staging().calls;
    auto node = c.split_node_local("nccl_node");
    ASSERT_NE(node, nullptr);
    EXPECT_EQ(node->backend(), "nccl");
    EXPECT_GE(node->size(), 1);
    EXPECT_EQ(c.host_staging().calls, staged + 1);
    node->barrier();
    EXPECT_EQ(node->stats()[CommOp::barrier].calls, 1u);
  }
  EXPECT_EQ(c.stats().total().calls, 0u) << "set-up traffic is not counted on the parent";
}

}  // namespace
}  // namespace diffcp
