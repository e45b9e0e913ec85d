// The fp64 reference of the drafter attention layer is itself checked: its backward equals central
// finite differences of its forward (loss = sum(y * dy)) for X, the context and every parameter.
// Plus properties of the fast ops it is compared with: RoPE's inverse undoes it, position 0 is
// the identity.
#include <gtest/gtest.h>

#include "diffcp/testing/compare.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/testing/reference_layer.hpp"
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
