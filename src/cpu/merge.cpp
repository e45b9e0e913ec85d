// CPU log-sum-exp merge and rescale (attention/merge.hpp): OpenMP over rows.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_backend.hpp"
#include "diffcp/core/error.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_same(std::size_t a, std::size_t b, const char* what) {
  DIFFCP_CHECK(a == b, what, ": sizes differ (", a, " vs ", b, ")");
}
}  // namespace

void CpuBackend::lse_merge(std::span<const ConstTensorView> o_views, std::span<const ConstTensorView> lse_views,
                           TensorView o_v, TensorView lse_v) {
  const auto o = rows_f32(o_v);
  const auto lse = span_f32(lse_v);
  std::vector<HeadRows<const float>> o_parts;
  std::vector<std::span<const float>> lse_parts;
  for (const ConstTensorView& t : o_views) o_parts.push_back(rows_f32(t));
  for (const ConstTensorView& t : lse_views) lse_parts.push_back(span_f32(t));
  check_same(o_parts.size(), lse_parts.size(), "lse_merge: o parts vs lse parts");
  const std::size_t n = static_cast<std::size_t>(o.rows * o.heads);
  check_same(lse.size(), n, "lse_merge: lse vs o rows*heads");
  for (std::size_t p = 0; p < o_parts.size(); ++p) {
    DIFFCP_CHECK(o_parts[p].rows == o.rows && o_parts[p].heads == o.heads && o_parts[p].dim == o.dim,
                 "lse_merge: part ", p, " shape [", o_parts[p].rows, ", ", o_parts[p].heads, ", ",
                 o_parts[p].dim, "] differs from the output [", o.rows, ", ", o.heads, ", ", o.dim, "]");
    check_same(lse_parts[p].size(), n, "lse_merge: lse part vs rows*heads");
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < o.rows; ++r)
    for (std::int64_t h = 0; h < o.heads; ++h) {
      const std::size_t idx = static_cast<std::size_t>(r * o.heads + h);
      float mx = kNegInf;
      for (const auto& l : lse_parts) mx = std::max(mx, l[idx]);
      float* dst = o.at(r, h);
      for (std::int64_t c = 0; c < o.dim; ++c) dst[c] = 0.f;
      if (mx == kNegInf) {
        lse[idx] = kNegInf;
        continue;
      }
      float sum = 0.f;
      for (const auto& l : lse_parts) sum += std::exp(l[idx] - mx);
      const float merged = mx + std::log(sum);
      lse[idx] = merged;
      for (std::size_t p = 0; p < o_parts.size(); ++p) {
        const float wgt = std::exp(lse_parts[p][idx] - merged);
        const float* src = o_parts[p].at(r, h);
        for (std::int64_t c = 0; c < o.dim; ++c) dst[c] += wgt * src[c];
      }
    }
}

void CpuBackend::lse_rescale(TensorView o_v, ConstTensorView lse_p_v, ConstTensorView lse_v) {
  const auto o_p = rows_f32(o_v);
  const auto lse_p = span_f32(lse_p_v), lse = span_f32(lse_v);
  const std::size_t n = static_cast<std::size_t>(o_p.rows * o_p.heads);
  check_same(lse_p.size(), n, "lse_rescale: lse_p vs rows*heads");
  check_same(lse.size(), n, "lse_rescale: lse vs rows*heads");
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < o_p.rows; ++r)
    for (std::int64_t h = 0; h < o_p.heads; ++h) {
      const std::size_t idx = static_cast<std::size_t>(r * o_p.heads + h);
      // lse_p = -inf: this partial saw nothing, its o_p is 0 and stays 0.
      const float wgt = lse_p[idx] == kNegInf ? 0.f : std::exp(lse_p[idx] - lse[idx]);
      float* x = o_p.at(r, h);
      for (std::int64_t c = 0; c < o_p.dim; ++c) x[c] *= wgt;
    }
}

// x, m: [n]
void CpuBackend::lse_shift(TensorView x_v, ConstTensorView m_v, bool to_exp) {
  float* x = x_v.ptr<float>();
  const float* m = m_v.ptr<const float>();
  const std::int64_t n = x_v.numel();
  if (to_exp) {
#pragma omp parallel for schedule(static) if (n > 4096)
    for (std::int64_t i = 0; i < n; ++i) x[i] = m[i] == kNegInf ? 0.f : std::exp(x[i] - m[i]);
  } else {
#pragma omp parallel for schedule(static) if (n > 4096)
    for (std::int64_t i = 0; i < n; ++i) x[i] = m[i] == kNegInf ? kNegInf : m[i] + std::log(x[i]);
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
