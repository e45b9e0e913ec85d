#include "diffcp/cp/attention_layer.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "diffcp/core/error.hpp"

namespace diffcp {

void AttnLayerConfig::validate() const {
  DIFFCP_CHECK(hidden >= 1, "hidden = ", hidden, ", expected >= 1");
  DIFFCP_CHECK(n_q >= 1 && n_kv >= 1, "n_q = ", n_q, ", n_kv = ", n_kv, "; expected both >= 1");
  DIFFCP_CHECK(n_q % n_kv == 0, "n_q = ", n_q, " is not a multiple of n_kv = ", n_kv);
  DIFFCP_CHECK(d_h >= 2 && d_h % 2 == 0, "d_h = ", d_h, ", expected an even number >= 2 (RoPE rotates pairs)");
  DIFFCP_CHECK(rope_theta > 0, "rope theta = ", rope_theta, ", expected > 0");
  DIFFCP_CHECK(rms_eps > 0, "rms eps = ", rms_eps, ", expected > 0");
}

std::array<std::vector<std::int64_t>, AttnLayerParams::kCount> AttnLayerParams::shapes(const AttnLayerConfig& c) {
  c.validate();
  const std::int64_t H = c.hidden;
  return {{{H, c.q_width()}, {H, c.kv_width()}, {H, c.kv_width()}, {c.q_width(), H}, {H}, {c.d_h}, {c.d_h}}};
}

std::array<std::int64_t, AttnLayerParams::kCount + 1> AttnLayerParams::offsets(const AttnLayerConfig& c) {
  const auto sh = shapes(c);
  std::array<std::int64_t, kCount + 1> off{};
  for (std::size_t i = 0; i < static_cast<std::size_t>(kCount); ++i) {
    std::int64_t n = 1;
    for (std::int64_t d : sh[i]) n *= d;
    off[i + 1] = off[i] + n;
  }
  return off;
}

void AttnLayerParams::layout(const AttnLayerConfig& c) {
  shape_ = shapes(c);
  offset_ = offsets(c);
}

AttnLayerParams::AttnLayerParams(const AttnLayerConfig& c) {
  layout(c);
  owned_.assign(static_cast<std::size_t>(offset_[kCount]), 0.f);
  base_ = owned_.data();
}

AttnLayerParams::AttnLayerParams(const AttnLayerConfig& c, float* external) : base_(external) {
  layout(c);
  DIFFCP_CHECK(external != nullptr, "AttnLayerParams: null external storage");
}

AttnLayerParams::AttnLayerParams(const AttnLayerParams& o)
    : owned_(o.all().begin(), o.all().end()), base_(owned_.data()), offset_(o.offset_), shape_(o.shape_) {}


const char* AttnLayerParams::name(Id id) {
  static const char* names[] = {"wq", "wk", "wv", "wo", "bo", "q_norm", "k_norm"};
  return names[id];
}

void AttnLayerParams::init_random(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < kCount; ++i) {
    const Id id = static_cast<Id>(i);
    double mean = 0, std = 0.02;
    if (id == wq || id == wk || id == wv || id == wo) std = 1.0 / std::sqrt(static_cast<double>(shape_[id][0]));
    if (id == q_norm || id == k_norm) mean = 1.0, std = 0.1;
    std::normal_distribution<double> dist(mean, std);
    float* x = (*this)[id];
    for (std::int64_t j = 0; j < size(id); ++j) x[j] = static_cast<float>(dist(rng));
  }
}

std::int64_t CpShard::context_rows() const {
  std::int64_t n = 0;
  for (const PosRange& c : chunks) n += c.end - c.begin;
  return n;
}

std::vector<std::int64_t> CpShard::owned_block_list() const {
  std::vector<std::int64_t> out;
  for (std::int64_t i = blocks.begin; i < blocks.end; ++i) out.push_back(i);
  return out;
}

BlockMask CpShard::mask() const { return local_mask(batch, chunks, owned_block_list(), bucket, window); }

std::vector<std::int64_t> CpShard::context_positions() const {
  const auto starts = batch.sample_starts();
  std::vector<std::int64_t> pos;
  pos.reserve(static_cast<std::size_t>(context_rows()));
  for (const PosRange& c : chunks) {
    // sample of position x: last start <= x
    for (std::int64_t x = c.begin; x < c.end; ++x) {
      const auto it = std::upper_bound(starts.begin(), starts.end(), x) - 1;
      pos.push_back(x - *it);
    }
  }
  return pos;
}

std::vector<std::int64_t> CpShard::block_positions() const {
  const auto refs = batch.blocks();
  std::vector<std::int64_t> pos;
  for (std::int64_t i = blocks.begin; i < blocks.end; ++i)
    for (std::int64_t k = 0; k < batch.block; ++k)
      pos.push_back(refs[static_cast<std::size_t>(i)].anchor - refs[static_cast<std::size_t>(i)].sample_start + k);
  return pos;
}

namespace {
CpShard make_shard(const PackedBatch& batch, int P, int p, std::vector<PosRange> chunks) {
  batch.validate();
  DIFFCP_CHECK(P >= 1 && 0 <= p && p < P, "shard: rank ", p, " of ", P, " ranks");
  CpShard s;
  s.batch = batch;
  s.P = P;
  s.p = p;
  s.chunks = std::move(chunks);
  const std::int64_t N = batch.num_blocks();
  s.blocks = even_shard(N, P, p);
  for (int r = 0; r < P; ++r) s.query_rows.push_back(even_shard(N, P, r).size() * batch.block);
  return s;
}
}  // namespace

CpShard contiguous_shard(const PackedBatch& batch, int P, int p) {
  DIFFCP_CHECK(P >= 1 && 0 <= p && p < P, "shard: rank ", p, " of ", P, " ranks");
  const Shard c = even_shard(batch.context_rows(), P, p);
  return make_shard(batch, P, p, {{c.begin, c.end}});
}

CpShard chunked_shard(const PackedBatch& batch, int P, int p, const std::vector<std::vector<PosRange>>& chunks_of_rank) {
  DIFFCP_CHECK(static_cast<int>(chunks_of_rank.size()) == P, "shard: ", chunks_of_rank.size(),
               " chunk lists for ", P, " ranks");
  std::vector<PosRange> all;
  for (const auto& l : chunks_of_rank) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end(), [](PosRange a, PosRange b) { return a.begin < b.begin; });
  std::int64_t next = 0;
  for (const PosRange& c : all) {
    DIFFCP_CHECK(c.begin == next && c.end >= c.begin, "shard: chunks do not partition the context: chunk [",
                 c.begin, ", ", c.end, ") where position ", next, " was expected next");
    next = c.end;
  }
  DIFFCP_CHECK(next == batch.context_rows(), "shard: chunks cover [0, ", next, ") of the context [0, ",
               batch.context_rows(), ")");
  return make_shard(batch, P, p, chunks_of_rank[static_cast<std::size_t>(p)]);
}

}  // namespace diffcp
