// What every context-parallel method of the drafter attention layer shares (SPEC A.1-A.2):
// its configuration, its parameters (one allocation, llm.c style), and the shard of the packed
// micro-batch a rank holds.
//
// The layer: Y = OProj(Attn(q, k, v)) + b_o with
//   q = RoPE(RMSNorm_q(X W_q)),  k = RoPE(RMSNorm_k([ctx; X] W_k)),  v = [ctx; X] W_v
// X: [Q, H] hidden states of the block rows (queries and the blocks' own keys), ctx: [S, H] fused
// context features. RMSNorm per head over d_h, then RoPE (rotate-half) at in-sample positions:
// context row x of sample u at x - s_u, block i's slot k at a_i - s_u + k.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/cp/shard.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {

struct AttnLayerConfig {
  std::int64_t hidden = 256;  // H
  std::int64_t n_q = 8, n_kv = 2, d_h = 32;
  double rope_theta = 1e6;
  double rms_eps = 1e-6;

  void validate() const;  // throws diffcp::Error naming the bad value
  std::int64_t q_width() const { return n_q * d_h; }
  std::int64_t kv_width() const { return n_kv * d_h; }
};

// Parameters (or their gradients) of one layer, contiguous in `data` in the order of Id.
// Shapes: wq [H, n_q*d_h], wk, wv [H, n_kv*d_h], wo [n_q*d_h, H] (all stored [in, out]),
// bo [H], q_norm [d_h], k_norm [d_h].
class AttnLayerParams {
 public:
  enum Id { wq, wk, wv, wo, bo, q_norm, k_norm, kCount };
  explicit AttnLayerParams(const AttnLayerConfig& cfg);  // owns its storage, all zeros
  // A view of count(cfg) floats owned elsewhere (a model's single parameter allocation).
  AttnLayerParams(const AttnLayerConfig& cfg, float* external);
  AttnLayerParams(const AttnLayerParams& o);  // copies the values into owned storage
  // A view of count(cfg) read-only floats owned elsewhere (a model's parameters while a layer
  // reads them), for the `const AttnLayerParams&` parameters of the layers: pass it straight there.
  // (It is not a separate read-only type: copied into a non-const object it would allow writes;
  // the device-ready core's views, issue #33, will carry constness.)
  static const AttnLayerParams view(const AttnLayerConfig& cfg, const float* external) {
    return AttnLayerParams(cfg, const_cast<float*>(external));  // the one const_cast of the parameters
  }
  AttnLayerParams& operator=(const AttnLayerParams&) = delete;
  // Offsets of every tensor in Id order (entry kCount = the total float count); the 1-D tensors
  // (bo, q_norm, k_norm) come last, after the four matrices.
  static std::array<std::int64_t, kCount + 1> offsets(const AttnLayerConfig& cfg);
  static std::int64_t count(const AttnLayerConfig& cfg) { return offsets(cfg)[kCount]; }

  float* operator[](Id id) { return base_ + offset_[id]; }
  const float* operator[](Id id) const { return base_ + offset_[id]; }
  std::span<float> all() { return {base_, static_cast<std::size_t>(offset_[kCount])}; }
  std::span<const float> all() const { return {base_, static_cast<std::size_t>(offset_[kCount])}; }
  std::int64_t size(Id id) const { return offset_[id + 1] - offset_[id]; }
  const std::vector<std::int64_t>& shape(Id id) const { return shape_[id]; }
  static const char* name(Id id);

  // Seeded init: weights N(0, 1/in), bias N(0, 0.02^2), norm weights 1 + N(0, 0.1^2).
  void init_random(std::uint64_t seed);

 private:
  static std::array<std::vector<std::int64_t>, kCount> shapes(const AttnLayerConfig& cfg);
  void layout(const AttnLayerConfig& cfg);
  std::vector<float> owned_;
  float* base_ = nullptr;
  std::array<std::int64_t, kCount + 1> offset_{};
  std::array<std::vector<std::int64_t>, kCount> shape_;
};

// What rank p of a context-parallel group of P holds for one micro-batch. Every rank knows the
// whole batch (all anchors); it holds the context rows of `chunks` (packed position ranges, in
// this order = its local context rows) and owns the blocks [blocks.begin, blocks.end): their
// query rows and their own key rows. Blocks are owned in contiguous ranges in rank order, so
// gathering per-rank query rows in rank order gives the global block order.
struct CpShard {
  PackedBatch batch;
  int P = 1, p = 0;
  std::vector<PosRange> chunks;
  Shard blocks{0, 0};
  std::vector<std::int64_t> query_rows;  // [P] query rows owned by each rank (B * its blocks)
  // Static-shape bucket: the local K/V length is rounded up to a multiple of this (padding
  // masked), so buffer shapes and allocations repeat across steps. 1 = no padding.
  std::int64_t bucket = 1;
  // The layer's key window (attention/mask.hpp): a sliding-window layer's; {} = SPEC A.1's mask.
  KeyWindow window;

  std::int64_t context_rows() const;  // C_p: rows of chunks
  std::int64_t own_query_rows() const { return blocks.size() * batch.block; }  // Q_p
  std::vector<std::int64_t> owned_block_list() const;
  std::int64_t key_rows() const { return context_rows() + own_query_rows(); }  // real rows, C_p + Q_p
  // local key rows: chunks' rows, then the owned blocks' own rows, then padding to the bucket
  BlockMask mask() const;
  // In-sample RoPE positions: [C_p] of the held context rows, [Q_p] of the owned block rows.
  std::vector<std::int64_t> context_positions() const;
  std::vector<std::int64_t> block_positions() const;
};

// The contiguous layout (no balancing): rank p holds context [p*S/P, (p+1)*S/P) and blocks
// [p*N/P, (p+1)*N/P). Any P >= 1 works, including P > N and ranks holding no context.
CpShard contiguous_shard(const PackedBatch& batch, int P, int p);
// Any context assignment: `chunks_of_rank[r]` lists rank r's chunks (together a partition of
// [0, S)); blocks stay contiguous and even. Throws if the chunks do not partition the context.
CpShard chunked_shard(const PackedBatch& batch, int P, int p, const std::vector<std::vector<PosRange>>& chunks_of_rank);

}  // namespace diffcp
