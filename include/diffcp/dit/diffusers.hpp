// The DiT from diffusers' model folders: the layout FLUX.1 is most often held in (issue #34, first
// part: FLUX.1's FluxTransformer2DModel; the other families follow on the same map).
//
// A folder is a pipeline (model_index.json, the transformer in transformer/) or a transformer
// folder: config.json (`_class_name` + the class's constructor arguments) and
// diffusion_pytorch_model.safetensors, or its sharded set (diffusion_pytorch_model.safetensors.index.json).
// diffcp's parameters keep BFL's names and layout (dit/config.hpp); a diffusers file fills them
// through dit_file_parts, so the model's math does not fork on the format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "diffcp/dit/config.hpp"

namespace diffcp {

enum class DitFileFormat {
  bfl,        // BFL's flux1-*.safetensors names (dit/config.hpp)
  diffusers,  // FluxTransformer2DModel's state-dict names
};

// Rows [row0, row0 + rows) of the file's tensor `name` (whose shape must be `file_shape`): one piece
// of a layout tensor, whose rows (the first dim: `out` of a Linear weight [out, in], or the
// elements of a vector) are its parts' rows in order. diffusers splits BFL's fused Linears (qkv:
// to_q, to_k, to_v; a single block's linear1: to_q, to_k, to_v, proj_mlp) and stores the final
// modulation as (scale, shift) where BFL has (shift, scale).
struct DitFilePart {
  std::string name;
  std::vector<std::int64_t> file_shape;
  std::int64_t row0 = 0, rows = 0;
};
std::vector<DitFilePart> dit_file_parts(const DitLayout::Tensor& t, const DitConfig& cfg, DitFileFormat format);

// The model of a FluxTransformer2DModel config.json (`source` names it in errors). Fields missing
// from the file take the class's defaults, as diffusers does; unknown fields and other classes are
// refused by name. FLUX's fixed choices (mlp_ratio 4, RoPE theta 10000, qkv biases) are the class's.
DitConfig dit_config_from_diffusers(const nlohmann::json& j, const std::string& source);
// The diffusers class of a family ("FluxTransformer2DModel", ...).
const char* diffusers_class(DitFamily family);

// diffusers' FlowMatchEulerDiscreteScheduler, from a pipeline's scheduler/scheduler_config.json,
// as FluxPipeline drives it (the others: pipeline_sigmas): sigmas linspace(1, 1/N, N); mu = calculate_shift(image tokens), the
// line through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift); the
// scheduler's shift (use_dynamic_shifting: time_shift(mu, 1, sigma), exponential
// e^mu / (e^mu + 1/sigma - 1) or linear mu / (mu + 1/sigma - 1); else shift s / (1 + (shift - 1) s));
// shift_terminal's stretch; then 0. The options diffcp does not implement (Karras / exponential /
// beta sigmas, invert_sigmas, stochastic sampling, num_train_timesteps other than 1000) are refused
// by name, as are unknown fields and other classes.
struct FlowMatchEulerScheduler {
  double shift = 1.0;
  bool dynamic = false;  // use_dynamic_shifting
  double base_shift = 0.5, max_shift = 1.15;
  double base_seq = 256, max_seq = 4096;  // base_image_seq_len, max_image_seq_len
  double shift_terminal = 0;              // 0: none
  bool exponential = true;                // time_shift_type
  // [steps + 1] sigmas, the last 0, for `image_tokens` tokens per image, as the family's pipeline
  // sets them: mu from calculate_shift (FluxPipeline, QwenImagePipeline), or FLUX.2's
  // compute_empirical_mu(image tokens, steps) (Flux2Pipeline: a fit that ignores the config's
  // base / max shift). Throws unless every sigma is finite, in [0, 1] and non-increasing (a config
  // whose fields are each valid can still shift into nonsense).
  std::vector<double> pipeline_sigmas(int steps, std::int64_t image_tokens, DitFamily family = DitFamily::flux1) const;
};
FlowMatchEulerScheduler flow_match_scheduler_from_json(const nlohmann::json& j, const std::string& source);

// A transformer in diffusers' layout, found from `path` (a pipeline or a transformer folder).
struct DiffusersTransformer {
  std::string dir;      // the transformer folder
  std::string weights;  // its safetensors file or sharded set's index, for SafeTensorsSet
  DitConfig config;
  std::string scheduler_config;  // a pipeline's scheduler/scheduler_config.json; "" when none
};
bool is_directory(const std::string& path);
DiffusersTransformer open_diffusers_transformer(const std::string& path);

}  // namespace diffcp
