// Image quality against a reference (the paper compares every method with Flat's output by PSNR,
// SSIM and MSE, SPEC B.5). Images: [n, height, width, channels] in [0, 1] (peak 1), fp32 in,
// fp64 arithmetic.
#pragma once

#include <cstdint>
#include <span>

namespace diffcp {

struct ImageSize {
  std::int64_t n = 1, height = 0, width = 0, channels = 3;
  std::int64_t elements() const { return n * height * width * channels; }
};

// Mean squared difference over all elements.
double image_mse(std::span<const float> a, std::span<const float> b);
// 10 log10(peak^2 / mse) with peak 1; +inf when mse == 0 (identical images).
double psnr_from_mse(double mse);
// Mean SSIM (Wang, Bovik, Sheikh, Simoncelli 2004): Gaussian window of side 11 (sigma 1.5; the
// largest odd side <= the image's when it is smaller), "valid" windows only, C1 = (0.01)^2,
// C2 = (0.03)^2; averaged over windows, channels and images. 1 for identical images.
double ssim(std::span<const float> a, std::span<const float> b, const ImageSize& size);
// max |a - b|
double max_abs_diff(std::span<const float> a, std::span<const float> b);

}  // namespace diffcp
