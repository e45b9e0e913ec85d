// `diffcp sim dit`: the DiT's denoising step under each attention exchange mode predicted on a
// profile's machine (sim/dit.hpp), for the model shape and run options `diffcp dit` takes.
#include <cstdio>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/sim.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/sim/dit.hpp"

namespace diffcp::cli {

namespace {
struct SimDitCli {
  SimMachineOptions machine;
  std::string mode = "all", preset = "default", config;
  std::int64_t heads = 0, head_dim = 0, double_blocks = -1, single_blocks = -1, mlp_hidden = 0;  // 0 / -1: the preset's
  std::int64_t frames = 1;
  std::int64_t resolution = 512, width = 0, height = 0, batch = 1, text_tokens = 64;        // width / height 0: --resolution
  int steps = 50, group_size = 0;
  std::string cache_schedule = "linear";
  double cache_ratio = 1.0;
  int warmup = 5, sync_every = 10;
  bool cfg = false, cfg_parallel = false;
  std::string wire = "auto";
  double cached_fraction = 0;
};
SimDitCli g_dit;

std::vector<std::string> mode_list(const std::string& text) {
  if (text == "all") return {"flat", "tapa", "vfirst", "cocodiff"};
  std::vector<std::string> out;
  std::set<std::string> seen;
  std::stringstream ss(text);
  for (std::string name; std::getline(ss, name, ',');) {
    DIFFCP_CHECK(!name.empty() && seen.insert(name).second, "--mode = '", text, "': empty or repeated mode name");
    parse_exchange_mode(name);  // throws naming the modes
    out.push_back(name);
  }
  DIFFCP_CHECK(!out.empty(), "--mode = '", text, "': expected all or a comma list of flat, tapa, vfirst, cocodiff");
  return out;
}

// The model shape: --config (FluxParams JSON, or a diffusers transformer's config.json: its
// `_class_name`), else the preset with its overrides (as `diffcp dit`).
DitConfig make_config(const SimDitCli& o) {
  if (!o.config.empty()) {
    const nlohmann::json j = read_json_file(o.config, "--config");
    if (j.is_object() && j.contains("_class_name")) return dit_config_from_diffusers(j, o.config);
    return read_dit_config(o.config);
  }
  return dit_preset(o.preset, {o.heads, o.head_dim, o.double_blocks, o.single_blocks, o.mlp_hidden});
}
}  // namespace

void add_sim_dit(CLI::App* sim) {
  SimDitCli& o = g_dit;
  CLI::App* c = sim->add_subcommand("dit", "Predict the DiT's denoising step (flat, TAPA, V-First, CoCoDiff exchanges) "
                                           "on P ranks of a profile");
  add_sim_machine_options(c, o.machine);
  c->add_option("--mode", o.mode, "all | a comma list of flat, tapa, vfirst, cocodiff")->capture_default_str();
  c->add_option("--preset", o.preset, "model shape: default | tiny")->capture_default_str();
  c->add_option("--config", o.config, "model shape as FLUX's FluxParams JSON or a diffusers transformer config.json "
                                      "(e.g. WanTransformer3DModel's; instead of --preset)");
  c->add_option("--frames", o.frames, "latent frames of a video (wan)")->check(CLI::Range(1, 65536))->capture_default_str();
  c->add_option("--heads", o.heads, "attention heads (default: the preset's)");
  c->add_option("--head-dim", o.head_dim, "head dimension (default: the preset's)");
  c->add_option("--double-blocks", o.double_blocks, "double-stream blocks (default: the preset's)");
  c->add_option("--single-blocks", o.single_blocks, "single-stream blocks (default: the preset's)");
  c->add_option("--mlp-hidden", o.mlp_hidden, "MLP width (default: the preset's)");
  c->add_option("--resolution", o.resolution, "image side in pixels, a multiple of 16")->capture_default_str();
  c->add_option("--width", o.width, "image width in pixels (default: --resolution)")->check(CLI::PositiveNumber);
  c->add_option("--height", o.height, "image height in pixels (default: --resolution)")->check(CLI::PositiveNumber);
  c->add_option("--batch", o.batch, "images generated together")->capture_default_str();
  c->add_option("--text-tokens", o.text_tokens, "text tokens T")->capture_default_str();
  c->add_option("--steps", o.steps, "denoising steps")->capture_default_str();
  c->add_option("--cache-schedule", o.cache_schedule, "cocodiff: linear | fixed")->capture_default_str();
  c->add_option("--cache-ratio", o.cache_ratio, "cocodiff: cache ratio r in [0, 1] (fixed: every selective step; linear: the last step's)")->capture_default_str();
  c->add_option("--warmup", o.warmup, "cocodiff: full-exchange steps at the start")->capture_default_str();
  c->add_option("--sync-every", o.sync_every, "cocodiff: a full exchange every this many steps (0: never)")->capture_default_str();
  c->add_option("--group-size", o.group_size, "TAPA's group L (0: the ranks of a node)")->capture_default_str();
  c->add_option("--wire", o.wire, "the exchanges' payload: auto (f32) | fp8 (e4m3 + one f32 scale per (token, head))")
      ->capture_default_str();
  c->add_flag("--cfg", o.cfg, "classifier-free guidance: two transformer passes a step");
  c->add_flag("--cfg-parallel", o.cfg_parallel, "the two passes at once on two halves of the ranks (with --cfg; an even P)");
  c->add_option("--cached-fraction", o.cached_fraction, "First-Block Cache: the fraction of the steps after the first that run "
                "only the first block (a run's steps_cached / (steps - 1))")->capture_default_str();
}

int run_sim_dit() {
  const SimDitCli& o = g_dit;
  const SimMachine m = make_sim_machine(o.machine);
  const DitConfig cfg = make_config(o);
  const DitShape shape{o.batch, o.width > 0 ? o.width : o.resolution, o.height > 0 ? o.height : o.resolution, o.text_tokens,
                       o.frames};
  SimDitOptions opt;
  opt.modes = mode_list(o.mode);
  opt.group_size = o.group_size;
  opt.steps = o.steps;
  opt.schedule = {parse_cache_schedule(o.cache_schedule), o.cache_ratio, o.warmup, o.sync_every};
  opt.cfg = o.cfg;
  opt.wire = parse_wire(o.wire);
  opt.cfg_parallel = o.cfg_parallel;
  opt.cached_fraction = o.cached_fraction;
  warn_profile_fit(m, cfg.heads, cfg.heads, cfg.head_dim);
  const std::vector<SimDitResult> rows = simulate_dit(m, cfg, shape, opt);

  nlohmann::ordered_json arr = nlohmann::ordered_json::array();
  for (const SimDitResult& r : rows) {
    nlohmann::ordered_json j{{"mode", r.mode},         {"P", r.P},         {"profile", m.profile.name},
                             {"ranks_per_node", m.R},  {"group_size", r.L}, {"supported", r.supported()},
                             {"reason", r.reason},     {"steps", r.steps},
                             {"cfg", o.cfg},           {"cfg_parallel", o.cfg_parallel}, {"cached_fraction", o.cached_fraction},
                             {"wire", o.wire}};
    if (r.supported())
      j.update(nlohmann::ordered_json{{"step_ms", r.step_ms}, {"total_ms", r.total_ms}, {"compute_ms", r.compute_ms},
                                      {"exposed_comm_ms", r.exposed_comm_ms}, {"comm_ms", r.comm_ms},
                                      {"bytes_intra_group", r.bytes_intra_group}, {"bytes_inter_group", r.bytes_inter_group},
                                      {"messages_inter_group", r.messages_inter_group}});
    arr.push_back(j);
  }
  if (o.machine.json) {
    std::printf("%s\n", arr.dump().c_str());
    return 0;
  }
  std::printf("diffcp sim dit: profile %s, P = %d (%d per node, %d nodes), %lldx%lld x %lld images x %lld frames, N = %lld tokens, "
              "%lld heads x %lld, %lld + %lld blocks, %d steps (cache: %s r = %g, warm-up %d, sync every %d)\n",
              m.profile.name.c_str(), m.P, m.R, m.nodes(), static_cast<long long>(shape.width),
              static_cast<long long>(shape.height), static_cast<long long>(shape.batch), static_cast<long long>(shape.frames),
              static_cast<long long>(cfg.cross_attention() ? shape.image_tokens() : shape.tokens()), static_cast<long long>(cfg.heads),
              static_cast<long long>(cfg.head_dim), static_cast<long long>(cfg.double_blocks),
              static_cast<long long>(cfg.single_blocks), o.steps, o.cache_schedule.c_str(), o.cache_ratio, o.warmup,
              o.sync_every);
  std::printf("  %-9s %3s %10s %11s %10s %10s %13s %13s\n", "mode", "L", "step_ms", "total_ms", "compute", "exposed",
              "intra B/step", "inter B/step");
  for (const SimDitResult& r : rows) {
    if (!r.supported()) {
      std::printf("  %-9s unsupported: %s\n", r.mode.c_str(), r.reason.c_str());
      continue;
    }
    std::printf("  %-9s %3d %10.3f %11.3f %10.3f %10.3f %13.4g %13.4g\n", r.mode.c_str(), r.L, r.step_ms, r.total_ms,
                r.compute_ms, r.exposed_comm_ms, r.bytes_intra_group, r.bytes_inter_group);
  }
  return 0;
}

}  // namespace diffcp::cli
