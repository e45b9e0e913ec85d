// V-Major's cache schedule (SPEC B.4, the paper's "time-varying cache scheduling"): which
// denoising steps exchange everything and what fraction r of each rank's tokens the others steps
// keep cached (do not send).
//
//   full steps:  step < warmup (the cache is filled), step 0 always (nothing cached yet), and every
//                sync_every-th step (step % sync_every == 0; 0 = never) to flush stale entries.
//   linear:      r(step) = ratio * min(1, (step - warmup) / max(1, steps - 1 - warmup)): 0 at the
//                warm-up boundary, `ratio` (default 1, the paper's) at the last step.
//   fixed:       r(step) = ratio on every selective step (the comparison curve).
// A rank with n tokens per exchange caches floor(r n + 1e-9) of them (n - that many are "active").
// r = 1 on the last linear step therefore sends no q, k, v rows across at all (the paper's schedule;
// pass --cache-ratio 0.9 to stop short of it).
#pragma once

#include <cstdint>
#include <string>

namespace diffcp {

enum class CacheScheduleKind : std::uint8_t { linear, fixed };
// "linear" | "fixed"; anything else throws naming both.
CacheScheduleKind parse_cache_schedule(const std::string& name);
const char* cache_schedule_name(CacheScheduleKind kind);

struct CacheSchedule {
  CacheScheduleKind kind = CacheScheduleKind::linear;
  double ratio = 1.0;  // fixed: r; linear: r at the last step. In [0, 1].
  int warmup = 5;      // full steps at the start (>= 0)
  int sync_every = 10; // a full step every this many steps (0: never)

  // Throws diffcp::Error naming the bad value (r outside [0, 1], negative warmup / sync_every).
  void validate() const;
  bool full(int step, int steps) const;
  // r of a step: 0 on full steps.
  double ratio_at(int step, int steps) const;
  // Tokens (of `tokens` per rank) kept cached at this step: floor(r n + 1e-9), 0 on full steps.
  std::int64_t cached_tokens(int step, int steps, std::int64_t tokens) const;
};

}  // namespace diffcp
