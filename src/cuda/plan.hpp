// The CUDA attention's plans of a BlockMask (the layouts are in attention.hpp) and the GEMM path's
// runs and spans, built on the host
// and staged to the device with each call. Plain C++: built in every configuration, so their unit
// test (tests/kernels/test_cuda_plan.cpp) runs without a GPU.
#pragma once

#include <cstdint>
#include <vector>

namespace diffcp {
class BlockMask;
}

namespace diffcp::cuda {

// plan = [anchor: N][range_offset: N + 1][ranges: R x 3 {begin, end, position of begin}]: each
// block's anchor and its visible key ranges (BlockMask::visible_ranges).
void attention_plan(const BlockMask& mask, std::vector<std::int64_t>& plan);
// key_plan = [S][segments: S x 5 {first row, end row, position of the first row, first entry,
// count}][blocks]: every stretch of key rows that the same (non-empty) set of blocks sees, in row
// order, with those blocks in ascending order. From `plan` (attention_plan of the same mask).
void attention_key_plan(const BlockMask& mask, const std::vector<std::int64_t>& plan, std::vector<std::int64_t>& key_plan);

// The GEMM path's work list (src/cuda/backend.cpp): the blocks of each sample group split into runs
// of consecutive blocks; a run's key spans are the union of its blocks' visible ranges, merged
// into disjoint row intervals in row order, each given a first column in the run's score tile
// (columns rounded up to 8 per span: 16-byte aligned bf16 operands for the GEMMs).
struct AttentionRun {
  std::int64_t row0, rows;     // query rows [row0, row0 + rows)
  std::int64_t span0, n_spans; // spans [span0, span0 + n_spans) of AttentionRuns::spans
  std::int64_t L;              // the score tile's row length (the padded columns of all its spans)
};
struct AttentionRuns {
  std::vector<AttentionRun> runs;
  std::vector<std::int64_t> spans;  // [S, 3]: first key row, end row, first column
};
// From `plan` (attention_plan of the same mask).
AttentionRuns attention_runs(const BlockMask& mask, const std::vector<std::int64_t>& plan);

}  // namespace diffcp::cuda
