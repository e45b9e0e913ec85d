// What a fuzz target and its seed (fuzz/gen_seeds.cpp) must agree on.
#pragma once

#include <string_view>

#include "diffcp/dit/config.hpp"
#include "diffcp/drafter/config.hpp"

namespace diffcp_fuzz {

// fuzz_dit_weights: a DiT with every tensor kind of the layout (double and single blocks), a few KB.
inline diffcp::DitConfig micro_dit_config() {
  diffcp::DitConfig c;
  c.heads = 2;
  c.head_dim = 4;
  c.double_blocks = 1;
  c.single_blocks = 1;
  c.mlp_hidden = 4;
  c.latent_channels = 1;
  c.patch = 1;
  c.text_dim = 2;
  c.pooled_dim = 2;
  c.time_dim = 2;
  c.rope_axes = {0, 2, 2};
  return c;
}

// fuzz_shards: a drafter shard directory with V = 16, H = 4, n_t = 2 (hidden rows of 8 floats).
inline diffcp::DrafterConfig micro_drafter_config() {
  diffcp::DrafterConfig c;
  c.vocab = 16;
  c.hidden = 4;
  c.target_layers = 2;
  c.mask_token = 15;
  return c;
}
// One fuzz_shards input = model.safetensors, then up to 2 shard files, joined by this separator.
constexpr std::string_view kShardSeparator = "\n#DIFFCP-SHARD#\n";
constexpr std::int64_t kShardHeldout = 1;

}  // namespace diffcp_fuzz
