// The DFlash block-sparse mask (SPEC A.1) of ONE attention call, in compact form: never a dense
// Q x L_k matrix. Work over it is proportional to the number of visible (query, key) pairs.
//
// Legend: N blocks of B query rows (block i owns query rows [i*B, (i+1)*B)), Q = N*B,
//         L_k key rows held by this call.
// Key rows come in two kinds:
//   * context rows, given as segments: local key rows [row, row+len) hold the context at global
//     packed positions [pos, pos+len). A call may hold any number of disjoint segments (a rank's
//     list of context chunks after load balancing) in any order; K/V are never copied to make
//     them contiguous.
//   * block rows: block i's own B key rows at local rows [own_row, own_row+B), or own_row = -1
//     when this call does not hold them.
// Query block i sees (a) context rows whose packed position x has ctx_begin <= x < ctx_end, where
// [ctx_begin, ctx_end) = [s_i, a_i) is its sample's context strictly before its anchor, and (b) its
// own B block rows (bidirectional inside the block). Nothing else.
// A layer's KeyWindow narrows this per query row (the sliding-window layers of z-lab's
// DFlashDraftModel): see KeyWindow below. Tiles outside a row's window are never visited; only
// the tiles a window edge crosses are masked element by element.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "diffcp/workload/batch.hpp"

namespace diffcp {

// Which keys a query row sees inside its block's visible set, by position: query slot r of block i
// sits at packed position qpos = a_i + r; context key x at x, the block's own slot j at a_i + j.
// z-lab's DFlashDraftModel (dflash/model.py, _attention_mask) for a layer of config.layer_types:
//   "full_attention":    window 0, causal false (SPEC A.1 unchanged);
//   "sliding_attention": window = config.sliding_window, causal true (its default when the
//                        config sets no is_causal): qpos - W < y <= qpos.
// A config's is_causal sets `causal` for every layer; without causal a window also bounds
// y - qpos < W. Context keys are all before the anchor, so `causal` only acts inside the block.
// The largest window accepted (2^40 positions: past any context, and position arithmetic with it
// cannot overflow).
inline constexpr std::int64_t kMaxKeyWindow = std::int64_t{1} << 40;

struct KeyWindow {
  std::int64_t window = 0;  // W in [1, kMaxKeyWindow]: keys with qpos - y < W; 0 = unbounded
  bool causal = false;      // keys with y <= qpos only
  bool active() const { return window > 0 || causal; }
  // A "sliding_attention" layer of window W as z-lab makes it (causal); W = 0: a full layer.
  static KeyWindow sliding(std::int64_t W) { return {W, W > 0}; }
  // Whether the query at position qpos sees the key at position y (given SPEC A.1's block rule).
  bool sees(std::int64_t qpos, std::int64_t y) const {
    if (causal && y > qpos) return false;
    return window == 0 || (qpos - y < window && (causal || y - qpos < window));
  }
  // The positions [first, last] the query at qpos may see (an empty or unbounded side clipped by
  // the caller): first = qpos - W + 1, last = qpos (causal) or qpos + W - 1.
  std::int64_t first(std::int64_t qpos) const { return window > 0 ? qpos - window + 1 : std::numeric_limits<std::int64_t>::min() / 4; }
  std::int64_t last(std::int64_t qpos) const {
    return causal ? qpos : window > 0 ? qpos + window - 1 : std::numeric_limits<std::int64_t>::max() / 4;
  }
};

struct ContextSegment {
  std::int64_t row;  // first local key row
  std::int64_t pos;  // global packed position of that row
  std::int64_t len;  // rows
};

struct MaskBlock {
  std::int64_t ctx_begin;  // s_i: packed start of the block's sample
  std::int64_t ctx_end;    // a_i: packed anchor position (exclusive end of the visible context)
  std::int64_t own_row;    // first local key row of the block's own B rows, or -1 if not held
};

// A half-open range of local key rows; pos: the key position of row `begin` (packed position of a
// context row, a_i + slot of a block's own row), for a KeyWindow's per-row test.
struct RowRange {
  std::int64_t begin, end;
  std::int64_t pos = 0;
};

class BlockMask {
 public:
  // Validates and indexes the description; throws diffcp::Error naming the bad value.
  // Requirements: block >= 1; key_rows >= 0; segments inside [0, key_rows), pairwise disjoint in
  // rows and in positions, not overlapping any held block rows; own rows inside [0, key_rows) and
  // pairwise disjoint; ctx_begin <= ctx_end; blocks of different samples (different ctx_begin)
  // have disjoint context windows (what makes the backward's per-sample parallelism race-free);
  // window.window >= 0.
  BlockMask(std::int64_t block, std::int64_t key_rows, std::vector<ContextSegment> segments,
            std::vector<MaskBlock> blocks, KeyWindow window = {});

  std::int64_t block() const { return block_; }                  // B
  std::int64_t key_rows() const { return key_rows_; }            // L_k
  std::int64_t num_blocks() const { return static_cast<std::int64_t>(blocks_.size()); }  // N
  std::int64_t query_rows() const { return num_blocks() * block_; }                       // Q
  const std::vector<ContextSegment>& segments() const { return segments_; }  // sorted by pos
  const std::vector<MaskBlock>& blocks() const { return blocks_; }
  const KeyWindow& window() const { return window_; }
  // A process-unique number of this mask's contents (a mask never changes after construction; its
  // copies share the number): what a device backend keys the plans it prepared for it by, so a
  // mask built once per batch is planned and uploaded once (the CUDA backend).
  std::uint64_t id() const { return id_; }

  // Replaces `out` with the local key-row ranges block i sees, the union over its B query rows
  // (context ranges in position order, then its own rows). O(log #segments + #ranges).
  void visible_ranges(std::int64_t i, std::vector<RowRange>& out) const;
  // Number of keys in block i's visible ranges (without a window, what each of its rows sees).
  std::int64_t visible_keys(std::int64_t i) const;
  // Sum over block i's query rows of the keys each sees (B * visible_keys(i) without a window).
  std::int64_t visible_pairs(std::int64_t i) const;
  // Sum over all query rows: the unmasked pairs per head.
  std::int64_t visible_pairs() const;
  // Blocks grouped by sample (equal ctx_begin); groups touch disjoint key rows.
  const std::vector<std::vector<std::int64_t>>& sample_groups() const { return groups_; }

 private:
  std::uint64_t id_;
  std::int64_t block_, key_rows_;
  std::vector<ContextSegment> segments_;
  std::vector<MaskBlock> blocks_;
  KeyWindow window_;
  std::vector<std::vector<std::int64_t>> groups_;
};

// The mask of a call that holds the whole problem in SPEC's layout: key rows [0, S) are the packed
// context, rows [S + i*B, S + (i+1)*B) are block i's own rows (L_k = S + Q).
BlockMask full_mask(const PackedBatch& batch, KeyWindow window = {});

// A position range [begin, end) of the packed context.
struct PosRange {
  std::int64_t begin, end;
};

// The mask of one rank's call: it holds context `chunks` (packed position ranges, stored in this
// order as local key rows 0..) followed by the own rows of `owned_blocks` (in this order), and the
// query rows of ALL blocks (Split-KV gathers every query). L_k = sum chunk lengths + |owned|*B,
// rounded up to a multiple of `bucket` (static-shape buckets): padding rows are in no segment and
// no block, so no query ever sees them.
BlockMask local_mask(const PackedBatch& batch, const std::vector<PosRange>& chunks,
                     const std::vector<std::int64_t>& owned_blocks, std::int64_t bucket = 1, KeyWindow window = {});

// For each local key row of local_mask(batch, chunks, owned_blocks), its row in full_mask(batch)'s
// layout (context position x -> row x, block i's slot k -> row S + i*B + k). [L_k]
std::vector<std::int64_t> full_rows_of_local(const PackedBatch& batch, const std::vector<PosRange>& chunks,
                                             const std::vector<std::int64_t>& owned_blocks);

}  // namespace diffcp
