// The bf16 gate of the distributed layer tests (issue #14): against the fp64 reference, each
// tensor's max error at P ranks (max over the ranks of `comm`) is at most `factor` times that of
// the same bf16 layer run on one rank, plus 2^-12 of the tensor's largest reference value — the
// relative rule of the best peers, which a lost row, a wrong scale or an f32 term computed in bf16
// fails where a loose absolute tolerance would not. Also: the one-rank run did round (its error is
// above 2^-14 of the peak), so the gate cannot pass because bf16 never ran.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/testing/layer_problem.hpp"

namespace diffcp::test {

inline void expect_bf16_like_one_rank(Communicator& comm, const ReferenceLayerResult& ref, const LayerCheck& one,
                                      const LayerCheck& many, double factor = 2.5) {
  auto peak = [](const std::vector<double>& v) {
    double m = 0;
    for (double x : v) m = std::max(m, std::abs(x));
    return m;
  };
  const struct {
    const char* name;
    double one, many, peak;
  } t[] = {{"y", one.y.max_abs, many.y.max_abs, peak(ref.y)},
           {"dx", one.dx.max_abs, many.dx.max_abs, peak(ref.dx)},
           {"dctx", one.dctx.max_abs, many.dctx.max_abs, peak(ref.dctx)},
           {"param grads", one.grad.max_abs, many.grad.max_abs, peak(ref.grad)}};
  for (const auto& x : t) {
    std::vector<double> e{x.many};
    comm.all_reduce<double>(e, ReduceOp::max);
    EXPECT_LE(e[0], factor * x.one + 0x1p-12 * x.peak)
        << x.name << ": P = " << comm.size() << " error " << e[0] << ", one rank " << x.one << ", peak " << x.peak;
    EXPECT_GT(x.one, 0x1p-14 * x.peak) << x.name << ": no bf16 rounding at all (the bf16 path did not run)";
  }
}

}  // namespace diffcp::test
