// The DFlash drafter's Hugging Face format: what z-lab's released drafters use, what SGLang's
// DFLASH speculative algorithm and transformers (trust_remote_code, `DFlashDraftModel`) load.
//
// DIR/config.json: a Qwen3 config (hidden_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads, head_dim, intermediate_size, vocab_size, rms_norm_eps, rope_theta) with
// architectures ["DFlashDraftModel"], top-level block_size and num_target_layers (the target's
// depth), and dflash_config {target_layer_ids, mask_token_id}.
// DIR/model.safetensors, PyTorch's [out, in] weights, no biases:
//   fc.weight [H, n_t*H], hidden_norm.weight [H], norm.weight [H]; per layer i:
//   layers.i.input_layernorm.weight [H], layers.i.post_attention_layernorm.weight [H],
//   layers.i.self_attn.q_proj.weight [n_q*d_h, H], k_proj / v_proj [n_kv*d_h, H],
//   o_proj [H, n_q*d_h], q_norm / k_norm [d_h], layers.i.mlp.gate_proj / up_proj [F, H],
//   down_proj [H, F].
// Ours are stored [in, out] (DrafterLayout): export and import transpose. fc's input features are
// the target layers' hidden states concatenated in target_layer_ids order, as ours. The embedding
// and the LM head are the target's and are not in the file. Our attention output bias b_o is
// fixed at zero (the drafter never trains it); export refuses parameters where it is not.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "diffcp/drafter/config.hpp"

namespace diffcp {

struct DrafterWeights {
  DrafterConfig config;
  std::vector<float> params;  // [DrafterLayout(config).total]
};

// dtype: "f32" or "bf16" (round to nearest even). Needs the config's target_layer_ids and
// target_depth. Writes DIR/config.json and DIR/model.safetensors (each atomically).
// max_positions: max_position_embeddings, the longest context an engine may draft over (>= 1).
void export_dflash(const std::string& dir, const DrafterConfig& cfg, std::span<const float> params,
                   const std::string& dtype, std::int64_t max_positions = 40960);

// Reads DIR (F32, BF16 or F16 tensors, converted to f32). Every tensor's name, dtype and shape is
// checked against the config, nothing may be missing or extra; bad input throws naming it.
DrafterWeights import_dflash(const std::string& dir);

}  // namespace diffcp
