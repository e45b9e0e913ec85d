// TAPA (SPEC B.2): the same all-to-all as Flat in two topology-aligned phases, bitwise the same
// result. Inside-group bytes are phase 1 (point-to-point on the intra communicator), across-group
// bytes phase 2 (the inter all-to-all), read from the sub-communicators' own counters.
#include "comm/tapa.hpp"
#include "dit/exchange.hpp"

namespace diffcp {

namespace {

class TapaExchange final : public AttentionExchange {
 public:
  TapaExchange(Communicator& world, int L)
      : AttentionExchange(ExchangeMode::tapa, world.rank(), world.size(), L), tapa_(world, L) {}

 private:
  void all_to_all(const float* send, float* recv, std::size_t count) override {
    const OpCounter intra_send0 = tapa_.intra_stats()[CommOp::send];
    const OpCounter intra_a2a0 = tapa_.intra_stats()[CommOp::all_to_all];
    const OpCounter inter0 = tapa_.inter_stats()[CommOp::all_to_all];
    tapa_.all_to_all(send, recv, count, DType::f32);
    const OpCounter& intra_send = tapa_.intra_stats()[CommOp::send];
    const OpCounter& intra_a2a = tapa_.intra_stats()[CommOp::all_to_all];
    const OpCounter& inter = tapa_.inter_stats()[CommOp::all_to_all];
    // plan_uniform exchanges no counts, so intra all_to_all stays 0; counted anyway, should a
    // planned exchange ever be used here.
    stats_.bytes_intra += (intra_send.bytes_sent - intra_send0.bytes_sent) + (intra_a2a.bytes_sent - intra_a2a0.bytes_sent);
    stats_.bytes_inter += inter.bytes_sent - inter0.bytes_sent;
    // Phase 1: one message per non-empty block (the send calls); phase 2: one per other group.
    stats_.messages += (intra_send.calls - intra_send0.calls) +
                       (count > 0 ? (inter.calls - inter0.calls) * static_cast<std::uint64_t>(tapa_.num_groups() - 1) : 0);
  }

  TapaAllToAll tapa_;
};

}  // namespace

std::unique_ptr<AttentionExchange> make_tapa_exchange(Communicator& world, int group_size) {
  return std::make_unique<TapaExchange>(world, group_size);
}

}  // namespace diffcp
