// `diffcp draft`: one draft block of a DFlash drafter directory, as a serving engine runs it
// (drafter/draft.hpp), with Split-KV over the context across the mpirun ranks.
#include <chrono>
#include <cstdio>

#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/drafter/draft.hpp"
#include "diffcp/drafter/hf_format.hpp"
#include "diffcp/io/npy.hpp"

namespace diffcp::cli {

void add_draft_command(CLI::App& app, DraftOptions& opt) {
  CLI::App* c = app.add_subcommand("draft", "Run one draft block of a DFlash drafter (Split-KV over the context across ranks)");
  c->add_option("--model", opt.model, "drafter directory (config.json + model.safetensors)")->required();
  c->add_option("--target-hidden", opt.target_hidden, ".npy [ctx, n_t*H]: the target's hidden states of positions [0, ctx)")->required();
  c->add_option("--noise-embedding", opt.noise, ".npy [B, H]: the block's input embeddings (last verified token, then masks)")->required();
  c->add_option("--out", opt.out, ".npy [B, H]: the final normed hidden states (before the target's LM head)")->required();
  c->add_option("--balancer", opt.balancer, "context layout over the ranks: none | zigzag | lpt | partition")->capture_default_str();
  c->add_option("--reps", opt.reps, "timed repetitions after one warm-up (median reported)")->capture_default_str();
}

int run_draft(Communicator& world, const DraftOptions& opt) {
  const DrafterWeights w = import_dflash(opt.model);
  const DrafterConfig& cfg = w.config;
  std::vector<std::int64_t> hs, es;
  const std::vector<float> hidden = read_npy_f32(opt.target_hidden, hs);
  const std::vector<float> noise = read_npy_f32(opt.noise, es);
  DIFFCP_CHECK(hs.size() == 2 && hs[1] == cfg.target_layers * cfg.hidden, "--target-hidden '", opt.target_hidden,
               "': shape ", nlohmann::json(hs).dump(), ", expected [ctx, n_t*H] with n_t*H = ", cfg.target_layers,
               " * ", cfg.hidden, " (the model's target_layer_ids x hidden_size)");
  DIFFCP_CHECK(es.size() == 2 && es[0] == cfg.block && es[1] == cfg.hidden, "--noise-embedding '", opt.noise, "': shape ",
               nlohmann::json(es).dump(), ", expected [B, H] = [", cfg.block, ", ", cfg.hidden, "]");
  DIFFCP_CHECK(opt.reps >= 1, "--reps = ", opt.reps, ", expected >= 1");
  std::vector<float> out = draft_block(world, cfg, w.params, hidden, hs[0], noise, opt.balancer);  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < opt.reps; ++r) {
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    out = draft_block(world, cfg, w.params, hidden, hs[0], noise, opt.balancer);
    std::vector<double> t{std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()};
    world.all_reduce<double>(t, ReduceOp::max);  // the slowest rank
    ms.push_back(t[0]);
  }
  if (world.rank() == 0) {
    write_npy(opt.out, out.data(), {cfg.block, cfg.hidden});
    std::printf("diffcp draft: context %lld positions over %d rank(s), block %lld -> %s [%lld, %lld], %.2f ms (median of %d, "
                "model set-up included)\n",
                static_cast<long long>(hs[0]), world.size(), static_cast<long long>(cfg.block), opt.out.c_str(),
                static_cast<long long>(cfg.block), static_cast<long long>(cfg.hidden), median(ms), opt.reps);
  }
  return 0;
}

}  // namespace diffcp::cli
