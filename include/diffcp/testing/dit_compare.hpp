// A DiT run against a reference image (SPEC B.5: every method is compared with Flat's output):
// which run `diffcp dit --compare flat` forms as the reference, and the comparison itself (PSNR,
// SSIM and MSE of the images, and the latents against a tolerance where the run is exact).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "diffcp/dit/cache_schedule.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/usp.hpp"
#include "diffcp/testing/compare.hpp"

namespace diffcp {

// The reference of a run in `mode` with USP degrees `deg` on P ranks: never the run itself.
//   * flat Ulysses over the same P ranks (U = P, R = 1) where P divides the heads and the run is
//     not that configuration (a TAPA / V-First / CoCoDiff run, or any USP run with R > 1);
//   * otherwise the single-rank run (P = 1: each rank samples the whole image alone), for a flat
//     run at P > 1 or a run whose heads P does not divide.
// Throws diffcp::Error for flat at P = 1 (the run is the single-rank run: nothing to compare with).
// A CFG-parallel run (deg: of its halves) is never the sequential reference: flat Ulysses over all
// P ranks where P divides the heads, else the single-rank run.
struct DitReferenceRun {
  bool single_rank = false;
  UspDegrees deg;  // over the same ranks (single_rank false); {1, 1} for the single-rank run
  std::string describe(int P) const;  // e.g. "flat Ulysses, U = 4 over the same 4 ranks"
};
DitReferenceRun flat_reference_for(ExchangeMode mode, UspDegrees deg, int P, std::int64_t heads, bool cfg_parallel = false);

// The tolerance an exact run's latent is judged by against a reference of the same compute dtype
// (atol scaled by max(1, max|ref|)); nullopt where the run is lossy by design (CoCoDiff with a
// cache ratio above 0 reuses stale rows: judged by PSNR, not a tolerance). f32: kTolF32, as the
// tests' single-process checks. bf16: 2^-5 of the peak: bf16 GEMM and attention inputs round to
// 2^-9 relative, and a different split of the sums (ring merges, other shards) moves the rounding
// points; the sampling loop carries the difference over the steps.
std::optional<Tolerance> dit_check_tolerance(ExchangeMode mode, const CacheSchedule& schedule, DType compute);
// `--reference FILE`: a saved latent may come from another dtype (an f32 run's, the documented way
// to judge a bf16 run), mode or machine, so an exact run is judged by the loosest exact tolerance,
// bf16's, whatever its own dtype; nullopt where the run is lossy by design.
std::optional<Tolerance> dit_reference_file_tolerance(ExchangeMode mode, const CacheSchedule& schedule);

struct DitComparison {
  double mse = 0, psnr = 0, ssim = 0, max_abs_diff = 0;  // images (latent -> RGB) and latents
  std::optional<Tolerance> tolerance;                    // nullopt: not judged (PSNR only)
  CompareResult latent;                                  // the latent against the reference's (with tolerance)
  bool identical() const { return mse == 0 && max_abs_diff == 0; }
  bool pass() const { return !tolerance || latent.pass(); }
};
// latent, ref_latent: [b, N_img, C_in] (gathered, global order).
DitComparison compare_dit_latents(const std::vector<float>& latent, const std::vector<float>& ref_latent,
                                  const DitConfig& cfg, const DitShape& shape, std::optional<Tolerance> tolerance);

}  // namespace diffcp
