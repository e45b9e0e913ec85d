// The CUDA backend's kernels (kernels.cu), with plain C++ arguments so that nvcc never reads the
// library's headers: device pointers, sizes, row strides (elements) and the backend's stream.
// Each enqueues on `stream` and returns cudaSuccess or the launch error (as an int: no CUDA header
// here). Element types: f32 as float, bf16 as its uint16 bits.
#pragma once

#include <cstdint>

namespace diffcp::cuda {

using Stream = void*;  // cudaStream_t

int fill_f32(float* x, std::int64_t n, float value, Stream s);
int fill_bf16(std::uint16_t* x, std::int64_t n, std::uint16_t bits, Stream s);
// rows x cols, row strides ld_* (elements); f32 -> bf16 round to nearest even, bf16 -> f32 exact,
// or a copy (same dtype: elem_bytes 2 or 4)
int convert_f32_bf16(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t ld_dst, std::int64_t rows,
                     std::int64_t cols, Stream s);
int convert_bf16_f32(const std::uint16_t* src, std::int64_t ld_src, float* dst, std::int64_t ld_dst, std::int64_t rows,
                     std::int64_t cols, Stream s);
int copy_rows(const void* src, std::int64_t ld_src, void* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols,
              int elem_bytes, Stream s);
// dst[r, :cols] = src[:cols] for every row r (row stride ld_dst): one row broadcast
int copy_rows_broadcast_f32(const float* src, float* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols, Stream s);
int copy_rows_broadcast_u16(const std::uint16_t* src, std::uint16_t* dst, std::int64_t ld_dst, std::int64_t rows,
                            std::int64_t cols, Stream s);
// y[n] += alpha x[n] (alpha = 1: y + x exactly)
int axpy(float* y, const float* x, float alpha, std::int64_t n, Stream s);
// x[n] = silu(x) in place
int silu(float* x, std::int64_t n, Stream s);
// x: rows x cols (row stride ld) in place: GELU, tanh approximation
int gelu_tanh(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, Stream s);
// act = silu(gate) * up, rows x cols with a row stride each (rows = 1: [n])
int swiglu_forward(const float* gate, std::int64_t lg, const float* up, std::int64_t lu, float* act, std::int64_t la,
                   std::int64_t rows, std::int64_t cols, Stream s);
int swiglu_backward(const float* dact, const float* gate, const float* up, float* dgate, float* dup, std::int64_t n,
                    Stream s);
// y: M x N (contiguous) += b[N] on every row;  db[N] += column sums of dy (M x N), summed in row order
int bias_add(float* y, const float* b, std::int64_t M, std::int64_t N, Stream s);
int bias_backward(const float* dy, float* db, std::int64_t M, std::int64_t N, Stream s);
// C (rows x cols, row stride ldc, f32 or bf16 bits) = beta * C: the GEMM's K = 0 case
int scale_f32(float* c, std::int64_t rows, std::int64_t cols, std::int64_t ldc, float beta, Stream s);

}  // namespace diffcp::cuda
