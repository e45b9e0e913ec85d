// The TAPA exchange (SPEC B.2) as a base for the modes built on it (vfirst, cocodiff): it owns the
// TapaAllToAll and turns the sub-communicators' counters into ExchangeStats.
#pragma once

#include "diffcp/comm/tapa.hpp"
#include "diffcp/dit/exchange.hpp"

namespace diffcp {

class TapaExchange : public AttentionExchange {
 public:
  TapaExchange(Communicator& world, int L, ExchangeMode mode = ExchangeMode::tapa)
      : AttentionExchange(mode, world.rank(), world.size(), L), tapa_(world, L) {}

 protected:
  // The sub-communicators' counters at one moment.
  struct Counters {
    OpCounter intra_send, intra_a2a, intra_ag, inter_a2a, inter_ag;
  };
  Counters counters() const;
  // Adds what moved since `before` to stats_: inside groups = intra send + all_to_all + all_gather
  // bytes, across groups = inter all_to_all + all_gather bytes; messages = intra sends (one per
  // block) + (G-1) per inter call that moved bytes + (L-1) per intra all_gather that moved bytes.
  void count_since(const Counters& before);

  // plan_uniform + phase 1 + phase 2, counted.
  void all_to_all(const void* send, void* recv, std::size_t count) override;

  TapaAllToAll tapa_;
};

}  // namespace diffcp
