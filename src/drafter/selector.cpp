#include "diffcp/drafter/selector.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "diffcp/core/error.hpp"

namespace diffcp {

Proposal propose(const DrafterConfig& cfg, std::span<const float> params, std::span<const float> hidden,
                 std::span<const float> logits, std::int32_t anchor, double temperature, std::uint64_t seed) {
  DIFFCP_CHECK(cfg.has_selector(), "propose: the drafter has no candidate selector (a DFlash drafter drafts the logits' argmax)");
  const DrafterLayout lay(cfg);
  const std::int64_t H = cfg.hidden, V = cfg.vocab, K = cfg.selector_top_k, r = cfg.selector_rank;
  DIFFCP_CHECK(static_cast<std::int64_t>(params.size()) == lay.total, "propose: ", params.size(), " parameters, the model has ",
               lay.total);
  const std::int64_t n = static_cast<std::int64_t>(hidden.size()) / H;
  DIFFCP_CHECK(n >= 1 && n * H == static_cast<std::int64_t>(hidden.size()) && n * V == static_cast<std::int64_t>(logits.size()),
               "propose: hidden holds ", hidden.size(), " values and logits ", logits.size(), "; expected [n >= 1, H = ", H,
               "] and [n, V = ", V, "]");
  DIFFCP_CHECK(anchor >= 0 && anchor < V, "propose: anchor token ", anchor, " outside [0, ", V, ")");
  DIFFCP_CHECK(temperature >= 0 && std::isfinite(temperature), "propose: temperature ", temperature, ", expected >= 0");
  const float* A = params.data() + lay.sel_pred;
  const float* Bc = params.data() + lay.sel_succ;
  const float* P = params.data() + lay.sel_proj;
  Proposal out;
  out.path.resize(static_cast<std::size_t>(n));
  out.candidates.resize(static_cast<std::size_t>(n * K));
  if (temperature > 0) out.q.resize(static_cast<std::size_t>(n * K));
  std::mt19937_64 rng(seed);
  std::vector<double> u(static_cast<std::size_t>(V)), hp(static_cast<std::size_t>(r)), S(static_cast<std::size_t>(K));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(V));
  std::int32_t prev = anchor;
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t v = 0; v < V; ++v) {
      double x = static_cast<double>(logits[static_cast<std::size_t>(i * V + v)]) * cfg.output_multiplier;
      if (cfg.logit_softcap > 0) x = cfg.logit_softcap * std::tanh(x / cfg.logit_softcap);
      DIFFCP_CHECK(!std::isnan(x), "propose: logit ", v, " of row ", i, " is NaN");
      u[static_cast<std::size_t>(v)] = x;
    }
    std::iota(ids.begin(), ids.end(), 0);
    const auto before = [&u](std::int32_t a, std::int32_t b) {
      const double ua = u[static_cast<std::size_t>(a)], ub = u[static_cast<std::size_t>(b)];
      return ua > ub || (ua == ub && a < b);
    };
    std::partial_sort(ids.begin(), ids.begin() + K, ids.end(), before);
    for (std::int64_t j = 0; j < r; ++j) {  // h_i P, then times the predecessor's code
      double acc = 0;
      for (std::int64_t c = 0; c < H; ++c)
        acc += static_cast<double>(hidden[static_cast<std::size_t>(i * H + c)]) * P[c * r + j];
      hp[static_cast<std::size_t>(j)] = acc * A[static_cast<std::int64_t>(prev) * r + j];
    }
    std::int64_t best = 0;
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int32_t cand = ids[static_cast<std::size_t>(k)];
      out.candidates[static_cast<std::size_t>(i * K + k)] = cand;
      double s = u[static_cast<std::size_t>(cand)];
      for (std::int64_t j = 0; j < r; ++j) s += hp[static_cast<std::size_t>(j)] * Bc[static_cast<std::int64_t>(cand) * r + j];
      S[static_cast<std::size_t>(k)] = s;
      if (s > S[static_cast<std::size_t>(best)]) best = k;
    }
    if (temperature > 0) {  // q = softmax(S / T); idx drawn by its CDF
      const double mx = *std::max_element(S.begin(), S.end());
      double z = 0;
      for (double& s : S) z += (s = std::exp((s - mx) / temperature));
      const double x = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      double cdf = 0;
      std::int64_t pick = -1;
      for (std::int64_t k = 0; k < K; ++k) {
        const double q = S[static_cast<std::size_t>(k)] / z;
        out.q[static_cast<std::size_t>(i * K + k)] = static_cast<float>(q);
        cdf += q;
        if (pick < 0 && x < cdf) pick = k;
      }
      best = pick < 0 ? K - 1 : pick;  // (x past the rounded CDF's end: the last)
    }
    prev = out.candidates[static_cast<std::size_t>(i * K + best)];
    out.path[static_cast<std::size_t>(i)] = prev;
  }
  return out;
}

}  // namespace diffcp
