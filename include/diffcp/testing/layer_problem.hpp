// A seeded random instance of the drafter attention layer problem (parameters, X, ctx, dY),
// identical on every rank, the slices each rank holds, and the check of a rank's results
// against the fp64 single-process reference. Shared by `diffcp attn --check` and the tests.
#pragma once

#include <vector>

#include "diffcp/testing/compare.hpp"
#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/testing/reference_layer.hpp"

namespace diffcp {

struct LayerProblem {
  AttnLayerConfig cfg;
  PackedBatch batch;
  AttnLayerParams w;
  std::vector<float> x, ctx, dy;  // [Q, H], [S, H], [Q, H] in global row order
  KeyWindow window;               // a sliding-window layer's (the reference writes the rule out itself)

  LayerProblem(const AttnLayerConfig& cfg, const PackedBatch& batch, std::uint64_t seed);

  // This rank's slices: owned block rows [Q_p, H], held context rows in chunk order [C_p, H].
  std::vector<float> x_rows(const CpShard& s) const;
  std::vector<float> dy_rows(const CpShard& s) const;
  std::vector<float> ctx_rows(const CpShard& s) const;
  ReferenceLayerResult reference() const;
};

struct LayerCheck {
  CompareResult y, dx, dctx, grad;
  bool pass() const { return y.pass() && dx.pass() && dctx.pass() && grad.pass(); }
  CompareResult all() const;  // merged over the four
};

// y_p, dx_p: [Q_p, H], dctx_p: [C_p, H] of this rank; grad: the parameter gradients already
// summed over the group. Tolerance: fp32 (kTolF32).
LayerCheck check_layer(const ReferenceLayerResult& ref, const CpShard& s, std::int64_t hidden,
                       const std::vector<float>& y_p, const std::vector<float>& dx_p,
                       const std::vector<float>& dctx_p, const AttnLayerParams& grad, Tolerance tol = kTolF32);

}  // namespace diffcp
