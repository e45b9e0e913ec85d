// The DFlash drafter, forward and backward on rank p of a context-parallel group (llm.c style:
// explicit per-layer forward/backward, trainable parameters and their gradients in one
// allocation each). Every attention layer is a Split-KV layer.
//
//   c   = RMSNorm_fc(hidden_p @ fc)                         [C_p, H] fused context features
//   h_0 = embedding(anchor token | mask token)              [Q_p, H] the owned blocks' rows
//         (or the batch's block_input: a serving engine's noise embedding)
//   h  += SplitKV(RMSNorm_attn(h), c)                        per layer
//   h  += SwiGLU(RMSNorm_mlp(h)) = (silu(m W_gate) * (m W_up)) W_down
//   DFlash2 (config has_conv): each sublayer f as conv_1(f(conv_0(x))), x its normed input, both
//   convolutions' taps predicted from x (x W_proj: [Q_p, 2, K, G]) over the owned blocks' rows
//   (ops/conv.hpp, blocks of B rows: local to a block, nothing communicated)
//   logits = RMSNorm_final(h) @ lm_head                      [Q_p, V]
// Loss (SPEC A.1): slot k of block i predicts token a_i + k with weight w_k = exp(-(k-1)/gamma)
// for k >= 1 (w_0 = 0) times the loss mask of that token; loss = sum(CE * w) / (sum(w) + 1e-6)
// over the whole global batch. The embedding and the LM head are the target's: frozen.
// The attention layers' output bias b_o is fixed at zero (its gradient is dropped): the DFlash
// format (Qwen3's attention_bias = false) has none.
// Memory: parameters, gradients, activations and scratch live in the active backend's memory
// (DeviceVector) and only ops and collectives touch them; the batch's inputs (token ids, target
// hidden states, block inputs, embedding rows) come from the host and are uploaded once per step
// (used in place by a backend that computes on host memory, the CPU: no extra copy there);
// the loss pieces and predictions come back to the host (O(rows)).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "diffcp/cp/splitkv.hpp"
#include "diffcp/drafter/config.hpp"
#include "diffcp/drafter/lm_head.hpp"
#include "diffcp/drafter/selector.hpp"
#include "diffcp/drafter/sharded_state.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/conv.hpp"

namespace diffcp {

// One packed micro-batch as rank p of a CP group holds it: host input data (the data source's; the
// drafter copies hidden_p and block_input into its device workspace).
struct DrafterBatch {
  CpShard shard;                          // samples, anchors (B = config block), chunks, owned blocks
  std::vector<std::int32_t> tokens;       // [S] packed token ids (every rank has them all)
  std::vector<std::uint8_t> loss_mask;    // [S]
  std::vector<float> hidden_p;            // [C_p, n_t*H] target hidden states of the held context rows
  std::vector<float> block_input;         // [Q_p, H] h_0 of the owned blocks; empty = embedding lookup
  // DFlash2: [S] the tokens the candidate selector's predecessors come from for rows k >= 2 (token
  // anchor + k - 1; row 1's is the anchor's token); empty: tokens (teacher forcing). Held-out
  // evaluation passes the target's greedy tokens, so the choice equals sequential drafting up to
  // the first miss.
  std::vector<std::int32_t> prev_tokens;
};

// Sums over this rank's rows (sum over CP ranks and micro-batches gives the global figures).
struct DrafterStats {
  double loss_sum = 0;    // sum of w * CE
  double weight_sum = 0;  // sum of w
  std::vector<std::int64_t> correct, counted;  // [B] per-slot argmax hits / predictions (w > 0)
  // DFlash2's candidate selector (drafter/selector.hpp selector_loss): its part of loss_sum, and
  // rows with w > 0, those whose target is among the candidates, those it chose right
  double selector_loss_sum = 0;
  std::int64_t selector_rows = 0, selector_covered = 0, selector_correct = 0;
};

// Embedding lookup: out [n, H] (host) = the frozen embedding rows of tokens [n] (where they live:
// a mapped file, a generator; the drafter never holds the table). The drafter copies them to the device.
using EmbeddingRows = std::function<void(std::span<const std::int32_t> tokens, float* out)>;

class Drafter {
 public:
  // attn: the Split-KV options of every layer (hierarchical collectives need cp's topology).
  // The trainable state starts resident (ShardMode::none); use_state() hands it to a sharded one.
  Drafter(Communicator& cp, const DrafterConfig& cfg, SplitKVOptions attn = {});

  const DrafterConfig& config() const { return cfg_; }
  const DrafterLayout& layout() const { return layout_; }
  DeviceVector<float>& params() { return state().params(); }  // [layout().total] device (not --shard full)
  DeviceVector<float>& grads() { return state().grads(); }    // [layout().total] device (not --shard full)
  // The trainable state: the one given to use_state(), else a resident one (ShardMode::none),
  // allocated on first use.
  ShardedState& state();
  // Runs on `state` (before anything used the resident one; it must be of this layout and
  // outlive the drafter's use of it).
  void use_state(ShardedState& state);
  void set_embedding(EmbeddingRows rows) { embedding_ = std::move(rows); }  // before step()
  void set_embedding(std::vector<float> table);                             // [V, H] host
  void set_lm_head(LmHead head);  // before step(); DFlash2: with the config's logit map
  // The parameter gathers of step(mb, false) without a batch: a DP replica with no micro-batch in
  // an evaluation round takes part in the mesh-wide gathers the others make.
  void idle_step();
  // DFlash2: lambda, the candidate selector's loss weight (1 by default).
  void set_selector_loss_weight(double lambda);
  // Activation recomputation: keep only each layer's input and run the layer's forward again in
  // backward (one Split-KV layer and one layer's activations live at a time). Saves ~all the
  // per-layer activation memory for one more forward; the results are bitwise the same.
  void set_recompute(bool on) { recompute_ = on; }
  // Seeded init of the trainable parameters (matrices N(0, 1/in), norms 1), unit by unit.
  void init_params(std::uint64_t seed);

  // Forward of one micro-batch; with `backward`, dloss/dlogits = w * (softmax - onehot) (UNscaled:
  // the trainer divides the summed gradients by the global weight sum) and the gradients are
  // ADDED to the state's gradients. Returns this rank's loss pieces.
  DrafterStats step(const DrafterBatch& mb, bool backward);
  // After step(): argmax token of every owned query row, [Q_p] (slot 0 rows included).
  const std::vector<std::int32_t>& predictions() const { return argmax_; }
  // The forward up to the final RMSNorm (no LM head, no loss): what a serving engine's drafter
  // returns. Needs the embedding only when mb.block_input is empty. Returns [Q_p, H] (device).
  const DeviceVector<float>& forward_hidden(const DrafterBatch& mb);

  // Wall time of the phases of the steps so far, ms (attention includes its collectives).
  // attention_comm: the part of attention spent in Split-KV's exposed collectives (the
  // CpTimings::exposed_comm_ms of every call: transfers and waits for the other ranks).
  struct Phases {
    double fusion = 0, attention = 0, attention_comm = 0, mlp = 0, lm_head = 0, gather_wait = 0;
  };
  const Phases& phases() const { return phases_; }

 private:
  struct LayerState {
    std::unique_ptr<SplitKVLayer> attn;
    CpSaved attn_saved;  // attn's forward context (views of a and the fused context c_), for its backward
    double attn_fwd_comm = 0;  // the exposed collectives of attn's last forward, ms (its backward adds the rest)
    DeviceVector<float> h_in, a, a_rstd, h_mid, m, m_rstd, gate, up, act;  // saved activations
    // DFlash2's convolutions (config has_conv): the taps predicted from a and m [Q_p, 2, K, G],
    // the convolved sublayer inputs [Q_p, H], the attention's output and the MLP's before their
    // second convolution [Q_p, H]
    DeviceVector<float> a_dyn, a_conv, o, m_dyn, m_conv, z;
  };
  void embed(const DrafterBatch& mb);
  void forward(const DrafterBatch& mb);  // -> hf_ (and the saved activations)
  // step()'s parts after forward(): the decay-weighted loss over the LM head (with `backward`, its
  // gradient dhf [Q_p, H]), then the backward from dhf through every layer and the fusion.
  DrafterStats loss(const DrafterBatch& mb, bool backward, DeviceVector<float>& dhf);
  // DFlash2: the selector's loss over the rows' candidates (with `backward`, its gradients kept in
  // selector_grads_), and their application in backward() (dhf [Q_p, H] += the selector's part).
  SelectorLoss selector_step(std::span<const std::int32_t> prev, std::span<const std::int32_t> target,
                             std::span<const double> weight, std::span<const float> top_v,
                             std::span<const std::int32_t> top_i, bool backward);
  void apply_selector_grads(const float* params, float* grads, DeviceVector<float>& dhf);
  struct BackwardScratch {  // [C_p, H] x 3, [Q_p, H] x 3, [Q_p, F] x 3; with convolutions [Q_p, H], [Q_p, 2 K G]
    DeviceVector<float> dc, dc_l, dc_lin, dh, da, dm, dact, dgate, dup, dconv, ddyn;
  };
  void backward(const DrafterBatch& mb, DeviceVector<float>& dhf);  // dhf: DFlash2 adds the selector's part
  // Layer l's backward: bs.dh [Q_p, H] in (its output's gradient) and out (its input's); adds the
  // context's gradient into bs.dc.
  void layer_backward(std::int64_t l, const CpShard& s, BackwardScratch& bs);
  // Layer l on h_ (in: its input, out: its output), saving its activations in L.
  void layer_forward(std::int64_t l, LayerState& L, const float* params, const CpShard& s);
  const float* acquire(int u, bool backward);  // the unit's parameters, timing the wait
  // DFlash2's convolutions over Q_p rows in blocks of B (ops/conv.hpp).
  DynamicConvShape conv_shape(std::int64_t rows) const;
  // Offset of layout offset `abs` inside unit u.
  std::int64_t rel(int u, std::int64_t abs) const { return abs - layout_.units[static_cast<std::size_t>(u)].begin; }

  Communicator& comm_;
  DrafterConfig cfg_;
  SplitKVOptions attn_opt_;
  DrafterLayout layout_;
  std::unique_ptr<ShardedState> own_state_;
  ShardedState* state_ = nullptr;
  EmbeddingRows embedding_;
  std::unique_ptr<LmHead> lm_head_;
  std::vector<LayerState> layers_;
  bool recompute_ = false;
  LayerState scratch_;  // recompute: the activations of the layer being run
  DeviceVector<float> hidden_;  // [C_p, n_t*H] the batch's hidden_p uploaded (a backend of other memory than the host's)
  const float* hidden_in_ = nullptr;  // [C_p, n_t*H] the fusion's input: hidden_, or hidden_p itself on the host
  DeviceVector<float> c_lin_, c_rstd_, c_, h_, hf_, hf_rstd_;
  DeviceVector<float> conv_out_;  // [Q_p, H] the MLP's output after its second convolution
  std::vector<std::int32_t> argmax_;
  double selector_lambda_ = 1.0;
  // DFlash2: the selector's gradients from loss(), applied by backward() with the last unit's
  // parameters: d(h P) [Q_p, r] (device), the codebook rows used (ascending tokens) and theirs [m, r]
  struct SelectorGrads {
    DeviceVector<float> dhp;
    std::vector<std::int32_t> pred_tokens, succ_tokens;
    std::vector<float> dpred, dsucc;
  };
  std::optional<SelectorGrads> selector_grads_;
  Phases phases_;
};

}  // namespace diffcp
