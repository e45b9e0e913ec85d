// `diffcp draft`: one draft block of a DFlash drafter directory, as a serving engine runs it
// (drafter/draft.hpp), with Split-KV over the context across the mpirun ranks; with --draft-cache
// from a draft KV cache that holds the context (drafter/draft_cache.hpp), as a decoding loop does.
#include <chrono>
#include <cstdio>

#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/drafter/draft.hpp"
#include "diffcp/drafter/draft_cache.hpp"
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
  c->add_flag("--draft-cache", opt.draft_cache,
              "append the context to a draft KV cache once (timed apart), then time the block's draft from it "
              "(the cache's chunks of 256 positions round-robin over the ranks; --balancer does not apply)");
}

namespace {
// The slowest rank's milliseconds of f().
template <typename F>
double timed_ms(Communicator& world, F&& f) {
  world.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  std::vector<double> t{std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()};
  world.all_reduce<double>(t, ReduceOp::max);
  return t[0];
}
}  // namespace

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
  std::vector<float> out;
  std::vector<double> ms;
  double append_ms = 0;
  if (opt.draft_cache) {
    DraftCache cache(world, cfg, w.params);
    append_ms = timed_ms(world, [&] { cache.append(hidden); });
    out = cache.draft(noise);  // warm-up
    for (int r = 0; r < opt.reps; ++r) ms.push_back(timed_ms(world, [&] { out = cache.draft(noise); }));
  } else {
    out = draft_block(world, cfg, w.params, hidden, hs[0], noise, opt.balancer);  // warm-up
    for (int r = 0; r < opt.reps; ++r)
      ms.push_back(timed_ms(world, [&] { out = draft_block(world, cfg, w.params, hidden, hs[0], noise, opt.balancer); }));
  }
  if (world.rank() == 0) {
    write_npy(opt.out, out.data(), {cfg.block, cfg.hidden});
    std::printf("diffcp draft: context %lld positions over %d rank(s), block %lld -> %s [%lld, %lld], %.2f ms (median of %d, ",
                static_cast<long long>(hs[0]), world.size(), static_cast<long long>(cfg.block), opt.out.c_str(),
                static_cast<long long>(cfg.block), static_cast<long long>(cfg.hidden), median(ms), opt.reps);
    if (opt.draft_cache)
      std::printf("from the draft cache; appending the context to it took %.2f ms)\n", append_ms);
    else
      std::printf("model set-up included)\n");
  }
  return 0;
}

}  // namespace diffcp::cli
