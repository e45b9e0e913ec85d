// TAPA: the topology-aware two-phase all-to-all of CoCoDiff (SPEC B.2).
//
// Legend: P ranks in the flat group, group size L (P % L == 0), G = P / L groups. Flat rank
// p = g * L + i belongs to group g = p / L and has local index i = p % L. A block "(g, j) -> (h, i)"
// is what flat rank g*L + j sends to flat rank h*L + i in the flat all-to-all-v.
//
//   phase 1 (inside each group, intra communicator, point-to-point): rank (g, j) sends every block
//            (g, j) -> (h, i) to its group mate (g, i). Afterwards rank (g, i) holds all blocks its
//            group sends to ranks of local index i: the "phase-1 output", laid out [h][j] (block
//            (g, j) -> (h, i) at index h*L + j, the same index space as flat ranks).
//   phase 2 (across groups, inter communicator = the G ranks of local index i): one all-to-all-v;
//            inter rank h gets the L blocks [h][0..L) in one message, and they arrive in the flat
//            recv layout (source (g, j) at flat position g*L + j), so phase 2 receives straight
//            into the caller's buffer. The L inter communicators run in parallel.
//
// The result is bitwise identical to Communicator::all_to_all_v on the flat group (pure copies).
//
// Why point-to-point in phase 1: the blocks for one group mate are not contiguous in the caller's
// send buffer (they are spread over the G groups), and the phase-1 output wants them interleaved
// with other mates' blocks. One message per block (G per mate, empty ones skipped) reads the
// caller's buffer and writes the phase-1 output in place, so no pack/unpack copy is made; only the
// L-th of the data a rank keeps for itself is copied locally. The paper's phase 1 is p2p too,
// which is what makes it asynchronous (overlap with compute, V-First, SPEC B.3).
//
// Byte accounting (per rank, counted by the two sub-communicators under communicator.hpp's rules;
// the flat communicator's counters do not move):
//   intra_stats(): send / recv = phase 1 (one call per non-empty block); all_to_all = the count
//                  exchange of plan() (G u64 values to each of the L-1 mates).
//   inter_stats(): all_to_all = phase 2 (the self block, h = g, is a local copy and not counted).
// Uniform case (count c elements of e bytes per destination): see tapa_uniform_bytes().
//
// Call order (every rank of the flat group, the same sequence, like MPI collectives):
//   TapaAllToAll t(flat, L);             // collective over flat: builds the sub-communicators
//   TapaPlan plan = t.plan(sc, rc);      // collective over intra (count exchange); reusable
//                                        // (or t.plan_uniform(c): local, no communication)
//   TapaPhase1 p1 = t.phase1_async(plan, send, type);   // non-blocking p2p inside the group
//   ... compute; p1.test() drives progress (Open MPI progresses large messages only in MPI calls)
//   t.phase2(std::move(p1), recv);       // waits phase 1, then the inter all-to-all-v
//                                        // (or WorkPtr w = t.phase2_async(...); ...; w->wait())
// or in one call: t.all_to_all_v(send, sc, recv, rc, type)  /  t.all_to_all(send, recv, c, type).
// Several exchanges may be in phase 1 at once (e.g. V's while Q and K are computed) provided every
// rank starts them in the same order and issues their phase 2 calls in the same order. Wrong:
// rank 0 runs phase2(V) before phase2(K) and rank 1 the other way round (the inter all-to-alls
// then pair up mismatched). phase1_async only posts messages, so it never blocks on a mate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

// Bytes one rank sends (= receives) in a uniform TAPA exchange: `count` elements of `elem_bytes`
// to every destination, data volume V = P * count * elem_bytes per rank.
struct TapaBytes {
  std::uint64_t phase1 = 0;          // (L-1)/L * V      (intra send/recv)
  std::uint64_t phase2 = 0;          // (G-1)/G * V      (inter all_to_all), G = P/L
  std::uint64_t count_exchange = 0;  // (L-1) * G * 8    (intra all_to_all; 0 with plan_uniform)
};
// Throws diffcp::Error when P < 1, L < 1 or P % L != 0.
TapaBytes tapa_uniform_bytes(int P, int L, std::size_t count, std::size_t elem_bytes,
                             bool count_exchange);

// Who sends what in phase 1 and phase 2, in elements (independent of the dtype). Made by
// TapaAllToAll::plan / plan_uniform for that object's P and L; reusable for every exchange with
// the same counts (e.g. all layers of a DiT with one shape).
class TapaPlan {
 public:
  // Elements of the phase-1 output (the staging buffer phase 2 sends from).
  std::size_t phase1_output_count() const { return staged_total_; }

 private:
  friend class TapaAllToAll;
  int P_ = 0, L_ = 0;
  std::vector<std::size_t> send_counts_;    // [P] the caller's send counts, flat rank order
  std::vector<std::size_t> send_offsets_;   // [P] exclusive scan of send_counts_
  std::vector<std::size_t> staged_counts_;  // [P] index h*L + j: block (g, j) -> (h, i)
  std::vector<std::size_t> staged_offsets_; // [P] exclusive scan of staged_counts_
  std::vector<std::size_t> phase2_send_counts_;  // [G] sum over j of staged_counts_[h*L + j]
  std::vector<std::size_t> phase2_recv_counts_;  // [G] sum over j of recv_counts[h*L + j]
  std::size_t staged_total_ = 0;
};

// One exchange whose phase 1 is in flight (TapaAllToAll::phase1_async). Move-constructible only
// (a move assignment would free the target's buffer before its messages land). Destroying it
// without phase 2 waits for phase 1, so no message targets freed memory.
class TapaPhase1 {
 public:
  TapaPhase1(TapaPhase1&&) = default;
  TapaPhase1& operator=(TapaPhase1&&) = delete;
  ~TapaPhase1() = default;

  // True once phase 1 is complete; drives the backend's progress (call it between compute steps).
  bool test();
  // Blocks until phase 1 is complete. Afterwards the caller's send buffer may be reused.
  void wait();
  // The phase-1 output: [TapaPlan::phase1_output_count()] elements of the exchange's type, P
  // blocks laid out [h][j] (block (g, j) -> (h, i) at index h*L + j, see the file comment), as raw
  // bytes; valid after wait() (V-Major, SPEC B.4, reads V's here).
  // In the memory the send buffer lives in (backend_of(send)).
  std::span<const std::byte> output() const { return {staged(), staged_bytes_}; }

 private:
  friend class TapaAllToAll;
  TapaPhase1() = default;
  DType type_ = DType::u8;
  // What phase 2 needs of the plan, copied (G entries each) so the plan need not outlive phase 1.
  std::vector<std::size_t> phase2_send_counts_, phase2_recv_counts_;
  // Declared before works_: members die in reverse order, so the works (which wait for their
  // messages on destruction) go before the buffer they write. Host memory, or (an exchange on a
  // device) a Buffer of the send buffer's backend.
  std::byte* staged() const { return staged_dev_.data() ? static_cast<std::byte*>(staged_dev_.data()) : staged_.get(); }
  std::unique_ptr<std::byte[]> staged_;
  Buffer staged_dev_;
  std::size_t staged_bytes_ = 0;
  bool consumed_ = false;  // by phase 2
  std::vector<WorkPtr> works_;
};

class TapaAllToAll {
 public:
  // Groups of L consecutive flat ranks. Throws diffcp::Error naming P and L, before any
  // communication, when L < 1 or P % L != 0. Collective over `flat` (two splits); `flat` must
  // outlive this object. L = 1 (phase 1 is a local copy) and L = P (phase 2 is a local copy)
  // are valid.
  TapaAllToAll(Communicator& flat, int group_size);
  // L = the size of this rank's node (Communicator::split_node_local). Throws on every rank when
  // nodes differ in size or a node's ranks are not L consecutive flat ranks starting at a
  // multiple of L. Collective over `flat`: costs one node-local and one flat all_reduce
  // (counted on those communicators) besides the splits.
  static TapaAllToAll node_local(Communicator& flat);

  TapaAllToAll(TapaAllToAll&&) = default;

  int size() const { return P_; }         // P
  int group_size() const { return L_; }   // L
  int num_groups() const { return P_ / L_; }  // G
  int group() const { return group_; }    // g = rank / L
  int local_index() const { return local_; }  // i = rank % L

  // The sub-communicators and their counters: "inside group" and "across groups" bytes.
  Communicator& intra() { return *intra_; }  // size L, rank i
  Communicator& inter() { return *inter_; }  // size G, rank g
  const CommStats& intra_stats() const { return intra_->stats(); }
  const CommStats& inter_stats() const { return inter_->stats(); }
  void reset_stats();

  // send_counts[d]: elements this rank sends to flat rank d; recv_counts[s]: elements it receives
  // from flat rank s; both [P], as for Communicator::all_to_all_v, zeros allowed. Collective over
  // intra: each rank sends each mate G u64 counts (intra all_to_all, (L-1)*G*8 bytes). Checks
  // that what the mates announce for this rank's own group matches recv_counts.
  TapaPlan plan(std::span<const std::size_t> send_counts, std::span<const std::size_t> recv_counts);
  // `count` elements to and from every flat rank. Local: no communication.
  TapaPlan plan_uniform(std::size_t count) const;

  // Starts phase 1. send: [sum(send_counts)] elements of `type`, packed in flat rank order; it
  // must stay unchanged until phase 1 completes. Point-to-point inside the group (receives posted
  // before sends); the part this rank keeps (blocks to local index i) is copied before returning.
  TapaPhase1 phase1_async(const TapaPlan& plan, const void* send, DType type);
  // Waits for phase 1, then runs phase 2. recv: [sum(recv_counts)] elements, packed in flat rank
  // order, exactly as Communicator::all_to_all_v fills it. Collective over inter.
  void phase2(TapaPhase1&& p1, void* recv);
  // As phase2, but returns once phase 2 is posted; the handle keeps the phase-1 output alive.
  WorkPtr phase2_async(TapaPhase1&& p1, void* recv);

  // plan + phase 1 + phase 2. Same arguments and result as Communicator::all_to_all_v.
  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, void* recv,
                    std::span<const std::size_t> recv_counts, DType type);
  // plan_uniform + phase 1 + phase 2; send, recv: [P * count], as Communicator::all_to_all.
  void all_to_all(const void* send, void* recv, std::size_t count, DType type);
  // Typed form of all_to_all_v; checks the buffer sizes against the counts.
  template <typename T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts,
                    std::span<T> recv, std::span<const std::size_t> recv_counts);

 private:
  void check_plan(const TapaPlan& plan) const;
  // Offsets and phase-2 counts from the three [P] count arrays (staged: index h*L + j).
  static TapaPlan make_plan(int P, int L, std::vector<std::size_t> send_counts,
                            std::vector<std::size_t> staged_counts,
                            std::span<const std::size_t> recv_counts);

  Communicator* flat_;
  int P_ = 1, L_ = 1, group_ = 0, local_ = 0;
  std::unique_ptr<Communicator> intra_, inter_;
};

// Throws diffcp::Error unless `counts` has P entries summing to `elements` (the typed wrapper's
// buffer check, named `what` in the message).
void tapa_check_buffer(const char* what, std::span<const std::size_t> counts, int P,
                       std::size_t elements);

template <typename T>
void TapaAllToAll::all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts,
                                std::span<T> recv, std::span<const std::size_t> recv_counts) {
  tapa_check_buffer("TAPA all_to_all_v send", send_counts, P_, send.size());
  tapa_check_buffer("TAPA all_to_all_v recv", recv_counts, P_, recv.size());
  all_to_all_v(send.data(), send_counts, recv.data(), recv_counts, dtype_of<T>());
}

}  // namespace diffcp
