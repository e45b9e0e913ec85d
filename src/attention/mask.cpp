#include "diffcp/attention/mask.hpp"

#include <algorithm>
#include <atomic>
#include <map>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {
std::uint64_t next_mask_id() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

BlockMask::BlockMask(std::int64_t block, std::int64_t key_rows, std::vector<ContextSegment> segments,
                     std::vector<MaskBlock> blocks, KeyWindow window)
    : id_(next_mask_id()), block_(block), key_rows_(key_rows), segments_(std::move(segments)), blocks_(std::move(blocks)), window_(window) {
  DIFFCP_CHECK(block_ >= 1, "mask: block size B = ", block_, ", expected >= 1");
  DIFFCP_CHECK(window_.window >= 0 && window_.window <= kMaxKeyWindow, "mask: sliding window W = ", window_.window,
               ", expected 1 .. 2^40 (or 0: none)");
  DIFFCP_CHECK(key_rows_ >= 0, "mask: key rows L_k = ", key_rows_, ", expected >= 0");

  // Every held key row belongs to at most one segment or block: check via sorted row intervals.
  std::vector<RowRange> used;
  for (std::size_t s = 0; s < segments_.size(); ++s) {
    const ContextSegment& g = segments_[s];
    DIFFCP_CHECK(g.len >= 0 && g.row >= 0 && g.pos >= 0 && g.row + g.len <= key_rows_, "mask: segment ",
                 s, " {row ", g.row, ", pos ", g.pos, ", len ", g.len,
                 "} expected row, pos, len >= 0 and row + len <= L_k = ", key_rows_);
    if (g.len > 0) used.push_back({g.row, g.row + g.len});
  }
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    const MaskBlock& b = blocks_[i];
    DIFFCP_CHECK(b.ctx_begin >= 0 && b.ctx_begin <= b.ctx_end, "mask: block ", i, " context window [",
                 b.ctx_begin, ", ", b.ctx_end, ") expected 0 <= begin <= end");
    DIFFCP_CHECK(b.own_row == -1 || (b.own_row >= 0 && b.own_row + block_ <= key_rows_), "mask: block ",
                 i, " own_row = ", b.own_row, ", expected -1 or within [0, L_k - B] = [0, ",
                 key_rows_ - block_, "]");
    if (b.own_row >= 0) used.push_back({b.own_row, b.own_row + block_});
  }
  std::sort(used.begin(), used.end(), [](RowRange a, RowRange b) { return a.begin < b.begin; });
  for (std::size_t j = 1; j < used.size(); ++j)
    DIFFCP_CHECK(used[j - 1].end <= used[j].begin, "mask: key rows [", used[j - 1].begin, ", ",
                 used[j - 1].end, ") and [", used[j].begin, ", ", used[j].end,
                 ") overlap; each key row must hold one context position or one block row");

  std::sort(segments_.begin(), segments_.end(),
            [](const ContextSegment& a, const ContextSegment& b) { return a.pos < b.pos; });
  segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                 [](const ContextSegment& g) { return g.len == 0; }),
                  segments_.end());
  for (std::size_t s = 1; s < segments_.size(); ++s)
    DIFFCP_CHECK(segments_[s - 1].pos + segments_[s - 1].len <= segments_[s].pos,
                 "mask: segments holding positions [", segments_[s - 1].pos, ", ",
                 segments_[s - 1].pos + segments_[s - 1].len, ") and [", segments_[s].pos, ", ",
                 segments_[s].pos + segments_[s].len, ") overlap; each position is held once");

  // Group blocks by sample; windows of different samples must not overlap.
  std::map<std::int64_t, std::pair<std::int64_t, std::vector<std::int64_t>>> by_start;  // begin -> (max end, blocks)
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    auto& [max_end, members] = by_start[blocks_[i].ctx_begin];
    max_end = std::max(max_end, blocks_[i].ctx_end);
    members.push_back(static_cast<std::int64_t>(i));
  }
  std::int64_t reach = 0;  // end of the last non-empty window so far
  for (auto& [begin, group] : by_start) {
    const std::int64_t end = group.first;
    if (end > begin) {
      DIFFCP_CHECK(begin >= reach, "mask: the context window [", begin, ", ", end,
                   ") of a sample starts before an earlier sample's window ends at ", reach,
                   "; blocks of different samples must see disjoint context");
      reach = end;
    }
    groups_.push_back(std::move(group.second));
  }
}

void BlockMask::visible_ranges(std::int64_t i, std::vector<RowRange>& out) const {
  out.clear();
  const MaskBlock& b = blocks_[static_cast<std::size_t>(i)];
  // Slot 0 (at the anchor) sees the widest part of the context: no row sees below its first.
  const std::int64_t ctx_begin = std::max(b.ctx_begin, window_.first(b.ctx_end));
  if (ctx_begin < b.ctx_end) {
    // First segment that ends after ctx_begin.
    auto it = std::partition_point(segments_.begin(), segments_.end(), [&](const ContextSegment& g) {
      return g.pos + g.len <= ctx_begin;
    });
    for (; it != segments_.end() && it->pos < b.ctx_end; ++it) {
      const std::int64_t lo = std::max(it->pos, ctx_begin), hi = std::min(it->pos + it->len, b.ctx_end);
      if (lo < hi) out.push_back({it->row + (lo - it->pos), it->row + (hi - it->pos), lo});
    }
  }
  // Every own slot j is seen by some row (by row j itself).
  if (b.own_row >= 0) out.push_back({b.own_row, b.own_row + block_, b.ctx_end});
}

std::int64_t BlockMask::visible_keys(std::int64_t i) const {
  std::vector<RowRange> r;
  visible_ranges(i, r);
  std::int64_t n = 0;
  for (const RowRange& x : r) n += x.end - x.begin;
  return n;
}

std::int64_t BlockMask::visible_pairs(std::int64_t i) const {
  if (!window_.active()) return visible_keys(i) * block_;  // every row sees the same keys
  std::vector<RowRange> ranges;
  visible_ranges(i, ranges);
  std::int64_t n = 0;
  const std::int64_t a = blocks_[static_cast<std::size_t>(i)].ctx_end;
  for (std::int64_t r = 0; r < block_; ++r) {
    const std::int64_t first = window_.first(a + r), last = window_.last(a + r);
    for (const RowRange& x : ranges)
      n += std::max<std::int64_t>(0, std::min(last + 1, x.pos + (x.end - x.begin)) - std::max(first, x.pos));
  }
  return n;
}

std::int64_t BlockMask::visible_pairs() const {
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < num_blocks(); ++i) n += visible_pairs(i);
  return n;
}

BlockMask full_mask(const PackedBatch& batch, KeyWindow window) {
  batch.validate();
  const std::int64_t S = batch.context_rows(), B = batch.block;
  std::vector<MaskBlock> blocks;
  std::int64_t i = 0;
  for (const auto& ref : batch.blocks()) blocks.push_back({ref.sample_start, ref.anchor, S + (i++) * B});
  return BlockMask(B, S + batch.query_rows(), {{0, 0, S}}, std::move(blocks), window);
}

BlockMask local_mask(const PackedBatch& batch, const std::vector<PosRange>& chunks,
                     const std::vector<std::int64_t>& owned_blocks, std::int64_t bucket, KeyWindow window) {
  batch.validate();
  DIFFCP_CHECK(bucket >= 1, "local mask: bucket = ", bucket, ", expected >= 1");
  const std::int64_t S = batch.context_rows(), B = batch.block, N = batch.num_blocks();
  std::vector<ContextSegment> segments;
  std::int64_t row = 0;
  for (const PosRange& c : chunks) {
    DIFFCP_CHECK(0 <= c.begin && c.begin <= c.end && c.end <= S, "local mask: chunk [", c.begin, ", ",
                 c.end, ") outside the packed context [0, ", S, ")");
    segments.push_back({row, c.begin, c.end - c.begin});
    row += c.end - c.begin;
  }
  std::vector<MaskBlock> blocks;
  for (const auto& ref : batch.blocks()) blocks.push_back({ref.sample_start, ref.anchor, -1});
  for (std::int64_t i : owned_blocks) {
    DIFFCP_CHECK(0 <= i && i < N, "local mask: owned block ", i, " outside [0, N = ", N, ")");
    DIFFCP_CHECK(blocks[static_cast<std::size_t>(i)].own_row < 0, "local mask: block ", i,
                 " listed twice as owned");
    blocks[static_cast<std::size_t>(i)].own_row = row;
    row += B;
  }
  const std::int64_t padded = (row + bucket - 1) / bucket * bucket;
  return BlockMask(B, padded, std::move(segments), std::move(blocks), window);
}

std::vector<std::int64_t> full_rows_of_local(const PackedBatch& batch, const std::vector<PosRange>& chunks,
                                             const std::vector<std::int64_t>& owned_blocks) {
  const std::int64_t S = batch.context_rows(), B = batch.block;
  std::vector<std::int64_t> rows;
  for (const PosRange& c : chunks)
    for (std::int64_t x = c.begin; x < c.end; ++x) rows.push_back(x);
  for (std::int64_t i : owned_blocks)
    for (std::int64_t k = 0; k < B; ++k) rows.push_back(S + i * B + k);
  return rows;
}

}  // namespace diffcp
