// The transfer patterns of Ring's backward and LV-XAttn's forward as they were before issue #65,
// replayed on the rendezvous communicator (tests/CMakeLists.txt expects the watchdog to end them
// at P >= 3 with a message naming the stuck receive), and the per-hop pattern that replaced them
// (it must complete and deliver). Only the transfers: no compute, 64 KiB messages.
//   rendezvous_helper SECONDS ring_backward_old|lvxattn_forward_old|hops
// The old patterns: at step t a rank posted, by tag, the accumulator receive (t >= 2) and the next
// shard's receive and send, then sent its own accumulator after computing; NCCL's deferred
// point-to-point issued all of it as one group at the next wait, so step t's group held a send
// whose receive the peer posts only in its step t + 1 group: each rank waits on its neighbour's
// later group, a cycle around the ring.
#include <string>
#include <vector>

#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/comm/rendezvous_communicator.hpp"
#include "diffcp/core/error.hpp"

namespace {

using diffcp::Communicator;
using diffcp::DType;
using diffcp::WorkPtr;
constexpr std::size_t kN = 16384;  // floats per message

// Ring's backward, commit 7d4777b (src/cp/ring.cpp:118-150): kv and accumulator on their own tags.
void ring_backward_old(Communicator& c) {
  const int P = c.size(), next = (c.rank() + 1) % P, prev = (c.rank() + P - 1) % P;
  std::vector<float> cur(kN, 1.f), kv_buf[2] = {std::vector<float>(kN), std::vector<float>(kN)}, acc_in(kN),
                                   acc_out[2] = {std::vector<float>(kN, 1.f), std::vector<float>(kN, 1.f)};
  WorkPtr acc_send[2];
  for (int t = 0; t < P; ++t) {
    WorkPtr send, recv, acc_recv;
    if (t >= 2) acc_recv = c.recv_async(acc_in.data(), kN, DType::f32, prev, 1);
    if (t + 1 < P) {
      recv = c.recv_async(kv_buf[t % 2].data(), kN, DType::f32, prev, 0);
      send = c.send_async(cur.data(), kN, DType::f32, next, 0);
    }
    if (t >= 1 && acc_send[t % 2]) acc_send[t % 2]->wait();
    if (t >= 1) {
      if (acc_recv) acc_recv->wait();
      acc_send[t % 2] = c.send_async(acc_out[t % 2].data(), kN, DType::f32, next, 1);
    }
    if (send) {
      recv->wait();
      send->wait();
      cur = kv_buf[t % 2];
    }
  }
  if (P > 1) c.recv_async(acc_in.data(), kN, DType::f32, prev, 1)->wait();
  for (WorkPtr& a : acc_send)
    if (a) a->wait();
}

// LV-XAttn's forward, commit 7d4777b (src/cp/lvxattn.cpp:104-145): queries and running state.
void lvxattn_forward_old(Communicator& c) {
  const int P = c.size(), next = (c.rank() + 1) % P, prev = (c.rank() + P - 1) % P;
  std::vector<float> q_own(kN, 1.f), q_in[2] = {std::vector<float>(kN), std::vector<float>(kN)}, acc_in(kN),
                                     acc_out[2] = {std::vector<float>(kN, 1.f), std::vector<float>(kN, 1.f)};
  WorkPtr q_send[2], q_recv[2], acc_send[2];
  if (P > 1) {
    q_send[0] = c.send_async(q_own.data(), kN, DType::f32, next, 0);
    q_recv[1] = c.recv_async(q_in[1].data(), kN, DType::f32, prev, 0);
  }
  for (int t = 1; t < P; ++t) {
    q_recv[t % 2]->wait();
    WorkPtr acc_recv = t >= 2 ? c.recv_async(acc_in.data(), kN, DType::f32, prev, 1) : nullptr;
    if (t + 1 < P) {
      q_send[t % 2] = c.send_async(q_in[t % 2].data(), kN, DType::f32, next, 0);
      if (q_send[(t + 1) % 2]) q_send[(t + 1) % 2]->wait();
      q_recv[(t + 1) % 2] = c.recv_async(q_in[(t + 1) % 2].data(), kN, DType::f32, prev, 0);
    }
    if (acc_send[t % 2]) acc_send[t % 2]->wait();
    if (acc_recv) acc_recv->wait();
    acc_send[t % 2] = c.send_async(acc_out[t % 2].data(), kN, DType::f32, next, 1);
  }
  if (P > 1) c.recv_async(acc_in.data(), kN, DType::f32, prev, 1)->wait();
  for (WorkPtr* w : {&q_send[0], &q_send[1], &acc_send[0], &acc_send[1]})
    if (*w) (*w)->wait();
}

// What replaced both: hop t carries step t - 1's accumulator and step t + 1's shard, one group.
void hops(Communicator& c) {
  const int P = c.size(), p = c.rank(), next = (p + 1) % P, prev = (p + P - 1) % P;
  using Op = Communicator::P2pOp;
  const auto view = [](std::vector<float>& v) { return diffcp::view_of(v, {static_cast<std::int64_t>(kN)}); };
  std::vector<float> cur(kN, static_cast<float>(p)), kv_buf[2] = {std::vector<float>(kN), std::vector<float>(kN)},
                     acc_in(kN), acc_out[2] = {std::vector<float>(kN), std::vector<float>(kN)};
  // The accumulator of a shard gains 1 at every other rank it visits: it comes home holding P - 1.
  const auto src_of_step = [&](int t) { return (p - t + P) % P; };
  for (int t = 0; t < P; ++t) {
    std::vector<Op> ops;
    if (t >= 2) ops.push_back(Op::send(view(acc_out[(t - 1) % 2]), next)), ops.push_back(Op::recv(view(acc_in), prev));
    if (t + 1 < P) ops.push_back(Op::send(view(cur), next)), ops.push_back(Op::recv(view(kv_buf[t % 2]), prev));
    WorkPtr hop = ops.empty() ? nullptr : c.exchange_async(ops);
    if (hop) hop->wait();
    DIFFCP_CHECK(cur[0] == static_cast<float>(src_of_step(t)), "step ", t, ": shard ", cur[0], ", expected ", src_of_step(t));
    if (t >= 1) acc_out[t % 2].assign(kN, t == 1 ? 1.f : acc_in[0] + 1.f);
    if (t + 1 < P) cur = kv_buf[t % 2];
  }
  if (P > 1) {
    const Op ops[] = {Op::send(view(acc_out[(P - 1) % 2]), next), Op::recv(view(acc_in), prev)};
    c.exchange_async(ops)->wait();
    DIFFCP_CHECK(acc_in[0] == static_cast<float>(P - 1), "the accumulator came home holding ", acc_in[0], ", expected ",
                 P - 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  DIFFCP_CHECK(argc == 3, "usage: rendezvous_helper SECONDS ring_backward_old|lvxattn_forward_old|hops");
  diffcp::Communicator::set_watchdog_timeout(std::stod(argv[1]));
  const std::string mode = argv[2];
  return diffcp::run_mpi_main(argc, argv, [&](Communicator&) {
    const auto world = diffcp::make_world("rendezvous");
    if (mode == "ring_backward_old") ring_backward_old(*world);
    else if (mode == "lvxattn_forward_old") lvxattn_forward_old(*world);
    else if (mode == "hops") hops(*world);
    else DIFFCP_FAIL("unknown mode '", mode, "'");
    return 0;
  });
}
