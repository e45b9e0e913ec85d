// The fp64 reference of the drafter attention layer is itself checked: its backward equals central
// finite differences of its forward (loss = sum(y * dy)) for X, the context and every parameter.
// Its mask is SPEC A.1 written out from the batch, equal to the library's BlockMask (two derivations).
// Plus properties of the fast ops it is compared with: RoPE's inverse undoes it, position 0 is
// the identity.
#include <gtest/gtest.h>

#include "diffcp/testing/compare.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/testing/reference_layer.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/workload/batch.hpp"
#include "diffcp/io/npy.hpp"
#include "diffcp/ops/rope.hpp"

namespace diffcp {
namespace {

TEST(ReferenceLayer, BackwardMatchesFiniteDifferences) {
  const AttnLayerConfig cfg{6, 4, 2, 4, 100.0, 1e-6};
  PackedBatch b;
  b.block = 3;
  b.lengths = {10, 8};
  b.anchors = {{4, 5}, {2}};  // overlapping blocks in sample 0
  const std::int64_t Q = b.query_rows(), S = b.context_rows(), H = cfg.hidden;
  AttnLayerParams w(cfg);
  w.init_random(3);
  auto x = random_normal<double>(static_cast<std::size_t>(Q * H), 1), ctx = random_normal<double>(static_cast<std::size_t>(S * H), 2);
  const auto dy = random_normal<double>(static_cast<std::size_t>(Q * H), 4);
  const ReferenceLayerResult r = reference_attention_layer(cfg, b, w, x, ctx, dy);
  auto loss = [&] {
    const auto y = reference_attention_layer(cfg, b, w, x, ctx, dy).y;
    double s = 0;
    for (std::size_t j = 0; j < y.size(); ++j) s += y[j] * dy[j];
    return s;
  };
  const double h = 1e-5;
  const Tolerance tol{2e-7, 2e-6};
  auto fd_vec = [&](std::vector<double>& v) {
    std::vector<double> g(v.size());
    for (std::size_t j = 0; j < v.size(); ++j) {
      const double keep = v[j];
      v[j] = keep + h;
      const double up = loss();
      v[j] = keep - h;
      const double down = loss();
      v[j] = keep;
      g[j] = (up - down) / (2 * h);
    }
    return g;
  };
  EXPECT_TRUE(compare<double>(r.dx, fd_vec(x), tol).pass()) << "dx";
  EXPECT_TRUE(compare<double>(r.dctx, fd_vec(ctx), tol).pass()) << "dctx";
  // Parameters are float; perturb them in float steps and difference in double.
  std::vector<double> fd(w.all().size());
  const float hf = 1e-3f;
  for (std::size_t j = 0; j < fd.size(); ++j) {
    const float keep = w.all()[j];
    w.all()[j] = keep + hf;
    const double up = loss();
    w.all()[j] = keep - hf;
    const double down = loss();
    w.all()[j] = keep;
    fd[j] = (up - down) / (static_cast<double>(keep + hf) - static_cast<double>(keep - hf));
  }
  const CompareResult g = compare<double>(r.grad, fd, Tolerance{1e-4, 1e-3});  // O(hf^2) truncation
  EXPECT_TRUE(g.pass()) << "param grads: max abs err " << g.max_abs << " at " << g.worst;
}

// The layer reference's mask comes from SPEC A.1 and the batch's numbers, the kernels' from the
// library's BlockMask (full_mask): two derivations, equal on random batches (uneven lengths, a
// sample without anchors, anchors at the sample's start and blocks that overlap), and a wrong
// library mask would make them differ.
TEST(ReferenceLayer, SpecVisibilityEqualsTheLibrarysMaskIndependently) {
  for (const std::uint64_t seed : {1, 2, 3}) {
    PackedBatch b = make_random_batch(3, 40, 3, 4, 0.25, seed, 90);
    b.lengths.push_back(9);  // a sample with no anchors: no block sees it
    b.anchors.push_back({});
    b.anchors[0] = {0, 1, 2};  // anchor at the start (sees no context), overlapping blocks
    const DenseVisibility spec = spec_visibility(b), lib = dense_visibility(full_mask(b));
    EXPECT_EQ(spec.blocks, lib.blocks);
    EXPECT_EQ(spec.key_rows, lib.key_rows);
    EXPECT_EQ(spec.visible, lib.visible) << "seed " << seed;
    // Row 0 (anchor 0 of sample 0) sees only its own B block rows.
    std::int64_t seen = 0;
    for (std::int64_t j = 0; j < spec.key_rows; ++j) seen += spec.visible[static_cast<std::size_t>(j)];
    EXPECT_EQ(seen, b.block);
  }
  // A mask that lets a block see its own anchor token (off by one) differs from the spec's.
  const PackedBatch b = make_random_batch(2, 64, 2, 4, 0.25, 5);
  const BlockMask good = full_mask(b);
  std::vector<MaskBlock> blocks = good.blocks();
  for (MaskBlock& m : blocks) m.ctx_end += 1;
  const BlockMask off_by_one(good.block(), good.key_rows(), good.segments(), blocks);
  EXPECT_NE(spec_visibility(b).visible, dense_visibility(off_by_one).visible);
}

// The same two derivations agree for sliding-window layers (the reference writes z-lab's rule out
// again; the library's KeyWindow and range trimming), and a window off by one differs.
TEST(ReferenceLayer, SpecWindowVisibilityEqualsTheLibrarysMask) {
  PackedBatch b = make_random_batch(3, 60, 4, 4, 0.25, 6, 90);
  b.anchors[0] = {0, 1, 9};
  for (const KeyWindow w : {KeyWindow{1, true}, KeyWindow{3, true}, KeyWindow{6, false}, KeyWindow{17, true},
                            KeyWindow{0, true}, KeyWindow{500, false}}) {
    const DenseVisibility spec = spec_visibility(b, w), lib = dense_visibility(full_mask(b, w));
    EXPECT_EQ(spec.visible, lib.visible) << "window " << w.window << (w.causal ? " causal" : " two-sided");
    if (w.causal || w.window < 60)  // a two-sided window wider than the samples changes nothing
      EXPECT_NE(spec.visible, spec_visibility(b).visible) << "window " << w.window;
    else
      EXPECT_EQ(spec.visible, spec_visibility(b).visible);
  }
  EXPECT_NE(spec_visibility(b, {5, true}).visible, dense_visibility(full_mask(b, {6, true})).visible);
  // The kernels' pair count is the reference's cell count.
  for (const KeyWindow w : {KeyWindow{3, true}, KeyWindow{6, false}, KeyWindow{17, true}}) {
    std::int64_t cells = 0;
    for (char c : spec_visibility(b, w).visible) cells += c;
    EXPECT_EQ(full_mask(b, w).visible_pairs(), cells);
  }
}

TEST(Rope, InverseUndoesForwardAndPositionZeroIsIdentity) {
  const RopeTable table(8, 1e6, 50);
  auto x = random_normal(3 * 2 * 8, 1);
  const auto x0 = x;
  const std::vector<std::int64_t> pos{0, 17, 49};
  rope_apply(x.data(), 3, 2, pos, table, false);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(x[static_cast<std::size_t>(c)], x0[static_cast<std::size_t>(c)]);  // row 0: pos 0
  EXPECT_NE(x[16], x0[16]);
  rope_apply(x.data(), 3, 2, pos, table, true);
  for (std::size_t j = 0; j < x.size(); ++j) EXPECT_NEAR(x[j], x0[j], 1e-5);
  const std::vector<std::int64_t> bad{0, 1, 50};
  EXPECT_THROW(rope_apply(x.data(), 3, 2, bad, table, false), Error);
  EXPECT_THROW(RopeTable(7, 1e6, 10), Error);
}

}  // namespace
}  // namespace diffcp

namespace diffcp {
namespace {

TEST(Npy, WriteThenReadRoundTrips) {
  const std::string path = ::testing::TempDir() + "/roundtrip.npy";
  const auto v = random_normal(6 * 7, 3);
  write_npy(path, v.data(), {6, 7});
  std::vector<std::int64_t> shape;
  EXPECT_EQ(read_npy_f32(path, shape), v);
  EXPECT_EQ(shape, (std::vector<std::int64_t>{6, 7}));
  write_npy(path, v.data(), {42});
  EXPECT_EQ(read_npy_f32(path, shape).size(), 42u);
  EXPECT_EQ(shape, (std::vector<std::int64_t>{42}));
  EXPECT_THROW(read_npy_f32(::testing::TempDir() + "/missing.npy", shape), Error);
}

}  // namespace
}  // namespace diffcp
