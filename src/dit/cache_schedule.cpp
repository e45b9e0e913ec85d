#include "diffcp/dit/cache_schedule.hpp"

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"

namespace diffcp {

CacheScheduleKind parse_cache_schedule(const std::string& name) {
  if (name == "linear") return CacheScheduleKind::linear;
  if (name == "fixed") return CacheScheduleKind::fixed;
  DIFFCP_FAIL("`cache_schedule` '", name, "': unknown schedule, expected linear or fixed");
}

const char* cache_schedule_name(CacheScheduleKind kind) {
  return kind == CacheScheduleKind::linear ? "linear" : "fixed";
}

void CacheSchedule::validate() const {
  DIFFCP_CHECK(ratio >= 0.0 && ratio <= 1.0, "`cache_ratio` = ", ratio, ", expected a cache ratio r in [0, 1]");
  DIFFCP_CHECK(warmup >= 0, "`warmup` = ", warmup, ", expected >= 0 full steps");
  DIFFCP_CHECK(sync_every >= 0, "`sync_every` = ", sync_every, ", expected >= 0 (0: never)");
}

bool CacheSchedule::full(int step, int /*steps*/) const {
  return step == 0 || step < warmup || (sync_every > 0 && step % sync_every == 0);
}

double CacheSchedule::ratio_at(int step, int steps) const {
  if (full(step, steps)) return 0.0;
  if (kind == CacheScheduleKind::fixed) return ratio;
  const double span = std::max(1, steps - 1 - warmup);
  return ratio * std::min(1.0, static_cast<double>(step - warmup) / span);
}

std::int64_t CacheSchedule::cached_tokens(int step, int steps, std::int64_t tokens) const {
  const double c = std::floor(ratio_at(step, steps) * static_cast<double>(tokens) + 1e-9);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(c), 0, tokens);
}

}  // namespace diffcp
