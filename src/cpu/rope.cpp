#include "diffcp/ops/rope.hpp"

#include <cmath>

#include "diffcp/core/error.hpp"

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

void rope_apply(float* x, std::int64_t rows, std::int64_t heads, std::span<const std::int64_t> positions,
                const RopeTable& table, bool inverse) {
  DIFFCP_CHECK(static_cast<std::int64_t>(positions.size()) == rows, "RoPE: ", positions.size(),
               " positions for ", rows, " rows");
  const std::int64_t d = table.d_h(), half = d / 2;
  const float sign = inverse ? -1.f : 1.f;
  for (std::int64_t pos : positions)  // validated before the parallel loop: no throw inside OpenMP
    DIFFCP_CHECK(pos >= 0 && pos < table.max_pos(), "RoPE: position ", pos, " outside the table [0, ",
                 table.max_pos(), ")");
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t pos = positions[static_cast<std::size_t>(r)];
    const float* c = table.cos(pos);
    const float* s = table.sin(pos);
    for (std::int64_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * d;
      for (std::int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half], sn = sign * s[i];
        v[i] = a * c[i] - b * sn;
        v[i + half] = b * c[i] + a * sn;
      }
    }
  }
}

}  // namespace diffcp
