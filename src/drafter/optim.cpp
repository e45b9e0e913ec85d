#include "diffcp/drafter/optim.hpp"

#include "diffcp/ops/optim.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace diffcp {

namespace {
// Elements [lo, hi) of one update with one weight-decay factor (the backend's adamw_step).
void adamw_span(float* p, const float* g, float* m, float* v, std::int64_t lo, std::int64_t hi, AdamWStepArgs args,
                float decay) {
  args.decay = decay;
  adamw_step(p + lo, g + lo, m + lo, v + lo, hi - lo, args);
}
}  // namespace

void AdamW::update(float* p, const float* g, float* m, float* v, std::int64_t at, std::int64_t n, double lr_now,
                   const std::vector<std::pair<std::int64_t, std::int64_t>>& no_decay) const {
  const double c1 = 1 - std::pow(beta1, static_cast<double>(t)), c2 = 1 - std::pow(beta2, static_cast<double>(t));
  const AdamWStepArgs args{static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(lr_now / c1),
                           static_cast<float>(1 / std::sqrt(c2)), static_cast<float>(eps), 1.f};
  const auto decay = static_cast<float>(1 - lr_now * weight_decay);
  // Walk [at, at + n) in flat indices: decayed stretches between the no-decay spans (sorted or not).
  std::vector<std::pair<std::int64_t, std::int64_t>> keep;  // [lo, hi) local, not decayed
  for (const auto& [off, len] : no_decay) {
    const std::int64_t lo = std::max(off, at), hi = std::min(off + len, at + n);
    if (lo < hi) keep.emplace_back(lo - at, hi - at);
  }
  std::sort(keep.begin(), keep.end());
  std::int64_t i = 0;
  for (const auto& [lo, hi] : keep) {
    if (i < lo) adamw_span(p, g, m, v, i, lo, args, decay);
    adamw_span(p, g, m, v, std::max(i, lo), hi, args, 1.f);
    i = std::max(i, hi);
  }
  if (i < n) adamw_span(p, g, m, v, i, n, args, decay);
}

double cosine_lr(double lr, std::int64_t step, std::int64_t total, double warmup_frac) {
  const auto warmup = static_cast<std::int64_t>(std::ceil(warmup_frac * static_cast<double>(total)));
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(std::max<std::int64_t>(1, total - warmup));
  return 0.5 * lr * (1 + std::cos(std::numbers::pi * std::min(1.0, progress)));
}

double clip_scale(double norm, double max_norm) { return norm > max_norm ? max_norm / (norm + 1e-6) : 1.0; }

}  // namespace diffcp
