// A draft KV cache (issue #53): DFlash drafting whose cost does not grow with the context.
//
// draft_block (drafter/draft.hpp) is stateless: every block it fuses the whole context again
// (fc + RMSNorm over ctx rows) and projects every layer's context K/V again, O(ctx) GEMM rows per
// block. A serving engine keeps instead what no later block changes: each drafter layer's K/V of
// the context positions (after k_norm and RoPE; a position's K/V depend only on the target's
// hidden states there and on the position), appended as the target accepts tokens. A block then
// costs its own b rows' projections and MLPs, plus attention over the cached keys:
// O(b x (window or context)) in attention, no O(context) GEMM.
//
// Split-KV over the context, as draft_block: context position x is held by rank
// (x / kChunk) % P (round-robin chunks, so every rank's share grows with the context); every rank
// computes the block's rows (b <= B rows: replicated, cheap), attends over its own keys (rank 0
// also holds the block's own keys), and the partial (o, lse) of the b x n_q query rows are
// all-gathered and merged by log-sum-exp in rank order (attention/merge.hpp): Q-sized traffic
// only, [b, n_q, d_h + 1] floats per rank per layer; the context K/V never move.
// A sliding-window layer keeps only the keys a later block can still see (positions
// >= length() - W + 1; compacted when the dead prefix outgrows the live part).
//
// Equal to draft_block within f32 rounding, not bitwise: the K/V projections run over other row
// blocks (a GEMM's row result may depend on M and on the row's place in the kernel's blocking),
// and the attention visits the keys in other tiles (draft_block splits the context into up to
// 4 chunks per rank; the online softmax's accumulation order follows the tiles). Tests bound the
// difference (tests/drafter/test_dflash.cpp, DraftCache.*; on the guard device: test_drafter_guard.cpp).
//
// Collective: every rank of `cp` calls append() and draft() in the same order with the same
// arguments (the whole target_hidden and noise, as draft_block).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/comm/communicator.hpp"
#include "diffcp/drafter/config.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/rope.hpp"

namespace diffcp {

class DraftCache {
 public:
  // Positions per round-robin chunk of the context over the ranks.
  static constexpr std::int64_t kChunk = 256;

  // params: [DrafterLayout(cfg).total] the drafter's parameters (copied to the active backend).
  DraftCache(Communicator& cp, const DrafterConfig& cfg, std::span<const float> params);

  // target_hidden: [n, n_t*H] the target's hidden states of positions [length(), length() + n)
  // (its layers cfg.target_layer_ids, concatenated in that order); n >= 1.
  void append(std::span<const float> target_hidden);

  // noise: [b, H], 1 <= b <= cfg.block, the block's input embeddings at positions
  // [length(), length() + b): the target's embedding of the last verified token, then of the mask
  // token. Returns, on every rank, the final RMSNorm's output [b, H] (draft_block's result for
  // the same context and block). Needs length() >= 1.
  std::vector<float> draft(std::span<const float> noise);

  std::int64_t length() const { return length_; }        // context positions appended
  std::int64_t own_positions() const;                      // of them, held by this rank
  std::int64_t cached_keys(std::int64_t layer) const;      // K/V rows layer `layer` keeps here
  std::int64_t bytes() const;                              // device bytes of the cached K/V here

 private:
  struct Layer {
    DeviceVector<float> k, v;  // [capacity, n_kv * d_h]: rows [0, rows) cached, then the block's
    std::int64_t rows = 0;     // cached rows
    std::int64_t first = 0;    // index into own_ of row 0 (rows before it were evicted)
    KeyWindow window;
  };
  const float* param(std::int64_t offset) const { return params_.data() + offset; }
  void reserve_rows(Layer& L, std::int64_t rows);
  void evict(Layer& L);
  void ensure_rope(std::int64_t max_pos);
  BlockMask layer_mask(const Layer& L, std::int64_t b, bool holds_block) const;

  Communicator& cp_;
  DrafterConfig cfg_;
  DrafterLayout layout_;
  DeviceVector<float> params_;
  std::vector<Layer> layers_;
  std::vector<std::int64_t> own_;  // positions this rank holds, ascending
  std::int64_t length_ = 0;
  RopeTable rope_;  // positions [0, max_pos), grown by doubling
  // Scratch, sized once per shape.
  DeviceVector<float> hidden_, c_lin_, c_, rstd_, k_lin_, h_, a_, q_, o_, lse_, y_, gate_, up_, act_, send_, parts_;
  DeviceVector<float> dyn_, conv_;  // DFlash2: a sublayer's taps [b, 2 K G], a convolved row set [b, H]
};

}  // namespace diffcp
