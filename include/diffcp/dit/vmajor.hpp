// V-Major selective communication (SPEC B.4) on top of V-First: the "cocodiff" exchange.
//
// Legend: P ranks in G groups of L, rank (g, i); n = b n_p tokens per rank per exchange (text and
//         image rows, exchange order); hd = h_p d_h; r the step's cache ratio (cache_schedule.hpp);
//         n_c = floor(r n) cached and k = n - n_c active tokens per rank.
//
// Per layer and rank the cache holds (what the paper's memory analysis counts):
//   V^p1  [G][L][n][hd]    V's phase-1 output (all tokens of the group, this rank's lane of heads)
//   QKV^p2 [P][n][3][hd]   the head-layout q|k|v the attention reads (Q^p2, K^p2, V^p2 interleaved,
//                          so attention sees exactly TAPA's layout and strides)
// i.e. 4 n H elements of the payload dtype per layer (H = n_h d_h; f32, or bf16: half the bytes;
// fp8 wire: the e4m3 blocks as received, 4 n (H + 4 n_h) bytes), independent of P for a fixed image.
// The L1 statistics are computed in f32 (double sums) from the payload values (fp8: decoded into the
// compute dtype), and all-gathered in f32.
//
// Full step (warm-up, sync, step 0): V-First's exchange; the outputs fill V^p1 and QKV^p2.
// Selective step:
//   1. V's phase 1 at full size (started by start_v, overlapped with Q/K compute by poll()).
//   2. Per group token (source mate j, token t) the L1 distance between its phase-1 v and V^p1,
//      over this rank's lane of heads; the L lanes' partial sums are all-gathered inside the group
//      (L n floats) and added in lane order, so every mate holds the same full-head L1 (equal to
//      the L1 over the token's whole v row) and makes the same choice.
//   3. For every source rank of the group: its n_c tokens with the smallest L1 (ties: lower index)
//      are cached, the other k are active (ascending). The group's active lists [L][k] are
//      all-gathered across groups (inter communicator: every lane holds the same lists), so every
//      rank knows every source's active list [P][k].
//   4. V^p1 takes the active rows (so it mirrors what the receivers hold, and the next step's L1
//      measures the change against the value they actually use: staleness accumulates and the
//      token is sent once it matters).
//   5. Q|K phase 1 sends only the active rows (TAPA, uniform count k 2 hd per destination);
//      phase 2 is one inter all-to-all of the active rows' q|k|v ([h][j][k][3][hd]).
//   6. Receivers scatter the rows into QKV^p2 (indexed by the all-gathered lists); cached rows keep
//      their older values; attention runs on QKV^p2; o goes back through TAPA at full size.
// Steps 2, 3, 4 and 6 run on the device (dit/ops.hpp select_active and token_rows, row gathers and
// scatters by device row lists): a selective step makes no host sync of its own.
// r = 0 on a selective step moves every row through this path and is bitwise equal to TAPA.
// Call order as AttentionExchange's; begin_step() each step (the sampler does it).
#pragma once

#include <cstdint>
#include <vector>

#include "diffcp/dit/cache_schedule.hpp"
#include "diffcp/dit/exchange_vfirst.hpp"

namespace diffcp {

class VMajorExchange final : public VFirstExchange {
 public:
  // Throws diffcp::Error (schedule.validate()) before any communication.
  VMajorExchange(Communicator& world, int L, const CacheSchedule& schedule);

  const CacheSchedule& schedule() const { return schedule_; }
  void begin_step(int step, int steps) override;
  void attention(HeadRows<const float> qkv, HeadRows<float> out) override;
  std::uint64_t cache_bytes() const override;

 private:
  struct LayerCache {  // in the wire format (fp8: the blocks as received), in the active backend's memory
    DeviceVector<std::uint8_t> v_p1;    // [G][L][n][hd]
    DeviceVector<std::uint8_t> qkv_p2;  // [P][n][3][hd]
    DType compute = DType::f32;         // the wire format they hold
    Wire wire = Wire::compute;
  };
  void full_exchange(HeadRows<const float> qkv, LayerCache& c);
  void selective_exchange(HeadRows<const float> qkv, LayerCache& c, std::int64_t cached);

  CacheSchedule schedule_;
  int step_ = 0, steps_ = 1;
  std::size_t layer_ = 0;
  std::vector<LayerCache> caches_;
  // The selection, all device memory (no host sync): the L1 partials of this lane [L n] and of the
  // group's lanes [L][L n], the active tokens of the group's sources [L][k] and of all [P][k], row
  // lists made from them [max(G L k, P k)], and the layout's local rows [n] (with a host copy that
  // says when to upload them again).
  DeviceVector<float> l1_part_, l1_all_;
  DeviceVector<std::int32_t> act_group_, act_all_;
  DeviceVector<std::int64_t> rows_, map_;
  std::vector<std::int64_t> map_host_;
  DeviceVector<std::uint8_t> p2_send_, p2_recv_;  // payload bytes
  DeviceVector<std::uint8_t> l1_a_, l1_b_;        // fp8: V's phase 1 and V^p1 decoded for the L1 [G][L][n][hd]
};

// Bytes one rank sends in a run (closed form of the exchange above, every rank alike): `layers`
// attention exchanges per step, n tokens and hd per rank, rows in `payload` (f32 or bf16) or a wire
// format (the L1 partials f32, the active indices i32). n counts the tokens of the joint attention:
// text and image rows (b (T_p + I_p)); Wan's only its video rows (b I_p): its cross-attention to
// the text exchanges nothing, every rank holding the whole text and all heads of it.
struct VMajorBytes {
  std::uint64_t intra = 0, inter = 0;  // inside / across groups, everything (as ExchangeStats)
  std::uint64_t inter_qkv = 0;         // of inter: the q|k|v phase 2 alone (what V-Major shrinks)
  std::uint64_t scales = 0;            // of intra + inter: the fp8 wire's scales (ExchangeStats::scale_bytes)
};
// vmajor = false: TAPA's (every step full). Throws for P % L != 0.
VMajorBytes vmajor_predicted_bytes(int P, int L, std::int64_t n, std::int64_t hd, std::int64_t layers,
                                   const CacheSchedule& schedule, int steps, bool vmajor, DType payload = DType::f32);
// The same in any wire format (dit/wire.hpp; fp8: rows of hd elements are whole blocks of
// wire.head_dim, 1 byte per element + 4 per block).
VMajorBytes vmajor_predicted_bytes(int P, int L, std::int64_t n, std::int64_t hd, std::int64_t layers,
                                   const CacheSchedule& schedule, int steps, bool vmajor, const WireFormat& wire);

}  // namespace diffcp
