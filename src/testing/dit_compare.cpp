#include "diffcp/testing/dit_compare.hpp"

#include <string>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/image.hpp"
#include "diffcp/dit/metrics.hpp"

namespace diffcp {

std::string DitReferenceRun::describe(int P) const {
  if (single_rank) return "flat on one rank (P = 1)";
  return "flat Ulysses, U = " + std::to_string(deg.ulysses) + " over the same " + std::to_string(P) + " ranks";
}

DitReferenceRun flat_reference_for(ExchangeMode mode, UspDegrees deg, int P, std::int64_t heads, bool cfg_parallel) {
  if (cfg_parallel) return heads % P == 0 ? DitReferenceRun{false, {P, 1}} : DitReferenceRun{true, {1, 1}};
  DIFFCP_CHECK(P >= 1 && heads >= 1 && deg.ulysses * deg.ring == P, "flat_reference_for: U = ", deg.ulysses, " x R = ",
               deg.ring, " on P = ", P, " ranks with ", heads, " heads");
  const bool run_is_flat_ulysses = mode == ExchangeMode::flat && deg.ring == 1;  // then deg.ulysses == P
  DIFFCP_CHECK(!(run_is_flat_ulysses && P == 1), "`compare` flat: this run is flat on one rank, the reference itself; "
               "nothing to compare it with (run it on P > 1 ranks or in another `mode`)");
  if (heads % P == 0 && !run_is_flat_ulysses) return {false, {P, 1}};
  return {true, {1, 1}};
}

std::optional<Tolerance> dit_check_tolerance(ExchangeMode mode, const CacheSchedule& schedule, DType compute) {
  if (mode == ExchangeMode::cocodiff && schedule.ratio > 0) return std::nullopt;
  return compute == DType::bf16 ? Tolerance{0x1p-5, 0} : kTolF32;
}

std::optional<Tolerance> dit_reference_file_tolerance(ExchangeMode mode, const CacheSchedule& schedule) {
  return dit_check_tolerance(mode, schedule, DType::bf16);
}

DitComparison compare_dit_latents(const std::vector<float>& latent, const std::vector<float>& ref_latent,
                                  const DitConfig& cfg, const DitShape& shape, std::optional<Tolerance> tolerance) {
  DIFFCP_CHECK(latent.size() == ref_latent.size(), "compare: a latent of ", latent.size(), " values against a reference of ",
               ref_latent.size());
  const std::vector<float> rgb = latent_to_rgb(latent, cfg, shape), ref_rgb = latent_to_rgb(ref_latent, cfg, shape);
  DitComparison c;
  c.mse = image_mse(rgb, ref_rgb);
  c.psnr = psnr_from_mse(c.mse);
  c.ssim = ssim(rgb, ref_rgb, {shape.batch * shape.frames, shape.grid_h() * cfg.patch, shape.grid_w() * cfg.patch, 3});
  c.max_abs_diff = max_abs_diff(latent, ref_latent);
  c.tolerance = tolerance;
  const std::vector<double> ref(ref_latent.begin(), ref_latent.end());
  c.latent = compare<float>(latent, ref, scaled_to(tolerance.value_or(kTolF32), ref));
  return c;
}

}  // namespace diffcp
