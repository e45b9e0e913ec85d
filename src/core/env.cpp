#include "diffcp/core/env.hpp"

#include <cstdlib>

#include "diffcp/core/error.hpp"

namespace diffcp {

const char* env_name(EnvKnob k) {
  switch (k) {
    case EnvKnob::cpu_isa: return "DIFFCP_CPU_ISA";
    case EnvKnob::cpu_amx: return "DIFFCP_CPU_AMX";
    case EnvKnob::cpu_fused: return "DIFFCP_CPU_FUSED";
    case EnvKnob::node: return "DIFFCP_NODE";
    case EnvKnob::comm: return "DIFFCP_COMM";
    case EnvKnob::comm_timeout: return "DIFFCP_COMM_TIMEOUT";
    case EnvKnob::profiles: return "DIFFCP_PROFILES";
    case EnvKnob::cuda_attention: return "DIFFCP_CUDA_ATTENTION";
  }
  return "?";
}

std::optional<std::string> env_value(EnvKnob k) {
  const char* v = std::getenv(env_name(k));
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool env_switch(EnvKnob k, const char* on) {
  const auto knob = env_value(k);
  if (knob && *knob != "0" && *knob != "1") DIFFCP_FAIL(env_name(k), "=", *knob, ": expected 0 (off) or 1 (", on, ")");
  return !(knob && *knob == "0");
}

}  // namespace diffcp
