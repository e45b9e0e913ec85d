// The DFlash drafter, forward and backward on rank p of a context-parallel group (llm.c style:
// explicit per-layer forward/backward, trainable parameters and their gradients in one
// allocation each). Every attention layer is a Split-KV layer.
//
//   c   = RMSNorm_fc(hidden_p @ fc)                         [C_p, H] fused context features
//   h_0 = embedding(anchor token | mask token)              [Q_p, H] the owned blocks' rows
//         (or the batch's block_input: a serving engine's noise embedding)
//   h  += SplitKV(RMSNorm_attn(h), c)                        per layer
//   h  += SwiGLU(RMSNorm_mlp(h)) = (silu(m W_gate) * (m W_up)) W_down
//   logits = RMSNorm_final(h) @ lm_head                      [Q_p, V]
// Loss (SPEC A.1): slot k of block i predicts token a_i + k with weight w_k = exp(-(k-1)/gamma)
// for k >= 1 (w_0 = 0) times the loss mask of that token; loss = sum(CE * w) / (sum(w) + 1e-6)
// over the whole global batch. The embedding and the LM head are the target's: frozen.
// The attention layers' output bias b_o is fixed at zero (its gradient is dropped): the DFlash
// format (Qwen3's attention_bias = false) has none.
#pragma once

#include <memory>
#include <vector>

#include "cp/splitkv.hpp"
#include "drafter/config.hpp"

namespace diffcp {

// One packed micro-batch as rank p of a CP group holds it.
struct DrafterBatch {
  CpShard shard;                          // samples, anchors (B = config block), chunks, owned blocks
  std::vector<std::int32_t> tokens;       // [S] packed token ids (every rank has them all)
  std::vector<std::uint8_t> loss_mask;    // [S]
  std::vector<float> hidden_p;            // [C_p, n_t*H] target hidden states of the held context rows
  std::vector<float> block_input;         // [Q_p, H] h_0 of the owned blocks; empty = embedding lookup
};

// Sums over this rank's rows (sum over CP ranks and micro-batches gives the global figures).
struct DrafterStats {
  double loss_sum = 0;    // sum of w * CE
  double weight_sum = 0;  // sum of w
  std::vector<std::int64_t> correct, counted;  // [B] per-slot argmax hits / predictions (w > 0)
};

class Drafter {
 public:
  // attn: the Split-KV options of every layer (hierarchical collectives need cp's topology).
  Drafter(Communicator& cp, const DrafterConfig& cfg, SplitKVOptions attn = {});

  const DrafterConfig& config() const { return cfg_; }
  const DrafterLayout& layout() const { return layout_; }
  std::vector<float>& params() { return params_; }        // [layout().total]
  std::vector<float>& grads() { return grads_; }          // [layout().total]
  std::vector<float>& embedding() { return embedding_; }  // [V, H] frozen; set before step()
  std::vector<float>& lm_head() { return lm_head_; }      // [H, V] frozen; set before step()
  // Seeded init of the trainable parameters (matrices N(0, 1/in), norms 1).
  void init_params(std::uint64_t seed);

  // Forward of one micro-batch; with `backward`, dloss/dlogits = w * (softmax - onehot) (UNscaled:
  // the trainer divides the summed gradients by the global weight sum) and the gradients are
  // ADDED to grads(). Returns this rank's loss pieces.
  DrafterStats step(const DrafterBatch& mb, bool backward);
  // After step(): argmax token of every owned query row, [Q_p] (slot 0 rows included).
  const std::vector<std::int32_t>& predictions() const { return argmax_; }
  // The forward up to the final RMSNorm (no LM head, no loss): what a serving engine's drafter
  // returns. Needs the embedding only when mb.block_input is empty. Returns [Q_p, H].
  const std::vector<float>& forward_hidden(const DrafterBatch& mb);

 private:
  struct LayerState {
    std::unique_ptr<SplitKVLayer> attn;
    std::vector<float> h_in, a, a_rstd, h_mid, m, m_rstd, gate, up, act;  // saved activations
  };
  void embed(const DrafterBatch& mb);
  void forward(const DrafterBatch& mb);  // -> hf_ (and the saved activations)
  AttnLayerParams attn_params(std::vector<float>& buf, std::int64_t l) const;

  Communicator& comm_;
  DrafterConfig cfg_;
  SplitKVOptions attn_opt_;
  DrafterLayout layout_;
  std::vector<float> params_, grads_, embedding_, lm_head_;
  std::vector<LayerState> layers_;
  std::vector<float> c_lin_, c_rstd_, c_, h_, hf_, hf_rstd_, logits_;
  std::vector<std::int32_t> argmax_;
};

}  // namespace diffcp
