// Step caching: First-Block Cache (FBCache, as ParaAttention defines it; cache-dit's DBCache with
// one front block). On every denoising step the model runs its first transformer block; if the
// first block's residual barely changed since the last fully computed step, the remaining blocks
// are skipped and their residual from that step is added instead.
//
//   r1_k  = x_after_first_k - x_before_first_k            (this step's first-block residual, image rows)
//   rel_k = sum |r1_k - r1_f| / sum |r1_f|                 (f: the last fully computed step; sums over
//                                                           every real image row of every rank)
//   rel_k < threshold:  x_after_last_k = x_after_first_k + R_f   (cached step: the rest is skipped)
//   else:               run the rest; R_k = x_after_last_k - x_after_first_k, r1_f <- r1_k (full step)
// The first step is always full (no r1_f yet). Threshold 0 never caches: the run equals the exact
// run bitwise (the metric is still computed and reported). ParaAttention compares against the last
// full step's residual, not the previous step's, so slow drift across cached steps is caught.
//
// The two sums are all-reduced over the ranks of the pass (one all-reduce of two doubles a step),
// so every rank of the pass takes the same decision and sharded runs stay in lockstep (weight
// gathers, exchanges). Padding rows (DitShard) are left out of the sums: the decision does not
// depend on P. Only image rows are cached: the final layer reads nothing else.
//
// Legend: b images, I_p image rows per image on this rank (iv of them real), H hidden width,
//         R = b I_p rows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

// `--step-cache`: none, or fbcache:THRESHOLD (THRESHOLD >= 0, finite).
struct StepCacheSpec {
  bool enabled = false;
  double threshold = 0;
  std::string name() const;  // "none" | "fbcache:<threshold>"
};
// "none" | "fbcache:T"; anything else throws naming the accepted forms.
StepCacheSpec parse_step_cache(const std::string& spec);

// What a pass's cache decided, per step (in order).
struct StepCacheStats {
  int computed = 0, cached = 0;  // steps that ran every block / only the first
  std::vector<double> rel_l1;    // rel_k of each step (NaN on the first step: nothing to compare)
};

class FirstBlockCache {
 public:
  // threshold >= 0; comm: the ranks that run this pass (the decision's all-reduce; it must outlive
  // the cache); b images of I_p rows each, the first `valid` real; H the hidden width. Buffers:
  // 4 R H floats of the active backend's memory.
  FirstBlockCache(double threshold, Communicator& comm, std::int64_t batch, std::int64_t rows_per_image,
                  std::int64_t valid, std::int64_t hidden);

  // x: [R, H] the image rows before the first block (device memory). Local.
  void enter(const float* x);
  // x: [R, H] the image rows after the first block. Collective over comm. Returns true when the step
  // is cached: x then holds x + R_f, the remaining blocks must be skipped. False: run them, then
  // leave(x).
  bool reuse(float* x);
  // x: [R, H] the image rows after the last block (a full step): keeps R_k. Local.
  void leave(const float* x);

  const StepCacheStats& stats() const { return stats_; }
  double threshold() const { return threshold_; }

 private:
  // sum over real rows of the per-row l1_distance(a, b) [R] (b = zeros_: the l1 norm of a).
  double real_rows_l1(const float* a, const float* b);

  double threshold_;
  Communicator& comm_;
  std::int64_t b_, Ip_, iv_, H_;
  // in_: x before the first block, then -r1_k; first_: -r1_f; rest_: x after the first block of
  // step f, then -R_f; zeros_: [R, H] of 0; l1_: [R] per-row sums.
  DeviceVector<float> in_, first_, rest_, zeros_, l1_;
  bool have_first_ = false;
  StepCacheStats stats_;
};

}  // namespace diffcp
