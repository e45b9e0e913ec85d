// ops/rope.hpp: the cos/sin table, and rope_apply's checks before the active backend (CPU:
// src/cpu/rope.cpp).
#include "diffcp/ops/rope.hpp"

#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp {

RopeTable::RopeTable(std::int64_t d_h, double theta, std::int64_t max_pos) : d_h_(d_h), max_pos_(max_pos) {
  DIFFCP_CHECK(d_h >= 2 && d_h % 2 == 0, "RoPE: d_h = ", d_h, ", expected an even number >= 2");
  DIFFCP_CHECK(theta > 0, "RoPE: theta = ", theta, ", expected > 0");
  DIFFCP_CHECK(max_pos >= 0, "RoPE: max position ", max_pos, " < 0");
  const std::int64_t half = d_h / 2;
  cos_.resize(static_cast<std::size_t>(max_pos * half));
  sin_.resize(cos_.size());
  for (std::int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d_h));
    for (std::int64_t p = 0; p < max_pos; ++p) {
      cos_[static_cast<std::size_t>(p * half + i)] = static_cast<float>(std::cos(static_cast<double>(p) * inv_freq));
      sin_[static_cast<std::size_t>(p * half + i)] = static_cast<float>(std::sin(static_cast<double>(p) * inv_freq));
    }
  }
}

RopeTable RopeTable::rows(std::span<const std::int64_t> positions) const {
  RopeTable t;
  t.d_h_ = d_h_;
  t.max_pos_ = static_cast<std::int64_t>(positions.size());
  const std::int64_t half = d_h_ / 2;
  t.cos_.reserve(positions.size() * static_cast<std::size_t>(half));
  t.sin_.reserve(t.cos_.capacity());
  for (std::int64_t pos : positions) {
    DIFFCP_CHECK(pos >= 0 && pos < max_pos_, "RoPE: position ", pos, " outside the table [0, ", max_pos_, ")");
    t.cos_.insert(t.cos_.end(), cos(pos), cos(pos) + half);
    t.sin_.insert(t.sin_.end(), sin(pos), sin(pos) + half);
  }
  return t;
}

void rope_apply(float* x, std::int64_t rows, std::int64_t heads, std::span<const std::int64_t> positions,
                const RopeTable& table, bool inverse) {
  DIFFCP_CHECK(static_cast<std::int64_t>(positions.size()) == rows, "RoPE: ", positions.size(),
               " positions for ", rows, " rows");
  for (std::int64_t pos : positions)
    DIFFCP_CHECK(pos >= 0 && pos < table.max_pos(), "RoPE: position ", pos, " outside the table [0, ",
                 table.max_pos(), ")");
  backend_for(OpKind::rope, DType::f32)
      .rope(TensorView::contiguous(x, DType::f32, {rows, heads, table.d_h()}, active_device()), positions, table, inverse);
}

}  // namespace diffcp
