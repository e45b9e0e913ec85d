// Subcommands of the diffcp CLI: options structs, registration and entry points.
#pragma once

#include <cstdint>

#include <CLI/CLI.hpp>

#include "comm/communicator.hpp"

namespace diffcp::cli {

// `diffcp demo`: the Split-KV attention core (all-gather q, local block-sparse attention, LSE
// merge, reduce-scatter; and its backward) on a random packed micro-batch, checked against the
// fp64 single-process reference.
struct DemoOptions {
  std::int64_t samples = 2, context = 1024, anchors = 16, block = 16;
  std::int64_t n_q = 8, n_kv = 2, d_h = 64;
  double prompt_fraction = 0.25;
  std::uint64_t seed = 1;
  bool json = false;
};
void add_demo_command(CLI::App& app, DemoOptions& opt);
int run_demo(Communicator& world, const DemoOptions& opt);

}  // namespace diffcp::cli
