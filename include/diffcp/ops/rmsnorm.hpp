// Per-head RMSNorm (Qwen3's q_norm / k_norm): each [d_h] vector x of a [rows, heads, d_h] tensor
// becomes y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps) and a weight w: [d_h] shared by heads.
// Runs on the active backend (ops/backend.hpp; CPU: src/cpu/rmsnorm.cpp).
#pragma once

#include <cstdint>

namespace diffcp {

// x, y: [rows, heads, d] (may alias)   w: [d]   rstd: [rows, heads] out (saved for backward)
void rmsnorm_forward(const float* x, std::int64_t rows, std::int64_t heads, std::int64_t d, const float* w,
                     float eps, float* y, float* rstd);
// dy, x (the forward INPUT), rstd: as above; dx: [rows, heads, d] out (may alias dy); dw: [d] += grad
void rmsnorm_backward(const float* dy, const float* x, const float* rstd, std::int64_t rows, std::int64_t heads,
                      std::int64_t d, const float* w, float* dx, float* dw);

}  // namespace diffcp
