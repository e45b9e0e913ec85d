// The attention exchange of Ulysses sequence parallelism (SPEC B.1): the all-to-all that turns the
// sequence layout (a rank's n_p tokens of each image, all n_h heads) into the head layout (all N
// tokens, h_p = n_h / P heads) for q, k, v before attention, the attention itself, and the
// all-to-all that turns o back. The modes differ only in how the all-to-all moves bytes:
//   flat     Communicator::all_to_all on the flat group (one call for q|k|v, one for o)
//   tapa     TapaAllToAll (SPEC B.2): phase 1 inside groups of L ranks, phase 2 across groups;
//            bitwise the same result as flat
//   vfirst   TAPA with V-First (SPEC B.3, exchange_vfirst.cpp): the model calls start_v() once V's
//            columns are projected; V's phase 1 flies (driven by poll() between the row chunks of the
//            Q/K GEMMs) while q, k are computed; attention() then moves q|k through TAPA and finishes
//            V's phase 2. Bitwise the same result as tapa.
//   cocodiff V-First + V-Major selective communication (SPEC B.4, vmajor.hpp): per layer caches,
//            only the active rows of q, k (phase 1 and 2) and v (phase 2) move on selective steps.
//
// Legend: P ranks in groups of L (G = P / L), b images, n_p tokens per image on a rank, N = P*n_p
//         tokens per image, n_h heads of dim d_h, h_p = n_h / P, hd = h_p * d_h, M_p local rows.
//
// Head layout (what attention sees): row (r, j, t) = token t of image j held by rank r, rows in
// that order ([P][b][n_p], the order the all-to-all delivers them, so nothing is reordered);
// q, k, v interleaved per row ([3][hd], row stride 3 hd). The attention mask has one query block
// of n_p rows per (r, j); it sees the N key rows of image j, given as P segments at positions
// [j N, (j+1) N). A dense attention per image, in one call, over P*b*h_p work items.
//
// USP (ring_attention.hpp): with a Ulysses degree U < P the exchange runs on the U ranks of one
// Ulysses group (size(), rank(), group_size() are that group's), and the attention between the two
// all-to-alls becomes Ring attention over the R = P / U groups; tokens stay sharded over all P
// ranks (seq_size(), seq_rank()). U = P (the default): no ring, today's path unchanged.
//
// Payload (set_compute): f32, or bf16 — the sequence-layout rows are rounded once as they are packed,
// every exchange, the head layout, V-Major's caches and Ring's K|V hops carry bf16 (half the bytes),
// the bf16 attention kernel reads the head layout in place (f32 accumulation and softmax) and o
// returns in bf16, widened to f32 as it is unpacked. lse and V-Major's L1 statistics stay f32.
//
// Wire (set_wire, dit/wire.hpp): Wire::compute (default) sends the payload above. Wire::fp8 packs
// the same rows in the compute dtype, encodes them (ops/fp8.hpp: e4m3, one f32 scale per (token,
// head)) and sends the blocks; receivers decode into the compute dtype before attention. o returns
// encoded the same way. V-Major's selective sends and caches hold the blocks as received; Ring's K|V
// hops carry the blocks, each group's K|V decoded where it is used (so every rank attends to the same
// decoded values). Flat, TAPA and V-First stay bitwise equal with one wire.
//
// Call order (every rank of the group, same sequence): the constructor (collective), then any
// number of attention() calls with equal layouts on all ranks; set_layout() is local.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/dit/cache_schedule.hpp"
#include "diffcp/dit/ring_attention.hpp"
#include "diffcp/dit/usp.hpp"
#include "diffcp/dit/wire.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

enum class ExchangeMode : std::uint8_t { flat, tapa, vfirst, cocodiff };
// "flat" | "tapa" | "vfirst" | "cocodiff"; anything else throws naming the modes.
ExchangeMode parse_exchange_mode(const std::string& name);
const char* exchange_mode_name(ExchangeMode mode);

// What this rank's exchanges moved, by link class (SPEC B.2: a group of L ranks shares a fast link).
struct ExchangeStats {
  std::uint64_t bytes_intra = 0;  // bytes sent to ranks of its own group
  std::uint64_t bytes_inter = 0;  // bytes sent to ranks of other groups
  std::uint64_t messages = 0;     // point-to-point messages sent (an all-to-all: one per peer it sends a block to;
                                  // a ring hop: one)
  std::uint64_t ring_bytes = 0;   // of bytes_intra + bytes_inter: Ring's K|V (USP; ring_kv_bytes per attention)
  std::uint64_t scale_bytes = 0;  // of bytes_intra + bytes_inter: the fp8 wire's scales (4 per (token, head)
                                  // block sent; 0 for the compute-dtype wire)
  std::uint64_t calls = 0;        // all-to-alls (two per attention)
  double comm_ms = 0;             // wall time inside communication calls (post, test, wait, collectives):
                                  // the communication the compute did not hide ("exposed")
  // V-First (vfirst, cocodiff): exchanges whose V phase 1 was started early, and how many of them
  // had completed (seen by a poll() between compute chunks) before attention() had to block on it.
  std::uint64_t v_started = 0, v_hidden = 0;
  double v_wait_ms = 0;           // of comm_ms: blocked waiting for V's phase 1 in attention()
  // V-Major (cocodiff): exchanges that ran selective / full.
  std::uint64_t selective = 0, full = 0;

  ExchangeStats& operator+=(const ExchangeStats& o);  // every counter summed (two passes of a step)
};

// Where one rank's tokens live in its sequence-layout tensors.
struct ExchangeLayout {
  std::int64_t batch = 1;       // b
  std::int64_t tokens_p = 0;    // n_p tokens of each image on this rank
  std::int64_t heads = 0;       // n_h
  std::int64_t head_dim = 0;    // d_h
  std::int64_t local_rows = 0;  // M_p rows of the sequence-layout tensors (>= b * n_p)
  // rows[j * n_p + t]: the local row of token t of image j (the rank's exchange order) [b * n_p]
  std::vector<std::int64_t> rows;
  // Padding (dit/config.hpp, DitShard): valid[r] = how many of the n_p tokens of each image that
  // sequence rank r holds are real; they come first in r's exchange order, the rest are padding that
  // no query sees as a key (their own outputs are computed and ignored). [seq_size()], every rank the
  // same; empty: every token is real.
  std::vector<std::int64_t> valid;
};

// Rows of projection between two polls of the exchange (V-First, SPEC B.3): the model projects in
// chunks of these rows in every mode, so that the modes compute the same sums (bitwise equal);
// on one rank (nothing to progress) in one chunk.
inline constexpr std::int64_t kPollRows = 64;

class AttentionExchange {
 public:
  virtual ~AttentionExchange() = default;
  AttentionExchange(const AttentionExchange&) = delete;
  AttentionExchange& operator=(const AttentionExchange&) = delete;

  ExchangeMode mode() const { return mode_; }
  int rank() const { return p_; }        // p (USP: u, the rank inside the Ulysses group)
  int size() const { return P_; }        // P (USP: U, the Ulysses degree)
  int group_size() const { return L_; }  // L (USP: of the Ulysses group, min(L, U))
  // USP: R Ulysses groups (this one: g); the tokens are sharded over P = U R ranks (this one:
  // p = g U + u) in link groups of L ranks. Without a ring: R = 1, g = 0, and these are size(),
  // rank(), group_size().
  int ring_degree() const { return ring_ ? ring_->size() : 1; }   // R
  int ring_rank() const { return ring_ ? ring_->rank() : 0; }     // g
  int seq_size() const { return P_ * ring_degree(); }             // P = U R
  int seq_rank() const { return ring_rank() * P_ + p_; }          // p = g U + u
  int link_group_size() const { return link_L_; }                 // L of the world
  // The ring communicator's own counters (tests check Ring's bytes against them); null when R = 1.
  const CommStats* ring_comm_stats() const { return ring_ ? &ring_->comm_stats() : nullptr; }

  // Checks the layout (P | n_h, rows inside [0, M_p), valid[r] in [0, n_p] and > 0 somewhere), sizes
  // the buffers and builds the masks (one per Ulysses group: its ranks' valid keys).
  // Local: no communication. Every rank must set an equal (b, n_p, n_h, d_h).
  void set_layout(ExchangeLayout layout);  // USP: U | n_h
  const ExchangeLayout& layout() const { return layout_; }

  // seq -> head, dense attention per image (softmax scale 1/sqrt(d_h); USP: over every group's keys,
  // Ring attention), head -> seq.
  //   qkv: [M_p, 3 n_h, d_h]: q heads, k heads, v heads of each local row (row stride >= 3 n_h d_h)
  //   out: [M_p, n_h, d_h] out; the layout's rows are written, other rows untouched. out may
  //        alias the v columns of qkv (they are read before out is written).
  virtual void attention(HeadRows<const float> qkv, HeadRows<float> out);

  // The staged schedule of V-First (SPEC B.3). Call order per attention, every rank alike:
  //   start_v(qkv)   once the v columns of qkv are final (q, k may still be garbage); vfirst and
  //                  cocodiff start V's exchange here, flat and tapa do nothing
  //   poll()         any number of times while q, k are computed (drives MPI progress; local)
  //   attention(qkv, out)  with the same qkv, now with q, k final
  // attention() without a start_v() is valid in every mode (V then starts inside it).
  virtual void start_v(HeadRows<const float> /*qkv*/) {}
  // V-First's progress: the model calls poll() after every kPollRows rows of projection.
  virtual void poll() {}
  // Denoising step `step` of `steps` begins (the sampler calls it; cocodiff's schedule reads it;
  // layers are counted by attention() calls since). Local.
  virtual void begin_step(int /*step*/, int /*steps*/) {}
  // Bytes of this rank's cross-step caches (cocodiff: V^p1, Q^p2, K^p2, V^p2 per layer).
  virtual std::uint64_t cache_bytes() const { return 0; }

  // The payload and attention dtype (see the header comment): f32 (default) or bf16. Set it before
  // the first attention() or between steps (a change makes V-Major refill its caches).
  // fp8 wire: throws when the active backend declines fp8_encode / fp8_decode on `compute`.
  void set_compute(DType compute);
  DType compute() const { return compute_; }
  // The wire format (dit/wire.hpp): Wire::compute (default) or Wire::fp8. Local; every rank must set
  // the same before the first attention() or between steps (a change makes V-Major refill its
  // caches). fp8 throws "backend '<name>' does not support fp8_encode on <dtype>" when the active
  // backend declines the codec, before any communication.
  void set_wire(Wire w);
  Wire wire_kind() const { return wire_; }
  // How payload elements become bytes on the wire (the layout's d_h; set_layout first for fp8 sizes).
  WireFormat wire_format() const { return {compute_, wire_, layout_.head_dim}; }

  // The two halves attention() is made of (for tests and later schedules).
  void seq_to_head(HeadRows<const float> qkv);
  // The mask of this rank's queries against the keys of Ulysses group g (default: its own group;
  // USP: every group's keys visit through the ring).
  const BlockMask& mask() const { return mask(ring_rank()); }
  const BlockMask& mask(int g) const;
  void head_to_seq(HeadRows<float> out);

  const ExchangeStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 protected:
  AttentionExchange(ExchangeMode mode, int rank, int P, int L);
  // Communicator::all_to_all semantics: send, recv [P * count] payload elements in the wire format
  // (wire_bytes(count) bytes per block), block r to / from rank r. Implementations add their bytes,
  // scale bytes and messages to stats_ (the caller adds calls and comm_ms).
  virtual void all_to_all(const void* send, void* recv, std::size_t count) = 0;
  ExchangeStats stats_;

  std::int64_t head_rows() const { return P_ * layout_.batch * layout_.tokens_p; }  // P b n_p
  std::int64_t hd() const { return layout_.heads / P_ * layout_.head_dim; }         // h_p d_h
  // Messages: the element dtype the communicators are given (compute(), or u8 for fp8) and how many
  // of them `elements` payload elements are (elements, or their bytes for fp8).
  DType wire() const { return wire_ == Wire::fp8 ? DType::u8 : compute_; }
  std::size_t wire_count(std::int64_t elements) const {
    return wire_ == Wire::fp8 ? static_cast<std::size_t>(wire_bytes(elements)) : static_cast<std::size_t>(elements);
  }
  // Bytes of `elements` payload elements on the wire (whole (token, head) blocks; wire_format()).
  std::int64_t wire_bytes(std::int64_t elements) const { return static_cast<std::int64_t>(wire_format().bytes(elements)); }
  // Payload element i (a multiple of d_h for fp8) of a wire buffer, and element i of a buffer in the
  // compute dtype (what is packed, and what attention reads).
  std::byte* wire_at(void* base, std::int64_t i) const { return static_cast<std::byte*>(base) + wire_bytes(i); }
  const std::byte* wire_at(const void* base, std::int64_t i) const { return static_cast<const std::byte*>(base) + wire_bytes(i); }
  std::byte* compute_at(void* base, std::int64_t i) const {
    return static_cast<std::byte*>(base) + i * static_cast<std::int64_t>(dtype_size(compute_));
  }
  // The payload to send for x [elements] in the compute dtype: fp8 encodes it into `enc` (resized)
  // and returns enc's data; the compute wire returns x itself.
  const void* encode(const void* x, std::int64_t elements, DeviceVector<std::uint8_t>& enc) const;
  // The values of wire payload w [elements] in the compute dtype: fp8 decodes it into `dec` (resized)
  // and returns dec's data; the compute wire returns w itself.
  const void* decode(const void* w, std::int64_t elements, DeviceVector<std::uint8_t>& dec) const;
  // fp8 only: decodes wire payload w [elements] into x [elements] of the compute dtype.
  void decode_to(const void* w, std::int64_t elements, void* x) const;
  // The head-layout q|k|v [P b n_p][3][hd] as received, in the wire format (subclasses fill it; the
  // compute wire: the buffer attention reads), and decode_head(), which makes the compute-dtype head
  // layout attention reads from `from` ([P b n_p][3][hd] in the wire format; null: head_qkv_wire()).
  void* head_qkv_wire();
  void decode_head(const void* from = nullptr);
  const void* head_wire_src_ = nullptr;  // fp8: the wire head layout decode_head() last read
  // Attention on head_qkv() (USP: Ring attention over the groups), then head -> seq into out (as the
  // second half of attention()).
  void finish_attention(HeadRows<float> out);
  // Checks qkv's shape against the layout.
  void check_qkv(HeadRows<const float> qkv) const;

 private:
  void timed_all_to_all(const void* send, void* recv, std::size_t count);
  // The attention on the head layout in the compute dtype: o_head_ [P b n_p][hd] out.
  void attend();
  friend std::unique_ptr<AttentionExchange> make_attention_exchange(ExchangeMode, Communicator&, int,
                                                                    const CacheSchedule&, int);

  ExchangeMode mode_;
  int p_, P_, L_, link_L_;
  // USP only (make_attention_exchange): the Ulysses group's communicator that the subclass uses
  // (destroyed after it), the ring, and whether Ring's bytes stay inside this rank's link group.
  std::unique_ptr<Communicator> ulysses_comm_;
  std::unique_ptr<RingAttention> ring_;
  bool ring_intra_ = false;
  ExchangeLayout layout_;
  std::vector<BlockMask> masks_;  // [R] by Ulysses group
  // Buffers in the compute dtype, sized in f32 elements (bf16 uses half of each): send [P][b n_p][3][hd],
  // head-layout q|k|v [P b n_p][3][hd], o [P b n_p][hd] and the o coming back [P][b n_p][hd].
  // In the active backend's memory.
  DeviceVector<float> send_, qkv_head_, o_head_, o_recv_;
  DeviceVector<float> lse_;  // [P b n_p, h_p]
  // fp8 wire only, bytes: what is sent (q|k|v, then o), the head-layout q|k|v as received, the o
  // coming back.
  DeviceVector<std::uint8_t> send_wire_, qkv_wire_, o_recv_wire_;
  DType compute_ = DType::f32;
  Wire wire_ = Wire::compute;
};

// The exchange for `mode` over the ranks of `world` in groups of `group_size` consecutive ranks
// (0: the ranks sharing a node, Communicator::split_node_local). Collective over `world`, which
// must outlive the exchange. `schedule` is cocodiff's (ignored by the other modes). `ulysses_degree`
// U (0: P) < P makes USP: `mode`'s exchange on the Ulysses group of world rank p (ranks
// [p/U U, p/U U + U), Communicator::split), groups of min(L, U) inside it, and Ring attention over
// the ranks with the same p % U (ring_attention.hpp). Throws on every rank, before any exchange, for
// L < 1, P % L != 0, nodes of unequal size / non-consecutive ranks (group_size 0), U < 0, P % U != 0,
// U and L that do not tile (neither divides the other) or an invalid schedule.
std::unique_ptr<AttentionExchange> make_attention_exchange(ExchangeMode mode, Communicator& world, int group_size,
                                                           const CacheSchedule& schedule = {}, int ulysses_degree = 0);


// The implementations, one file each (exchange_flat.cpp, exchange_tapa.cpp, exchange_vfirst.cpp,
// vmajor.cpp); L already checked.
std::unique_ptr<AttentionExchange> make_flat_exchange(Communicator& world, int group_size);
std::unique_ptr<AttentionExchange> make_tapa_exchange(Communicator& world, int group_size);
std::unique_ptr<AttentionExchange> make_vfirst_exchange(Communicator& world, int group_size);
std::unique_ptr<AttentionExchange> make_vmajor_exchange(Communicator& world, int group_size, const CacheSchedule& schedule);

// The size of this rank's node as a group size: checks (collectively) that every node holds the
// same number L of ranks and that they are L consecutive ranks starting at a multiple of L.
int node_local_group_size(Communicator& world);

}  // namespace diffcp
