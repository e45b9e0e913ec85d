// Collectives on device memory (comm/communicator.hpp, "Device memory"), on the guard device
// (testing/guard_backend.hpp), at every rank count, flat and hierarchical (two nodes):
//   * every operation gives bit for bit the results it gives on host memory, with the same
//     network byte counters: the MPI communicator does not read guard memory, so the base class
//     stages it, and any host touch of device memory outside the backend's copies would fault;
//   * the staging copies are counted: to the host the send data, back to the device the received
//     data (an in-place all_reduce copies its buffer each way, a broadcast root only sends);
//   * the communicator learns where a buffer lives from the buffer (Backend::device_of); a view
//     that names other memory than its data's is refused.
#include <algorithm>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/comm/tapa.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "error_of.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using Counts = std::vector<std::size_t>;

// One operation: its arrays' sizes (the first `inputs` are sent, the rest received), and the call.
struct Op {
  const char* name;
  std::vector<std::size_t> sizes;
  std::function<void(Communicator&, std::vector<float*>&, CollAlgo)> run;
  std::size_t to_host, to_device;  // the staging copies' elements
};

std::vector<Op> ops(int P, int me) {
  const std::size_t uP = static_cast<std::size_t>(P);
  Counts cv(uP), s2a(uP), r2a(uP);
  for (int r = 0; r < P; ++r) {
    cv[static_cast<std::size_t>(r)] = static_cast<std::size_t>((r * 2) % 3);  // zeros included
    s2a[static_cast<std::size_t>(r)] = static_cast<std::size_t>((me + r) % 3);
    r2a[static_cast<std::size_t>(r)] = static_cast<std::size_t>((r + me) % 3);
  }
  const std::size_t all = std::accumulate(cv.begin(), cv.end(), std::size_t{0}), mine = cv[static_cast<std::size_t>(me)];
  const std::size_t s_all = std::accumulate(s2a.begin(), s2a.end(), std::size_t{0}),
                    r_all = std::accumulate(r2a.begin(), r2a.end(), std::size_t{0});
  const int root = P - 1, next = (me + 1) % P, prev = (me + P - 1) % P;
  return {
      {"all_gather", {3, 3 * uP}, [](Communicator& c, auto& a, CollAlgo) { c.all_gather_async(a[0], a[1], 3, DType::f32)->wait(); },
       3, 3 * uP},
      {"all_gather_v", {mine, all}, [cv](Communicator& c, auto& a, CollAlgo g) {
         c.all_gather_v_async(a[0], a[1], cv, DType::f32, g)->wait();
       }, mine, all},
      {"reduce_scatter", {2 * uP, 2}, [](Communicator& c, auto& a, CollAlgo) {
         c.reduce_scatter_async(a[0], a[1], 2, DType::f32, ReduceOp::sum)->wait();
       }, 2 * uP, 2},
      {"reduce_scatter_v", {all, mine}, [cv](Communicator& c, auto& a, CollAlgo g) {
         c.reduce_scatter_v_async(a[0], a[1], cv, DType::f32, ReduceOp::sum, g)->wait();
       }, all, mine},
      {"all_reduce in place", {7}, [](Communicator& c, auto& a, CollAlgo g) {
         c.all_reduce_async(a[0], a[0], 7, DType::f32, ReduceOp::sum, g)->wait();
       }, 7, 7},
      {"all_reduce max", {5, 5}, [](Communicator& c, auto& a, CollAlgo) {
         WorkPtr w = c.all_reduce_async(a[0], a[1], 5, DType::f32, ReduceOp::max);
         while (!w->test()) {  // test() alone completes it, copy back included
         }
       }, 5, 5},
      {"all_to_all", {2 * uP, 2 * uP}, [](Communicator& c, auto& a, CollAlgo) {
         c.all_to_all_async(a[0], a[1], 2, DType::f32)->wait();
       }, 2 * uP, 2 * uP},
      {"all_to_all_v", {s_all, r_all}, [s2a, r2a](Communicator& c, auto& a, CollAlgo) {
         c.all_to_all_v_async(a[0], s2a, a[1], r2a, DType::f32)->wait();
       }, s_all, r_all},
      {"broadcast", {4}, [root](Communicator& c, auto& a, CollAlgo) { c.broadcast_async(a[0], 4, DType::f32, root)->wait(); },
       me == root ? 4u : 0u, me == root ? 0u : 4u},
      {"send / recv", {6, 6}, [next, prev](Communicator& c, auto& a, CollAlgo) {
         WorkPtr r = c.recv_async(a[1], 6, DType::f32, prev, 3);
         c.send_async(a[0], 6, DType::f32, next, 3)->wait();
         r->wait();
       }, 6, 6},
  };
}

struct Outcome {
  std::vector<std::vector<float>> arrays;
  OpCounter net;
  Communicator::StagingStats staging;
};

Outcome run(Communicator& c, const Op& op, bool on_guard, CollAlgo algo) {
  Backend& b = on_guard ? static_cast<Backend&>(guard_backend()) : cpu_backend();
  ScopedBackend use(b);
  const Communicator::StagingStats before = c.staging();
  c.stats().reset();
  std::vector<Buffer> bufs;
  std::vector<float*> ptrs;
  for (std::size_t i = 0; i < op.sizes.size(); ++i) {
    std::vector<float> init(op.sizes[i]);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = static_cast<float>(100 * c.rank() + 10 * i + j);
    bufs.emplace_back(to_device(std::span<const float>(init), b));
    ptrs.push_back(bufs.back().ptr<float>());
  }
  op.run(c, ptrs, algo);
  Outcome o;
  for (const Buffer& buf : bufs) o.arrays.push_back(to_host<float>(buf.view()));
  o.net = c.stats().total();
  o.staging = {c.staging().calls - before.calls, c.staging().bytes_to_host - before.bytes_to_host,
               c.staging().bytes_to_device - before.bytes_to_device};
  return o;
}

class CommOnDevice : public ::testing::TestWithParam<CollAlgo> {};

TEST_P(CommOnDevice, EveryOperationStagesThroughTheHostAndEqualsTheHostRun) {
  std::unique_ptr<Communicator> c = test::world().split(0, test::world().rank(), "device");
  const int P = c->size(), me = c->rank();
  c->set_topology(me < (P + 1) / 2 ? 0 : 1);  // two nodes (one at P = 1)
  for (const Op& op : ops(P, me)) {
    SCOPED_TRACE(op.name);
    const Outcome host = run(*c, op, false, GetParam());
    const Outcome dev = run(*c, op, true, GetParam());
    ASSERT_EQ(host.arrays.size(), dev.arrays.size());
    for (std::size_t i = 0; i < host.arrays.size(); ++i) EXPECT_EQ(host.arrays[i], dev.arrays[i]) << "array " << i;
    EXPECT_EQ(host.net.calls, dev.net.calls);
    EXPECT_EQ(host.net.bytes_sent, dev.net.bytes_sent);
    EXPECT_EQ(host.net.bytes_recv, dev.net.bytes_recv);
    EXPECT_EQ(host.net.bytes_sent_inter, dev.net.bytes_sent_inter);
    EXPECT_EQ(host.staging.calls, 0u);
    // The communicator stages by where the buffers live: an operation on empty (null) buffers only
    // holds no device memory and runs as it is.
    const bool holds_device = std::any_of(op.sizes.begin(), op.sizes.end(), [](std::size_t n) { return n > 0; });
    EXPECT_EQ(dev.staging.calls, !holds_device ? 0u : op.name == std::string("send / recv") ? 2u : 1u);
    EXPECT_EQ(dev.staging.bytes_to_host, op.to_host * sizeof(float));
    EXPECT_EQ(dev.staging.bytes_to_device, op.to_device * sizeof(float));
  }
}

INSTANTIATE_TEST_SUITE_P(Algo, CommOnDevice, ::testing::Values(CollAlgo::flat, CollAlgo::hierarchical),
                         [](const auto& info) { return std::string(coll_algo_name(info.param)); });

// TAPA (comm/tapa.hpp) on device memory: its phase-1 output lives on the device, the blocks that
// stay on a rank are copied by the backend, and both phases stage through the host. Every group
// size L that divides P, uniform and uneven counts: bitwise the host run's result.
TEST(CommOnDevice, TapaAllToAllEqualsTheHostRun) {
  const int P = test::world().size(), me = test::world().rank();
  for (int L = 1; L <= P; ++L) {
    if (P % L != 0) continue;
    SCOPED_TRACE("L = " + std::to_string(L));
    TapaAllToAll tapa(test::world(), L);
    Counts send(static_cast<std::size_t>(P)), recv(send.size());
    for (int r = 0; r < P; ++r) {
      send[static_cast<std::size_t>(r)] = static_cast<std::size_t>((me + 2 * r) % 4);  // zeros included
      recv[static_cast<std::size_t>(r)] = static_cast<std::size_t>((r + 2 * me) % 4);
    }
    const std::size_t ns = std::accumulate(send.begin(), send.end(), std::size_t{0}),
                      nr = std::accumulate(recv.begin(), recv.end(), std::size_t{0});
    const auto exchange = [&](Backend& b, bool uneven) {
      ScopedBackend use(b);
      const std::size_t n_send = uneven ? ns : 3 * static_cast<std::size_t>(P), n_recv = uneven ? nr : n_send;
      std::vector<float> init(n_send);
      for (std::size_t j = 0; j < init.size(); ++j) init[j] = static_cast<float>(1000 * me + j);
      Buffer in = to_device(std::span<const float>(init), b);
      Buffer out(DType::f32, static_cast<std::int64_t>(n_recv), b);
      if (uneven)
        tapa.all_to_all_v(in.data(), send, out.data(), recv, DType::f32);
      else
        tapa.all_to_all(in.data(), out.data(), 3, DType::f32);
      return to_host<float>(out.view());
    };
    for (bool uneven : {false, true}) {
      SCOPED_TRACE(uneven ? "all_to_all_v" : "all_to_all");
      const std::uint64_t staged = tapa.intra().staging().calls + tapa.inter().staging().calls;
      const std::vector<float> host = exchange(cpu_backend(), uneven);
      EXPECT_EQ(tapa.intra().staging().calls + tapa.inter().staging().calls, staged);
      EXPECT_EQ(exchange(guard_backend(), uneven), host);
      // Staged when there is device memory to move (an empty exchange holds none: null buffers).
      if (!uneven || ns + nr > 0) {
        EXPECT_GT(tapa.intra().staging().calls + tapa.inter().staging().calls, staged);
      }
    }
  }
}

// A communicator learns where a buffer lives from the buffer (Backend::device_of); a view that names
// other memory than its data's is refused.
TEST(CommOnDevice, AViewThatMisnamesItsMemoryIsRefused) {
  std::unique_ptr<Communicator> c = test::world().split(0, test::world().rank(), "device");
  std::vector<float> x(4, 1.f);
  TensorView v = view_of(x, {4});
  v.device = guard_device();
  const std::string e = error_of([&] { c->all_reduce_async(v, ReduceOp::sum)->wait(); });
  EXPECT_NE(e.find("communicator: a view of f32[4] guard points into host memory"), std::string::npos) << e;
  EXPECT_EQ(guard_backend().device_of(x.data()), Device::host);
  Buffer g(DType::f32, 4, guard_backend());
  EXPECT_EQ(guard_backend().device_of(g.data()), guard_device());
  EXPECT_EQ(cpu_backend().device_of(g.data()), Device::host);
  EXPECT_FALSE(c->reads_device(guard_device()));
  EXPECT_TRUE(c->reads_device(Device::host));
}

}  // namespace
}  // namespace diffcp
