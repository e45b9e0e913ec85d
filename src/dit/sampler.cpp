#include "diffcp/dit/sampler.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "diffcp/core/error.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

std::uint64_t prompt_hash(const std::string& prompt) {
  std::uint64_t h = 1469598103934665603ull;
  for (const unsigned char c : prompt) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

DitConditioning prompt_conditioning(const DitConfig& cfg, const DitShape& shape, const std::string& prompt) {
  const std::uint64_t h = prompt_hash(prompt);
  DitConditioning c;
  c.txt = random_normal(static_cast<std::size_t>(shape.text_tokens * cfg.text_dim), h);
  c.pooled = random_normal(static_cast<std::size_t>(cfg.pooled_dim), h + 1);
  return c;
}

DitShape negative_shape(const DitShape& shape, const DitConditioning& cond) {
  DitShape s = shape;
  s.text_tokens = cond.negative_tokens;
  return s;
}

bool uses_negative_pass(const DitConfig& cfg, const DitConditioning& cond, const SampleOptions& opt) {
  return cfg.accepts_negative() && cond.has_negative() && cfg_scale(cfg, opt) > 1;
}

double cfg_scale(const DitConfig& cfg, const SampleOptions& opt) {
  return cfg.family == DitFamily::flux1 ? opt.true_cfg_scale : opt.guidance;
}

std::vector<float> initial_noise(const DitConfig& cfg, const DitShape& shape, std::uint64_t seed) {
  return random_normal(static_cast<std::size_t>(shape.batch * shape.image_tokens() * cfg.in_channels()), seed);
}

namespace {
// tokens[j, (f, y, x), c * 4 + ph * 2 + pw] <-> ncfhw[j, c, f, 2 y + ph, 2 x + pw] (F = 1: an image)
template <bool kPack>
void repack(const float* src, float* dst, const DitConfig& cfg, const DitShape& shape) {
  const std::int64_t C = cfg.latent_channels, F = shape.frames, gh = shape.grid_h(), gw = shape.grid_w(), W = 2 * gw;
  for (std::int64_t j = 0; j < shape.batch; ++j)
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t f = 0; f < F; ++f)
        for (std::int64_t y = 0; y < 2 * gh; ++y)
          for (std::int64_t x = 0; x < W; ++x) {
            const std::int64_t img = (((j * C + c) * F + f) * 2 * gh + y) * W + x;
            const std::int64_t tok = (j * F * gh * gw + f * gh * gw + (y / 2) * gw + x / 2) * 4 * C + c * 4 + (y % 2) * 2 + x % 2;
            if (kPack)
              dst[tok] = src[img];
            else
              dst[img] = src[tok];
          }
}
}  // namespace

std::vector<float> pack_latent(const std::vector<float>& nchw, const DitConfig& cfg, const DitShape& shape) {
  DIFFCP_CHECK(cfg.patch == 2 && static_cast<std::int64_t>(nchw.size()) == shape.batch * shape.image_tokens() * cfg.in_channels(),
               "pack_latent: ", nchw.size(), " values, expected b * C * F * H/8 * W/8 = ", shape.batch * shape.image_tokens() * cfg.in_channels());
  std::vector<float> out(nchw.size());
  repack<true>(nchw.data(), out.data(), cfg, shape);
  return out;
}

std::vector<float> unpack_latent(const std::vector<float>& tokens, const DitConfig& cfg, const DitShape& shape) {
  DIFFCP_CHECK(cfg.patch == 2 && static_cast<std::int64_t>(tokens.size()) == shape.batch * shape.image_tokens() * cfg.in_channels(),
               "unpack_latent: ", tokens.size(), " values, expected b * N_img * C_in = ", shape.batch * shape.image_tokens() * cfg.in_channels());
  std::vector<float> out(tokens.size());
  repack<false>(tokens.data(), out.data(), cfg, shape);
  return out;
}

std::vector<float> shard_latent(const std::vector<float>& full, const DitConfig& cfg, const DitShape& shape,
                                const DitShard& shard) {
  return shard_rows(full, cfg.in_channels(), shape, shard);
}

std::vector<float> shard_rows(const std::vector<float>& full, std::int64_t C, const DitShape& shape, const DitShard& shard) {
  const std::int64_t N = shape.image_tokens(), Ip = shard.image_p, iv = shard.image_valid(shard.p);
  DIFFCP_CHECK(static_cast<std::int64_t>(full.size()) == shape.batch * N * C, "shard_rows: ", full.size(),
               " values, expected b * N_img * C = ", shape.batch * N * C);
  std::vector<float> out(static_cast<std::size_t>(shape.batch * Ip * C));  // padding rows stay 0
  if (iv > 0)  // a rank of padding only has no offset inside the latent
    for (std::int64_t j = 0; j < shape.batch; ++j)
      std::copy_n(full.begin() + (j * N + shard.p * Ip) * C, iv * C, out.begin() + j * Ip * C);
  return out;
}

std::vector<float> gather_latent(Communicator& comm, const std::vector<float>& x_p, const DitConfig& cfg,
                                 const DitShape& shape, const DitShard& shard) {
  DIFFCP_CHECK(comm.size() == shard.P && comm.rank() == shard.p, "gather_latent: communicator is rank ", comm.rank(),
               " of ", comm.size(), ", the shard rank ", shard.p, " of ", shard.P);
  const std::int64_t C = cfg.in_channels(), N = shape.image_tokens(), Ip = shard.image_p, b = shape.batch;
  std::vector<float> all(x_p.size() * static_cast<std::size_t>(shard.P)), full(static_cast<std::size_t>(b * N * C));
  comm.all_gather<float>(x_p, all);
  // all: [P][b][I_p][C] -> full: [b][N][C], the real rows of each rank
  for (int r = 0; r < shard.P; ++r)
    if (shard.image_valid(r) > 0)
      for (std::int64_t j = 0; j < b; ++j)
        std::copy_n(all.begin() + ((r * b + j) * Ip) * C, shard.image_valid(r) * C, full.begin() + (j * N + r * Ip) * C);
  return full;
}

std::vector<float> shard_text(const std::vector<float>& txt, std::int64_t text_dim, const DitShard& shard) {
  if (shard.context > 0) {  // Wan: every rank the whole text (its cross-attention's keys)
    DIFFCP_CHECK(static_cast<std::int64_t>(txt.size()) == shard.context * text_dim, "shard_text: ", txt.size(),
                 " values, expected T * text_dim = ", shard.context * text_dim);
    return txt;
  }
  DIFFCP_CHECK(static_cast<std::int64_t>(txt.size()) == shard.text * text_dim, "shard_text: ", txt.size(),
               " values, expected T * text_dim = ", shard.text * text_dim);
  std::vector<float> out(static_cast<std::size_t>(shard.text_p * text_dim));  // padding rows stay 0
  if (shard.text_valid(shard.p) > 0)
    std::copy_n(txt.begin() + shard.p * shard.text_p * text_dim, shard.text_valid(shard.p) * text_dim, out.begin());
  return out;
}

TimeSchedule parse_time_schedule(const std::string& name) {
  if (name == "linear") return TimeSchedule::linear;
  if (name == "flux") return TimeSchedule::flux;
  DIFFCP_FAIL("`schedule` '", name, "': unknown schedule, expected linear or flux");
}

const char* time_schedule_name(TimeSchedule s) { return s == TimeSchedule::flux ? "flux" : "linear"; }

double flux_shift_mu(std::int64_t image_tokens) {
  constexpr double x1 = 256, y1 = 0.5, x2 = 4096, y2 = 1.15;
  const double m = (y2 - y1) / (x2 - x1);
  return m * static_cast<double>(image_tokens) + (y1 - m * x1);
}

std::vector<double> flow_schedule(int steps, TimeSchedule kind, std::int64_t image_tokens) {
  DIFFCP_CHECK(steps >= 1, "`steps` = ", steps, ", expected >= 1");
  DIFFCP_CHECK(kind == TimeSchedule::linear || image_tokens >= 1, "flow_schedule: flux needs the image token count");
  std::vector<double> t(static_cast<std::size_t>(steps) + 1);
  const double e_mu = std::exp(flux_shift_mu(image_tokens));
  for (int k = 0; k <= steps; ++k) {
    const double s = 1.0 - static_cast<double>(k) / steps;
    t[static_cast<std::size_t>(k)] = kind == TimeSchedule::linear || s == 0.0 ? s : e_mu / (e_mu + (1.0 / s - 1.0));
  }
  return t;
}

SampleTimings euler_sample(DitModel& model, std::vector<float>& x_p, const DitConditioning& cond,
                           const SampleOptions& opt, DitModel* negative, CfgPair cfg_pair) {
  const std::vector<double>& t = opt.timesteps;
  DIFFCP_CHECK(t.size() >= 2, "euler_sample: ", t.size(), " timesteps, expected steps + 1 >= 2");
  const int steps = static_cast<int>(t.size()) - 1;
  const ScopedBackend on(model.backend());  // the run's context: the weights' backend, opt.compute (below)
  const DitShard& s = model.shard();
  const DitConfig& cfg = model.config();
  const std::int64_t text_dim = cfg.text_dim;
  const bool cfg_pass = uses_negative_pass(cfg, cond, opt), split = cfg_pair.pair != nullptr;
  DIFFCP_CHECK(!split || (cfg_pass && negative == nullptr && cfg_pair.pair->size() == 2),
               "euler_sample: CFG-parallel needs a run with a negative pass (a family with CFG, a negative prompt and "
               "a guidance scale > 1), a pair of two ranks and no negative model on this rank");
  // This rank's model runs the prompt's pass, or (CFG-parallel, pass 1) the negative prompt's.
  const bool neg_here = split && cfg_pair.pass() == 1;
  const std::vector<float>& my_txt = neg_here ? cond.negative_txt : cond.txt;
  const std::vector<float>& my_pooled = neg_here ? cond.negative_pooled : cond.pooled;
  DIFFCP_CHECK(static_cast<std::int64_t>(my_txt.size()) == model.shape().text_tokens * text_dim &&
                   static_cast<std::int64_t>(my_pooled.size()) == cfg.pooled_dim,
               "euler_sample: conditioning has ", my_txt.size(), " text and ", my_pooled.size(),
               " pooled values, expected T * text_dim = ", model.shape().text_tokens * text_dim, " and ", cfg.pooled_dim);
  DIFFCP_CHECK(static_cast<std::int64_t>(x_p.size()) == model.shape().batch * s.image_p * cfg.in_channels(),
               "euler_sample: x_p has ", x_p.size(), " values, expected b * I_p * C_in = ",
               model.shape().batch * s.image_p * cfg.in_channels());
  DIFFCP_CHECK(split || !cfg_pass || (negative != nullptr && &negative->config() == &cfg &&
                                      negative->shape().text_tokens == cond.negative_tokens &&
                                      static_cast<std::int64_t>(cond.negative_txt.size()) == cond.negative_tokens * text_dim),
               "euler_sample: classifier-free guidance needs the negative prompt's model (negative_shape(), the same "
               "weights) and its [", cond.negative_tokens, ", ", text_dim, "] text");
  // On the device: the latent, this rank's text rows, the pooled vector and the velocity (CFG-parallel:
  // [2, n], the prompt's pass's then the negative's, after the pair's all-gather).
  const std::int64_t n = static_cast<std::int64_t>(x_p.size());
  DeviceVector<float> txt, pooled, x, v, neg_txt, neg_pooled, v_neg;
  DeviceVector<float> v_pair;  // CFG-parallel: [2, n] the prompt's pass's velocity, then the negative's
  txt.assign(shard_text(my_txt, text_dim, s));
  pooled.assign(my_pooled);
  x.assign(x_p);
  v.resize(n);
  const ScopedF32GemmCompute precision(opt.compute);
  model.exchange().set_compute(opt.compute);
  if (split) v_pair.resize(2 * n);
  if (cfg_pass && !split) {
    const DitShard& ns = negative->shard();
    neg_txt.assign(shard_text(cond.negative_txt, text_dim, ns));
    DIFFCP_CHECK(static_cast<std::int64_t>(cond.negative_pooled.size()) == (cfg.has_pooled() ? cfg.pooled_dim : 0),
                 "euler_sample: the negative prompt's pooled vector has ", cond.negative_pooled.size(), " values, expected ",
                 cfg.has_pooled() ? cfg.pooled_dim : 0);
    neg_pooled.assign(cond.negative_pooled);
    v_neg.resize(n);
    negative->exchange().set_compute(opt.compute);
  }
  const auto exchange_ms = [&] {
    return model.exchange().stats().comm_ms + (cfg_pass && !split ? negative->exchange().stats().comm_ms : 0.0);
  };
  DIFFCP_CHECK(opt.model_timesteps.empty() || static_cast<int>(opt.model_timesteps.size()) == steps,
               "euler_sample: ", opt.model_timesteps.size(), " model timesteps for ", steps, " steps");
  std::optional<UniPCSolver> unipc;
  if (opt.unipc.order > 0) unipc.emplace(opt.unipc, t, n);
  SampleTimings out;
  for (int k = 0; k < steps; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    const double comm0 = exchange_ms();
    double pair_ms = 0;
    const double tk = opt.model_timestep(static_cast<std::size_t>(k));
    model.exchange().begin_step(k, steps);
    model.velocity(x.data(), txt.data(), pooled.data(), tk, opt.guidance, v.data());
    float* v_step = v.data();  // the velocity of the step, after guidance
    if (split) {  // v_pair = [v_prompt | v_negative] from the pair
      const auto p0 = std::chrono::steady_clock::now();
      cfg_pair.pair->all_gather_async(v.data(), v_pair.data(), static_cast<std::size_t>(n), DType::f32)->wait();
      active_backend().synchronize();
      pair_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p0).count();
      v_step = v_pair.data();
      guidance_combine(v_step, v_pair.data() + n, n / cfg.in_channels(), cfg.in_channels(), static_cast<float>(cfg_scale(cfg, opt)),
                       cfg.cfg_keeps_norm());
    } else if (cfg_pass) {  // v = v_neg + g (v - v_neg) (Qwen-Image: the conditional norm of each token kept)
      negative->exchange().begin_step(k, steps);
      negative->velocity(x.data(), neg_txt.data(), neg_pooled.data(), tk, opt.guidance, v_neg.data());
      guidance_combine(v_step, v_neg.data(), n / cfg.in_channels(), cfg.in_channels(), static_cast<float>(cfg_scale(cfg, opt)),
                       cfg.cfg_keeps_norm());
    }
    if (unipc) {
      unipc->step(k, x.data(), v_step);
    } else {
      const float dt = static_cast<float>(t[static_cast<std::size_t>(k) + 1] - t[static_cast<std::size_t>(k)]);
      axpy(x.data(), dt, v_step, n);  // x += dt v
    }
    active_backend().synchronize();  // the step's time is the device's
    out.step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    out.comm_ms.push_back(exchange_ms() - comm0 + pair_ms);
    if (opt.on_velocity)
      opt.on_velocity(k, to_host<float>(TensorView::contiguous(v_step, DType::f32, {n}, active_device())));
  }
  copy(TensorView::contiguous(x_p.data(), DType::f32, {n}), x.view());
  return out;
}

}  // namespace diffcp
