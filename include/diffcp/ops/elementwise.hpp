// Row-wise element ops of the DiT (FLUX semantics), fp32. Every op treats rows independently, so
// a row's result does not depend on how many rows a rank holds. Each runs on the active backend
// (ops/backend.hpp; CPU: src/cpu/elementwise.cpp, OpenMP over rows).
//
// Legend: rows of width H (hidden), ld = elements between consecutive rows (>= the row's width).
#pragma once

#include <cstdint>

namespace diffcp {

// x[n] = silu(x) = x / (1 + exp(-x))
void silu_inplace(float* x, std::int64_t n);
// act[n] = silu(gate) * up (the drafter's SwiGLU); gate, up, act: [n]
void swiglu_forward(const float* gate, const float* up, float* act, std::int64_t n);
// In place on rows of a fused MLP input (FLUX.2): x[rows, 2M] (row stride ld) holds [gate | up];
// x[:, 0:M] becomes silu(gate) * up (the up half is left as it was).
void swiglu_rows(float* x, std::int64_t rows, std::int64_t M, std::int64_t ld);
// Its gradients: dgate[n], dup[n] out from dact[n] and the forward's gate[n], up[n].
void swiglu_backward(const float* dact, const float* gate, const float* up, float* dgate, float* dup, std::int64_t n);
// y[n] += x[n]
void add_into(float* y, const float* x, std::int64_t n);
// y[n] += alpha * x[n] (the sampler's Euler step)
void axpy(float* y, float alpha, const float* x, std::int64_t n);
// Classifier-free guidance per row (the DiT sampler, one row per token): v[rows, C] in: the
// conditional velocity, out: g = v_neg + scale (v - v_neg); with keep_norm, g * |v| / |g| (the
// conditional row's L2 norm kept: QwenImagePipeline's true CFG; norms summed in double). v_neg: [rows, C].
void guidance_combine(float* v, const float* v_neg, std::int64_t rows, std::int64_t C, float scale, bool keep_norm);
// x[rows, cols] (row stride ld) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) (GELU, tanh
// form), evaluated as x / (1 + exp(-2u)) with a polynomial exp2 (relative error ~1e-6)
void gelu_tanh_inplace(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld);
// x[rows, cols] (row stride ld) = 0.5 x (1 + erf(x / sqrt(2))): the exact GELU (PyTorch's
// approximate="none"; std::erf per element, so a few ulp from the fp64 value)
void gelu_inplace(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld);

// y[rows, H] = (1 + scale) * LayerNorm(x) + shift: LayerNorm without affine weights (mean and
// variance over H, eps), shift, scale: [H] (adaLN modulation). x, y: contiguous, may not alias.
void layernorm_modulate(const float* x, std::int64_t rows, std::int64_t H, const float* shift, const float* scale,
                        float eps, float* y);
// x[rows, H] += gate[H] * y[rows, H] (y row stride ldy): a gated residual.
void gated_add(float* x, std::int64_t rows, std::int64_t H, const float* gate, const float* y, std::int64_t ldy);

}  // namespace diffcp
