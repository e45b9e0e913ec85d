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

}  // namespace diffcp
