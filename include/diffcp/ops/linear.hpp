// Dense projections, row-major, on the one GEMM entry point (ops/gemm.hpp) of the active backend.
// Weights are stored [in, out] (y = x W), the layout of the dump files and of llm.c.
#pragma once

#include <cstdint>

namespace diffcp {

// y[M, N] = x[M, K] W[K, N] + beta * y
void linear_forward(const float* x, std::int64_t M, std::int64_t K, const float* W, std::int64_t N, float* y,
                    float beta = 0.f);
// dx[M, K] = dy[M, N] W^T + beta * dx
void linear_backward_input(const float* dy, std::int64_t M, std::int64_t N, const float* W, std::int64_t K,
                           float* dx, float beta = 0.f);
// dW[K, N] += x[M, K]^T dy[M, N]
void linear_backward_weight(const float* x, std::int64_t M, std::int64_t K, const float* dy, std::int64_t N,
                            float* dW);
// db[N] += sum over rows of dy[M, N]
void bias_backward(const float* dy, std::int64_t M, std::int64_t N, float* db);
// y[M, N] += b[N] on every row
void bias_add(float* y, std::int64_t M, std::int64_t N, const float* b);

}  // namespace diffcp
