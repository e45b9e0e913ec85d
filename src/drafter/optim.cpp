#include "drafter/optim.hpp"

#include <cmath>
#include <numbers>

namespace diffcp {

void AdamW::step(std::vector<float>& params, const std::vector<float>& grads, double lr_now,
                 const std::vector<std::pair<std::int64_t, std::int64_t>>& no_decay) {
  if (m.size() != params.size()) m.assign(params.size(), 0.f), v.assign(params.size(), 0.f);
  std::vector<char> decay(params.size(), 1);
  for (const auto& [off, n] : no_decay) std::fill_n(decay.begin() + off, n, 0);
  t += 1;
  const double c1 = 1 - std::pow(beta1, static_cast<double>(t)), c2 = 1 - std::pow(beta2, static_cast<double>(t));
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double g = grads[i];
    m[i] = static_cast<float>(beta1 * m[i] + (1 - beta1) * g);
    v[i] = static_cast<float>(beta2 * v[i] + (1 - beta2) * g * g);
    const double update = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + (decay[i] ? weight_decay * params[i] : 0.0);
    params[i] = static_cast<float>(params[i] - lr_now * update);
  }
}

double cosine_lr(double lr, std::int64_t step, std::int64_t total, double warmup_frac) {
  const auto warmup = static_cast<std::int64_t>(std::ceil(warmup_frac * static_cast<double>(total)));
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(std::max<std::int64_t>(1, total - warmup));
  return 0.5 * lr * (1 + std::cos(std::numbers::pi * std::min(1.0, progress)));
}

double clip_grad_norm(std::vector<float>& grads, double max_norm) {
  double ss = 0;
  for (float g : grads) ss += static_cast<double>(g) * g;
  const double norm = std::sqrt(ss);
  if (norm > max_norm) {
    const double s = max_norm / (norm + 1e-6);
    for (float& g : grads) g = static_cast<float>(g * s);
  }
  return norm;
}

}  // namespace diffcp
