// Ring attention across the Ulysses groups of DiT USP (SPEC B.1: the ranks beyond the head count
// form a Ring dimension, as in xDiT / USP; CoCoDiff's multi-node runs past the head limit).
//
// Legend: P = U x R ranks; U the Ulysses degree (ranks sharing the heads of one group's tokens), R the
//         Ring degree (Ulysses groups); b images, n_p tokens per image on a rank, M = U b n_p head-layout
//         rows of a group, h_p = n_h / U heads per rank, hd = h_p d_h, H = n_h d_h.
//
// Rank mapping: world rank p = g U + u, g = p / U the ring index (Ulysses group), u = p % U the
// Ulysses index. A Ulysses group is U consecutive ranks, so with the usual by-slot placement (and
// with TAPA's groups of L consecutive ranks, --group-size / the node) Ulysses runs inside a node and
// the ring across nodes, as xDiT / USP do; U and L must tile each other (L | U or U | L). Tokens
// stay sharded over all P ranks in rank order (rank p holds tokens [p n_p, (p+1) n_p) of every image),
// so group g holds the U n_p consecutive tokens [g U n_p, (g+1) U n_p).
//
// Per attention, after the Ulysses exchange (any mode: flat, tapa, vfirst, cocodiff) rank (g, u)
// holds q, k, v of its group's M rows for heads [u h_p, (u+1) h_p). The ring communicator joins the
// R ranks with the same u (ring rank g). For t = 0..R-1 the rank holds the K|V of group s = g - t:
// it posts recv(K|V of s-1 <- g-1) and send(K|V of s -> g+1), computes the partial (o, lse) of its
// queries against group s's keys, merges by log-sum-exp into the running (o, lse)
// (attention/merge.hpp), then waits: the next block flies while the current one computes, as in
// cp/ring.cpp. Every group has the same row layout; a group's mask differs only where its ranks
// hold padding (dit/config.hpp: their keys are in no segment), so the caller gives one per group.
// Then the reverse
// Ulysses all-to-all. Exact up to fp32 rounding (R partial softmaxes merged instead of one); R = 1
// makes no ring at all (the exchange's plain attention, bitwise today's path).
//
// Ring's K/V traffic is full (unoptimised, as in the paper): V-Major's caches act inside the Ulysses
// exchange only, every hop carries every row.
//
// bf16 (the exchange's payload): q, k, v, o and the K|V hops in bf16, the bf16 kernel; partial
// outputs widened and merged in f32, the merged o rounded once.
//
// fp8 wire (dit/wire.hpp, RingWire): the hops carry this group's K|V blocks as the exchange received
// them (e4m3 + one f32 scale per (token, head)); every block, this group's own too, is decoded into
// the compute dtype where it is used, so all ranks attend to the same values.
//
// Bytes (per rank per attention, every rank alike, e = 4 for f32, 2 for bf16): R-1 hops, each one
// group's K and V for h_p heads, 2 M hd = 2 b n_p H elements:
//   ring_kv_bytes = e * 2 b n_p H = 2 e b N H / P           (N = P n_p tokens per image)
// fp8: 2 b n_p (H + 4 n_h) (1 byte per element, 4 per (token, head) block of d_h = H / n_h).
// all to ring rank g+1 (world rank p + U mod P): inside the link group iff it shares p's group of L.
// Compare the Ulysses all-to-alls (q|k|v in, o out): 16 (U-1)/U b n_p H. Summed over the P ranks,
// Ulysses moves 16 (U-1)/U b N H and the ring 8 b N H: past the head limit (U fixed) the
// ring's share grows linearly with R while each rank's compute shrinks as 1/P.
//
// Call order: every rank of the ring calls forward() the same number of times with equal shapes
// (the exchange does, once per attention()).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/comm/communicator.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/dit/wire.hpp"

namespace diffcp {

// ring_kv_bytes above: R the ring degree, tokens_p = b n_p, hidden = H. Throws for R < 1.
std::uint64_t ring_kv_bytes(int R, std::int64_t tokens_p, std::int64_t hidden, DType payload = DType::f32);
// The same in any wire format (fp8: H a multiple of wire.head_dim).
std::uint64_t ring_kv_bytes(int R, std::int64_t tokens_p, std::int64_t hidden, const WireFormat& wire);

// This group's K|V as the exchange received them in an fp8 wire: kv: [M] rows of
// wire.bytes(2 hd) bytes (k blocks, then v blocks) at row stride ld bytes.
struct RingWire {
  const void* kv = nullptr;
  std::int64_t ld = 0;
  WireFormat wire;
};

// What one forward() moved (the exchange adds it to its ExchangeStats).
struct RingTraffic {
  std::uint64_t bytes = 0, messages = 0;
  double comm_ms = 0;  // wall time inside the posts and waits (not hidden by the attention)
};

class RingAttention {
 public:
  // ring: the R ranks of equal Ulysses index, ring rank g = ring->rank(); owned.
  explicit RingAttention(std::unique_ptr<Communicator> ring);

  int size() const { return ring_->size(); }  // R
  int rank() const { return ring_->rank(); }  // g
  const CommStats& comm_stats() const { return ring_->stats(); }

  // o, lse = softmax attention (scale 1/sqrt(d_h)) of q over the keys of every group:
  //   masks: [R] q's rows against group s's M key rows (masks[s]; equal unless a group holds padding)
  //   q, k, v: [M, h_p, d_h] this rank's head-layout tensors (core/tensor.hpp head_view: any row
  //            stride), f32 or bf16, o the same dtype
  //   o: [M, h_p, d_h] out   lse: [M h_p] out
  //   fp8: (optional) the K|V blocks the hops carry instead of k, v (which are then not read)
  RingTraffic forward(std::span<const BlockMask> masks, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                      TensorView o, std::span<float> lse, const RingWire* fp8 = nullptr);

 private:
  std::unique_ptr<Communicator> ring_;
  // In the active backend's memory.
  Workspace kv_[2];                                   // [M][2][hd] visiting K|V in q's dtype (fp8: the
                                                      // decoded block in kv_[0])
  DeviceVector<std::uint8_t> kv_wire_[2];             // fp8: [M] rows of wire.bytes(2 hd) visiting K|V blocks
  Workspace o_c_;                                     // [M, hd] a partial in q's dtype (f32: o_run_ / o_part_ itself)
  DeviceVector<float> o_run_, o_part_, o_tmp_;        // [M, hd]: the merge runs in f32
  DeviceVector<float> lse_run_, lse_part_, lse_tmp_;  // [M h_p]
};

}  // namespace diffcp
