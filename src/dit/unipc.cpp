#include "diffcp/dit/unipc.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/elementwise.hpp"

namespace diffcp {

namespace {

// Solves the p x p system R rho = b (p <= 3) by Gaussian elimination with partial pivoting.
std::vector<double> solve(std::vector<std::vector<double>> R, std::vector<double> b) {
  const std::size_t p = b.size();
  for (std::size_t c = 0; c < p; ++c) {
    std::size_t piv = c;
    for (std::size_t r = c + 1; r < p; ++r)
      if (std::fabs(R[r][c]) > std::fabs(R[piv][c])) piv = r;
    std::swap(R[c], R[piv]);
    std::swap(b[c], b[piv]);
    DIFFCP_CHECK(R[c][c] != 0, "UniPC: a singular coefficient system (repeated sigmas?)");
    for (std::size_t r = c + 1; r < p; ++r) {
      const double f = R[r][c] / R[c][c];
      for (std::size_t k = c; k < p; ++k) R[r][k] -= f * R[c][k];
      b[r] -= f * b[c];
    }
  }
  std::vector<double> x(p);
  for (std::size_t c = p; c-- > 0;) {
    double s = b[c];
    for (std::size_t k = c + 1; k < p; ++k) s -= R[c][k] * x[k];
    x[c] = s / R[c][c];
  }
  return x;
}

}  // namespace

// UniPC's p x p system for step size h and the ratios r_1..r_{p-1} (the last ratio 1): R[i][j] =
// r_j^i, b_i = h phi_{i+1}(-h) i! / B(h) as diffusers forms them (x0 prediction: hh = -h);
// also e^{hh} - 1 and B(h).
struct UniPCSolver::Coefficients {
  std::vector<std::vector<double>> R;
  std::vector<double> b;
  double h_phi_1 = 0, B = 0;
};

namespace {

UniPCSolver::Coefficients coefficients(double h, const std::vector<double>& r, int p, bool bh2) {
  UniPCSolver::Coefficients c;
  const double hh = -h;
  c.h_phi_1 = std::expm1(hh);
  c.B = bh2 ? std::expm1(hh) : hh;
  double h_phi_k = c.h_phi_1 / hh - 1, factorial = 1;
  std::vector<double> rk = r;
  rk.push_back(1.0);
  for (int i = 1; i <= p; ++i) {
    std::vector<double> row(rk.size());
    for (std::size_t j = 0; j < rk.size(); ++j) row[j] = std::pow(rk[j], i - 1);
    c.R.push_back(row);
    c.b.push_back(h_phi_k * factorial / c.B);
    factorial *= i + 1;
    h_phi_k = h_phi_k / hh - 1 / factorial;
  }
  return c;
}

}  // namespace

void UniPCFlowScheduler::schedule(int steps, std::vector<double>& sigmas, std::vector<double>& model_timesteps) const {
  DIFFCP_CHECK(steps >= 1, "`steps` = ", steps, ", expected >= 1");
  const double N = train_steps;
  std::vector<double> s(static_cast<std::size_t>(steps));
  // np.linspace(1, 1/N, steps + 1)[:steps], rounded as NumPy rounds it (k * step + start: another
  // order of the same operations can move N sigma across an integer, and so the model's timestep)
  const double du = (1.0 / N - 1.0) / steps;
  for (int k = 0; k < steps; ++k) {
    const double u = static_cast<double>(k) * du + 1.0;
    s[static_cast<std::size_t>(k)] = flow_shift * u / (1 + (flow_shift - 1) * u);
  }
  if (std::fabs(s[0] - 1) < 1e-6) s[0] -= 1e-6;
  sigmas.assign(static_cast<std::size_t>(steps) + 1, 0.0);
  model_timesteps.assign(static_cast<std::size_t>(steps), 0.0);
  for (int k = 0; k < steps; ++k) {
    const std::size_t i = static_cast<std::size_t>(k);
    sigmas[i] = static_cast<float>(s[i]);                  // diffusers' float32 sigmas
    model_timesteps[i] = std::trunc(s[i] * N) / 1000.0;     // its int64 timesteps, in sigma units
  }
  sigmas.back() = final_zero ? 0.0 : static_cast<float>(s.back());
  for (std::size_t k = 0; k + 1 < sigmas.size(); ++k)
    DIFFCP_CHECK(std::isfinite(sigmas[k]) && sigmas[k] > 0 && sigmas[k] < 1 && sigmas[k + 1] <= sigmas[k],
                 "UniPC: sigma ", k, " of ", steps, " steps is ", sigmas[k], " (flow_shift ", flow_shift,
                 "): expected decreasing sigmas in (0, 1)");
}

UniPCFlowScheduler unipc_scheduler_from_json(const nlohmann::json& j, const std::string& source) {
  DIFFCP_CHECK(j.is_object() && j.value("_class_name", std::string()) == "UniPCMultistepScheduler", "scheduler config '",
               source, "': expected a UniPCMultistepScheduler object");
  UniPCFlowScheduler s;
  const auto where = [&](const std::string& f) { return "scheduler config '" + source + "': field '" + f + "'"; };
  const auto is = [&](const std::string& f, const nlohmann::json& v, bool ok, const char* want) {
    DIFFCP_CHECK(ok, where(f), " = ", v.dump(), ", expected ", want);
  };
  bool flow_sigmas = false, flow_prediction = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& f = it.key();
    const nlohmann::json& v = it.value();
    if (!f.empty() && f[0] == '_') continue;  // _class_name, _diffusers_version, ...
    // Unused by the flow configuration: the beta schedule (flow sigmas replace it), the spacing of
    // non-flow timesteps, thresholding's parameters (thresholding itself must be off), the Karras /
    // exponential / beta sigmas' bounds (those must be off), dynamic shifting's kind (it must be off).
    if (f == "beta_start" || f == "beta_end" || f == "beta_schedule" || f == "trained_betas" ||
        f == "rescale_betas_zero_snr" || f == "timestep_spacing" || f == "steps_offset" || f == "sample_max_value" ||
        f == "dynamic_thresholding_ratio" || f == "time_shift_type" || f == "sigma_min" || f == "sigma_max")
      continue;
    if (f == "prediction_type") {
      flow_prediction = v == "flow_prediction";
      is(f, v, flow_prediction, "\"flow_prediction\" (diffcp's models predict the flow velocity)");
    } else if (f == "use_flow_sigmas") {
      flow_sigmas = v == true;
      is(f, v, flow_sigmas, "true (flow matching)");
    } else if (f == "flow_shift") {
      is(f, v, v.is_number() && v.get<double>() > 0 && std::isfinite(v.get<double>()), "a positive number");
      s.flow_shift = v.get<double>();
    } else if (f == "num_train_timesteps") {
      is(f, v, v.is_number_integer() && v.get<std::int64_t>() >= 1 && v.get<std::int64_t>() <= 100000,
         "an integer in [1, 100000]");
      s.train_steps = v.get<int>();
    } else if (f == "solver_order") {
      is(f, v, v.is_number_integer() && v.get<int>() >= 1 && v.get<int>() <= 3, "1, 2 or 3 (diffcp's UniPC)");
      s.solver.order = v.get<int>();
    } else if (f == "solver_type") {  // diffusers runs midpoint, heun and logrho as bh2
      is(f, v, v == "bh1" || v == "bh2" || v == "midpoint" || v == "heun" || v == "logrho",
         "\"bh1\", \"bh2\" (or midpoint, heun, logrho: bh2)");
      s.solver.bh2 = v != "bh1";
    } else if (f == "lower_order_final") {
      is(f, v, v.is_boolean(), "true or false");
      s.solver.lower_order_final = v.get<bool>();
    } else if (f == "final_sigmas_type") {
      is(f, v, v == "zero" || v == "sigma_min", "\"zero\" or \"sigma_min\"");
      s.final_zero = v == "zero";
    } else if (f == "predict_x0") {
      is(f, v, v == true, "true (diffcp's UniPC predicts x0, as Wan's config)");
    } else if (f == "thresholding" || f == "use_karras_sigmas" || f == "use_exponential_sigmas" || f == "use_beta_sigmas" ||
               f == "use_dynamic_shifting") {
      is(f, v, v == false, "false (not implemented in diffcp)");
    } else if (f == "shift_terminal" || f == "solver_p") {  // shift_terminal 0 / false: off, as in diffusers
      is(f, v, v.is_null() || (f == "shift_terminal" && (v == false || v == 0)), "null (not implemented in diffcp)");
    } else if (f == "disable_corrector") {
      is(f, v, v.is_array() && v.empty(), "[] (every step corrected)");
    } else {
      DIFFCP_FAIL("scheduler config '", source, "': unknown field '", f, "' of UniPCMultistepScheduler");
    }
  }
  DIFFCP_CHECK(flow_sigmas && flow_prediction, "scheduler config '", source,
               "': UniPCMultistepScheduler without use_flow_sigmas true and prediction_type \"flow_prediction\" "
               "(its defaults are a noise-prediction schedule; diffcp's models are flow matching)");
  // Both divide by zero at the last step (diffusers returns NaN there): with a final sigma of 0 its
  // lambda is infinite (bh1's B(h) = -h), and with sigma_min the last two sigmas are equal (h = 0).
  DIFFCP_CHECK(s.solver.lower_order_final || s.solver.order == 1, "scheduler config '", source,
               "': lower_order_final false with solver_order ", s.solver.order, " divides by zero at the last step "
               "(diffusers returns NaN); set lower_order_final true");
  DIFFCP_CHECK(s.solver.bh2 || !s.final_zero, "scheduler config '", source, "': solver_type \"bh1\" with ",
               "final_sigmas_type \"zero\" gives NaN at the last step in diffusers (B(h) = -h is infinite there); use bh2");
  return s;
}

UniPCSolver::UniPCSolver(const UniPCOptions& o, std::vector<double> sigmas, std::int64_t n)
    : o_(o), sigma_(std::move(sigmas)), n_(n) {
  DIFFCP_CHECK(o_.order >= 1 && o_.order <= 3 && sigma_.size() >= 2 && n_ >= 0, "UniPCSolver: order ", o_.order,
               ", ", sigma_.size(), " sigmas; expected order 1-3 and steps + 1 >= 2 sigmas");
  m_.resize(static_cast<std::size_t>(o_.order));
  for (auto& m : m_) m.resize(static_cast<std::size_t>(n_));
  last_.resize(static_cast<std::size_t>(n_));
  m_new_.resize(static_cast<std::size_t>(n_));
  tmp_.resize(static_cast<std::size_t>(n_));
}

double UniPCSolver::lambda(int k) const {
  const double s = sigma_[static_cast<std::size_t>(k)];
  return std::log(1 - s) - std::log(s);  // +inf at sigma 0
}

void UniPCSolver::combine(float* out, const std::vector<std::pair<double, const float*>>& terms) {
  fill(tmp_.data(), n_, 0.f);
  for (const auto& [c, src] : terms) axpy(tmp_.data(), static_cast<float>(c), src, n_);
  copy(TensorView::contiguous(out, DType::f32, {n_}, active_device()), tmp_.view());
}

void UniPCSolver::update(float* out, const float* x, int from, int to, const Coefficients& c, const std::vector<double>& r,
                         const std::vector<double>& rho, const float* m_new) {
  // out = (s_to / s_from) x - a_to h_phi_1 m_0 - a_to B (sum_i rho_i (m_i - m_0) / r_i [+ rho_p (m_new - m_0)])
  const double st = sigma_[static_cast<std::size_t>(to)], s0 = sigma_[static_cast<std::size_t>(from)], at = 1 - st;
  double c_m0 = -at * c.h_phi_1;
  std::vector<std::pair<double, const float*>> terms{{st / s0, x}};
  for (std::size_t i = 1; i <= r.size(); ++i) {
    const double w = -at * c.B * rho[i - 1] / r[i - 1];
    terms.push_back({w, m_[i].data()});
    c_m0 -= w;
  }
  if (m_new != nullptr) {  // the corrector's own difference (its ratio is 1)
    const double w = -at * c.B * rho.back();
    terms.push_back({w, m_new});
    c_m0 -= w;
  }
  terms.push_back({c_m0, m_[0].data()});
  combine(out, terms);
}

void UniPCSolver::step(int k, float* x, const float* v) {
  const int K = static_cast<int>(sigma_.size()) - 1;
  DIFFCP_CHECK(k >= 0 && k < K, "UniPCSolver: step ", k, " of ", K);
  const double sk = sigma_[static_cast<std::size_t>(k)];
  // m_new = x - sigma_k v: the x0 prediction of flow matching
  combine(m_new_.data(), {{1.0, x}, {-sk, v}});
  if (k > 0 && filled_ > 0) {  // corrector: x_k again from x_{k-1}, m_{k-1}, older m and m_new
    const int p = last_order_;
    const double h = lambda(k) - lambda(k - 1);
    std::vector<double> r;
    for (int i = 1; i < p; ++i) r.push_back((lambda(k - 1 - i) - lambda(k - 1)) / h);
    const Coefficients c = coefficients(h, r, p, o_.bh2);
    const std::vector<double> rho = p == 1 ? std::vector<double>{0.5} : solve(c.R, c.b);
    update(x, last_.data(), k - 1, k, c, r, rho, m_new_.data());
  }
  std::rotate(m_.rbegin(), m_.rbegin() + 1, m_.rend());  // m_[i] <- m_[i - 1]; the oldest is reused
  copy(m_[0].view(), m_new_.view());
  filled_ = std::min(filled_ + 1, o_.order);
  int p = o_.lower_order_final ? std::min(o_.order, K - k) : o_.order;
  p = std::min(p, filled_);
  copy(last_.view(), TensorView::contiguous(x, DType::f32, {n_}, active_device()));
  // predictor: x_{k+1} from x_k, m_k and p - 1 older predictions
  const double h = lambda(k + 1) - lambda(k);
  std::vector<double> r;
  for (int i = 1; i < p; ++i) r.push_back((lambda(k - i) - lambda(k)) / h);
  const Coefficients c = coefficients(h, r, p, o_.bh2);
  std::vector<double> rho;
  if (p == 2) rho = {0.5};
  if (p == 3) rho = solve({{c.R[0][0], c.R[0][1]}, {c.R[1][0], c.R[1][1]}}, {c.b[0], c.b[1]});
  update(x, last_.data(), k, k + 1, c, r, rho, nullptr);
  last_order_ = p;
}

}  // namespace diffcp
