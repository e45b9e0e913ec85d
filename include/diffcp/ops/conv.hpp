// DFlash2's grouped dynamic causal convolution (z-lab's GroupedDynamicCausalConv, issue #67): each
// layer convolves its sublayer input and output along the rows of a block with per-row taps that
// the model predicts (a shared base kernel plus a dynamic part per group of channels).
//
// Legend: T rows (whole blocks of `block` rows, each block its own sequence: no tap crosses a block
//         boundary), H channels, K taps, G groups of gs = H / G channels, p(t) = t mod block.
//   y[t, c] = sum over o = 0 .. min(K - 1, p(t)), ascending, of (base[o, c] + dyn[t, o, c / gs]) x[t - o, c]
// in f32 (each tap's (base + dyn) rounded once, then the product added).
#pragma once

#include <cstdint>

namespace diffcp {

struct DynamicConvShape {
  std::int64_t rows = 0;    // T, a multiple of block
  std::int64_t hidden = 0;  // H
  std::int64_t taps = 0;    // K >= 1
  std::int64_t groups = 0;  // G, dividing H
  std::int64_t block = 0;   // rows per block >= 1
};

// x: [T, H]  dyn: [T, K, G] with row stride ld_dyn >= K G (a slice of the projection's [T, 2, K, G])
// base: [K, H]  y: [T, H] out, not aliasing x
void dynamic_conv_forward(const float* x, const float* dyn, std::int64_t ld_dyn, const float* base,
                          const DynamicConvShape& s, float* y);
// The gradients of y above, given dy: [T, H]:
//   dx: [T, H] out (not aliasing dy or x)  ddyn: [T, K, G] out (not overlapping dyn), row stride ld_ddyn >= K G (0 where
//   t - o crosses the block start)  dbase: [K, H] += (summed over rows in row order)
void dynamic_conv_backward(const float* dy, const float* x, const float* dyn, std::int64_t ld_dyn, const float* base,
                           const DynamicConvShape& s, float* dx, float* ddyn, std::int64_t ld_ddyn, float* dbase);

// As a sublayer f uses it (z-lab's prepare / finish): conv_1(f(conv_0(x))), both convolutions' taps
// predicted from f's input x, dyn = x proj viewed [T, 2, K, G] (row stride 2 K G), base [2, K, H]:
//   prepare: x [T, H] -> dyn [T, 2 K G] out, y = conv_0(x) [T, H] out   proj: [H, 2 K G]
//   finish:  x [T, H] (f's output) -> y = conv_1(x) [T, H] out
void dynamic_conv_prepare(const float* x, const float* proj, const float* base, const DynamicConvShape& s, float* dyn,
                          float* y);
void dynamic_conv_finish(const float* x, const float* dyn, const float* base, const DynamicConvShape& s, float* y);
// Their gradients, finish's first (it fills ddyn's second half, prepare's its first and then reads
// all of it): dy [T, H] -> dx [T, H] out; ddyn [T, 2 K G]; dbase [2, K, H] +=; prepare also
// dproj [H, 2 K G] += x^T ddyn and dx through the projection (dx += ddyn proj^T).
void dynamic_conv_finish_backward(const float* dy, const float* x, const float* dyn, const float* base,
                                  const DynamicConvShape& s, float* dx, float* ddyn, float* dbase);
void dynamic_conv_prepare_backward(const float* dy, const float* x, const float* dyn, const float* proj,
                                   const float* base, const DynamicConvShape& s, float* dx, float* ddyn, float* dproj,
                                   float* dbase);

}  // namespace diffcp
