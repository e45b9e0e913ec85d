// Comparing a computed tensor with its fp64 reference: |got - ref| <= atol + rtol * |ref|
// elementwise (dtype-aware tolerances are chosen by the caller).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace diffcp {

struct Tolerance {
  double atol, rtol;
};

// fp32 storage and accumulation against fp64: a few ulps of the row sums (relative 1e-4) and an
// absolute floor for values that cancel to ~0.
inline constexpr Tolerance kTolF32{1e-5, 1e-4};
// fp64 computations compared with each other (reassociation only).
inline constexpr Tolerance kTolF64{1e-12, 1e-10};
// A layer computed in bf16 (Split-KV compute = bf16) against fp64: 2^-6 of each tensor's peak
// (measured: at most ~2^-7.5 of it on the test shapes). What `diffcp attn --dtype bf16 --check`
// applies; the tests gate bf16 more tightly, relative to the one-rank bf16 error.
inline constexpr Tolerance kTolBf16Layer{0x1p-6, 0};

// Tolerance for a whole tensor: fp32 rounding in a sum grows with the magnitude of its terms, not
// of the (possibly cancelled) result, so the absolute floor scales with the tensor's largest
// reference value: atol' = atol * max(1, max|ref|).
Tolerance scaled_to(Tolerance t, std::span<const double> ref);

struct CompareResult {
  double max_abs = 0;        // max |got - ref|
  double max_ref = 0;        // max |ref| over the finite reference values (the tensor's scale)
  // Scale-relative error: max |got - ref| / max |ref| (0 when both are 0, inf when only the
  // reference is all zeros). Elementwise |d| / |ref| of near-zero values would mean nothing.
  double max_rel = 0;
  double worst_ratio = 0;    // max |got - ref| / (atol + rtol*|ref|), the tolerance-normalised error; pass iff <= 1
  std::int64_t worst = -1;   // index of the worst element
  std::int64_t mismatched = 0;
  bool pass() const { return mismatched == 0; }
  // Combine over several tensors: the maxima (max_rel: the worst tensor's, each against its own
  // scale) and the mismatch count.
  void merge(const CompareResult& o);
};

template <typename T>
CompareResult compare(std::span<const T> got, std::span<const double> ref, Tolerance tol);
// For a slice of a tensor (a rank's rows): max_ref and max_rel against the WHOLE tensor's largest
// finite |value|, so that every rank's figure has the same scale and the max over ranks is the
// tensor's scale-relative error.
void relative_to_whole(CompareResult& r, std::span<const double> whole_ref);

// Sizes must match; NaN or inf where the reference is finite counts as a mismatch, and -inf
// matches -inf (fully masked rows' lse).
extern template CompareResult compare<float>(std::span<const float>, std::span<const double>, Tolerance);
extern template CompareResult compare<double>(std::span<const double>, std::span<const double>, Tolerance);

}  // namespace diffcp
