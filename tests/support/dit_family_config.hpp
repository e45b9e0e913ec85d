// A tiny DiT of each family for the multi-rank tests (test_dit_uneven, test_dit_weights).
#pragma once

#include <cstdint>

#include "diffcp/dit/config.hpp"

namespace diffcp::test {

// `heads` heads of dim 8, MLP width `mlp_hidden`, text 16 wide, `double_blocks` double blocks and
// (FLUX.1 / FLUX.2: the others have none) `single_blocks` single ones; each family's own parts:
// Qwen-Image's 3 RoPE axes, FLUX.2's 4 and no qkv bias, SD3's position table of side
// `pos_embed_max` and no RoPE; a pooled vector where the family has one.
inline DitConfig tiny_family_config(DitFamily family, std::int64_t heads, std::int64_t mlp_hidden,
                                    std::int64_t double_blocks, std::int64_t single_blocks, std::int64_t pos_embed_max) {
  DitConfig c = dit_preset("tiny");
  c.family = family;
  c.heads = heads;
  c.head_dim = 8;
  c.rope_axes = flux_rope_axes(8);
  c.mlp_hidden = mlp_hidden;
  c.text_dim = 16;
  c.pooled_dim = c.has_pooled() ? 16 : 0;
  c.time_dim = 32;
  c.double_blocks = double_blocks;
  c.single_blocks = family == DitFamily::flux1 || family == DitFamily::flux2 ? single_blocks : 0;
  if (family == DitFamily::qwen_image) c.rope_axes = {2, 2, 4};
  if (family == DitFamily::flux2) {
    c.qkv_bias = false;
    c.rope_axes = {2, 2, 2, 2};
  }
  if (family == DitFamily::sd3) {
    c.rope_axes.clear();
    c.pos_embed_max = pos_embed_max;
  }
  return c;
}

}  // namespace diffcp::test
