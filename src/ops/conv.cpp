#include "diffcp/ops/conv.hpp"

#include <cstdint>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/linear.hpp"

namespace diffcp {

namespace {
void check_shape(const char* op, const DynamicConvShape& s, std::int64_t ld_dyn) {
  DIFFCP_CHECK(s.rows >= 0 && s.hidden >= 1 && s.taps >= 1 && s.groups >= 1 && s.block >= 1, op, ": T = ", s.rows,
               ", H = ", s.hidden, ", K = ", s.taps, ", G = ", s.groups, ", block = ", s.block,
               " (expected T >= 0 and the others >= 1)");
  DIFFCP_CHECK(s.hidden % s.groups == 0, op, ": H = ", s.hidden, " is not a multiple of G = ", s.groups, " groups");
  DIFFCP_CHECK(s.rows % s.block == 0, op, ": T = ", s.rows, " rows are not whole blocks of ", s.block);
  DIFFCP_CHECK(ld_dyn >= s.taps * s.groups, op, ": taps row stride ", ld_dyn, " < K G = ", s.taps * s.groups);
}
ConstTensorView rows_of(const float* p, std::int64_t T, std::int64_t H) {
  return ConstTensorView::contiguous(p, DType::f32, {T, H}, active_device());
}
TensorView rows_of(float* p, std::int64_t T, std::int64_t H) {
  return TensorView::contiguous(p, DType::f32, {T, H}, active_device());
}
template <typename View, typename Ptr>
View taps_of(Ptr p, std::int64_t ld, const DynamicConvShape& s) {
  View v = View::contiguous(p, DType::f32, {s.rows, s.taps, s.groups}, active_device());
  v.stride[0] = ld;
  return v;
}
}  // namespace

void dynamic_conv_forward(const float* x, const float* dyn, std::int64_t ld_dyn, const float* base,
                          const DynamicConvShape& s, float* y) {
  check_shape("dynamic_conv_forward", s, ld_dyn);
  if (s.rows == 0) return;
  DIFFCP_CHECK(x != y, "dynamic_conv_forward: y aliases x (the taps read earlier rows of x)");
  backend_for(OpKind::dynamic_conv_forward, DType::f32)
      .dynamic_conv_forward(rows_of(x, s.rows, s.hidden), taps_of<ConstTensorView>(dyn, ld_dyn, s),
                            rows_of(base, s.taps, s.hidden), s.block, rows_of(y, s.rows, s.hidden));
}

void dynamic_conv_backward(const float* dy, const float* x, const float* dyn, std::int64_t ld_dyn, const float* base,
                           const DynamicConvShape& s, float* dx, float* ddyn, std::int64_t ld_ddyn, float* dbase) {
  check_shape("dynamic_conv_backward", s, ld_dyn);
  check_shape("dynamic_conv_backward", s, ld_ddyn);
  if (s.rows == 0) return;
  DIFFCP_CHECK(dx != dy && dx != x, "dynamic_conv_backward: dx aliases ", dx == dy ? "dy" : "x",
               " (the other gradients read them after dx is written)");
  const auto extent = [&](std::int64_t ld) { return static_cast<std::size_t>((s.rows - 1) * ld + s.taps * s.groups); };  // floats
  const auto overlap = [](const float* a, std::size_t na, const float* b, std::size_t nb) {
    const auto at = reinterpret_cast<std::uintptr_t>(a), bt = reinterpret_cast<std::uintptr_t>(b);
    return at < bt + nb * sizeof(float) && bt < at + na * sizeof(float);
  };
  DIFFCP_CHECK(!overlap(ddyn, extent(ld_ddyn), dyn, extent(ld_dyn)), "dynamic_conv_backward: ddyn overlaps dyn");
  backend_for(OpKind::dynamic_conv_backward, DType::f32)
      .dynamic_conv_backward(rows_of(dy, s.rows, s.hidden), rows_of(x, s.rows, s.hidden),
                             taps_of<ConstTensorView>(dyn, ld_dyn, s), rows_of(base, s.taps, s.hidden), s.block,
                             rows_of(dx, s.rows, s.hidden), taps_of<TensorView>(ddyn, ld_ddyn, s),
                             rows_of(dbase, s.taps, s.hidden));
}

void dynamic_conv_prepare(const float* x, const float* proj, const float* base, const DynamicConvShape& s, float* dyn,
                          float* y) {
  const std::int64_t KG2 = 2 * s.taps * s.groups;
  linear_forward(x, s.rows, s.hidden, proj, KG2, dyn);
  dynamic_conv_forward(x, dyn, KG2, base, s, y);
}

void dynamic_conv_finish(const float* x, const float* dyn, const float* base, const DynamicConvShape& s, float* y) {
  const std::int64_t KG = s.taps * s.groups;
  dynamic_conv_forward(x, dyn + KG, 2 * KG, base + s.taps * s.hidden, s, y);
}

void dynamic_conv_finish_backward(const float* dy, const float* x, const float* dyn, const float* base,
                                  const DynamicConvShape& s, float* dx, float* ddyn, float* dbase) {
  const std::int64_t KG = s.taps * s.groups, KH = s.taps * s.hidden;
  dynamic_conv_backward(dy, x, dyn + KG, 2 * KG, base + KH, s, dx, ddyn + KG, 2 * KG, dbase + KH);
}

void dynamic_conv_prepare_backward(const float* dy, const float* x, const float* dyn, const float* proj,
                                   const float* base, const DynamicConvShape& s, float* dx, float* ddyn, float* dproj,
                                   float* dbase) {
  const std::int64_t KG2 = 2 * s.taps * s.groups;
  dynamic_conv_backward(dy, x, dyn, KG2, base, s, dx, ddyn, KG2, dbase);
  linear_backward_weight(x, s.rows, s.hidden, ddyn, KG2, dproj);
  linear_backward_input(ddyn, s.rows, KG2, proj, s.hidden, dx, 1.f);
}

}  // namespace diffcp
