// One draft block as a serving engine runs it (DFlash's drafting step), exact across any number
// of context-parallel ranks: Split-KV over the context.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/drafter/config.hpp"

namespace diffcp {

// params:        [DrafterLayout(cfg).total] the drafter's parameters
// target_hidden: [ctx, n_t*H] the target's hidden states of positions [0, ctx) (its layers
//                cfg.target_layer_ids, concatenated in that order); every rank passes all of it
// noise:         [B, H] the block's input embeddings at positions [ctx, ctx + B): the target's
//                embedding of the last verified token, then of the mask token
// The block's queries see every context position and the whole block (positions for RoPE:
// context 0 .. ctx-1, block ctx .. ctx+B-1). The context rows are split over cp's ranks by
// `balancer` (as in training). Returns, on every rank, the final RMSNorm's output [B, H]: the
// hidden states the target's LM head turns into draft logits.
std::vector<float> draft_block(Communicator& cp, const DrafterConfig& cfg, std::span<const float> params,
                               std::span<const float> target_hidden, std::int64_t ctx, std::span<const float> noise,
                               const std::string& balancer = "lpt");

}  // namespace diffcp
