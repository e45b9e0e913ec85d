#include "diffcp/drafter/config.hpp"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"

namespace diffcp {

void DrafterConfig::validate() const {
  DIFFCP_CHECK(vocab >= 2 && hidden >= 1 && target_layers >= 1 && layers >= 1 && ffn >= 1, "drafter: vocab = ", vocab,
               ", hidden = ", hidden, ", target_layers = ", target_layers, ", layers = ", layers, ", ffn = ", ffn,
               "; expected vocab >= 2 and the rest >= 1");
  DIFFCP_CHECK(block >= 2, "drafter: block = ", block, ", expected >= 2 (slot 0 is the anchor)");
  DIFFCP_CHECK(gamma > 0, "drafter: gamma = ", gamma, ", expected > 0");
  DIFFCP_CHECK(mask_token >= 0 && mask_token < vocab, "drafter: mask token ", mask_token, " outside [0, ", vocab, ")");
  DIFFCP_CHECK(target_layer_ids.empty() || static_cast<std::int64_t>(target_layer_ids.size()) == target_layers,
               "drafter: ", target_layer_ids.size(), " target layer ids for ", target_layers, " target layers (n_t)");
  for (std::int64_t id : target_layer_ids)
    DIFFCP_CHECK(id >= 0 && (target_depth == 0 || id < target_depth), "drafter: target layer id ", id, " outside [0, ",
                 target_depth, ") (the target's layers)");
  DIFFCP_CHECK(target_depth >= 0, "drafter: target depth ", target_depth, " < 0");
  DIFFCP_CHECK(layer_types.empty() || static_cast<std::int64_t>(layer_types.size()) == layers, "drafter: ",
               layer_types.size(), " layer types for ", layers, " layers");
  for (const std::string& t : layer_types)
    DIFFCP_CHECK(t == "full_attention" || t == "sliding_attention", "drafter: layer type '", t,
                 "', expected full_attention or sliding_attention");
  DIFFCP_CHECK(sliding_window >= 0 && sliding_window <= kMaxKeyWindow, "drafter: sliding window ", sliding_window,
               ", expected 1 .. 2^40 (or 0: none)");
  DIFFCP_CHECK(conv_taps >= 0 && (conv_taps == 0 || (conv_group_size >= 1 && hidden % conv_group_size == 0)),
               "drafter: conv_kernel_size ", conv_taps, ", conv_group_size ", conv_group_size, " for hidden ", hidden,
               "; expected a group size dividing hidden (or conv_kernel_size 0: no convolutions)");
  DIFFCP_CHECK(selector_rank >= 0 && (selector_rank == 0 || (selector_top_k >= 1 && selector_top_k <= vocab)),
               "drafter: selector_rank ", selector_rank, ", selector_top_k ", selector_top_k, " for a vocabulary of ", vocab,
               "; expected 1 <= selector_top_k <= vocab_size (or selector_rank 0: no selector)");
  DIFFCP_CHECK(output_multiplier > 0 && logit_softcap >= 0, "drafter: output_multiplier ", output_multiplier,
               ", final_logit_softcapping ", logit_softcap, "; expected > 0 and >= 0 (0: none)");
  attn().validate();
}

std::vector<KeyWindow> DrafterConfig::layer_windows() const {
  std::vector<KeyWindow> out;
  for (std::int64_t l = 0; l < layers; ++l) out.push_back(layer_window(l));
  return out;
}

std::vector<std::int64_t> default_target_layer_ids(std::int64_t depth, std::int64_t n_t) {
  DIFFCP_CHECK(n_t >= 1 && depth >= std::max<std::int64_t>(n_t, 4), "target layer ids: ", n_t, " of a ", depth,
               "-layer target; expected 1 <= n_t and depth >= max(n_t, 4)");
  if (n_t == 1) return {depth / 2};
  std::vector<std::int64_t> ids;
  for (std::int64_t i = 0; i < n_t; ++i)
    ids.push_back(std::llround(1.0 + static_cast<double>(i) * static_cast<double>(depth - 4) / static_cast<double>(n_t - 1)));
  return ids;
}

nlohmann::json DrafterConfig::to_json() const {
  nlohmann::json j = {{"vocab", vocab}, {"hidden", hidden}, {"target_layers", target_layers}, {"layers", layers}, {"n_q", n_q},
          {"n_kv", n_kv}, {"d_h", d_h}, {"ffn", ffn}, {"block", block}, {"gamma", gamma}, {"mask_token", mask_token},
          {"rope_theta", rope_theta}, {"rms_eps", rms_eps}, {"target_layer_ids", target_layer_ids},
          {"target_depth", target_depth}, {"layer_types", layer_types}, {"sliding_window", sliding_window},
          {"is_causal", is_causal ? nlohmann::json(*is_causal) : nlohmann::json()}};
  if (has_conv()) {  // absent for DFlash: its checkpoints' configs stay as they were
    j["conv_taps"] = conv_taps;
    j["conv_group_size"] = conv_group_size;
  }
  if (has_selector()) {
    j["selector_rank"] = selector_rank;
    j["selector_top_k"] = selector_top_k;
  }
  if (output_multiplier != 1.0) j["output_multiplier"] = output_multiplier;
  if (logit_softcap != 0.0) j["logit_softcap"] = logit_softcap;
  return j;
}

DrafterConfig DrafterConfig::from_json(const nlohmann::json& j) {
  DrafterConfig c;
  c.vocab = j.at("vocab");
  c.hidden = j.at("hidden");
  c.target_layers = j.at("target_layers");
  c.layers = j.at("layers");
  c.n_q = j.at("n_q");
  c.n_kv = j.at("n_kv");
  c.d_h = j.at("d_h");
  c.ffn = j.at("ffn");
  c.block = j.at("block");
  c.gamma = j.at("gamma");
  c.mask_token = j.at("mask_token");
  c.rope_theta = j.at("rope_theta");
  c.rms_eps = j.at("rms_eps");
  c.target_layer_ids = j.value("target_layer_ids", std::vector<std::int64_t>{});
  c.target_depth = j.value("target_depth", std::int64_t{0});
  c.layer_types = j.value("layer_types", std::vector<std::string>{});  // absent before issue #36: all full
  c.sliding_window = j.value("sliding_window", std::int64_t{0});
  if (j.contains("is_causal") && !j.at("is_causal").is_null()) c.is_causal = j.at("is_causal").get<bool>();
  c.conv_taps = j.value("conv_taps", std::int64_t{0});
  c.conv_group_size = j.value("conv_group_size", std::int64_t{0});
  c.selector_rank = j.value("selector_rank", std::int64_t{0});
  c.selector_top_k = j.value("selector_top_k", std::int64_t{0});
  c.output_multiplier = j.value("output_multiplier", 1.0);
  c.logit_softcap = j.value("logit_softcap", 0.0);
  c.validate();
  return c;
}

DrafterConfig drafter_preset(const std::string& name) {
  DrafterConfig c;
  if (name == "tiny") return c;
  if (name == "small") {  // a larger config for benchmarks: still synthetic-data sized
    c.vocab = 256;
    c.hidden = 512;
    c.layers = 4;
    c.n_q = 8;
    c.n_kv = 2;
    c.d_h = 64;
    c.ffn = 1536;
    c.target_layers = 3;
    c.block = 16;
    c.gamma = 7;
    c.mask_token = 255;
    c.target_layer_ids = {0, 1, 2};  // the synthetic target's layers
    c.target_depth = 3;
    return c;
  }
  if (name == "qwen3.5-35b-a3b" || name == "qwen3.5-27b") {
    const bool a3b = name == "qwen3.5-35b-a3b";
    c.vocab = 151936;
    c.hidden = a3b ? 2048 : 5120;
    c.layers = a3b ? 8 : 5;
    c.ffn = a3b ? 6144 : 17408;
    c.n_q = 32;
    c.n_kv = a3b ? 4 : 8;
    c.d_h = 128;
    c.target_layers = 5;
    c.block = 16;
    c.gamma = 7;
    c.mask_token = static_cast<std::int32_t>(c.vocab - 1);
    c.target_layer_ids = {};  // which layers of the real target: the shards' extraction decides
    c.target_depth = 0;
    return c;
  }
  // z-lab's Qwen3.8-27B-DFlash2 as issue #67 gives it (block 8, 5 sliding layers of 2048, 32 / 8
  // heads x 128); H, F and V those of the qwen3.5-27b preset's target family (1.9 B parameters,
  // the release's 3.85 GB in bf16)
  if (name == "qwen3.8-27b-dflash2") {
    c.vocab = 151936;
    c.hidden = 5120;
    c.layers = 5;
    c.ffn = 17408;
    c.n_q = 32;
    c.n_kv = 8;
    c.d_h = 128;
    c.target_layers = 5;
    c.block = 8;
    c.gamma = 4;  // SPEC A.1's decay for B = 8
    c.mask_token = static_cast<std::int32_t>(c.vocab - 1);
    c.target_layer_ids = {};
    c.target_depth = 0;
    c.layer_types.assign(5, "sliding_attention");
    c.sliding_window = 2048;
    c.is_causal = false;
    c.conv_taps = 2;
    c.conv_group_size = 16;
    c.selector_rank = 256;
    c.selector_top_k = 16;  // (a Qwen target's logits: no multiplier, no soft cap)
    return c;
  }
  DIFFCP_FAIL("unknown preset '", name, "', expected tiny, small, qwen3.5-35b-a3b, qwen3.5-27b or qwen3.8-27b-dflash2");
}

DrafterConfig as_dflash2(DrafterConfig c) {
  if (!c.has_conv()) {
    c.conv_taps = 2;
    c.conv_group_size = 16;
    while (c.hidden % c.conv_group_size != 0) --c.conv_group_size;
  }
  if (!c.has_selector()) {
    c.selector_rank = std::min<std::int64_t>(256, c.hidden);
    c.selector_top_k = std::max<std::int64_t>(1, std::min<std::int64_t>(16, c.vocab / 2));
  }
  c.validate();
  return c;
}

DrafterLayout::DrafterLayout(const DrafterConfig& c) {
  c.validate();
  const std::int64_t H = c.hidden, F = c.ffn;
  std::int64_t off = 0;
  auto take = [&](std::int64_t n, bool vector) {
    const std::int64_t at = off;
    off += n;
    if (vector) vectors.push_back({at, n});
    return at;
  };
  fc = take(c.target_layers * H * H, false);
  fc_norm = take(H, true);
  const auto attn_off = AttnLayerParams::offsets(c.attn());
  for (std::int64_t l = 0; l < c.layers; ++l) {
    Layer L{};
    L.attn_norm = take(H, true);
    L.attn = off;
    take(attn_off[AttnLayerParams::bo], false);                                             // wq, wk, wv, wo
    take(attn_off[AttnLayerParams::kCount] - attn_off[AttnLayerParams::bo], true);        // bo, q_norm, k_norm
    L.mlp_norm = take(H, true);
    L.w_gate = take(H * F, false);
    L.w_up = take(H * F, false);
    L.w_down = take(F * H, false);
    if (c.has_conv()) {  // the bases start as the identity (not decayed, as the norms); the projections are matrices
      const std::int64_t K = c.conv_taps, G = c.conv_groups();
      L.attn_conv_base = take(2 * K * H, true);
      L.attn_conv_proj = take(H * 2 * K * G, false);
      L.mlp_conv_base = take(2 * K * H, true);
      L.mlp_conv_proj = take(H * 2 * K * G, false);
    }
    layer.push_back(L);
  }
  final_norm = take(H, true);
  if (c.has_selector()) {  // in the final norm's unit (the last): the codebooks are embedding tables
    const std::int64_t r = c.selector_rank;
    sel_pred = take(c.vocab * r, false);
    sel_succ = take(c.vocab * r, false);
    sel_proj = take(H * r, false);
  }
  total = off;
  units.push_back({0, layer.empty() ? final_norm : layer[0].attn_norm});
  for (std::size_t l = 0; l < layer.size(); ++l) {
    const std::int64_t end = l + 1 < layer.size() ? layer[l + 1].attn_norm : final_norm;
    units.push_back({layer[l].attn_norm, end - layer[l].attn_norm});
  }
  units.push_back({final_norm, total - final_norm});
}

}  // namespace diffcp
