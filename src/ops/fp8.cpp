// ops/fp8.hpp's blocked e4m3 codec on the active backend (one virtual call per op call).
#include "diffcp/ops/fp8.hpp"

#include "diffcp/core/error.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp {

namespace {
void check_codec(const char* op, DType t, std::int64_t n, std::int64_t d) {
  DIFFCP_CHECK(t == DType::f32 || t == DType::bf16, op, ": ", dtype_name(t), " values, expected f32 or bf16");
  DIFFCP_CHECK(n >= 0 && d >= 1, op, ": n = ", n, " blocks of d = ", d, " elements; expected n >= 0, d >= 1");
}
}  // namespace

void fp8_encode(const void* x, DType t, std::int64_t n, std::int64_t d, void* enc) {
  check_codec("fp8_encode", t, n, d);
  if (n == 0) return;
  const Device dev = active_device();
  backend_for(OpKind::fp8_encode, t)
      .fp8_encode(ConstTensorView::contiguous(x, t, {n, d}, dev), TensorView::contiguous(enc, DType::u8, {n, d + kFp8ScaleBytes}, dev));
}

void fp8_decode(const void* enc, std::int64_t n, std::int64_t d, void* x, DType t) {
  check_codec("fp8_decode", t, n, d);
  if (n == 0) return;
  const Device dev = active_device();
  backend_for(OpKind::fp8_decode, t)
      .fp8_decode(ConstTensorView::contiguous(enc, DType::u8, {n, d + kFp8ScaleBytes}, dev), TensorView::contiguous(x, t, {n, d}, dev));
}

}  // namespace diffcp
