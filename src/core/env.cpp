#include "diffcp/core/env.hpp"

#include <cstdlib>

namespace diffcp {

const char* env_name(EnvKnob k) {
  switch (k) {
    case EnvKnob::cpu_isa: return "DIFFCP_CPU_ISA";
    case EnvKnob::cpu_amx: return "DIFFCP_CPU_AMX";
    case EnvKnob::cpu_fused: return "DIFFCP_CPU_FUSED";
    case EnvKnob::node: return "DIFFCP_NODE";
    case EnvKnob::comm_timeout: return "DIFFCP_COMM_TIMEOUT";
    case EnvKnob::profiles: return "DIFFCP_PROFILES";
  }
  return "?";
}

std::optional<std::string> env_value(EnvKnob k) {
  const char* v = std::getenv(env_name(k));
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

}  // namespace diffcp
