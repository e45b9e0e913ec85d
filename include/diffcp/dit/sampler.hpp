// Inputs and the sampler of a DiT run: the prompt's text conditioning, the seeded initial noise,
// and the flow-matching Euler sampler.
//
// Flow matching (rectified flow, FLUX's convention): x_t = (1 - t) x_0 + t noise, the model predicts
// v = d x_t / d t = noise - x_0. Schedules of T steps, t_0 = 1 > t_1 > ... > t_T = 0:
//   linear: t_k = 1 - k/T (no shift; FLUX.1-schnell's)
//   flux:   FLUX's time-shifted schedule (flux/sampling.py get_schedule, shift=True; FLUX.1-dev's):
//           t_k = e^mu / (e^mu + 1/s_k - 1), s_k = 1 - k/T, mu = 0.5 + (1.15 - 0.5) (N_img - 256) /
//           (4096 - 256), linear in the image token count N_img; t = 0 stays 0. Evaluated in double
//           (FLUX evaluates it in torch's float32: values differ by < 1e-7).
// Euler, as FLUX's denoise(): step k: x <- x + (t_{k+1} - t_k) v(x, t_k); or UniPC (dit/unipc.hpp,
// Wan's folders' scheduler).
//
// Legend as in dit/config.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/profile.hpp"
#include "diffcp/dit/step_cache.hpp"
#include "diffcp/dit/unipc.hpp"

namespace diffcp {

// FNV-1a (64 bit) of the prompt's bytes: the seed of its text conditioning.
std::uint64_t prompt_hash(const std::string& prompt);

// A stand-in for the text encoders (no T5 / CLIP here): the prompt's hash seeds N(0, 1) draws, so
// equal prompts give equal conditioning and different prompts different ones.
struct DitConditioning {
  std::vector<float> txt;     // [T, text_dim] text tokens (seed prompt_hash(prompt))
  std::vector<float> pooled;  // [pooled_dim] pooled vector (seed prompt_hash(prompt) + 1); empty without one
  // Classifier-free guidance's negative prompt (families with true_cfg(), dit/config.hpp): its text
  // tokens [negative_tokens, text_dim]; empty: no negative prompt.
  std::vector<float> negative_txt;
  std::int64_t negative_tokens = 0;
  std::vector<float> negative_pooled;  // [pooled_dim] the negative prompt's pooled vector (families with one)
  bool has_negative() const { return !negative_txt.empty(); }
};
DitConditioning prompt_conditioning(const DitConfig& cfg, const DitShape& shape, const std::string& prompt);
// The shape of the negative prompt's pass: `shape` with its text tokens.
DitShape negative_shape(const DitShape& shape, const DitConditioning& cond);

// x_1 ~ N(0, I): [b, N_img, C_in], one stream seeded by `seed`, image-major, tokens row-major over
// the grid, channels (c, ph, pw) (FLUX's packing). The same for every P: a rank takes its rows.
// (SD3's latent [b, C, H/8, W/8] packs to these tokens and back with pack_latent / unpack_latent.)
std::vector<float> initial_noise(const DitConfig& cfg, const DitShape& shape, std::uint64_t seed);

// A latent image [b, C, 2 g_h, 2 g_w] (diffusers' SD3 layout; a video [b, C, F, 2 g_h, 2 g_w], Wan's)
// -> tokens [b, F g_h g_w, 4 C] (frame-major), channels (c, ph, pw); unpack_latent is the inverse.
std::vector<float> pack_latent(const std::vector<float>& nchw, const DitConfig& cfg, const DitShape& shape);
std::vector<float> unpack_latent(const std::vector<float>& tokens, const DitConfig& cfg, const DitShape& shape);

// This rank's image rows of a full latent: full [b, N_img, C_in] -> [b, I_p, C_in] (padding rows 0).
std::vector<float> shard_latent(const std::vector<float>& full, const DitConfig& cfg, const DitShape& shape,
                                const DitShard& shard);
// The same for rows of C values a token: full [b, N_img, C] -> [b, I_p, C] (Wan I2V's model input:
// C = embed_in_channels(), the latent's and the condition's channels).
std::vector<float> shard_rows(const std::vector<float>& full, std::int64_t C, const DitShape& shape, const DitShard& shard);
// The inverse, collective over `comm` (the P ranks of the shard, rank order = shard order): every
// rank gets the full [b, N_img, C_in] from the ranks' [b, I_p, C_in] (their real rows).
std::vector<float> gather_latent(Communicator& comm, const std::vector<float>& x_p, const DitConfig& cfg,
                                 const DitShape& shape, const DitShard& shard);
// This rank's text rows: txt [T, text_dim] -> [T_p, text_dim] (padding rows 0); Wan (shard.context):
// the whole text, every rank.
std::vector<float> shard_text(const std::vector<float>& txt, std::int64_t text_dim, const DitShard& shard);

enum class TimeSchedule { linear, flux };
TimeSchedule parse_time_schedule(const std::string& name);  // "linear" | "flux"; throws naming it
const char* time_schedule_name(TimeSchedule s);
// FLUX's shift mu for N_img image tokens (the line through (256, 0.5) and (4096, 1.15)).
double flux_shift_mu(std::int64_t image_tokens);
// t_0 = 1, ..., t_T = 0: [steps + 1]. Throws unless steps >= 1 (and image_tokens >= 1 for flux).
std::vector<double> flow_schedule(int steps, TimeSchedule kind = TimeSchedule::linear, std::int64_t image_tokens = 0);

// Per step, this rank's wall time and the exchange's time in communication.
struct SampleTimings {
  std::vector<double> step_ms, comm_ms;  // [steps]
};

struct SampleOptions {
  std::vector<double> timesteps;  // [T + 1] from flow_schedule (the update's sigmas)
  // Read by models with guidance_embed (the distilled guidance; 3.5 is diffusers' FluxPipeline
  // default, BFL's CLI has 2.5), and in true_cfg() families as classifier-free guidance's scale:
  // above 1 with a negative prompt, every step runs the negative pass too and combines the two
  // velocities (guidance_combine; Qwen-Image keeps the conditional norm, SD3 does not).
  double guidance = 3.5;
  // Called on every rank after step k's velocity v_p [b, I_p, C_in] (e.g. --dump-velocity), a host
  // copy; may communicate (every rank calls it at the same point). Not counted in the step time.
  std::function<void(int k, const std::vector<float>& v_p)> on_velocity;
  // f32, or bf16: the model's GEMMs on bf16-rounded operands (ScopedF32GemmCompute), the exchanges'
  // payloads, caches and the dense attention in bf16 (AttentionExchange::set_compute); latents,
  // norms, modulation and the Euler update stay f32.
  DType compute = DType::f32;
  // Step caching (dit/step_cache.hpp): run_dit_sampling sets it on each pass's model.
  StepCacheSpec step_cache{};
  // FLUX.1's true classifier-free guidance (FluxPipeline's true_cfg_scale): above 1 with a negative
  // prompt, the negative pass runs too and the velocities combine as v_neg + s (v - v_neg), while
  // `guidance` stays the distilled guidance embedding of both passes. Read by FLUX.1 only.
  double true_cfg_scale = 1.0;
  // Per op family timers (dit/profile.hpp): run_dit_sampling sets it on each pass's model; null: off.
  DitProfile* profile = nullptr;
  // [T] the timestep the model sees at step k (UniPC: the scheduler's integer timesteps, in sigma
  // units); empty: timesteps[k].
  std::vector<double> model_timesteps{};
  // The timestep the model sees at step k: model_timesteps[k], else timesteps[k].
  double model_timestep(std::size_t k) const { return model_timesteps.empty() ? timesteps.at(k) : model_timesteps.at(k); }
  // order > 0: UniPC's multistep update (dit/unipc.hpp) instead of Euler's.
  UniPCOptions unipc{};
};

// The scale classifier-free guidance combines the two velocities with: FLUX.1's true_cfg_scale,
// the true-CFG families' guidance.
double cfg_scale(const DitConfig& cfg, const SampleOptions& opt);

// CFG-parallel (dit/run.hpp make_cfg_groups): this rank runs one pass of classifier-free guidance;
// the pair's all-gather brings the other pass's velocity (the same image rows) and both ranks
// combine the two alike, so every rank continues with the same latent.
struct CfgPair {
  Communicator* pair = nullptr;  // two ranks; pair rank 0 runs the prompt's pass, 1 the negative's. null: off
  int pass() const { return pair != nullptr ? pair->rank() : 0; }
};

// Whether a run with these options takes the negative prompt's pass: a family that accepts one
// (DitConfig::accepts_negative), a negative prompt and cfg_scale > 1.
bool uses_negative_pass(const DitConfig& cfg, const DitConditioning& cond, const SampleOptions& opt);

// Runs the T Euler steps of the schedule on this rank's tokens; collective over the model's
// exchange; calls exchange().begin_step(k, steps) before step k (cocodiff's schedule). `negative`:
// the negative prompt's model (negative_shape(), the same weights, its own exchange and so its own
// V-Major caches, as diffusers' cache_context("uncond")), required when uses_negative_pass() unless
// `cfg_pair` is given: then `model` is this rank's pass's (pass 1: negative_shape()), `negative` is
// null, and the step ends with the pair's all-gather of the velocities (counted in comm_ms). x_p:
// [b, I_p, C_in] in: x_1 (noise), out: x_0. cond: the full conditioning (each rank
// reads its text rows). The exchange's statistics accumulate over all steps. The host data goes to
// the model's device once, and x_0 comes back at the end: the steps run in device memory (the
// Euler update is an op).
SampleTimings euler_sample(DitModel& model, std::vector<float>& x_p, const DitConditioning& cond,
                           const SampleOptions& opt, DitModel* negative = nullptr, CfgPair cfg_pair = {});

}  // namespace diffcp
