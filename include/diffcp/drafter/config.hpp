// The DFlash drafter (SPEC A.1): configuration, named presets, and the parameter layout.
//
// Legend: V vocab, H hidden, n_t target layers whose hidden states feed the context fusion,
//         L drafter layers, F SwiGLU width, B block size, gamma loss decay.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "diffcp/cp/attention_layer.hpp"

namespace diffcp {

struct DrafterConfig {
  std::int64_t vocab = 64, hidden = 64, target_layers = 2, layers = 2;
  std::int64_t n_q = 4, n_kv = 2, d_h = 16, ffn = 128;
  std::int64_t block = 8;
  double gamma = 4.0;  // 7 for B = 16, 5 for 10, 4 for 8 (SPEC A.1)
  std::int32_t mask_token = 63;
  double rope_theta = 1e6, rms_eps = 1e-6;
  // Which layers of the target the n_t = target_layers context features come from, in feature
  // order (the DFlash format's dflash_config.target_layer_ids), and how many layers the target
  // has (its num_target_layers). Empty / 0 = not known (the real presets: their shards say).
  std::vector<std::int64_t> target_layer_ids = {0, 1};
  std::int64_t target_depth = 2;
  // Each layer's kind, as z-lab's DFlashDraftModel reads config.layer_types: "full_attention" or
  // "sliding_attention" ([layers]; empty = every layer full). sliding_window: the window of the
  // sliding layers as Qwen3Config resolves it (config.sliding_window when use_sliding_window,
  // else none = 0). is_causal: config.is_causal when the file sets it (then every layer is causal
  // or not); unset, sliding layers are causal and full ones are not. layer_window() turns these
  // into the layer's KeyWindow (attention/mask.hpp).
  std::vector<std::string> layer_types;
  std::int64_t sliding_window = 0;
  std::optional<bool> is_causal;
  // DFlash2 (issue #67): each layer's grouped dynamic causal convolutions before and after its
  // attention and its MLP (ops/conv.hpp; z-lab's attention_conv / mlp_conv): conv_taps K
  // (dflash_config.conv_kernel_size) and conv_group_size channels per group (G = H / it); conv_taps
  // = 0: none (DFlash).
  std::int64_t conv_taps = 0, conv_group_size = 0;
  // DFlash2's candidate selector (z-lab's CandidateSelector: predecessor / successor codebooks
  // [V, r], hidden_projection H -> r) and the logits it scores (x output_multiplier, then tanh
  // soft-capping at logit_softcap; 0: none). selector_rank = 0: none (drafter/selector.hpp).
  std::int64_t selector_rank = 0, selector_top_k = 0;
  double output_multiplier = 1.0, logit_softcap = 0.0;
  bool has_conv() const { return conv_taps > 0; }
  bool has_selector() const { return selector_rank > 0; }
  std::int64_t conv_groups() const { return has_conv() ? hidden / conv_group_size : 0; }

  void validate() const;
  bool sliding(std::int64_t l) const { return !layer_types.empty() && layer_types[static_cast<std::size_t>(l)] == "sliding_attention"; }
  KeyWindow layer_window(std::int64_t l) const {
    return {sliding(l) ? sliding_window : 0, is_causal.value_or(sliding(l))};
  }
  std::vector<KeyWindow> layer_windows() const;  // [layers]: what the load balancer's cost model sums
  AttnLayerConfig attn() const { return {hidden, n_q, n_kv, d_h, rope_theta, rms_eps}; }
  nlohmann::json to_json() const;
  static DrafterConfig from_json(const nlohmann::json& j);
};

// The reference's default target layers for a target of `depth` layers and n_t features (SPEC
// A.1): round(1 + i (depth - 4) / (n_t - 1)), i = 0 .. n_t - 1; depth / 2 when n_t = 1.
std::vector<std::int64_t> default_target_layer_ids(std::int64_t depth, std::int64_t n_t);

// "tiny" (the default: trains on 2 cores in seconds), "small" (for benchmarks), "qwen3.5-35b-a3b",
// "qwen3.5-27b" (DFlash) and "qwen3.8-27b-dflash2" (z-lab's Qwen3.8-27B-DFlash2: block 8, 5 sliding
// layers of window 2048, not causal, 32 / 8 heads x 128, convolutions of 2 taps over groups of 16,
// a selector of rank 256 over the top 16).
DrafterConfig drafter_preset(const std::string& name);
// The DFlash2 variant of a DFlash config (train --arch dflash2): convolutions of 2 taps over groups
// of 16 channels (the largest divisor of H up to 16), a selector of rank min(256, H) over the top
// min(16, V / 2) logits; the logit map stays the target's (identity unless set).
DrafterConfig as_dflash2(DrafterConfig c);

// Offsets of every trainable tensor in the drafter's single parameter allocation.
// fc [n_t*H, H], fc_norm [H]; per layer: attn_norm [H], attn (AttnLayerParams), mlp_norm [H],
// w_gate [H, F], w_up [H, F], w_down [F, H], and with convolutions (has_conv) attn_conv_base
// [2, K, H], attn_conv_proj [H, 2 K G], mlp_conv_base, mlp_conv_proj (else -1); final_norm [H];
// with a selector (has_selector), after final_norm in its unit: sel_pred [V, r], sel_succ [V, r],
// sel_proj [H, r] (else -1). Stored [in, out] (the codebooks as the embedding tables they are).
struct DrafterLayout {
  struct Layer {
    std::int64_t attn_norm, attn, mlp_norm, w_gate, w_up, w_down;
    std::int64_t attn_conv_base = -1, attn_conv_proj = -1, mlp_conv_base = -1, mlp_conv_proj = -1;
  };
  std::int64_t fc, fc_norm, final_norm, total;
  std::int64_t sel_pred = -1, sel_succ = -1, sel_proj = -1;
  std::vector<Layer> layer;
  // The units parameters are gathered and sharded by (drafter/sharded_state.hpp), in forward
  // order, each a contiguous span (begin, size): 0 = fc + fc_norm, 1 .. L = layer u - 1,
  // L + 1 = final_norm. They tile [0, total).
  struct Unit {
    std::int64_t begin, size;
  };
  std::vector<Unit> units;
  explicit DrafterLayout(const DrafterConfig& c);
  // (offset, size) of the 1-D tensors (norm weights, biases): not weight-decayed.
  std::vector<std::pair<std::int64_t, std::int64_t>> vectors;
};

}  // namespace diffcp
