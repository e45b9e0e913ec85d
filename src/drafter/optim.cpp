#include "diffcp/drafter/optim.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace diffcp {

void AdamW::update(float* p, const float* g, float* m, float* v, std::int64_t at, std::int64_t n, double lr_now,
                   const std::vector<std::pair<std::int64_t, std::int64_t>>& no_decay) const {
  std::vector<char> decay(static_cast<std::size_t>(n), 1);
  for (const auto& [off, len] : no_decay) {
    const std::int64_t lo = std::max(off, at), hi = std::min(off + len, at + n);
    if (lo < hi) std::fill(decay.begin() + (lo - at), decay.begin() + (hi - at), 0);
  }
  const double c1 = 1 - std::pow(beta1, static_cast<double>(t)), c2 = 1 - std::pow(beta2, static_cast<double>(t));
  for (std::int64_t i = 0; i < n; ++i) {
    const double gi = g[i];
    m[i] = static_cast<float>(beta1 * m[i] + (1 - beta1) * gi);
    v[i] = static_cast<float>(beta2 * v[i] + (1 - beta2) * gi * gi);
    const double step = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + (decay[static_cast<std::size_t>(i)] ? weight_decay * p[i] : 0.0);
    p[i] = static_cast<float>(p[i] - lr_now * step);
  }
}

double cosine_lr(double lr, std::int64_t step, std::int64_t total, double warmup_frac) {
  const auto warmup = static_cast<std::int64_t>(std::ceil(warmup_frac * static_cast<double>(total)));
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(std::max<std::int64_t>(1, total - warmup));
  return 0.5 * lr * (1 + std::cos(std::numbers::pi * std::min(1.0, progress)));
}

double clip_scale(double norm, double max_norm) { return norm > max_norm ? max_norm / (norm + 1e-6) : 1.0; }

}  // namespace diffcp
