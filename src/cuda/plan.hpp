// The CUDA attention's plans of a BlockMask (the layouts are in attention.hpp), built on the host
// and staged to the device with each call. Plain C++: built in every configuration, so their unit
// test (tests/test_cuda_plan.cpp) runs without a GPU.
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

}  // namespace diffcp::cuda
