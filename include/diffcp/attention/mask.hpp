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
#pragma once

#include <cstdint>
#include <vector>

#include "diffcp/workload/batch.hpp"

namespace diffcp {

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

// A half-open range of local key rows.
struct RowRange {
  std::int64_t begin, end;
};

class BlockMask {
 public:
  // Validates and indexes the description; throws diffcp::Error naming the bad value.
  // Requirements: block >= 1; key_rows >= 0; segments inside [0, key_rows), pairwise disjoint in
  // rows and in positions, not overlapping any held block rows; own rows inside [0, key_rows) and
  // pairwise disjoint; ctx_begin <= ctx_end; blocks of different samples (different ctx_begin)
  // have disjoint context windows (what makes the backward's per-sample parallelism race-free).
  BlockMask(std::int64_t block, std::int64_t key_rows, std::vector<ContextSegment> segments,
            std::vector<MaskBlock> blocks);

  std::int64_t block() const { return block_; }                  // B
  std::int64_t key_rows() const { return key_rows_; }            // L_k
  std::int64_t num_blocks() const { return static_cast<std::int64_t>(blocks_.size()); }  // N
  std::int64_t query_rows() const { return num_blocks() * block_; }                       // Q
  const std::vector<ContextSegment>& segments() const { return segments_; }  // sorted by pos
  const std::vector<MaskBlock>& blocks() const { return blocks_; }

  // Replaces `out` with the local key-row ranges block i sees (context ranges in position order,
  // then its own rows). O(log #segments + #ranges).
  void visible_ranges(std::int64_t i, std::vector<RowRange>& out) const;
  // Number of keys block i sees (each of its B query rows sees the same keys).
  std::int64_t visible_keys(std::int64_t i) const;
  // Sum over query rows of visible keys: the unmasked pairs per head.
  std::int64_t visible_pairs() const;
  // Blocks grouped by sample (equal ctx_begin); groups touch disjoint key rows.
  const std::vector<std::vector<std::int64_t>>& sample_groups() const { return groups_; }

 private:
  std::int64_t block_, key_rows_;
  std::vector<ContextSegment> segments_;
  std::vector<MaskBlock> blocks_;
  std::vector<std::vector<std::int64_t>> groups_;
};

// The mask of a call that holds the whole problem in SPEC's layout: key rows [0, S) are the packed
// context, rows [S + i*B, S + (i+1)*B) are block i's own rows (L_k = S + Q).
BlockMask full_mask(const PackedBatch& batch);

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
                     const std::vector<std::int64_t>& owned_blocks, std::int64_t bucket = 1);

// For each local key row of local_mask(batch, chunks, owned_blocks), its row in full_mask(batch)'s
// layout (context position x -> row x, block i's slot k -> row S + i*B + k). [L_k]
std::vector<std::int64_t> full_rows_of_local(const PackedBatch& batch, const std::vector<PosRange>& chunks,
                                             const std::vector<std::int64_t>& owned_blocks);

}  // namespace diffcp
