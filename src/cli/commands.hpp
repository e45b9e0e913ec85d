// Subcommands of the diffcp CLI: one options struct, registration and entry point each.
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "comm/communicator.hpp"

namespace diffcp::cli {

// "16k" -> 16384, "2m" -> 2097152, "300" -> 300 (k = 1024, m = 1024^2). Throws diffcp::Error
// naming the flag for anything else or a negative value.
std::int64_t parse_count(const std::string& text, const char* flag);

// `diffcp attn`: one drafter attention layer, forward + backward, with Split-KV over the ranks of
// mpirun, on a seeded random packed micro-batch.
struct AttnOptions {
  std::int64_t samples = 2;
  std::string context = "1k", queries = "256";  // per sample; anchors = queries / block
  std::int64_t block = 16;
  double prompt_fraction = 0.25;
  std::int64_t hidden = 256, n_q = 8, n_kv = 2, d_h = 32;
  double rope_theta = 1e6, rms_eps = 1e-6;
  std::string dtype = "f32";
  std::uint64_t seed = 1;
  int reps = 3;
  bool check = false, json = false;
  std::string dump;
};
void add_attn_command(CLI::App& app, AttnOptions& opt);
int run_attn(Communicator& world, const AttnOptions& opt);

}  // namespace diffcp::cli
