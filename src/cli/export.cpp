// `diffcp export`: a training checkpoint -> the DFlash drafter format (drafter/hf_format.hpp) that
// SGLang and transformers load. Needs no MPI.
#include <cstdio>
#include <sstream>

#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/hf_format.hpp"

namespace diffcp::cli {

void add_export_command(CLI::App& app, ExportOptions& opt) {
  CLI::App* c = app.add_subcommand("export", "Write a trained drafter in the DFlash format (config.json + model.safetensors)");
  c->add_option("--checkpoint", opt.checkpoint, "training checkpoint (DIR/checkpoint.bin of diffcp train)")->required();
  c->add_option("--out", opt.out, "output directory")->required();
  c->add_option("--dtype", opt.dtype, "f32 | bf16 (round to nearest even)")->capture_default_str();
  c->add_option("--target-layer-ids", opt.target_layer_ids,
                "comma list: which target layers the training shards' hidden states came from (default: the checkpoint's)");
  c->add_option("--num-target-layers", opt.num_target_layers, "the target model's depth (default: the checkpoint's)");
  c->add_option("--max-positions", opt.max_positions, "config.json's max_position_embeddings: the longest context the "
                                                      "serving engine may give the drafter (the target's)")
      ->capture_default_str();
}

int run_export(const ExportOptions& opt) {
  const Checkpoint ck = load_checkpoint(opt.checkpoint);
  DrafterConfig cfg;
  std::int64_t step = 0;
  try {
    cfg = DrafterConfig::from_json(ck.meta.at("config"));
    step = ck.meta.at("step").get<std::int64_t>();
  } catch (const nlohmann::json::exception& e) {
    DIFFCP_FAIL("checkpoint '", opt.checkpoint, "': header field missing or of the wrong type: ", e.what());
  }
  if (!opt.target_layer_ids.empty()) {
    cfg.target_layer_ids.clear();
    std::stringstream ss(opt.target_layer_ids);
    for (std::string item; std::getline(ss, item, ',');) cfg.target_layer_ids.push_back(parse_count(item, "--target-layer-ids"));
  }
  if (opt.num_target_layers > 0) cfg.target_depth = opt.num_target_layers;
  cfg.validate();
  export_dflash(opt.out, cfg, ck.params, opt.dtype, opt.max_positions);
  std::printf("diffcp export: %s (step %lld) -> %s/config.json + model.safetensors (%s, %lld layers, hidden %lld, "
              "target layers %s of %lld)\n",
              opt.checkpoint.c_str(), static_cast<long long>(step), opt.out.c_str(),
              opt.dtype.c_str(), static_cast<long long>(cfg.layers), static_cast<long long>(cfg.hidden),
              nlohmann::json(cfg.target_layer_ids).dump().c_str(), static_cast<long long>(cfg.target_depth));
  return 0;
}

}  // namespace diffcp::cli
