#include "diffcp/dit/step_cache.hpp"

#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/ops.hpp"

namespace diffcp {

std::string StepCacheSpec::name() const {
  if (!enabled) return "none";
  char buf[64];
  std::snprintf(buf, sizeof buf, "fbcache:%g", threshold);
  return buf;
}

StepCacheSpec parse_step_cache(const std::string& spec) {
  if (spec == "none") return {};
  const std::string prefix = "fbcache:";
  DIFFCP_CHECK(spec.rfind(prefix, 0) == 0 && spec.size() > prefix.size(), "`step_cache` '", spec,
               "': expected none or fbcache:THRESHOLD (First-Block Cache, e.g. fbcache:0.08)");
  const std::string t = spec.substr(prefix.size());
  std::size_t used = 0;
  double threshold = -1;
  try {
    threshold = std::stod(t, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DIFFCP_CHECK(used == t.size() && std::isfinite(threshold) && threshold >= 0, "`step_cache` '", spec, "': the threshold '",
               t, "' is not a finite number >= 0");
  return {true, threshold};
}

FirstBlockCache::FirstBlockCache(double threshold, Communicator& comm, std::int64_t batch, std::int64_t rows_per_image,
                                 std::int64_t valid, std::int64_t hidden)
    : threshold_(threshold), comm_(comm), b_(batch), Ip_(rows_per_image), iv_(valid), H_(hidden) {
  DIFFCP_CHECK(std::isfinite(threshold) && threshold >= 0, "step cache: threshold ", threshold, ", expected >= 0");
  DIFFCP_CHECK(batch >= 1 && rows_per_image >= 0 && valid >= 0 && valid <= rows_per_image && hidden >= 1,
               "step cache: batch ", batch, ", rows per image ", rows_per_image, ", valid ", valid, ", hidden ", hidden);
  const std::int64_t n = b_ * Ip_ * H_;
  for (DeviceVector<float>* v : {&in_, &first_, &rest_, &zeros_}) v->resize(n);
  fill(zeros_.data(), n, 0.f);
  l1_.resize(b_ * Ip_);
}

void FirstBlockCache::enter(const float* x) { device_copy(in_.data(), x, b_ * Ip_ * H_); }

double FirstBlockCache::real_rows_l1(const float* a, const float* b) {
  const std::int64_t R = b_ * Ip_;
  l1_distance(a, b, DType::f32, 1, R, H_, l1_.data());
  const std::vector<float> rows = to_host<float>(l1_.view());
  double s = 0;
  for (std::int64_t j = 0; j < b_; ++j)
    for (std::int64_t i = 0; i < iv_; ++i) s += rows[static_cast<std::size_t>(j * Ip_ + i)];
  return s;
}

bool FirstBlockCache::reuse(float* x) {
  const std::int64_t n = b_ * Ip_ * H_;
  axpy(in_.data(), -1.f, x, n);  // in_ = x_before - x_after = -r1_k
  double rel = std::numeric_limits<double>::quiet_NaN();
  if (have_first_) {
    // The same decision on every rank of the pass: sums over all real rows.
    std::vector<double> sums{real_rows_l1(first_.data(), in_.data()), real_rows_l1(first_.data(), zeros_.data())};
    comm_.all_reduce<double>(sums);
    rel = sums[1] > 0 ? sums[0] / sums[1] : (sums[0] > 0 ? std::numeric_limits<double>::infinity() : 0.0);
  }
  stats_.rel_l1.push_back(rel);
  if (have_first_ && rel < threshold_) {
    axpy(x, -1.f, rest_.data(), n);  // x + R_f (rest_ = -R_f)
    ++stats_.cached;
    return true;
  }
  std::swap(first_, in_);  // r1_f <- r1_k
  have_first_ = true;
  device_copy(rest_.data(), x, n);
  ++stats_.computed;
  return false;
}

void FirstBlockCache::leave(const float* x) { axpy(rest_.data(), -1.f, x, b_ * Ip_ * H_); }

}  // namespace diffcp
