#include "diffcp/dit/metrics.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {

void check_pair(std::span<const float> a, std::span<const float> b, const char* what) {
  DIFFCP_CHECK(a.size() == b.size() && !a.empty(), what, ": images of ", a.size(), " and ", b.size(),
               " values; expected equal, non-empty sizes");
}

// Valid-mode separable filtering of one [h, w] plane with the normalised 1-D window g: [h-k+1, w-k+1].
std::vector<double> filter_valid(const std::vector<double>& x, std::int64_t h, std::int64_t w, const std::vector<double>& g) {
  const std::int64_t k = static_cast<std::int64_t>(g.size()), oh = h - k + 1, ow = w - k + 1;
  std::vector<double> rows(static_cast<std::size_t>(h * ow)), out(static_cast<std::size_t>(oh * ow));
  for (std::int64_t y = 0; y < h; ++y)
    for (std::int64_t x0 = 0; x0 < ow; ++x0) {
      double s = 0;
      for (std::int64_t i = 0; i < k; ++i) s += g[static_cast<std::size_t>(i)] * x[static_cast<std::size_t>(y * w + x0 + i)];
      rows[static_cast<std::size_t>(y * ow + x0)] = s;
    }
  for (std::int64_t y0 = 0; y0 < oh; ++y0)
    for (std::int64_t x0 = 0; x0 < ow; ++x0) {
      double s = 0;
      for (std::int64_t i = 0; i < k; ++i) s += g[static_cast<std::size_t>(i)] * rows[static_cast<std::size_t>((y0 + i) * ow + x0)];
      out[static_cast<std::size_t>(y0 * ow + x0)] = s;
    }
  return out;
}

}  // namespace

double image_mse(std::span<const float> a, std::span<const float> b) {
  check_pair(a, b, "mse");
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return s / static_cast<double>(a.size());
}

double psnr_from_mse(double mse) {
  return mse == 0 ? std::numeric_limits<double>::infinity() : 10.0 * std::log10(1.0 / mse);
}

double max_abs_diff(std::span<const float> a, std::span<const float> b) {
  check_pair(a, b, "max_abs_diff");
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

double ssim(std::span<const float> a, std::span<const float> b, const ImageSize& s) {
  check_pair(a, b, "ssim");
  DIFFCP_CHECK(s.n >= 1 && s.height >= 1 && s.width >= 1 && s.channels >= 1 &&
                   static_cast<std::int64_t>(a.size()) == s.elements(),
               "ssim: ", a.size(), " values for [", s.n, ", ", s.height, ", ", s.width, ", ", s.channels, "]");
  std::int64_t k = std::min<std::int64_t>({11, s.height, s.width});
  if (k % 2 == 0) --k;
  std::vector<double> g(static_cast<std::size_t>(k));
  double gsum = 0;
  for (std::int64_t i = 0; i < k; ++i) {
    const double x = static_cast<double>(i - k / 2);
    gsum += g[static_cast<std::size_t>(i)] = std::exp(-x * x / (2 * 1.5 * 1.5));
  }
  for (double& v : g) v /= gsum;
  constexpr double C1 = 0.01 * 0.01, C2 = 0.03 * 0.03;

  const std::int64_t hw = s.height * s.width;
  std::vector<double> x(static_cast<std::size_t>(hw)), y(x.size()), xx(x.size()), yy(x.size()), xy(x.size());
  double total = 0;
  std::int64_t windows = 0;
  for (std::int64_t i = 0; i < s.n; ++i)
    for (std::int64_t c = 0; c < s.channels; ++c) {
      for (std::int64_t q = 0; q < hw; ++q) {
        const std::size_t at = static_cast<std::size_t>((i * hw + q) * s.channels + c), u = static_cast<std::size_t>(q);
        x[u] = a[at];
        y[u] = b[at];
        xx[u] = x[u] * x[u];
        yy[u] = y[u] * y[u];
        xy[u] = x[u] * y[u];
      }
      const auto mx = filter_valid(x, s.height, s.width, g), my = filter_valid(y, s.height, s.width, g);
      const auto sxx = filter_valid(xx, s.height, s.width, g), syy = filter_valid(yy, s.height, s.width, g);
      const auto sxy = filter_valid(xy, s.height, s.width, g);
      for (std::size_t w = 0; w < mx.size(); ++w) {
        const double vx = sxx[w] - mx[w] * mx[w], vy = syy[w] - my[w] * my[w], cxy = sxy[w] - mx[w] * my[w];
        total += ((2 * mx[w] * my[w] + C1) * (2 * cxy + C2)) / ((mx[w] * mx[w] + my[w] * my[w] + C1) * (vx + vy + C2));
        ++windows;
      }
    }
  return total / static_cast<double>(windows);
}

}  // namespace diffcp
