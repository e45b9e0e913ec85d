// dit/ops.hpp: projections on the one GEMM (ops/gemm.hpp), the timestep features, the axial RoPE
// table, and qk_norm_rope's views to the active backend (CPU: src/cpu/elementwise.cpp).
#include "diffcp/dit/ops.hpp"

#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

namespace {
void check_linear(std::int64_t M, std::int64_t K, std::int64_t N, std::int64_t ldx, std::int64_t ldw, std::int64_t ldy) {
  DIFFCP_CHECK(M >= 0 && K >= 1 && N >= 1 && ldx >= K && ldy >= N && ldw >= N, "dit_linear: M = ", M, ", K = ", K,
               ", N = ", N, ", ldx = ", ldx, ", ldw = ", ldw, ", ldy = ", ldy,
               "; expected K, N >= 1 and row strides >= the row widths");
}
}  // namespace

void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* W, std::int64_t ldw,
                std::int64_t N, const float* bias, float* y, std::int64_t ldy) {
  check_linear(M, K, N, ldx, ldw, ldy);
  if (M == 0) return;
  if (bias) convert_rows(bias, DType::f32, 0, y, DType::f32, ldy, M, N);  // y = bias in every row
  gemm(false, false, M, N, K, 1.f, x, ldx, W, ldw, bias ? 1.f : 0.f, y, ldy);
}

void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const bf16_t* W16, std::int64_t ldw,
                std::int64_t N, const float* bias, float* y, std::int64_t ldy, const PackedWeight* packed) {
  check_linear(M, K, N, ldx, ldw, ldy);
  if (M == 0) return;
  thread_local DeviceVector<bf16_t> x16;  // [M, K] x rounded, in the active backend's memory
  x16.resize(M * K);
  convert_rows(x, DType::f32, ldx, x16.data(), DType::bf16, K, M, K);
  const Device d = active_device();
  ConstTensorView w = ConstTensorView::contiguous(W16, DType::bf16, {K, N}, d);
  w.stride[0] = ldw;
  TensorView yv = TensorView::contiguous(y, DType::f32, {M, N}, d);
  yv.stride[0] = ldy;
  backend_for(OpKind::dense_linear, DType::bf16)
      .dense_linear(ConstTensorView::contiguous(x16.data(), DType::bf16, {M, K}, d), w, packed,
                    ConstTensorView::contiguous(bias, DType::f32, {bias ? N : 0}, d), yv);
}

void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, ConstTensorView w, const float* bias, float* y,
                std::int64_t ldy, const PackedWeight* packed) {
  DIFFCP_CHECK(w.rank == 2 && w.stride[1] == 1 && (w.dtype == DType::f32 || w.dtype == DType::bf16) &&
                   (packed == nullptr || w.dtype == DType::bf16),
               "dit_linear: weight ", w.describe(), (packed ? " with a packed copy" : ""),
               "; expected [K, N] f32 or bf16 rows (packed: bf16 only)");
  const std::int64_t K = w.shape[0], N = w.shape[1];
  if (w.dtype == DType::f32)
    dit_linear(x, ldx, M, K, w.ptr<float>(), w.stride[0], N, bias, y, ldy);
  else
    dit_linear(x, ldx, M, K, w.ptr<bf16_t>(), w.stride[0], N, bias, y, ldy, packed);
}

std::vector<float> timestep_embedding(double t, std::int64_t dim) {
  DIFFCP_CHECK(dim >= 2 && dim % 2 == 0, "timestep_embedding: dim = ", dim, ", expected even and >= 2");
  const std::int64_t half = dim / 2;
  std::vector<float> e(static_cast<std::size_t>(dim));
  for (std::int64_t i = 0; i < half; ++i) {
    const double arg = 1000.0 * t * std::exp(-std::log(10000.0) * static_cast<double>(i) / static_cast<double>(half));
    e[static_cast<std::size_t>(i)] = static_cast<float>(std::cos(arg));
    e[static_cast<std::size_t>(half + i)] = static_cast<float>(std::sin(arg));
  }
  return e;
}

AxialRope::AxialRope(const DitConfig& cfg, const std::vector<std::array<double, kMaxRopeAxes>>& positions)
    : rows_(static_cast<std::int64_t>(positions.size())), half_(cfg.head_dim / 2) {
  cfg.validate();
  std::vector<float> cos(static_cast<std::size_t>(rows_ * half_)), sin(cos.size());
  for (std::int64_t r = 0; r < rows_; ++r) {
    const std::array<double, kMaxRopeAxes>& pos = positions[static_cast<std::size_t>(r)];
    std::int64_t k = 0;
    for (std::size_t a = 0; a < cfg.rope_axes.size(); ++a)
      for (std::int64_t i = 0; i < cfg.rope_axes[a] / 2; ++i, ++k) {
        const double dim = static_cast<double>(cfg.rope_axes[a]);
        const double angle = pos[a] * std::pow(cfg.rope_theta, -2.0 * static_cast<double>(i) / dim);
        cos[static_cast<std::size_t>(r * half_ + k)] = static_cast<float>(std::cos(angle));
        sin[static_cast<std::size_t>(r * half_ + k)] = static_cast<float>(std::sin(angle));
      }
  }
  cos_.assign(cos);
  sin_.assign(sin);
}

void qk_norm_rope(float* qkv, std::int64_t rows, std::int64_t ld, std::int64_t heads, std::int64_t d,
                  const float* q_scale, const float* k_scale, float eps, const AxialRope* rope, bool across_heads) {
  DIFFCP_CHECK(ld >= 3 * heads * d, "qk_norm_rope: row stride ", ld, " < 3 * heads * d_h = ", 3 * heads * d);
  DIFFCP_CHECK(heads >= 1 && d >= 2 && d % 2 == 0, "qk_norm_rope: heads = ", heads, ", d_h = ", d, " (even d_h >= 2)");
  DIFFCP_CHECK(!rope || rope->rows() == rows, "qk_norm_rope: RoPE table has ", rope ? rope->rows() : 0,
               " rows, expected ", rows);
  TensorView x = TensorView::contiguous(qkv, DType::f32, {rows, 3, heads, d}, active_device());
  x.stride[0] = ld;
  ConstTensorView cos, sin;  // rank 0: no rotation
  if (rope) {
    cos = ConstTensorView::contiguous(rope->cos(0), DType::f32, {rows, d / 2}, active_device());
    sin = ConstTensorView::contiguous(rope->sin(0), DType::f32, {rows, d / 2}, active_device());
  }
  backend_for(OpKind::qk_norm_rope, DType::f32)
      .qk_norm_rope(x, ConstTensorView::contiguous(q_scale, DType::f32, {across_heads ? heads * d : d}, active_device()),
                    ConstTensorView::contiguous(k_scale, DType::f32, {across_heads ? heads * d : d}, active_device()), eps, cos,
                    sin);
}

void l1_distance(const void* a, const void* b, DType t, std::int64_t G, std::int64_t R, std::int64_t w, float* out) {
  DIFFCP_CHECK(t == DType::f32 || t == DType::bf16, "l1_distance: ", dtype_name(t), ", expected f32 or bf16");
  DIFFCP_CHECK(G >= 0 && R >= 0 && w >= 0, "l1_distance: G = ", G, ", R = ", R, ", w = ", w);
  if (R == 0) return;
  const Device d = active_device();
  backend_for(OpKind::l1_distance, t)
      .l1_distance(ConstTensorView::contiguous(a, t, {G, R, w}, d), ConstTensorView::contiguous(b, t, {G, R, w}, d),
                   TensorView::contiguous(out, DType::f32, {R}, d));
}

void select_active(const float* parts, std::int64_t lanes, std::int64_t S, std::int64_t n, std::int64_t k,
                   std::int32_t* active) {
  DIFFCP_CHECK(lanes >= 1 && S >= 0 && n >= 0 && k >= 0 && k <= n, "select_active: ", lanes, " lanes, S = ", S,
               ", n = ", n, ", k = ", k, " (expected lanes >= 1, 0 <= k <= n)");
  if (S == 0 || k == 0) return;
  const Device d = active_device();
  backend_for(OpKind::select_active, DType::f32)
      .select_active(ConstTensorView::contiguous(parts, DType::f32, {lanes, S, n}, d),
                     TensorView::contiguous(active, DType::i32, {S, k}, d));
}

void token_rows(const std::int32_t* active, std::int64_t S, std::int64_t k, const std::int64_t* map, std::int64_t n,
                std::int64_t B, std::int64_t stride, std::int64_t* rows) {
  DIFFCP_CHECK(S >= 1 && k >= 0 && n >= 0 && B >= 0 && stride >= 0, "token_rows: S = ", S, ", k = ", k, ", n = ", n,
               ", B = ", B, ", stride = ", stride);
  if (B == 0 || k == 0) return;
  const Device d = active_device();
  backend_for(OpKind::token_rows, DType::i32)
      .token_rows(ConstTensorView::contiguous(active, DType::i32, {S, k}, d),
                  map ? ConstTensorView::contiguous(map, DType::i64, {n}, d) : ConstTensorView{}, n, stride,
                  TensorView::contiguous(rows, DType::i64, {B, k}, d));
}

}  // namespace diffcp
