// TAPA (SPEC B.2): the same all-to-all as Flat in two topology-aligned phases, bitwise the same
// result. Inside-group bytes are phase 1 (point-to-point on the intra communicator), across-group
// bytes phase 2 (the inter all-to-all), read from the sub-communicators' own counters.
#include "diffcp/dit/exchange_tapa.hpp"

namespace diffcp {

TapaExchange::Counters TapaExchange::counters() const {
  const CommStats& a = tapa_.intra_stats();
  const CommStats& e = tapa_.inter_stats();
  return {a[CommOp::send], a[CommOp::all_to_all], a[CommOp::all_gather], e[CommOp::all_to_all], e[CommOp::all_gather]};
}

void TapaExchange::count_since(const Counters& b) {
  const Counters n = counters();
  // plan_uniform exchanges no counts, so intra all_to_all stays 0; counted anyway, should a
  // planned exchange ever be used here.
  stats_.bytes_intra += (n.intra_send.bytes_sent - b.intra_send.bytes_sent) +
                        (n.intra_a2a.bytes_sent - b.intra_a2a.bytes_sent) + (n.intra_ag.bytes_sent - b.intra_ag.bytes_sent);
  const std::uint64_t inter_a2a = n.inter_a2a.bytes_sent - b.inter_a2a.bytes_sent;
  const std::uint64_t inter_ag = n.inter_ag.bytes_sent - b.inter_ag.bytes_sent;
  const std::uint64_t intra_ag = n.intra_ag.bytes_sent - b.intra_ag.bytes_sent;
  stats_.bytes_inter += inter_a2a + inter_ag;
  // The payload moves in the sends and all-to-alls; the all_gathers carry V-Major's f32 L1 partials
  // and i32 active indices, no scales.
  stats_.scale_bytes += wire_format().scale_share((n.intra_send.bytes_sent - b.intra_send.bytes_sent) +
                                                  (n.intra_a2a.bytes_sent - b.intra_a2a.bytes_sent) + inter_a2a);
  const std::uint64_t G1 = static_cast<std::uint64_t>(tapa_.num_groups() - 1), L1 = static_cast<std::uint64_t>(group_size() - 1);
  // Phase 1: one message per non-empty block (the send calls); phase 2: one per other group.
  stats_.messages += (n.intra_send.calls - b.intra_send.calls) +
                     (inter_a2a > 0 ? (n.inter_a2a.calls - b.inter_a2a.calls) * G1 : 0) +
                     (inter_ag > 0 ? (n.inter_ag.calls - b.inter_ag.calls) * G1 : 0) +
                     (intra_ag > 0 ? (n.intra_ag.calls - b.intra_ag.calls) * L1 : 0);
}

void TapaExchange::all_to_all(const void* send, void* recv, std::size_t count) {
  const Counters before = counters();
  tapa_.all_to_all(send, recv, wire_count(static_cast<std::int64_t>(count)), wire());
  count_since(before);
}

std::unique_ptr<AttentionExchange> make_tapa_exchange(Communicator& world, int group_size) {
  return std::make_unique<TapaExchange>(world, group_size);
}

}  // namespace diffcp
