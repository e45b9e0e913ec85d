// Every environment variable the library reads, read here and nowhere else (docs/running.md,
// "Environment", lists them with their meaning). A variable that is unset or empty is absent.
//   DIFFCP_CPU_ISA       the CPU backend's instruction set (ops/backend.hpp cpu_backend)
//   DIFFCP_CPU_AMX       0: the CPU backend's bf16 attention leaves AMX tiles alone (cpu/attention_amx.cpp)
//   DIFFCP_NODE          this rank's node, overriding the host name (comm/communicator.hpp topology)
//   DIFFCP_COMM_TIMEOUT  the collective watchdog's seconds (comm/watchdog)
//   DIFFCP_PROFILES      the folder of `diffcp sim`'s machine profiles (sim/profile.hpp)
//   DIFFCP_CUDA_ATTENTION  gemm (default) | simt: the CUDA backend's attention forward (cuda/backend.cpp)
// The CLI also reads DIFFCP_BACKEND (--backend) and DIFFCP_COMM_TIMEOUT (--comm-timeout) as its
// options' defaults (CLI11 envname, src/cli/main.cpp).
#pragma once

#include <optional>
#include <string>

namespace diffcp {

enum class EnvKnob { cpu_isa, cpu_amx, cpu_fused, node, comm, comm_timeout, profiles, cuda_attention };

const char* env_name(EnvKnob k);  // "DIFFCP_CPU_ISA", ...
// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string> env_value(EnvKnob k);
// A 0 / 1 switch: false for 0, true for 1 or unset; any other value is an error naming the
// variable and `on` (what 1 means).
bool env_switch(EnvKnob k, const char* on);

}  // namespace diffcp
