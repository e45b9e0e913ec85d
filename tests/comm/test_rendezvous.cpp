// The rendezvous communicator's semantics (comm/rendezvous_communicator.hpp), each one shown against
// what MPI would do: synchronous sends, groups that complete whole, order-matched untagged
// messages, exact sizes, receive buffers undefined until completion, send buffers read until then.
// Ranks 0 and 1 take part; MPI_Barrier on MPI_COMM_WORLD orders what the other rank has posted.
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/comm/rendezvous_communicator.hpp"
#include "diffcp/core/error.hpp"
#include "error_of.hpp"

namespace diffcp {
namespace {

void barrier() { MPI_Barrier(MPI_COMM_WORLD); }
// Whether w completes within a few milliseconds of polling (it drives progress).
bool completes_soon(Work& w) {
  for (int i = 0; i < 50; ++i) {
    if (w.test()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST(Rendezvous, ASendCompletesOnlyOnceItsReceiveIsPosted) {
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> x(4, 1.f);  // a few bytes: MPI would deliver them eagerly
  if (c.rank() == 0) {
    WorkPtr s = c.send_async(x.data(), x.size(), DType::f32, 1);
    EXPECT_FALSE(completes_soon(*s)) << "a send completed before rank 1 posted its receive";
    barrier();
    s->wait();
  } else {
    barrier();
    if (c.rank() == 1) c.recv<float>(x, 0);
  }
}

TEST(Rendezvous, AGroupCompletesAsAWhole) {
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> out(8, 2.f), in(8, 0.f);
  if (c.rank() == 0) {
    WorkPtr s = c.send_async(out.data(), out.size(), DType::f32, 1);
    WorkPtr r = c.recv_async(in.data(), in.size(), DType::f32, 1);  // the same deferred group
    EXPECT_FALSE(completes_soon(*s));  // issues the group; rank 1 receives next
    barrier();                         // rank 1 has received the send
    EXPECT_FALSE(completes_soon(*s)) << "a send completed while its group's receive had not";
    barrier();                         // rank 1 sends now
    r->wait();
    EXPECT_TRUE(s->test());
    EXPECT_EQ(in, out);
  } else if (c.rank() == 1) {
    c.recv<float>(in, 0);
    barrier();
    barrier();
    c.send<float>(std::span<const float>(out), 0);
  } else {
    barrier();
    barrier();
  }
}

TEST(Rendezvous, MessagesMatchInIssueOrderWhateverTheirTags) {
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2 || c.rank() > 1) return;
  std::vector<float> a(6, 1.f), b(6, 2.f);
  if (c.rank() == 0) {
    WorkPtr s1 = c.send_async(a.data(), a.size(), DType::f32, 1, /*tag=*/5);
    WorkPtr s2 = c.send_async(b.data(), b.size(), DType::f32, 1, /*tag=*/7);
    s1->wait();
    s2->wait();
  } else {
    std::vector<float> first(6), second(6);
    WorkPtr r1 = c.recv_async(first.data(), first.size(), DType::f32, 0, /*tag=*/7);  // MPI: gets b
    WorkPtr r2 = c.recv_async(second.data(), second.size(), DType::f32, 0, /*tag=*/5);
    r1->wait();
    r2->wait();
    EXPECT_EQ(first, a) << "NCCL has no tags: the first receive matches the first send";
    EXPECT_EQ(second, b);
  }
}

TEST(Rendezvous, ASizeMismatchIsAnErrorNamingBoth) {
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2 || c.rank() > 1) return;
  std::vector<float> x(10, 1.f), y(12, 0.f);
  if (c.rank() == 0) {
    c.send<float>(std::span<const float>(x), 1);
  } else {
    const std::string e = error_of([&] { c.recv<float>(y, 0); });
    EXPECT_NE(e.find("expected 48 bytes and the matching send had 40"), std::string::npos) << e;
  }
}

TEST(Rendezvous, AReceiveBufferIsUndefinedUntilCompletion) {
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> x(5, 3.f);
  if (c.rank() == 0) {
    barrier();
    c.send<float>(std::span<const float>(x), 1);
  } else if (c.rank() == 1) {
    std::vector<float> y(5, 1.f);
    WorkPtr r = c.recv_async(y.data(), y.size(), DType::f32, 0);
    EXPECT_TRUE(std::isnan(y[0])) << "a receive buffer read before completion must not look valid";
    barrier();
    r->wait();
    EXPECT_EQ(y, x);
  } else {
    barrier();
  }
}

TEST(Rendezvous, ASendBufferWrittenInFlightIsAnError) {
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2 || c.rank() > 1) return;
  std::vector<float> x(5, 3.f), y(5);
  if (c.rank() == 0) {
    WorkPtr s = c.send_async(x.data(), x.size(), DType::f32, 1);
    x[2] = 4.f;  // before the wait: NCCL may read the buffer at any time until completion
    const std::string e = error_of([&] { s->wait(); });
    EXPECT_NE(e.find("send buffer (20 bytes) was written between its issue and its start"), std::string::npos) << e;
    c.send<float>(std::span<const float>(x), 1);  // the failed one never left: rank 1 gets this one
  } else {
    c.recv<float>(y, 0);
  }
}

TEST(Rendezvous, AReceiveBufferWrittenInFlightIsAnError) {
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2 || c.rank() > 1) return;
  std::vector<float> x(5, 3.f), y(5);
  if (c.rank() == 0) {
    c.send<float>(std::span<const float>(x), 1);
  } else {
    WorkPtr r = c.recv_async(y.data(), y.size(), DType::f32, 0);
    y[0] = 0.f;  // e.g. zeroing an accumulator after posting the receive into it
    const std::string e = error_of([&] { r->wait(); });
    EXPECT_NE(e.find("receive buffer (20 bytes) was written while the operation was in flight"), std::string::npos) << e;
  }
}

TEST(Rendezvous, StreamOrderLetsOneBufferBeSentAndReceivedWithoutAWaitBetween) {
  // Rank 0 sends x, then receives into x; rank 1 receives into x, then sends x on: each pair is
  // legal in stream order without a wait between (the earlier operation reads or writes x first).
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  if (c.size() < 2 || c.rank() > 1) return;
  using Op = Communicator::P2pOp;
  std::vector<float> x(7, static_cast<float>(c.rank() + 1));
  const int peer = 1 - c.rank();
  const Op send[] = {Op::send(view_of(x, {7}), peer)}, recv[] = {Op::recv(view_of(x, {7}), peer)};
  WorkPtr first = c.exchange_async(c.rank() == 0 ? send : recv);
  WorkPtr second = c.exchange_async(c.rank() == 0 ? recv : send);
  first->wait();
  second->wait();
  EXPECT_EQ(x, std::vector<float>(7, 1.f)) << "rank 0's values, there and back";
}

TEST(Rendezvous, CollectivesRunInIssueOrderAcrossSplitCommunicators) {
  // Every rank issues an all_reduce on a split communicator, then one on the parent: one stream.
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  auto half = c.split(c.rank() % 2, c.rank(), "half");
  std::vector<double> a(3, 1.0), b(3, 1.0);
  WorkPtr wa = half->all_reduce_async(a.data(), a.data(), a.size(), DType::f64, ReduceOp::sum);
  WorkPtr wb = c.all_reduce_async(b.data(), b.data(), b.size(), DType::f64, ReduceOp::sum);
  wb->wait();
  EXPECT_TRUE(wa->test()) << "an operation completed before the one issued before it on the stream";
  EXPECT_EQ(a[0], static_cast<double>(half->size()));
  EXPECT_EQ(b[0], static_cast<double>(c.size()));
  EXPECT_FALSE(c.supports_reduce(ReduceOp::logsumexp, DType::f32)) << "NCCL has no logsumexp";
}

TEST(Rendezvous, AHopIsOneGroupOnEveryRank) {
  // A ring hop: every rank sends to next and receives from prev in one exchange, at every P.
  RendezvousCommunicator c(MPI_COMM_WORLD, "rv");
  const int P = c.size(), next = (c.rank() + 1) % P, prev = (c.rank() + P - 1) % P;
  std::vector<float> mine(1000, static_cast<float>(c.rank())), got(1000);
  const Communicator::P2pOp ops[] = {Communicator::P2pOp::send(view_of(mine, {1000}), next),
                                     Communicator::P2pOp::recv(view_of(got, {1000}), prev)};
  c.exchange_async(ops)->wait();
  EXPECT_EQ(got, std::vector<float>(1000, static_cast<float>(prev)));
  EXPECT_EQ(c.stats()[CommOp::send].bytes_sent, 4000u);
}

}  // namespace
}  // namespace diffcp
