// Plain fp64 single-process reference of the drafter attention layer (see cp/attention_layer.hpp),
// forward and backward, for tests and --check. Dense loops, no parallelism, no cleverness.
#pragma once

#include <vector>

#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/testing/attention_reference.hpp"

namespace diffcp {

struct ReferenceLayerResult {
  std::vector<double> y;     // [Q, H]
  std::vector<double> lse;   // [Q, n_q]
  std::vector<double> dx;    // [Q, H]
  std::vector<double> dctx;  // [S, H]
  std::vector<double> grad;  // parameter gradients, in AttnLayerParams' layout
};

// SPEC A.1's visibility built from the batch's lengths, anchors and block alone (no BlockMask):
// what the layer reference attends with, so that a bug in attention/mask.cpp cannot be shared.
// `layer`: a sliding-window layer's window and causality (its fields only: the rule is written
// out again in the reference).
DenseVisibility spec_visibility(const PackedBatch& batch, KeyWindow layer = {});

//   x: [Q, H] block rows in block order   ctx: [S, H] packed context   dy: [Q, H]
ReferenceLayerResult reference_attention_layer(const AttnLayerConfig& cfg, const PackedBatch& batch,
                                               const AttnLayerParams& w, const std::vector<double>& x,
                                               const std::vector<double>& ctx, const std::vector<double>& dy,
                                               KeyWindow layer = {});

}  // namespace diffcp
