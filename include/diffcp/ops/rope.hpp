// Rotary position embedding, rotate-half convention (Qwen/LLaMA): in each [d_h] head vector the
// pairs (i, i + d_h/2), i < d_h/2, are rotated by angle pos * theta^(-2i/d_h). Backward is the
// rotation by the negative angle (rotations are orthogonal). rope_apply runs on the active backend
// (ops/backend.hpp; CPU: src/cpu/rope.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace diffcp {

// cos/sin of every (position, i) for positions [0, max_pos): computed in double, stored as float.
class RopeTable {
 public:
  RopeTable(std::int64_t d_h, double theta, std::int64_t max_pos);
  std::int64_t d_h() const { return d_h_; }
  std::int64_t max_pos() const { return max_pos_; }
  const float* cos(std::int64_t pos) const { return cos_.data() + pos * (d_h_ / 2); }
  const float* sin(std::int64_t pos) const { return sin_.data() + pos * (d_h_ / 2); }
  // The rows of `positions` (each inside the table) as a table of positions [0, n): what a device
  // backend takes with an op issued now and run later (the guard-async device; a GPU uploads them).
  RopeTable rows(std::span<const std::int64_t> positions) const;

 private:
  RopeTable() = default;
  std::int64_t d_h_ = 0, max_pos_ = 0;
  std::vector<float> cos_, sin_;
};

// x: [rows, heads, d_h] rotated in place; positions: [rows], each in [0, table.max_pos()).
// inverse = true applies the backward (rotation by -angle).
void rope_apply(float* x, std::int64_t rows, std::int64_t heads, std::span<const std::int64_t> positions,
                const RopeTable& table, bool inverse);

}  // namespace diffcp
