// diffusers' UniPCMultistepScheduler in the flow-matching configuration Wan's pipeline folders ship
// (prediction_type flow_prediction, use_flow_sigmas, flow_shift, predict_x0, solver_order 2, bh2,
// lower_order_final; issue #70): the schedule and the multistep predictor-corrector update.
//
// Schedule of K steps, N = num_train_timesteps, s = flow_shift:
//   sigma_k = s u_k / (1 + (s - 1) u_k), u = linspace(1, 1/N, K + 1)[:K]; sigma_0 -= 1e-6 when it is
//   1 (to 1e-6); then the final sigma (0, or sigma_{K-1} with final_sigmas_type sigma_min). The update
//   uses the sigmas rounded to float32 (diffusers holds them so); the transformer is called at the
//   integer timestep trunc(N sigma_k) (the scheduler's int64 timesteps), i.e. t_k = trunc(N sigma_k) / 1000
//   in diffcp's sigma units (the model embeds 1000 t).
// Update at step k with velocity v (x0 prediction m_k = x - sigma_k v; lambda(sigma) = log((1 - sigma)
// / sigma); h = lambda_{k+1} - lambda_k; B(h) = e^{-h} - 1 (bh2) or -h (bh1)):
//   corrector (k > 0, the order p of the last predictor): x <- UniC(x_{k-1}, m_{k-1}, ..., m_k)
//   predictor (order p = min(order, steps done + 1, K - k with lower_order_final)): x <- UniP(x, m_k, ...)
// with the coefficients of UniPC (Zhao et al. 2023) as diffusers computes them: rho from the p x p
// system R rho = b (rho_p = 1/2 at p = 2; rho_c = 1/2 at p = 1). Supported: orders 1-3, bh1 / bh2
// (midpoint, heun, logrho run as bh2, as in diffusers); refused by name: other prediction types,
// predict_x0 false, Karras / exponential / beta sigmas, dynamic shifting, shift_terminal,
// thresholding, a corrector-free step list, solver_p, and the two configurations whose last step
// diffusers computes as NaN (lower_order_final false above order 1; bh1 with a final sigma of 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "diffcp/ops/buffer.hpp"

namespace diffcp {

struct UniPCOptions {
  int order = 0;                  // solver_order; 0: not UniPC (Euler)
  bool bh2 = true;                // solver_type bh2 (else bh1)
  bool lower_order_final = true;  // the last steps at lower order
};

struct UniPCFlowScheduler {
  double flow_shift = 1.0;
  int train_steps = 1000;        // num_train_timesteps
  bool final_zero = true;        // final_sigmas_type zero (else sigma_min)
  UniPCOptions solver{2, true, true};
  // [steps + 1] sigmas for the update (float32-rounded, then the final one) and [steps] model
  // timesteps (trunc(N sigma) / 1000).
  void schedule(int steps, std::vector<double>& sigmas, std::vector<double>& model_timesteps) const;
};
// From a scheduler_config.json of class UniPCMultistepScheduler; unsupported options refused by name.
UniPCFlowScheduler unipc_scheduler_from_json(const nlohmann::json& j, const std::string& source);

// The multistep state of one sampling run on the active backend: the last `order` x0 predictions
// and the sample before the last predictor, each [n] floats (a rank's latent rows).
class UniPCSolver {
 public:
  struct Coefficients;  // one update's p x p system and its scalars (unipc.cpp)
  UniPCSolver(const UniPCOptions& o, std::vector<double> sigmas, std::int64_t n);
  // Step k: x [n] (the sample at sigma_k) and its velocity v [n] -> x at sigma_{k+1}.
  void step(int k, float* x, const float* v);

 private:
  // out = sum_i c_i src_i (each [n]), on the device.
  void combine(float* out, const std::vector<std::pair<double, const float*>>& terms);
  // UniPC's update from sigma_from to sigma_to of x with m_[0..] (and m_new: the corrector).
  void update(float* out, const float* x, int from, int to, const Coefficients& c, const std::vector<double>& r,
              const std::vector<double>& rho, const float* m_new);
  double lambda(int k) const;

  UniPCOptions o_;
  std::vector<double> sigma_;  // [K + 1]
  std::int64_t n_;
  std::vector<DeviceVector<float>> m_;  // m_[0] the newest x0 prediction, m_[i] i steps older
  DeviceVector<float> last_, m_new_, tmp_;
  int filled_ = 0, last_order_ = 0;  // predictions held; the last predictor's order
};

}  // namespace diffcp
