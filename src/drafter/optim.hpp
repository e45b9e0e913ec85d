// AdamW (decoupled weight decay; 1-D tensors, i.e. norm weights and biases, are not decayed),
// the cosine schedule with linear warm-up, and global-norm gradient clipping (SPEC A.1 recipe).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace diffcp {

struct AdamW {
  double lr = 6e-4, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.1;
  std::vector<float> m, v;  // [params] moments
  std::int64_t t = 0;       // updates applied

  // p -= lr_now * (mhat / (sqrt(vhat) + eps) + wd * p), with no decay inside `no_decay` spans.
  void step(std::vector<float>& params, const std::vector<float>& grads, double lr_now,
            const std::vector<std::pair<std::int64_t, std::int64_t>>& no_decay);
};

// lr at update `step` (0-based) of `total`: linear warm-up over the first warmup_frac, then cosine to 0.
double cosine_lr(double lr, std::int64_t step, std::int64_t total, double warmup_frac = 0.04);

// Scales grads so that their global L2 norm is at most max_norm; returns the norm before clipping.
double clip_grad_norm(std::vector<float>& grads, double max_norm);

}  // namespace diffcp
