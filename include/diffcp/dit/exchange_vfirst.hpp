// V-First (SPEC B.3): TAPA with V's phase 1 started as soon as V is projected, so it flies while
// the model computes Q, K (projection, QK RMSNorm, RoPE). Open MPI moves large messages only inside
// MPI calls, so the model calls poll() (TapaPhase1::test) between the row chunks of its GEMMs.
//
// Per attention (every rank the same order): start_v: V phase 1 posted; poll()s; attention: Q|K
// phase 1 posted, V phase 1 waited, V phase 2, Q|K phase 2 (the order TAPA requires for several
// exchanges in flight), then q|k and v interleaved into the head layout, attention, o back through
// TAPA. The bytes equal TAPA's; each phase-1 block is two messages (v, then q|k) instead of one.
// The head-layout tensor is bitwise TAPA's, so the result is too.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "diffcp/dit/exchange_tapa.hpp"

namespace diffcp {

class VFirstExchange : public TapaExchange {
 public:
  VFirstExchange(Communicator& world, int L, ExchangeMode mode = ExchangeMode::vfirst) : TapaExchange(world, L, mode) {}

  void start_v(HeadRows<const float> qkv) override;
  void poll() override;
  void attention(HeadRows<const float> qkv, HeadRows<float> out) override;

 protected:
  // Everything of attention() up to the filled head layout; v_p1_copy (optional) receives V's
  // phase-1 output [G][L][b n_p][hd] in wire() (cocodiff's V^p1).
  void exchange_qkv(HeadRows<const float> qkv, DeviceVector<std::uint8_t>* v_p1_copy);
  std::int64_t tokens() const { return layout().batch * layout().tokens_p; }  // b n_p
  // Packs the q|k slices of `count` local rows for every destination: dst [P][count][2][hd] in
  // compute() (encode() makes the payload). rows: null (all b n_p in exchange order: layout().rows,
  // count = b n_p) or [count] i64 local rows in device memory (V-Major's active rows, token_rows).
  void pack_qk(HeadRows<const float> qkv, const std::int64_t* rows, std::int64_t count, void* dst) const;
  // Blocks until V's phase 1 is complete (v_hidden when a poll saw it complete first; v_wait_ms).
  void wait_v();
  // Steady clock in ms (for the comm_ms intervals).
  static double now_ms();

  std::optional<TapaPhase1> v_p1_;  // V's phase 1 in flight: [G][L][b n_p][hd] staged
  bool v_done_ = false;
  Counters v_before_{};             // counters when V's phase 1 was posted
  DeviceVector<float> v_send_, qk_send_;                // packed rows in the compute dtype (f32 slots; bf16 uses half)
  DeviceVector<std::uint8_t> v_wire_, qk_wire_;         // fp8: their encoded payloads (in flight while phase 1 runs)
  DeviceVector<std::uint8_t> v_recv_, qk_recv_;         // received payload bytes [P][b n_p][hd], [P][b n_p][2][hd]
};

}  // namespace diffcp
