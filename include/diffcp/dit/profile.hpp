// Where a DiT step's time goes, per op family (`diffcp dit --profile`): wall-clock time of this
// rank summed over the velocity evaluations it ran. Host clock around each call: the CPU backend
// computes synchronously, so a call's time is its op's. Off (a null profile) costs one branch.
#pragma once

#include <array>
#include <chrono>
#include <string_view>

namespace diffcp {

enum class DitPhase : int {
  conditioning,   // timestep / guidance / pooled MLPs, the modulation vectors, the embeddings
  layernorm_mod,  // (1 + scale) LN(x) + shift
  gemm,           // the token projections (bias, bf16 rounding of the activations included)
  qk_norm_rope,   // q/k RMSNorm + RoPE
  attention,      // the exchange's attention: the all-to-alls (none at P = 1) and the dense kernel
  activation,     // GELU-tanh / SwiGLU
  gated_add,      // x += gate * y
  final_layer,    // the last modulation, norm and projection
  count
};

inline constexpr std::array<std::string_view, static_cast<int>(DitPhase::count)> kDitPhaseNames = {
    "conditioning", "layernorm_mod", "gemm", "qk_norm_rope", "attention", "activation", "gated_add", "final_layer"};

struct DitProfile {
  std::array<double, static_cast<int>(DitPhase::count)> ms{};  // per phase, summed
  int evaluations = 0;                                          // velocity() calls counted
};

// Adds the scope's wall time to `profile`'s phase (nothing when profile is null).
class DitPhaseScope {
 public:
  DitPhaseScope(DitProfile* profile, DitPhase phase) : p_(profile), phase_(phase) {
    if (p_) t0_ = std::chrono::steady_clock::now();
  }
  ~DitPhaseScope() {
    if (p_)
      p_->ms[static_cast<int>(phase_)] +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }
  DitPhaseScope(const DitPhaseScope&) = delete;
  DitPhaseScope& operator=(const DitPhaseScope&) = delete;

 private:
  DitProfile* p_;
  DitPhase phase_;
  std::chrono::steady_clock::time_point t0_{};
};

}  // namespace diffcp
