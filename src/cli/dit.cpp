// `diffcp dit`: DiT inference (the four families of dit/config.hpp, dit/model.hpp) with Ulysses sequence parallelism over
// the mpirun ranks; the attention exchange is Flat, TAPA, V-First or CoCoDiff (V-First + V-Major)
// (dit/exchange.hpp, dit/vmajor.hpp); past the head limit USP: Ulysses over U ranks, Ring attention
// over R = P / U groups (--ulysses-degree / --ring-degree, dit/ring_attention.hpp). Writes the image,
// reports step time, bytes per link class, messages and (with --compare flat / --reference) the
// quality against the Flat output.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "diffcp/dit/image.hpp"
#include "diffcp/dit/metrics.hpp"
#include "diffcp/dit/run.hpp"
#include "diffcp/dit/session.hpp"
#include "diffcp/dit/sampler.hpp"
#include "diffcp/dit/vmajor.hpp"
#include "diffcp/io/npy.hpp"
#include "diffcp/testing/dit_compare.hpp"

namespace diffcp::cli {

namespace {

// The CLI's own inputs and outputs; `run` is the library's (dit/session.hpp), its fields bound to
// the flags of the same names.
struct DitOptions {
  DitRunOptions run;
  int ulysses_degree = 0, ring_degree = 0;  // run's optionals, read only when given (g_ulysses_opt / g_ring_opt)
  double guidance = 3.5;                    // run.guidance when given (g_guidance_opt)
  bool no_pack_weights = false;             // run.pack_weights = false
  std::int64_t resolution = 512, width = 0, height = 0, batch = 1, text_tokens = 64;  // width/height 0: --resolution
  std::int64_t frames = 1;  // latent frames (video: wan)
  std::uint64_t seed = 1, weight_seed = 1;
  std::string prompt = "a lighthouse on a rocky coast at dusk";
  std::string weights, preset = "default", config;
  std::string text_embeddings, pooled, negative_text_embeddings, negative_pooled, noise, dump_velocity;
  bool dry_run = false;
  std::int64_t heads = 0, head_dim = 0, double_blocks = -1, single_blocks = -1, mlp_hidden = 0;  // 0/-1: preset's
  std::string out = "diffcp_dit.png", save_latent, reference, compare;
  bool json = false;
};

// CLI11 binds the options to this object; run_dit reads it (one subcommand per process).
DitOptions g_opt;
CLI::Option* g_ulysses_opt = nullptr;
CLI::Option* g_ring_opt = nullptr;
CLI::Option* g_heads_opt = nullptr;
CLI::Option* g_batch_opt = nullptr;
CLI::Option* g_width_opt = nullptr;
CLI::Option* g_height_opt = nullptr;
CLI::Option* g_frames_opt = nullptr;
CLI::Option* g_seed_opt = nullptr;
CLI::Option* g_prompt_opt = nullptr;
CLI::Option* g_text_tokens_opt = nullptr;
CLI::Option* g_guidance_opt = nullptr;
std::vector<CLI::Option*> g_shape_opts;  // --preset, --head-dim, --double-blocks, --single-blocks, --mlp-hidden

template <typename T>
std::optional<T> given(const CLI::Option* opt, T value) {
  return opt != nullptr && opt->count() > 0 ? std::optional<T>(value) : std::nullopt;
}

DitConfig make_config(const DitOptions& o) {
  return dit_preset(o.preset, {o.heads, o.head_dim, o.double_blocks, o.single_blocks, o.mlp_hidden});
}

// The model shape: from --config (FluxParams), else read off the --weights checkpoint, else the
// preset and its overrides (as before; with --weights the load then checks every tensor against it).
DitConfig resolve_config(const DitOptions& o, const SafeTensorsSet* ck, const std::optional<DitConfig>& folder_cfg) {
  bool shape_flags = false;
  for (const CLI::Option* opt : g_shape_opts) shape_flags = shape_flags || opt->count() > 0;
  const std::optional<std::int64_t> heads = given(g_heads_opt, o.heads);
  if (folder_cfg) {
    DIFFCP_CHECK(o.config.empty() && !shape_flags, "--weights '", o.weights, "' is a diffusers folder: its config.json ",
                 "gives the model shape; drop --config / --preset / --head-dim / --double-blocks / --single-blocks / --mlp-hidden");
    DIFFCP_CHECK(!heads || *heads == folder_cfg->heads, "--heads ", o.heads, " disagrees with --weights '", o.weights,
                 "' (num_attention_heads ", folder_cfg->heads, ")");
    return *folder_cfg;
  }
  if (!o.config.empty()) {
    DIFFCP_CHECK(!shape_flags, "--config '", o.config, "' gives the model shape: drop --preset / --head-dim / "
                 "--double-blocks / --single-blocks / --mlp-hidden");
    const DitConfig c = read_dit_config(o.config);
    DIFFCP_CHECK(!heads || *heads == c.heads, "--heads ", o.heads, " disagrees with --config '", o.config, "' (num_heads ",
                 c.heads, ")");
    return c;
  }
  if (ck != nullptr && !shape_flags) return infer_dit_config(*ck, heads);
  return make_config(o);
}

// A float .npy input with its shape checked: `want` lists the accepted shapes (-1: any size).
std::vector<float> read_input(const std::string& path, const char* flag, std::vector<std::int64_t>& shape,
                              const std::vector<std::vector<std::int64_t>>& want, const char* legend) {
  std::vector<float> v;
  try {
    v = read_npy_f32(path, shape);
  } catch (const Error& e) {
    DIFFCP_FAIL(flag, " '", path, "': ", e.what());
  }
  for (const auto& w : want) {
    bool ok = w.size() == shape.size();
    for (std::size_t i = 0; ok && i < w.size(); ++i) ok = w[i] < 0 || w[i] == shape[i];
    if (!ok) continue;
    for (std::size_t i = 0; i < v.size(); ++i)
      DIFFCP_CHECK(std::isfinite(v[i]), flag, " '", path, "': value ", i, " is ", v[i], " (NaN or infinite, or beyond float32)");
    return v;
  }
  DIFFCP_FAIL(flag, " '", path, "': shape ", shape_str(shape), ", expected ", legend);
}

// The run's inputs: conditioning and noise from the user's .npy files or made here (hashed prompt,
// seeded noise); they fix the batch and the text tokens when given.
struct DitInputs {
  DitShape shape;
  DitConditioning cond;
  std::vector<float> noise;  // [b, N_img, C_in]
};

DitInputs read_inputs(const DitOptions& o, const DitConfig& cfg) {
  DitInputs in;
  const bool w_given = g_width_opt->count() > 0, h_given = g_height_opt->count() > 0;
  in.shape = {o.batch, w_given ? o.width : o.resolution, h_given ? o.height : o.resolution, o.text_tokens, o.frames};
  DIFFCP_CHECK(o.frames == 1 || cfg.family == DitFamily::wan, "--frames ", o.frames, ": ", dit_family_name(cfg.family),
               " is an image model (one frame); the video family is wan");
  DIFFCP_CHECK(o.text_embeddings.empty() || g_prompt_opt->count() == 0, "--prompt is hashed into stand-in text "
               "conditioning; with --text-embeddings / --pooled it would be ignored: give one or the other");
  DIFFCP_CHECK(o.noise.empty() || g_seed_opt->count() == 0, "--seed draws the initial noise; with --noise it would be "
               "ignored: give one or the other");
  const char* family = dit_family_name(cfg.family);
  if (cfg.has_pooled())
    DIFFCP_CHECK(o.text_embeddings.empty() == o.pooled.empty(), "--text-embeddings and --pooled come together (your T5's "
                 "tokens and your CLIP's pooled vector); give both or neither");
  else
    DIFFCP_CHECK(o.pooled.empty(), "--pooled: this model (", family, ") has no pooled text vector; drop --pooled");
  DIFFCP_CHECK(o.negative_text_embeddings.empty() || cfg.accepts_negative(), "--negative-text-embeddings: this model (", family,
               ") has no classifier-free guidance pass", cfg.guidance_embed ? " (its --guidance is the distilled guidance embedding)" : "");
  DIFFCP_CHECK(o.negative_text_embeddings.empty() || !o.text_embeddings.empty(), "--negative-text-embeddings comes with "
               "--text-embeddings (the stand-in prompt conditioning makes its own negative)");
  const auto read_text = [&](const std::string& path, const char* flag, std::int64_t& T) {
    std::vector<std::int64_t> s;
    const std::string dim = cfg.has_pooled() ? "context_in_dim" : "joint_attention_dim";
    const std::string legend = "[T, " + dim + "] or [1, T, " + dim + "] with " + dim + " = " + std::to_string(cfg.text_dim) +
                               " (the model's txt_in; every image of the batch shares the prompt)";
    std::vector<float> v = read_input(path, flag, s, {{-1, cfg.text_dim}, {1, -1, cfg.text_dim}}, legend.c_str());
    T = s[s.size() - 2];
    return v;
  };
  if (!o.text_embeddings.empty()) {
    std::int64_t T = 0;
    in.cond.txt = read_text(o.text_embeddings, "--text-embeddings", T);
    DIFFCP_CHECK(!given(g_text_tokens_opt, o.text_tokens) || o.text_tokens == T, "--text-tokens ", o.text_tokens,
                 " disagrees with --text-embeddings '", o.text_embeddings, "' (", T, " tokens)");
    in.shape.text_tokens = T;
    if (cfg.has_pooled()) {
      std::vector<std::int64_t> s;
      const std::string plegend = "[vec_in_dim] or [1, vec_in_dim] with vec_in_dim = " + std::to_string(cfg.pooled_dim);
      in.cond.pooled = read_input(o.pooled, "--pooled", s, {{cfg.pooled_dim}, {1, cfg.pooled_dim}}, plegend.c_str());
    }
    if (!o.negative_text_embeddings.empty()) {
      in.cond.negative_txt = read_text(o.negative_text_embeddings, "--negative-text-embeddings", in.cond.negative_tokens);
      DIFFCP_CHECK(in.cond.negative_tokens >= 1, "--negative-text-embeddings '", o.negative_text_embeddings, "': no tokens");
    }
  }
  // SD3: the negative prompt's pooled vector comes with its tokens.
  DIFFCP_CHECK(cfg.has_pooled() || o.negative_pooled.empty(), "--negative-pooled: this model (", family,
               ") has no pooled text vector; drop --negative-pooled");
  if (cfg.has_pooled() && cfg.accepts_negative())
    DIFFCP_CHECK(o.negative_text_embeddings.empty() == o.negative_pooled.empty(), "--negative-text-embeddings and ",
                 "--negative-pooled come together (negative_prompt_embeds and negative_pooled_prompt_embeds); give both or neither");
  if (!o.negative_pooled.empty()) {
    std::vector<std::int64_t> s;
    const std::string plegend = "[pooled_projection_dim] or [1, pooled_projection_dim] with pooled_projection_dim = " +
                                std::to_string(cfg.pooled_dim);
    in.cond.negative_pooled = read_input(o.negative_pooled, "--negative-pooled", s, {{cfg.pooled_dim}, {1, cfg.pooled_dim}},
                                         plegend.c_str());
  }
  if (!o.noise.empty() && cfg.latent_image_layout()) {  // SD3 / Wan: the latent image or video, packed here
    std::vector<std::int64_t> s;
    const bool video = cfg.family == DitFamily::wan;
    const std::string legend = std::string(video ? "[b, C, F, H/8, W/8]" : "[b, C, H/8, W/8]") + " with C = in_channels = " +
                               std::to_string(cfg.latent_channels) + " (" + diffusers_class(cfg.family) + "'s hidden_states)";
    in.noise = read_input(o.noise, "--noise", s,
                          {video ? std::vector<std::int64_t>{-1, cfg.latent_channels, -1, -1, -1}
                                 : std::vector<std::int64_t>{-1, cfg.latent_channels, -1, -1}},
                          legend.c_str());
    DIFFCP_CHECK(!given(g_batch_opt, o.batch) || o.batch == s[0], "--batch ", o.batch, " disagrees with --noise '", o.noise,
                 "' (", s[0], " images)");
    in.shape.batch = s[0];
    if (video) {
      DIFFCP_CHECK(g_frames_opt->count() == 0 || o.frames == s[2], "--frames ", o.frames, " disagrees with --noise '", o.noise,
                   "' (", s[2], " latent frames)");
      in.shape.frames = s[2];
      s.erase(s.begin() + 2);
    }
    in.shape.validate();
    DIFFCP_CHECK(s[2] == in.shape.height / 8 && s[3] == in.shape.width / 8, "--noise '", o.noise, "': a ", s[3], " x ", s[2],
                 " latent, but a ", in.shape.width, "x", in.shape.height, " image has ", in.shape.width / 8, " x ",
                 in.shape.height / 8, " (give --width / --height)");
    in.noise = pack_latent(in.noise, cfg, in.shape);
  } else if (!o.noise.empty()) {
    std::vector<std::int64_t> s;
    const std::string legend = "[b, N_img, in_channels] with in_channels = " + std::to_string(cfg.in_channels());
    in.noise = read_input(o.noise, "--noise", s, {{-1, -1, cfg.in_channels()}}, legend.c_str());
    DIFFCP_CHECK(!given(g_batch_opt, o.batch) || o.batch == s[0], "--batch ", o.batch, " disagrees with --noise '", o.noise,
                 "' (", s[0], " images)");
    in.shape.batch = s[0];
    in.shape.validate();
    DIFFCP_CHECK(s[1] == in.shape.image_tokens(), "--noise '", o.noise, "': ", s[1], " image tokens, but a ", in.shape.width,
                 "x", in.shape.height, " image has (", in.shape.height, "/16) x (", in.shape.width, "/16) = ",
                 in.shape.image_tokens(), " (give --width / --height)");
  }
  in.shape.validate();
  if (o.text_embeddings.empty()) {
    in.cond = prompt_conditioning(cfg, in.shape, o.prompt);
    if (cfg.accepts_negative()) {  // the negative prompt "" through the same stand-in (dropped below unless its scale > 1)
      const DitConditioning neg = prompt_conditioning(cfg, in.shape, "");
      in.cond.negative_txt = neg.txt;
      in.cond.negative_pooled = neg.pooled;
      in.cond.negative_tokens = in.shape.text_tokens;
    }
  }
  return in;
}

// The latent layout a family's diffusers transformer takes (SD3: [b, C, H/8, W/8]; the others the
// tokens [b, N_img, C_in]).
std::vector<std::int64_t> latent_file_shape(const DitConfig& cfg, const DitShape& shape) {
  if (cfg.family == DitFamily::sd3) return {shape.batch, cfg.latent_channels, shape.height / 8, shape.width / 8};
  if (cfg.family == DitFamily::wan) return {shape.batch, cfg.latent_channels, shape.frames, shape.height / 8, shape.width / 8};
  return {shape.batch, shape.image_tokens(), cfg.in_channels()};
}

// tokens [b, N_img, C_in] -> PATH as .npy in latent_file_shape's layout
void write_latent(const std::string& path, const std::vector<float>& tokens, const DitConfig& cfg, const DitShape& shape) {
  if (cfg.latent_image_layout())
    write_npy(path, unpack_latent(tokens, cfg, shape).data(), latent_file_shape(cfg, shape));
  else
    write_npy(path, tokens.data(), latent_file_shape(cfg, shape));
}

// The timestep the model sees at each step (sigma units; UniPC: its integer timesteps / 1000).
std::vector<double> model_timesteps(const SampleOptions& opt) {
  std::vector<double> m;
  for (std::size_t k = 0; k + 1 < opt.timesteps.size(); ++k) m.push_back(opt.model_timestep(k));
  return m;
}

// Rank 0 writes DIR/timesteps.json now and DIR/velocity_<k>.npy at every step (the velocity
// gathered from all ranks); the callback is collective.
std::function<void(int, const std::vector<float>&)> velocity_dumper(Communicator& world, Communicator& pass_comm, const DitOptions& o,
                                                                     const std::string& schedule, const DitConfig& cfg, const DitShape& shape,
                                                                     const DitShard& shard, const SampleOptions& opt) {
  if (o.dump_velocity.empty()) return {};
  if (world.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(o.dump_velocity, ec);
    DIFFCP_CHECK(!ec && std::filesystem::is_directory(o.dump_velocity), "--dump-velocity '", o.dump_velocity,
                 "': cannot create the directory (", ec.message(), ")");
    const nlohmann::ordered_json j{{"schedule", schedule}, {"timesteps", opt.timesteps},
                                   {"model_timesteps", model_timesteps(opt)}, {"guidance", opt.guidance},
                                   {"guidance_embed", cfg.guidance_embed}, {"family", dit_family_name(cfg.family)},
                                   {"true_cfg", cfg.true_cfg()}, {"image_tokens", shape.image_tokens()},
                                   {"width", shape.width}, {"height", shape.height}, {"batch", shape.batch},
                                   {"in_channels", cfg.in_channels()}, {"mode", o.run.mode}, {"P", world.size()}};
    std::ofstream f(o.dump_velocity + "/timesteps.json");
    f << j.dump(1) << "\n";
    DIFFCP_CHECK(f.good(), "--dump-velocity: cannot write '", o.dump_velocity, "/timesteps.json'");
  }
  return [&world, &pass_comm, dir = o.dump_velocity, cfg, shape, shard](int k, const std::vector<float>& v_p) {
    const std::vector<float> v = gather_latent(pass_comm, v_p, cfg, shape, shard);
    if (world.rank() == 0) write_latent(dir + "/velocity_" + std::to_string(k) + ".npy", v, cfg, shape);
  };
}

}  // namespace

void add_dit_command(CLI::App& app) {
  DitOptions& o = g_opt;
  CLI::App* c = app.add_subcommand("dit", "DiT inference (FLUX.1, FLUX.2, Qwen-Image, SD3.5) with Ulysses sequence "
                                          "parallelism over the mpirun ranks: flow-matching Euler sampling, image out");
  c->add_option("--mode", o.run.mode, "attention exchange: flat | tapa | vfirst (TAPA + V-First) | cocodiff (V-First + V-Major)")->capture_default_str();
  c->add_option("--cache-schedule", o.run.cache_schedule, "cocodiff: linear (r from 0 after the warm-up to --cache-ratio at the last step) | fixed (r = --cache-ratio)")->capture_default_str();
  c->add_option("--cache-ratio", o.run.cache_ratio, "cocodiff: cache ratio r in [0, 1] (fixed: every selective step; linear: the last step's)")->capture_default_str();
  c->add_option("--warmup", o.run.warmup, "cocodiff: full-exchange steps at the start")->capture_default_str();
  c->add_option("--sync-every", o.run.sync_every, "cocodiff: a full exchange every this many steps (0: never)")->capture_default_str();
  c->add_option("--steps", o.run.steps, "denoising steps T")->capture_default_str();
  c->add_option("--resolution", o.resolution, "image side in pixels, a multiple of 16 ((R/16)^2 image tokens); --width / --height override it")->capture_default_str();
  g_width_opt = c->add_option("--width", o.width, "image width in pixels, a multiple of 16 (default: --resolution)");
  g_height_opt = c->add_option("--height", o.height, "image height in pixels, a multiple of 16 (default: --resolution)");
  g_frames_opt = c->add_option("--frames", o.frames, "latent frames of a video (wan; --noise [b, C, F, H/8, W/8] gives them)")
                     ->check(CLI::Range(1, 65536))
                     ->capture_default_str();
  g_batch_opt = c->add_option("--batch", o.batch, "images generated together (same prompt, different noise; default: --noise's b)")->capture_default_str();
  g_text_tokens_opt = c->add_option("--text-tokens", o.text_tokens, "text tokens T (default: --text-embeddings' T)")->capture_default_str();
  c->add_option("--text-embeddings", o.text_embeddings, "text tokens from your T5: .npy [T, context_in_dim] or [1, T, context_in_dim] (with --pooled; default: the hashed --prompt)");
  c->add_option("--pooled", o.pooled, "pooled vector from your CLIP: .npy [vec_in_dim] or [1, vec_in_dim] (with --text-embeddings; FLUX.1 only)");
  c->add_option("--negative-text-embeddings", o.negative_text_embeddings, "classifier-free guidance's negative prompt (Qwen-Image and SD3.5 with --guidance > 1, FLUX.1 with --true-cfg-scale > 1): its encoder_hidden_states, .npy [T_neg, text dim] or [1, T_neg, ...]");
  c->add_option("--negative-pooled", o.negative_pooled, "SD3.5 / FLUX.1: the negative prompt's pooled_projections, .npy [pooled_projection_dim] (with --negative-text-embeddings)");
  c->add_option("--noise", o.noise, "initial noise in the layout the family's diffusers transformer takes: packed 2x2 patches .npy [b, N_img, in_channels] (FLUX.1, FLUX.2, Qwen-Image), or the latent image [b, C, H/8, W/8] (SD3.5), or the latent video [b, C, F, H/8, W/8] (Wan); default: seeded N(0, 1), --seed");
  c->add_option("--true-cfg-scale", o.run.true_cfg_scale, "FLUX.1: true classifier-free guidance's scale (FluxPipeline's "
                "true_cfg_scale; > 1 runs the negative prompt's pass too: --negative-text-embeddings / --negative-pooled, "
                "or the stand-in's empty prompt); --guidance stays the distilled guidance")->capture_default_str();
  g_guidance_opt = c->add_option("--guidance", o.guidance, "FLUX.1: the distilled guidance scale (guidance_in, FLUX.1-dev; default 3.5); Qwen-Image: classifier-free guidance's scale (true_cfg_scale; default 4; 1: one conditional pass); SD3.5 / Wan: classifier-free guidance's scale (default 7 / 5)");
  c->add_option("--schedule", o.run.schedule, "timesteps: linear (t_k = 1 - k/T; FLUX.1-schnell) | flux (FLUX's time-shifted schedule; FLUX.1-dev) | auto (a diffusers pipeline's scheduler/scheduler_config.json, as the family's pipeline uses it; else FLUX.2: Flux2Pipeline's dynamic shift; others: flux for guidance-distilled models, linear otherwise)")->capture_default_str();
  c->add_option("--dump-velocity", o.dump_velocity, "write DIR/velocity_<k>.npy per step (in --noise's layout) and DIR/timesteps.json");
  c->add_flag("--dry-run", o.dry_run, "check every input, print the model shape and memory per rank; do not load the weights or sample");
  g_seed_opt = c->add_option("--seed", o.seed, "seed of the initial noise (not with --noise)")->capture_default_str();
  g_prompt_opt = c->add_option("--prompt", o.prompt, "prompt; hashed (FNV-1a) into the text conditioning (not with --text-embeddings)")->capture_default_str();
  c->add_option("--group-size", o.run.group_size, "ranks per group L sharing the fast link (0: the ranks of a node)")->capture_default_str();
  g_ulysses_opt = c->add_option("--ulysses-degree", o.ulysses_degree,
                                "USP: Ulysses over U consecutive ranks (must divide the heads); default: the largest "
                                "divisor of P that divides the heads");
  g_ring_opt = c->add_option("--ring-degree", o.ring_degree,
                             "USP: Ring attention across R = P / U Ulysses groups (U x R = P); default: P / U");
  c->add_option("--weights", o.weights, "the DiT's weights: FLUX.1 as BFL's checkpoint (a .safetensors file or a sharded set's index .json; F32/BF16/F16; names: dit/config.hpp; the model shape is read off it unless --config or --preset is given), or a diffusers folder of FLUX.1, Qwen-Image, FLUX.2, SD3.5 or Wan (a pipeline with model_index.json, or its transformer folder: config.json + diffusion_pytorch_model safetensors; the family and shape from config.json); default: seeded random init");
  c->add_option("--config", o.config, "model shape as FLUX's FluxParams JSON (in_channels, hidden_size, num_heads, depth, axes_dim, ...)");
  c->add_option("--weight-seed", o.weight_seed, "seed of the random init when no --weights is given")->capture_default_str();
  g_shape_opts.clear();
  g_shape_opts.push_back(c->add_option("--preset", o.preset, "model shape without --weights / --config: default | tiny")->capture_default_str());
  g_heads_opt = c->add_option("--heads", o.heads, "attention heads (default: the preset's, or read off --weights, which it must match)");
  g_shape_opts.push_back(c->add_option("--head-dim", o.head_dim, "head dimension (default: the preset's)"));
  g_shape_opts.push_back(c->add_option("--double-blocks", o.double_blocks, "double-stream blocks (default: the preset's)"));
  g_shape_opts.push_back(c->add_option("--single-blocks", o.single_blocks, "single-stream blocks (default: the preset's)"));
  g_shape_opts.push_back(c->add_option("--mlp-hidden", o.mlp_hidden, "MLP width (default: the preset's)"));
  c->add_option("--out", o.out, "PNG image to write (empty: none)")->capture_default_str();
  c->add_option("--save-latent", o.save_latent, "also write the final latent as .npy (in --noise's layout)");
  c->add_option("--reference", o.reference, "compare with this latent .npy (from --save-latent of a Flat run; an exact run "
                                            "is judged by bf16's tolerance, 2^-5 of the peak, and exits 2 beyond it)");
  c->add_option("--compare", o.compare, "compare with a flat reference run in the same job: flat (flat Ulysses over the same ranks where P divides "
                "the heads and this run is not that, else the one-rank run; refused for flat on one rank)");
  c->add_option("--weights-dtype", o.run.weights_dtype, "the Linear weights' dtype in memory: f32 | bf16 (GEMMs then read "
                "them as bf16, f32 accumulation) | auto (bf16 when the file stores them in BF16, f32 otherwise)")
      ->capture_default_str();
  c->add_flag("--cfg-parallel", o.run.cfg_parallel, "classifier-free guidance's two passes at once on two halves of the ranks "
              "(ranks [0, P/2): the prompt's, [P/2, P): the negative prompt's; each half runs --mode over its P/2 ranks, "
              "the velocities meet by one all-gather per step); needs an even P and a run with a negative pass");
  c->add_option("--step-cache", o.run.step_cache, "step caching: none | fbcache:THRESHOLD (First-Block Cache: the rest of the "
                "blocks are skipped on steps where the first block's residual changed by less than THRESHOLD, relative L1, "
                "since the last full step; 0 never skips)")->capture_default_str();
  c->add_flag("--shard-weights", o.run.shard_weights, "each rank holds 1/P of every block's weights; a block's are all-gathered "
              "just before it runs, the next one's gather in flight (dit/weights.hpp)");
  c->add_option("--dtype", o.run.dtype, "compute: f32 | bf16 (GEMMs, attention, the exchanges' payloads, V-Major's caches "
                                    "and Ring's K|V in bf16, f32 accumulation; latents and norms f32). PSNR against "
                                    "f32: --save-latent of an f32 run, then --reference")
      ->capture_default_str();
  c->add_option("--wire", o.run.wire, "the exchanges' payload: auto (the --dtype) | fp8 (e4m3 with one f32 scale per "
                                  "(token, head): half of bf16's payload bytes; decoded into --dtype before attention; "
                                  "Ring's K|V and V-Major's sends and caches too; judged by PSNR / SSIM, not a tolerance)")
      ->capture_default_str();
  c->add_flag("--json", o.json, "print one JSON object");
  c->add_flag("--no-pack-weights", o.no_pack_weights, "bf16 GEMMs: no packed copy of the weights (about 2 bytes per weight "
              "element less; the same results; slower: the layout is made per call; dit/weights.hpp packed)");
  c->add_flag("--profile", o.run.profile, "time each op family of the step (dit/profile.hpp): profile_ms_per_step in the report, "
              "the slowest rank's per family, over the steps after the first (the warm-up)");
}

namespace {

// Everything a run needs, resolved and checked identically on every rank before any
// communication: the checkpoint's header, the model shape, the run config and the generation
// (dit/session.hpp), the input and reference files, --compare's reference run.
struct DitPlan {
  std::unique_ptr<SafeTensorsSet> ck;
  DitFileFormat format = DitFileFormat::bfl;  // of ck's names
  std::string scheduler_config;               // a diffusers pipeline's scheduler/scheduler_config.json
  DitConfig cfg;
  std::optional<DitRunConfig> run_config;
  DitGeneration g;
  std::vector<float> noise;                    // --noise's, packed; empty: seeded
  std::optional<DitReferenceRun> compare_ref;  // --compare flat
  std::vector<float> reference;                // --reference's latent
  const DitRunConfig& run() const { return *run_config; }
};

DitPlan plan_dit(Communicator& world, DitOptions& o) {
  DitPlan pl;
  DIFFCP_CHECK(o.compare.empty() || o.compare == "flat", "--compare '", o.compare, "': only flat is supported");
  DIFFCP_CHECK(o.compare.empty() || o.reference.empty(), "--compare and --reference: give one of them");
  o.run.ulysses_degree = given(g_ulysses_opt, o.ulysses_degree);
  o.run.ring_degree = given(g_ring_opt, o.ring_degree);
  o.run.guidance = given(g_guidance_opt, o.guidance);
  o.run.pack_weights = !o.no_pack_weights;
  std::optional<DitConfig> folder_cfg;  // a diffusers folder's config.json
  if (!o.weights.empty() && is_directory(o.weights)) {  // a diffusers pipeline or transformer folder
    DiffusersTransformer t = open_diffusers_transformer(o.weights);
    pl.ck = std::make_unique<SafeTensorsSet>(t.weights);
    pl.format = DitFileFormat::diffusers;
    folder_cfg = t.config;
    pl.scheduler_config = t.scheduler_config;
  } else if (!o.weights.empty()) {
    pl.ck = std::make_unique<SafeTensorsSet>(o.weights);
  }
  pl.cfg = resolve_config(o, pl.ck.get(), folder_cfg);
  DIFFCP_CHECK(o.dry_run || (pl.cfg.condition_channels == 0 && pl.cfg.image_dim == 0), "--weights '", o.weights,
               "' is a Wan image-to-video transformer (in_channels ", pl.cfg.embed_in_channels() / 4, " = the latent's ",
               pl.cfg.latent_channels, " + the condition's ", pl.cfg.condition_channels,
               pl.cfg.image_dim > 0 ? ", a CLIP image context of " + std::to_string(pl.cfg.image_dim) + " features" : std::string(),
               "): its condition comes from the image through the VAE encoder",
               pl.cfg.image_dim > 0 ? " and CLIP" : "", ", which `diffcp dit` does not run; use ",
               "diffcp.diffusers.parallelize(WanImageToVideoPipeline) (docs/python.md), or --dry-run for its shape");
  pl.run_config.emplace(o.run, pl.cfg, world.size(), world.rank(), pl.ck.get(), pl.format);
  DitInputs in = read_inputs(o, pl.cfg);
  pl.g = plan_generation(pl.run(), in.shape, std::move(in.cond), pl.scheduler_config);
  if (pl.cfg.accepts_negative()) {  // the scale as plan_generation resolved it (the family's default)
    const char* flag = pl.cfg.family == DitFamily::flux1 ? "--true-cfg-scale" : "--guidance";
    DIFFCP_CHECK(cfg_scale(pl.cfg, pl.g.opt) > 1 || o.negative_text_embeddings.empty(), "--negative-text-embeddings is read ",
                 "only with ", flag, " > 1 (classifier-free guidance); ", flag, " is ", cfg_scale(pl.cfg, pl.g.opt));
  }
  pl.noise = std::move(in.noise);
  // --compare flat: a genuine reference, never this run's own configuration (refused where none).
  if (!o.compare.empty())
    pl.compare_ref = flat_reference_for(pl.run().mode, pl.run().deg, world.size(), pl.cfg.heads, o.run.cfg_parallel);
  if (!o.reference.empty()) {
    std::vector<std::int64_t> s;
    const std::vector<std::int64_t> want = latent_file_shape(pl.cfg, pl.g.shape);
    const std::string legend = shape_str(want) + " (--save-latent's layout)";
    pl.reference = read_input(o.reference, "--reference", s, {want}, legend.c_str());
    if (pl.cfg.latent_image_layout()) pl.reference = pack_latent(pl.reference, pl.cfg, pl.g.shape);
  }
  return pl;
}

void print_dry_run(Communicator& world, const DitOptions& o, const DitPlan& pl) {
  if (world.rank() != 0) return;
  const DitShape& shape = pl.g.shape;
  const DitRunConfig& run = pl.run();
  const DitMemory mem = dit_memory_per_rank(pl.cfg, shape, pl.g.shard, run.storage, run.weight_shards, run.compute, o.run.pack_weights);
  const nlohmann::ordered_json j{{"dry_run", true}, {"config", pl.cfg.to_json()},
                                 {"flux_params", pl.cfg.family == DitFamily::flux1 ? pl.cfg.to_flux_params() : nlohmann::json(nullptr)},
                                 {"parameters", DitLayout(pl.cfg).parameters}, {"weights", o.weights.empty() ? "random" : o.weights},
                                 {"weights_dtype", dtype_name(run.storage)}, {"shard_weights", o.run.shard_weights},
                                 {"weights_bytes_per_rank", mem.weight_bytes}, {"activation_bytes_per_rank", mem.activation_bytes},
                                 {"weight_gather_bytes_per_forward", dit_gather_bytes(DitLayout(pl.cfg), run.storage, run.weight_shards)},
                                 {"P", world.size()}, {"ulysses_degree", run.deg.ulysses}, {"ring_degree", run.deg.ring},
                                 {"width", shape.width}, {"height", shape.height}, {"batch", shape.batch},
                                 {"frames", shape.frames}, {"image_tokens", shape.image_tokens()}, {"text_tokens", shape.text_tokens},
                                 {"schedule", pl.g.schedule_name}, {"timesteps", pl.g.opt.timesteps},
                                 {"model_timesteps", model_timesteps(pl.g.opt)}};
  std::printf("%s\n", o.json ? j.dump().c_str() : j.dump(1).c_str());
}

// The report (dit/session.hpp DitReport) as JSON; the keys print in the documented order (docs/dit.md).
nlohmann::ordered_json report_json(const DitOptions& o, const DitPlan& pl, const DitReport& r, const DitWeights& w) {
  const DitShape& shape = pl.g.shape;
  const DitRunConfig& run = pl.run();
  const auto num = [](double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
  nlohmann::ordered_json rel_l1 = nlohmann::ordered_json::array();  // NaN -> null
  for (const double v : r.rel_l1) rel_l1.push_back(num(v));
  const bool cocodiff = run.mode == ExchangeMode::cocodiff;
  nlohmann::ordered_json j{
      {"mode", exchange_mode_name(run.mode)},
      {"P", r.P},
      {"group_size", r.group_size},
      {"steps", r.steps},
      {"step_ms", r.step_ms},
      {"bytes_intra_group", r.bytes_intra},
      {"bytes_inter_group", r.bytes_inter},
      {"messages", r.messages},
      {"cache_bytes_per_rank", static_cast<std::uint64_t>(r.cache_bytes)},
      {"exposed_comm_ms", r.exposed_comm_ms},
      {"mean_exposed_comm_ms", r.mean_exposed_comm_ms},
      {"v_wait_ms", r.v_wait_ms},
      {"v_phase1_hidden", r.v_phase1_hidden},
      {"ulysses_degree", run.deg.ulysses},
      {"ring_degree", run.deg.ring},
      {"ring_bytes", r.ring_bytes},
      {"predicted_ring_bytes", r.predicted.ring},
      {"wire", wire_name(run.wire)},
      {"scale_bytes", r.scale_bytes},
      {"predicted_scale_bytes", r.predicted.scales},
      {"predicted_bytes_inter_group", r.predicted.inter},
      {"tapa_bytes_inter_group", r.predicted.tapa_inter},
      {"predicted_inter_ratio_vs_tapa", r.predicted.inter_ratio()},
      {"measured_inter_ratio_vs_tapa", r.bytes_inter > 0 ? r.predicted.tapa_inter / r.bytes_inter : 1.0},
      {"predicted_qkv_inter_ratio_vs_tapa", r.predicted.qkv_ratio()},
      {"cache_schedule", cocodiff ? cache_schedule_name(run.schedule.kind) : "none"},
      {"cache_ratio", run.schedule.ratio},
      {"warmup", run.schedule.warmup},
      {"sync_every", run.schedule.sync_every},
      {"total_ms", r.total_ms},
      {"resolution", shape.width == shape.height ? nlohmann::ordered_json(shape.width) : nlohmann::ordered_json(nullptr)},
      {"width", shape.width},
      {"height", shape.height},
      {"schedule", pl.g.schedule_name},
      {"guidance", pl.cfg.guidance_embed || pl.cfg.true_cfg() ? nlohmann::ordered_json(pl.g.opt.guidance) : nlohmann::ordered_json(nullptr)},
      {"family", dit_family_name(pl.cfg.family)},
      {"cfg_passes", r.cfg_passes},
      {"true_cfg_scale", pl.cfg.family == DitFamily::flux1 ? nlohmann::ordered_json(pl.g.opt.true_cfg_scale) : nlohmann::ordered_json(nullptr)},
      {"cfg_parallel", o.run.cfg_parallel},
      {"cfg_pair_bytes", r.cfg_pair_bytes},
      {"predicted_cfg_pair_bytes", r.predicted_cfg_pair_bytes},
      {"step_cache", run.step_cache.name()},
      {"steps_computed", r.steps_computed},
      {"steps_cached", r.steps_cached},
      {"step_cache_rel_l1", rel_l1},
      {"batch", shape.batch},
      {"frames", shape.frames},
      {"image_tokens", shape.image_tokens()},
      {"text_tokens", shape.text_tokens},
      {"weights", o.weights.empty() ? "random" : o.weights},
      {"dtype", o.run.dtype},
      {"weights_dtype", dtype_name(w.storage())},
      {"shard_weights", w.sharded()},
      {"weights_bytes_per_rank", static_cast<std::int64_t>(r.weights_bytes)},
      {"predicted_weights_bytes_per_rank", static_cast<std::int64_t>(r.predicted_weights_bytes)},
      {"weight_gather_bytes", r.weight_gather_bytes},
      {"predicted_weight_gather_bytes", r.predicted_weight_gather_bytes},
      {"weight_gather_wait_ms", r.weight_gather_wait_ms},
      {"peak_rss_bytes", r.peak_rss_bytes},
      {"parameters", DitLayout(pl.cfg).parameters},
      {"config", pl.cfg.to_json()},
      {"out", o.out}};
  if (!r.profile_ms.empty()) {  // per family: the slowest rank's time per denoising step after the first
    nlohmann::ordered_json per_step;
    for (std::size_t i = 0; i < r.profile_ms.size(); ++i) per_step[std::string(kDitPhaseNames[i])] = r.profile_ms[i];
    j["profile_ms_per_step"] = per_step;
  }
  return j;
}

// --compare flat / --reference: the reference latent (sampled here, or the file's), the
// comparison into `j`; false when the latent check fails.
bool compare_with_reference(DitSession& session, const DitOptions& o, DitPlan& pl, const std::vector<float>& noise,
                            const DitRun& run, nlohmann::ordered_json& j) {
  Communicator& world = session.world();
  const DitRunConfig& rc = pl.run();
  std::vector<float> ref_latent;
  std::string reference_run = "the latent in " + o.reference;
  if (pl.compare_ref) {
    reference_run = pl.compare_ref->describe(world.size());
    ref_latent = session.sample_reference(pl.g, noise, pl.compare_ref->single_rank, pl.compare_ref->deg.ulysses).latent;
  } else {
    ref_latent = std::move(pl.reference);
  }
  // Lossy by design, as V-Major: the step cache skipping blocks, the fp8 wire (e4m3 keeps 3 mantissa
  // bits): judged by PSNR / SSIM.
  const bool skips = rc.step_cache.enabled && rc.step_cache.threshold > 0;
  const DitComparison c = compare_dit_latents(run.latent, ref_latent, pl.cfg, pl.g.shape,
                                              skips || rc.wire == Wire::fp8 ? std::nullopt
                                              : pl.compare_ref ? dit_check_tolerance(rc.mode, rc.schedule, rc.compute)
                                                               : dit_reference_file_tolerance(rc.mode, rc.schedule));
  // One verdict for the job: every rank compared the same gathered latents, but each sampled the
  // one-rank reference itself.
  std::vector<std::int32_t> pass{c.pass() ? 1 : 0};
  world.all_reduce<std::int32_t>(pass);
  const bool passed = pass[0] == world.size();
  // JSON has no infinity: identical images give "psnr": null (documented in docs/dit.md).
  j["psnr"] = std::isinf(c.psnr) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(c.psnr);
  j["ssim"] = c.ssim;
  j["mse"] = c.mse;
  j["max_abs_diff"] = c.max_abs_diff;
  j["compared_with"] = o.compare.empty() ? o.reference : "flat";
  j["reference_run"] = reference_run;
  if (c.tolerance) {
    add_check_json(j, passed, c.latent.max_abs, c.latent.max_rel, c.latent.worst_ratio, c.latent.mismatched, *c.tolerance,
                   "max(1, max|reference latent|)");
  } else {
    j["check_passed"] = nullptr;  // lossy by design (V-Major reuses stale rows): PSNR / SSIM only
    j["tolerance"] = nullptr;
  }
  return passed;
}

void print_text(const DitOptions& o, const DitPlan& pl, const nlohmann::ordered_json& j, int P, bool passed) {
  const DitShape& shape = pl.g.shape;
  const DitConfig& cfg = pl.cfg;
  std::printf("diffcp dit: mode %s, %s, P = %d in groups of L = %d, %lldx%lld (%lld image + %lld text tokens%s), batch %lld, %d steps (%s schedule)\n",
              exchange_mode_name(pl.run().mode),
              o.run.dtype == "bf16" ? ("bf16 GEMMs, attention and exchanges" + dtype_cost_note(o.run.dtype)).c_str() : "f32", P,
              j["group_size"].get<int>(), static_cast<long long>(shape.width), static_cast<long long>(shape.height),
              static_cast<long long>(shape.image_tokens()), static_cast<long long>(shape.text_tokens),
              cfg.cross_attention() ? (", " + std::to_string(shape.frames) + " latent frames; the text cross-attended on every rank").c_str() : "",
              static_cast<long long>(shape.batch), o.run.steps, pl.g.schedule_name.c_str());
  std::printf("  model: %s", dit_family_name(cfg.family));
  if (cfg.guidance_embed) std::printf(", distilled guidance %g", pl.g.opt.guidance);
  if (j["cfg_passes"].get<int>() == 2)
    std::printf(", classifier-free guidance %g: two passes a step (the negative prompt's: %lld text tokens)",
                cfg_scale(cfg, pl.g.opt), static_cast<long long>(pl.g.cond.negative_tokens));
  std::printf("\n");
  if (o.weights.empty()) {
    std::printf("  weights: RANDOM (seeded init, --weight-seed %llu; no --weights given)\n",
                static_cast<unsigned long long>(o.weight_seed));
  } else {
    const DitMemory mem = dit_memory_per_rank(cfg, shape, pl.g.shard, pl.run().storage, pl.run().weight_shards, pl.g.opt.compute, o.run.pack_weights);
    std::printf("  weights: %s (%lld parameters, %.2f GB %s per rank%s; activations %.2f GB per rank)\n", o.weights.c_str(),
                static_cast<long long>(j["parameters"].get<std::int64_t>()), mem.weight_bytes / 1e9, dtype_name(pl.run().storage),
                o.run.shard_weights ? ", sharded over the ranks" : " on every rank", mem.activation_bytes / 1e9);
  }
  std::printf("  step %.1f ms (median over steps, slowest rank), exposed communication %.2f ms/step, total %.2f s\n",
              j["step_ms"].get<double>(), j["exposed_comm_ms"].get<double>(), j["total_ms"].get<double>() / 1e3);
  std::printf("  per rank per step: %.0f bytes inside groups, %.0f bytes across groups, %.1f messages; cache %.0f bytes/rank\n",
              j["bytes_intra_group"].get<double>(), j["bytes_inter_group"].get<double>(), j["messages"].get<double>(),
              static_cast<double>(j["cache_bytes_per_rank"].get<std::uint64_t>()));
  if (pl.run().wire == Wire::fp8)
    std::printf("  fp8 wire (e4m3, one f32 scale per (token, head)): of those bytes %.0f are scales (%.0f predicted)\n",
                j["scale_bytes"].get<double>(), j["predicted_scale_bytes"].get<double>());
  if (pl.run().deg.ring > 1)
    std::printf("  USP: Ulysses degree U = %d x Ring degree R = %d; Ring's K|V %.0f bytes per rank per step (of the above), "
                "%.0f predicted\n",
                pl.run().deg.ulysses, pl.run().deg.ring, j["ring_bytes"].get<double>(), j["predicted_ring_bytes"].get<double>());
  if (pl.run().mode == ExchangeMode::vfirst || pl.run().mode == ExchangeMode::cocodiff)
    std::printf("  V-First: V phase 1 complete before the wait in %.0f%% of exchanges, blocked on it %.3f ms/step\n",
                100.0 * j["v_phase1_hidden"].get<double>(), j["v_wait_ms"].get<double>());
  if (pl.run().mode == ExchangeMode::cocodiff)
    std::printf("  V-Major (%s, r %.2f, warm-up %d, sync every %d): bytes across groups %.0f predicted, %.0f measured; "
                "TAPA/CoCoDiff %.3fx predicted, %.3fx measured (q|k|v phase 2 alone: %.3fx predicted)\n",
                cache_schedule_name(pl.run().schedule.kind), pl.run().schedule.ratio, pl.run().schedule.warmup, pl.run().schedule.sync_every,
                j["predicted_bytes_inter_group"].get<double>(), j["bytes_inter_group"].get<double>(),
                j["predicted_inter_ratio_vs_tapa"].get<double>(), j["measured_inter_ratio_vs_tapa"].get<double>(),
                j["predicted_qkv_inter_ratio_vs_tapa"].get<double>());
  if (o.run.cfg_parallel)
    std::printf("  CFG-parallel: the prompt's pass on ranks [0, %d), the negative's on [%d, %d), %d ranks each; velocities "
                "%.0f bytes per rank per step (%.0f predicted)\n",
                P / 2, P / 2, P, P / 2, j["cfg_pair_bytes"].get<double>(), j["predicted_cfg_pair_bytes"].get<double>());
  if (pl.g.opt.step_cache.enabled) {
    std::printf("  step cache %s: steps fully computed %s of %d (cached %s)\n", j["step_cache"].get<std::string>().c_str(),
                j["steps_computed"].dump().c_str(), o.run.steps, j["steps_cached"].dump().c_str());
  }
  if (o.run.shard_weights)
    std::printf("  sharded weights: %.0f bytes gathered per rank per step (%.0f predicted), blocked on a gather %.2f ms/step\n",
                j["weight_gather_bytes"].get<double>(), j["predicted_weight_gather_bytes"].get<double>(),
                j["weight_gather_wait_ms"].get<double>());
  if (!o.out.empty())
    std::printf("  image: %s (%lldx%lld, one pixel per latent pixel, latent->RGB map of dit/image.hpp%s)\n", o.out.c_str(),
                static_cast<long long>(shape.batch * shape.frames * shape.grid_w() * cfg.patch), static_cast<long long>(shape.grid_h() * cfg.patch),
                shape.frames > 1 ? "; the latent frames side by side" : "");
  if (!j.contains("psnr")) return;
  std::printf("  vs %s: PSNR %s dB, SSIM %.6f, MSE %.3g, max |latent diff| %.3g\n", j["reference_run"].get<std::string>().c_str(),
              j["psnr"].is_null() ? "inf (identical)" : std::to_string(j["psnr"].get<double>()).c_str(), j["ssim"].get<double>(),
              j["mse"].get<double>(), j["max_abs_diff"].get<double>());
  if (j["tolerance"].is_null()) {
    std::printf("  not judged by a tolerance: %s by design (PSNR / SSIM above say how close)\n",
                j["step_cache"].get<std::string>() != "none" && pl.g.opt.step_cache.threshold > 0 ? "the step cache skips blocks"
                : pl.run().wire == Wire::fp8 ? "the fp8 wire rounds q, k, v, o to e4m3"
                                       : "V-Major reuses stale rows");
    return;
  }
  std::printf("  latent check: worst error %.3g of its tolerance (atol %.3g x max(1, max|ref|) + rtol %.3g |ref|; <= 1 "
              "passes), %lld mismatches -> %s\n",
              j["max_tol_ratio"].is_null() ? INFINITY : j["max_tol_ratio"].get<double>(), j["tolerance"]["atol"].get<double>(),
              j["tolerance"]["rtol"].get<double>(), static_cast<long long>(j["mismatches"].get<std::int64_t>()),
              passed ? "PASSED" : "FAILED");
}

}  // namespace

int run_dit(Communicator& world) {
  DitOptions& o = g_opt;
  DitPlan pl = plan_dit(world, o);  // every refusal, on every rank, before any communication
  if (o.dry_run) {
    print_dry_run(world, o, pl);
    return 0;
  }
  const DitConfig& cfg = pl.cfg;
  const DitShape& shape = pl.g.shape;
  DitSession session(world, pl.run(), pl.ck.get(), pl.format, o.weight_seed);
  const std::vector<float> noise = pl.noise.empty() ? initial_noise(cfg, shape, o.seed) : pl.noise;
  pl.g.opt.on_velocity = velocity_dumper(world, session.pass_comm(), o, pl.g.schedule_name, cfg, shape, pl.g.shard, pl.g.opt);
  DitProfile profile;
  if (o.run.profile) pl.g.opt.profile = &profile;
  const DitRun run = session.sample(pl.g, noise);
  if (world.rank() == 0) {
    const std::int64_t side_h = shape.grid_h() * cfg.patch, side_w = shape.grid_w() * cfg.patch;
    if (!o.out.empty())
      write_png(o.out, tile_rgb8(latent_to_rgb(run.latent, cfg, shape), shape.batch * shape.frames, side_h, side_w).data(),
                shape.batch * shape.frames * side_w, side_h);  // a video's frames side by side
    if (!o.save_latent.empty()) write_latent(o.save_latent, run.latent, cfg, shape);
  }
  nlohmann::ordered_json j = report_json(o, pl, session.report(pl.g, run), session.weights());
  const bool passed = (o.compare.empty() && o.reference.empty()) || compare_with_reference(session, o, pl, noise, run, j);
  const int rc = passed ? 0 : 2;
  if (world.rank() != 0) return rc;
  if (o.json)
    std::printf("%s\n", j.dump().c_str());
  else
    print_text(o, pl, j, world.size(), passed);
  if (!o.json) print_host_syncs("dit", o.run.steps);
  return rc;
}

}  // namespace diffcp::cli
