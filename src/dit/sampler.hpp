// Inputs and the sampler of a DiT run: the prompt's text conditioning, the seeded initial noise,
// and the flow-matching Euler sampler.
//
// Flow matching (rectified flow, FLUX's convention): x_t = (1 - t) x_0 + t noise, the model predicts
// v = d x_t / d t = noise - x_0. Schedule: T steps on the uniform grid t_k = 1 - k/T, k = 0..T (no
// timestep shift); step k: x <- x + (t_{k+1} - t_k) v(x, t_k), i.e. x_{t - 1/T} = x_t - v(x_t, t) / T.
//
// Legend as in dit/config.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "dit/model.hpp"

namespace diffcp {

// FNV-1a (64 bit) of the prompt's bytes: the seed of its text conditioning.
std::uint64_t prompt_hash(const std::string& prompt);

// A stand-in for the text encoders (no T5 / CLIP here): the prompt's hash seeds N(0, 1) draws, so
// equal prompts give equal conditioning and different prompts different ones.
struct DitConditioning {
  std::vector<float> txt;     // [T, text_dim] text tokens (seed prompt_hash(prompt))
  std::vector<float> pooled;  // [pooled_dim] pooled vector (seed prompt_hash(prompt) + 1)
};
DitConditioning prompt_conditioning(const DitConfig& cfg, const DitShape& shape, const std::string& prompt);

// x_1 ~ N(0, I): [b, N_img, C_in], one stream seeded by `seed`, image-major, tokens row-major over
// the grid, channels (c, ph, pw) (FLUX's packing). The same for every P: a rank takes its rows.
std::vector<float> initial_noise(const DitConfig& cfg, const DitShape& shape, std::uint64_t seed);

// This rank's image rows of a full latent: full [b, N_img, C_in] -> [b, I_p, C_in].
std::vector<float> shard_latent(const std::vector<float>& full, const DitConfig& cfg, const DitShape& shape,
                                const DitShard& shard);
// The inverse, collective over `comm` (the P ranks of the shard, rank order = shard order): every
// rank gets the full [b, N_img, C_in] from the ranks' [b, I_p, C_in].
std::vector<float> gather_latent(Communicator& comm, const std::vector<float>& x_p, const DitConfig& cfg,
                                 const DitShape& shape, const DitShard& shard);

// t_0 = 1, ..., t_T = 0: [steps + 1]. Throws unless steps >= 1.
std::vector<double> flow_schedule(int steps);

// Per step, this rank's wall time and the exchange's time in communication.
struct SampleTimings {
  std::vector<double> step_ms, comm_ms;  // [steps]
};

// Runs the T Euler steps of the schedule on this rank's tokens; collective over the model's
// exchange; calls exchange().begin_step(k, steps) before step k (cocodiff's schedule). x_p:
// [b, I_p, C_in] in: x_1 (noise), out: x_0. cond: the full conditioning (each rank
// reads its text rows). The exchange's statistics accumulate over all steps.
SampleTimings euler_sample(DitModel& model, std::vector<float>& x_p, const DitConditioning& cond, int steps);

}  // namespace diffcp
