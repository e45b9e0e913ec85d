#include "diffcp/testing/compare.hpp"

#include <algorithm>
#include <limits>

#include "diffcp/core/error.hpp"

namespace diffcp {

void CompareResult::merge(const CompareResult& o) {
  max_abs = std::max(max_abs, o.max_abs);
  max_ref = std::max(max_ref, o.max_ref);
  max_rel = std::max(max_rel, o.max_rel);
  if (o.worst_ratio > worst_ratio) {
    worst_ratio = o.worst_ratio;
    worst = o.worst;
  }
  mismatched += o.mismatched;
}

namespace {
// The largest finite |x| (0 for none): a tensor's scale.
double max_finite_abs(std::span<const double> ref) {
  double mx = 0;
  for (const double x : ref)
    if (std::isfinite(x)) mx = std::max(mx, std::abs(x));
  return mx;
}
// r.max_ref = scale, r.max_rel = max_abs / scale (0 when nothing differs, inf for a zero scale).
void set_scale(CompareResult& r, double scale) {
  r.max_ref = scale;
  r.max_rel = r.max_abs == 0 ? 0.0 : scale > 0 ? r.max_abs / scale : std::numeric_limits<double>::infinity();
}
}  // namespace

Tolerance scaled_to(Tolerance t, std::span<const double> ref) {
  return {t.atol * std::max(1.0, max_finite_abs(ref)), t.rtol};
}

void relative_to_whole(CompareResult& r, std::span<const double> whole_ref) { set_scale(r, max_finite_abs(whole_ref)); }

template <typename T>
CompareResult compare(std::span<const T> got, std::span<const double> ref, Tolerance tol) {
  DIFFCP_CHECK(got.size() == ref.size(), "compare: ", got.size(), " values vs ", ref.size(), " reference values");
  CompareResult r;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), x = ref[i];
    double err, ratio;
    if (std::isinf(x) && g == x) {
      err = 0;
      ratio = 0;
    } else if (!std::isfinite(g) || !std::isfinite(x)) {
      err = std::numeric_limits<double>::infinity();
      ratio = err;
    } else {
      err = std::abs(g - x);
      ratio = err / (tol.atol + tol.rtol * std::abs(x));
    }
    r.max_abs = std::max(r.max_abs, err);
    if (r.worst < 0 || ratio > r.worst_ratio) {
      r.worst_ratio = ratio;
      r.worst = static_cast<std::int64_t>(i);
    }
    if (!(ratio <= 1.0)) r.mismatched += 1;
  }
  set_scale(r, max_finite_abs(ref));
  return r;
}

template CompareResult compare<float>(std::span<const float>, std::span<const double>, Tolerance);
template CompareResult compare<double>(std::span<const double>, std::span<const double>, Tolerance);

}  // namespace diffcp
