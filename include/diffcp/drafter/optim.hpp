// AdamW (decoupled weight decay; 1-D tensors, i.e. norm weights and biases, are not decayed),
// the cosine schedule with linear warm-up, and global-norm gradient clipping (SPEC A.1 recipe).
// The moments live with whoever owns the parameters (drafter/sharded_state.hpp: all of them, or
// this rank's shard), so the update works on a span of the flat parameter vector.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace diffcp {

struct AdamW {
  double lr = 6e-4, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.1;
  std::int64_t t = 0;  // updates applied

  // Counts one update; call once per optimizer step, before update().
  void begin_step() { t += 1; }
  // p -= lr_now * (mhat / (sqrt(vhat) + eps) + wd * p) on elements [at, at + n) of the flat
  // parameter vector (p, g, m, v: [n] each), with no decay inside the `no_decay` spans
  // ((offset, size) in flat indices). f32 arithmetic (as fused AdamW kernels on f32 state; not
  // PyTorch's bits), p * (1 - lr wd) - (lr / c1) m / (sqrt(v) / sqrt(c2) + eps), c_i = 1 - beta_i^t.
  // Elementwise: any split of the vector gives the same bits (optim.cpp is built without FMA
  // contraction, so the vectorised loop and its scalar tail round alike).
  void update(float* p, const float* g, float* m, float* v, std::int64_t at, std::int64_t n, double lr_now,
              const std::vector<std::pair<std::int64_t, std::int64_t>>& no_decay) const;
};

// lr at update `step` (0-based) of `total`: linear warm-up over the first warmup_frac, then cosine to 0.
double cosine_lr(double lr, std::int64_t step, std::int64_t total, double warmup_frac = 0.04);

// The factor that clips a gradient of global L2 norm `norm` to at most max_norm (1 if it is below).
double clip_scale(double norm, double max_norm);

}  // namespace diffcp
