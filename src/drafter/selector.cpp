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

namespace {
// The row of token t in rows (t must be there).
std::int64_t row_of(const CodebookRows& c, std::int32_t t, const char* what) {
  const auto it = std::lower_bound(c.tokens.begin(), c.tokens.end(), t);
  DIFFCP_CHECK(it != c.tokens.end() && *it == t, "selector_loss: token ", t, " is not among the ", what, " rows given");
  return it - c.tokens.begin();
}
}  // namespace

SelectorLoss selector_loss(const DrafterConfig& cfg, double lambda, std::span<const float> hp,
                           std::span<const float> values, std::span<const std::int32_t> candidates,
                           std::span<const std::int32_t> prev, std::span<const std::int32_t> gold,
                           std::span<const double> weight, CodebookRows pred, CodebookRows succ) {
  DIFFCP_CHECK(cfg.has_selector(), "selector_loss: the drafter has no candidate selector");
  const std::int64_t K = cfg.selector_top_k, r = cfg.selector_rank, n = static_cast<std::int64_t>(prev.size());
  const auto sz = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  DIFFCP_CHECK(hp.size() == sz(n * r) && values.size() == sz(n * K) && candidates.size() == values.size() &&
                   gold.size() == sz(n) && weight.size() == sz(n) && pred.rows.size() == pred.tokens.size() * sz(r) &&
                   succ.rows.size() == succ.tokens.size() * sz(r),
               "selector_loss: ", n, " rows with ", hp.size(), " hp, ", values.size(), " values, ", candidates.size(),
               " candidates, ", gold.size(), " gold, ", weight.size(), " weights; expected [n, r = ", r, "], [n, K = ", K,
               "] x 2, [n] x 3, and codebook rows of r");
  SelectorLoss out;
  out.choice.assign(sz(n), -1);
  out.dvalues.assign(sz(n * K), 0.0);
  out.dhp.assign(sz(n * r), 0.f);
  out.dpred.assign(pred.rows.size(), 0.f);
  out.dsucc.assign(succ.rows.size(), 0.f);
  std::vector<double> z(sz(r)), S(sz(K)), dz(sz(r));
  std::vector<std::int64_t> srow(sz(K));
  for (std::int64_t i = 0; i < n; ++i) {
    const double w = weight[sz(i)];
    const std::int64_t ar = row_of(pred, prev[sz(i)], "predecessor");
    const float* a = pred.rows.data() + ar * r;
    for (std::int64_t j = 0; j < r; ++j) z[sz(j)] = static_cast<double>(hp[sz(i * r + j)]) * a[j];
    std::int64_t slot = -1, best = 0;
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int32_t c = candidates[sz(i * K + k)];
      srow[sz(k)] = row_of(succ, c, "successor");
      const float* b = succ.rows.data() + srow[sz(k)] * r;
      double s = values[sz(i * K + k)];
      for (std::int64_t j = 0; j < r; ++j) s += z[sz(j)] * b[j];
      S[sz(k)] = s;
      if (s > S[sz(best)]) best = k;
      if (c == gold[sz(i)] && slot < 0) slot = k;
    }
    out.choice[sz(i)] = candidates[sz(i * K + best)];
    if (w == 0) continue;
    ++out.rows;
    if (slot < 0) continue;  // the gold token is not a candidate: no loss (candidate_recall)
    ++out.covered;
    out.correct += best == slot;
    double lse = 0;
    for (std::int64_t k = 0; k < K; ++k) lse += std::exp(S[sz(k)] - S[sz(best)]);
    lse = S[sz(best)] + std::log(lse);
    out.loss_sum += lambda * w * (lse - S[sz(slot)]);
    std::fill(dz.begin(), dz.end(), 0.0);
    for (std::int64_t k = 0; k < K; ++k) {
      const double dS = lambda * w * (std::exp(S[sz(k)] - lse) - (k == slot ? 1.0 : 0.0));
      out.dvalues[sz(i * K + k)] = dS;
      const float* b = succ.rows.data() + srow[sz(k)] * r;
      float* db = out.dsucc.data() + srow[sz(k)] * r;
      for (std::int64_t j = 0; j < r; ++j) {
        db[j] += static_cast<float>(dS * z[sz(j)]);
        dz[sz(j)] += dS * b[j];
      }
    }
    float* da = out.dpred.data() + ar * r;
    for (std::int64_t j = 0; j < r; ++j) {
      da[j] += static_cast<float>(dz[sz(j)] * hp[sz(i * r + j)]);
      out.dhp[sz(i * r + j)] = static_cast<float>(dz[sz(j)] * a[j]);
    }
  }
  return out;
}

}  // namespace diffcp
