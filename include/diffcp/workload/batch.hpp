// A packed micro-batch of DFlash training samples (SPEC A.1): b samples of given lengths packed
// back to back into S context rows, each with sorted anchors that open blocks of B query rows.
//
// Legend: b samples, S = sum of lengths (packed context rows), A_u anchors in sample u,
//         N = sum_u A_u blocks, B block size, Q = N*B query rows.
// Positions: "packed" positions run over [0, S); sample u starts at s_u = sum of earlier lengths.
// Anchors are stored as positions INSIDE their sample (0-based); block_anchor() gives packed ones.
// Blocks are numbered sample by sample, anchors in order; block i owns query rows [i*B, (i+1)*B).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diffcp {

struct PackedBatch {
  std::int64_t block = 16;                           // B
  std::vector<std::int64_t> lengths;                 // [b] sample lengths
  std::vector<std::vector<std::int64_t>> anchors;    // [b][A_u] positions inside the sample

  // Throws diffcp::Error naming the bad value: B < 1, a length < 1, anchors not strictly
  // increasing, an anchor < 0 or with a + B past its sample's end.
  void validate() const;

  std::int64_t num_samples() const { return static_cast<std::int64_t>(lengths.size()); }
  std::int64_t context_rows() const;  // S
  std::int64_t num_blocks() const;    // N
  std::int64_t query_rows() const { return num_blocks() * block; }  // Q
  std::vector<std::int64_t> sample_starts() const;  // [b] s_u

  struct BlockRef {
    std::int64_t sample;        // u
    std::int64_t sample_start;  // s_u (packed)
    std::int64_t anchor;        // a_i (packed)
  };
  std::vector<BlockRef> blocks() const;  // [N]
};

// The paper's workload protocol (SPEC A.5): `samples` samples of `context` tokens each (or, with
// context_max > context, of lengths drawn uniformly from [context, context_max]), the first
// round(prompt_fraction * length) being prompt; `anchors_per_sample` anchors drawn uniformly
// without replacement among response positions x with x + B <= length, then sorted. Seeded.
PackedBatch make_random_batch(std::int64_t samples, std::int64_t context,
                              std::int64_t anchors_per_sample, std::int64_t block,
                              double prompt_fraction, std::uint64_t seed, std::int64_t context_max = 0);

// The explicit form: a JSON file {"block": B, "samples": [{"length": L, "anchors": [a, ...]}, ...]}
// with anchors as positions inside their sample. Throws diffcp::Error naming the problem for an
// unreadable, malformed or over-large (> 64 MiB) file and for any invalid value.
PackedBatch read_anchors_file(const std::string& path);

}  // namespace diffcp
