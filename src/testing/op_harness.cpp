#include "diffcp/testing/op_harness.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/core/stats.hpp"
#include "diffcp/dit/ops.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/conv.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/fp8.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/loss.hpp"
#include "diffcp/ops/optim.hpp"
#include "diffcp/ops/rmsnorm.hpp"
#include "diffcp/ops/rope.hpp"

namespace diffcp {

namespace {

float* F(const TensorView& t) { return t.ptr<float>(); }
bf16_t* H(const TensorView& t) { return t.ptr<bf16_t>(); }
template <typename T>
HeadRows<T> rows_of(const TensorView& t, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  return {t.ptr<T>(), rows, heads, dim, heads * dim};
}

std::string dims(std::initializer_list<std::pair<const char*, std::int64_t>> d) {
  std::string s;
  for (const auto& [k, v] : d) s += (s.empty() ? "" : " ") + std::string(k) + " " + std::to_string(v);
  return s;
}

// Attention over nb blocks of B rows anchored through a context of S rows (anchors spread over
// it; the first block may see no context at all), with the blocks' own rows after it.
template <typename T>
OpCase attention_case(const char* name, DType dt, std::int64_t nb, std::int64_t B, std::int64_t S, std::int64_t nq,
                      std::int64_t nkv, std::int64_t d) {
  std::vector<MaskBlock> blocks;
  for (std::int64_t i = 0; i < nb; ++i) blocks.push_back({0, nb == 1 ? S : S * (i + 1) / nb, S + i * B});
  const std::int64_t Q = nb * B, Lk = S + Q;
  std::vector<ContextSegment> segments;
  if (S > 0) segments.push_back({0, 0, S});
  auto mask = std::make_shared<BlockMask>(B, Lk, std::move(segments), blocks);
  const std::int64_t q = Q * nq * d, kv = Lk * nkv * d, st = Q * nq;
  // q k v o lse delta do dq dk dv
  OpCase c{name,
           dims({{"blocks", nb}, {"B", B}, {"S", S}, {"n_q", nq}, {"n_kv", nkv}, {"d_h", d}}),
           {{OpKind::attention_forward, dt}, {OpKind::attention_delta, dt}, {OpKind::attention_backward, dt}},
           {{dt, q}, {dt, kv}, {dt, kv}, {dt, q}, {DType::f32, st},
            {DType::f32, st, -1.f, 1.f, OpCompare::value, /*from_bf16=*/dt == DType::bf16}, {dt, q}, {dt, q}, {dt, kv}, {dt, kv}},
           [=](Backend&, std::vector<TensorView>& t) {
             const auto Qr = [&](int i) { return rows_of<T>(t[i], Q, nq, d); };
             const auto Kr = [&](int i) { return rows_of<T>(t[i], Lk, nkv, d); };
             const std::span<float> lse(F(t[4]), st), delta(F(t[5]), st);
             attention_forward(*mask, Qr(0), Kr(1), Kr(2), Qr(3), lse);
             attention_delta(Qr(6), Qr(3), delta);
             attention_backward(*mask, Qr(0), Kr(1), Kr(2), Qr(6), lse, delta, Qr(7), Kr(8), Kr(9));
           },
           1e-4,
           (attention_forward_flops(*mask, nq, d) + attention_backward_flops(*mask, nq, d))};
  return c;
}

}  // namespace

std::vector<OpCase> op_cases() {
  const DType f = DType::f32, h = DType::bf16;
  std::vector<OpCase> cases;
  // GEMMs: an edge (a single row or column, K = 1), the guard suite's shape, and a larger one.
  for (const auto& [M, N, K] : {std::array<std::int64_t, 3>{1, 3, 1}, {20, 16, 24}, {256, 192, 320}}) {
    const std::string shape = dims({{"M", M}, {"N", N}, {"K", K}});
    cases.push_back({"gemm f32 (A^T B^T, alpha, beta, strides)", shape, {{OpKind::gemm, f}},
                     {{f, K * (M + 4)}, {f, N * (K + 1)}, {f, M * (N + 2)}},
                     [=](Backend&, auto& t) { gemm(true, true, M, N, K, 0.5f, F(t[0]), M + 4, F(t[1]), K + 1, 0.25f, F(t[2]), N + 2); },
                     2e-5, 2.0 * M * N * K});
    cases.push_back({"gemm bf16, f32 accumulation", shape, {{OpKind::gemm, h}}, {{h, M * K}, {h, K * N}, {f, M * N}},
                     [=](Backend&, auto& t) { gemm_bf16_f32acc(false, false, M, N, K, 1.f, H(t[0]), K, H(t[1]), N, 1.f, F(t[2]), N); },
                     1e-3, 2.0 * M * N * K});
  }
  cases.push_back({"gemm f32 with bf16 compute (convert)", dims({{"M", 20}, {"N", 16}, {"K", 24}}),
                   {{OpKind::gemm, h}, {OpKind::convert, h}}, {{f, 20 * 30}, {f, 24 * 16}, {f, 20 * 16}},
                   [](Backend&, auto& t) {
                     set_f32_gemm_compute(DType::bf16);
                     gemm(false, false, 20, 16, 24, 1.f, F(t[0]), 30, F(t[1]), 16, 0.f, F(t[2]), 16);
                     set_f32_gemm_compute(DType::f32);
                   },
                   1e-3});
  // The DiT's bf16-weight product: a column slice of a wider weight into a column slice of a wider
  // y, as stored and packed (the packed one made from the backend's memory by the backend).
  cases.push_back({"dense_linear (dit_linear on bf16 weights)", dims({{"M", 20}, {"N", 16}, {"K", 24}}),
                   {{OpKind::dense_linear, h}, {OpKind::convert, h}},
                   {{f, 20 * 30}, {h, 24 * 40}, {f, 40}, {f, 20 * 18}, {f, 20 * 18}}, [](Backend& b, auto& t) {
                     dit_linear(F(t[0]), 30, 20, 24, H(t[1]) + 8, 40, 16, F(t[2]) + 8, F(t[3]), 18);
                     ConstTensorView w = ConstTensorView::contiguous(H(t[1]) + 8, DType::bf16, {24, 16}, b.device());
                     w.stride[0] = 40;
                     const std::unique_ptr<PackedWeight> packed = b.pack_weight(w);
                     dit_linear(F(t[0]), 30, 20, 24, H(t[1]) + 8, 40, 16, F(t[2]) + 8, F(t[4]), 18, packed.get());
                   },
                   1e-3});
  cases.push_back({"bias", dims({{"rows", 12}, {"cols", 40}}), {{OpKind::bias_add, f}, {OpKind::bias_backward, f}},
                   {{f, 12 * 40}, {f, 40}, {f, 40}}, [](Backend&, auto& t) {
                     bias_add(F(t[0]), 12, 40, F(t[1]));
                     bias_backward(F(t[0]), 12, 40, F(t[2]));
                   }});
  // Attention: one block seeing no context (edge), the guard suite's two blocks, and a larger GQA
  // problem (4 query heads per KV head).
  cases.push_back(attention_case<float>("attention f32", f, 1, 4, 0, 2, 1, 8));
  cases.push_back(attention_case<float>("attention f32", f, 2, 4, 24, 4, 2, 16));
  cases.push_back(attention_case<float>("attention f32", f, 4, 16, 1024, 8, 2, 64));
  cases.push_back(attention_case<bf16_t>("attention bf16", h, 2, 4, 24, 4, 2, 16));
  cases.push_back(attention_case<bf16_t>("attention bf16", h, 4, 16, 1024, 8, 2, 64));
  cases.push_back({"lse merge / rescale", dims({{"rows", 6}, {"heads", 2}, {"dim", 8}}),
                   {{OpKind::lse_merge, f}, {OpKind::lse_rescale, f}},
                   {{f, 6 * 2 * 8}, {f, 6 * 2 * 8}, {f, 12}, {f, 12}, {f, 6 * 2 * 8}, {f, 12}},
                   [](Backend&, auto& t) {
                     const HeadRows<const float> parts[] = {rows_of<float>(t[0], 6, 2, 8), rows_of<float>(t[1], 6, 2, 8)};
                     const std::span<const float> lses[] = {{F(t[2]), 12}, {F(t[3]), 12}};
                     lse_merge(parts, lses, rows_of<float>(t[4], 6, 2, 8), {F(t[5]), 12});
                     lse_rescale(rows_of<float>(t[0], 6, 2, 8), {F(t[2]), 12}, {F(t[5]), 12});
                   }});
  cases.push_back({"gather / scatter rows", dims({{"rows", 9}, {"cols", 12}}),
                   {{OpKind::gather_rows, h}, {OpKind::scatter_rows, h}},
                   {{f, 9 * 12}, {h, 4 * 10}, {f, 4 * 5}, {f, 9 * 12}}, [](Backend&, auto& t) {
                     const std::int64_t rows[] = {8, 0, 3, 3};
                     gather_rows(F(t[0]) + 2, DType::f32, 9, 12, rows, 5, H(t[1]), DType::bf16, 10);  // rounded
                     gather_rows(F(t[0]) + 1, DType::f32, 9, 12, rows, 5, F(t[2]), DType::f32, 5);
                     const std::int64_t distinct[] = {7, 1, 4, 0};
                     scatter_rows(H(t[1]), DType::bf16, 10, distinct, 5, F(t[3]) + 6, DType::f32, 9, 12);  // widened
                     scatter_rows(F(t[2]), DType::f32, 5, distinct, 3, F(t[3]), DType::f32, 9, 12);
                     const std::int64_t in_four[] = {3, 1, 2, 0};
                     scatter_rows(H(t[1]), DType::bf16, 10, in_four, 2, H(t[1]) + 5, DType::bf16, 4, 10);
                   }});
  cases.push_back({"l1 distance", dims({{"rows", 3}, {"heads", 4}, {"dim", 5}}), {{OpKind::l1_distance, f}, {OpKind::l1_distance, h}},
                   {{f, 3 * 4 * 5}, {f, 3 * 4 * 5}, {h, 60}, {h, 60}, {f, 4}, {f, 4}}, [](Backend&, auto& t) {
                     l1_distance(F(t[0]), F(t[1]), DType::f32, 3, 4, 5, F(t[4]));
                     l1_distance(H(t[2]), H(t[3]), DType::bf16, 3, 4, 5, F(t[5]));
                   }});
  // V-Major's selection on the device: the choice (ties: source 1's distances all equal), row lists
  // through a map and without, then rows gathered and scattered by those device lists. Index
  // arrays are held in f32 arrays' memory and compared as bytes.
  cases.push_back({"token selection", dims({{"lanes", 2}, {"sources", 3}, {"n", 10}, {"k", 4}}),
                   {{OpKind::select_active, f}, {OpKind::token_rows, DType::i32}, {OpKind::fill, f},
                    {OpKind::gather_rows, f}, {OpKind::gather_rows, h}, {OpKind::scatter_rows, f}},
                   {{f, 60}, {f, 12, -1.f, 1.f, OpCompare::exact}, {f, 10, -1.f, 1.f, OpCompare::exact},
                    {f, 20, -1.f, 1.f, OpCompare::exact}, {f, 48, -1.f, 1.f, OpCompare::exact},
                    {f, 24, -1.f, 1.f, OpCompare::exact}, {f, 60 * 5}, {f, 24 * 5}, {f, 30 * 5}, {h, 24 * 5}},
                   [](Backend&, auto& t) {
                     const auto I32 = [](const TensorView& v) { return static_cast<std::int32_t*>(v.data); };
                     const auto I64 = [](const TensorView& v) { return static_cast<std::int64_t*>(v.data); };
                     fill(F(t[0]) + 10, 10, 0.25f);  // source 1, lane 0
                     fill(F(t[0]) + 40, 10, 0.5f);   // source 1, lane 1: ten equal distances
                     select_active(F(t[0]), 2, 3, 10, 4, I32(t[1]));
                     select_active(F(t[0]), 3, 2, 10, 5, I32(t[2]));           // [2, 5]: ten tokens in [0, 10)
                     token_rows(I32(t[2]), 2, 5, nullptr, 10, 2, 0, I64(t[3]));  // as a map [10]
                     token_rows(I32(t[1]), 3, 4, I64(t[3]), 10, 6, 10, I64(t[4]));
                     token_rows(I32(t[1]), 3, 4, nullptr, 10, 3, 10, I64(t[5]));  // distinct rows of [0, 30)
                     gather_rows(F(t[6]), DType::f32, 60, 5, I64(t[4]), 24, 5, F(t[7]), DType::f32, 5);
                     gather_rows(F(t[6]), DType::f32, 60, 5, I64(t[4]), 24, 5, H(t[9]), DType::bf16, 5);
                     scatter_rows(F(t[7]), DType::f32, 5, I64(t[5]), 12, 5, F(t[8]), DType::f32, 30, 5);
                   }});
  // DFlash2's dynamic convolution: 3 blocks of 4 rows, 3 taps, 4 groups of 4 channels, the taps a
  // slice of the projection's wider rows; dbase accumulates.
  cases.push_back({"dynamic conv", dims({{"T", 12}, {"H", 16}, {"K", 3}, {"G", 4}, {"block", 4}}),
                   {{OpKind::dynamic_conv_forward, f}, {OpKind::dynamic_conv_backward, f}},
                   {{f, 12 * 16}, {f, 12 * 24}, {f, 3 * 16}, {f, 12 * 16}, {f, 12 * 16}, {f, 12 * 16}, {f, 12 * 24},
                    {f, 3 * 16}},
                   [](Backend&, auto& t) {
                     const DynamicConvShape s{12, 16, 3, 4, 4};
                     dynamic_conv_forward(F(t[0]), F(t[1]), 24, F(t[2]), s, F(t[3]));
                     dynamic_conv_backward(F(t[4]), F(t[0]), F(t[1]) + 12, 24, F(t[2]), s, F(t[5]), F(t[6]) + 12, 24,
                                           F(t[7]));
                   }});
  // The fp8 codec (the DiT's --wire fp8): f32 and bf16 blocks of 16 encoded (6 x 20 bytes, held in
  // f32 arrays' memory: compared as bytes) and decoded.
  cases.push_back({"fp8 encode / decode", dims({{"rows", 6}, {"block", 16}}),
                   {{OpKind::fp8_encode, f}, {OpKind::fp8_encode, h}, {OpKind::fp8_decode, f}, {OpKind::fp8_decode, h}},
                   {{f, 6 * 16, -30.f, 30.f}, {h, 6 * 16}, {f, 30, -1.f, 1.f, OpCompare::exact},
                    {f, 30, -1.f, 1.f, OpCompare::exact}, {f, 6 * 16}, {h, 6 * 16}},
                   [](Backend&, auto& t) {
                     fp8_encode(F(t[0]), DType::f32, 6, 16, F(t[2]));
                     fp8_encode(H(t[1]), DType::bf16, 6, 16, F(t[3]));
                     fp8_decode(F(t[2]), 6, 16, F(t[4]), DType::f32);
                     fp8_decode(F(t[3]), 6, 16, H(t[5]), DType::bf16);
                   }});
  cases.push_back({"lse shift", dims({{"n", 40}}), {{OpKind::lse_shift, f}, {OpKind::fill, f}}, {{f, 40}, {f, 40}, {f, 40}},
                   [](Backend&, auto& t) {
                     fill(F(t[1]) + 7, 3, -std::numeric_limits<float>::infinity());  // rows no rank saw
                     device_copy(F(t[2]), F(t[0]), 40);
                     lse_shift_to_exp({F(t[2]), 40}, {F(t[1]), 40});
                     lse_shift_from_exp({F(t[2]), 40}, {F(t[1]), 40});
                   }});
  for (const auto& [rows, heads, d] : {std::array<std::int64_t, 3>{1, 1, 2}, {5, 3, 16}, {512, 8, 128}})
    cases.push_back({"rmsnorm", dims({{"rows", rows}, {"heads", heads}, {"dim", d}}),
                     {{OpKind::rmsnorm_forward, f}, {OpKind::rmsnorm_backward, f}},
                     {{f, rows * heads * d}, {f, d}, {f, rows * heads * d}, {f, rows * heads}, {f, rows * heads * d},
                      {f, rows * heads * d}, {f, d}},
                     [=](Backend&, auto& t) {
                       rmsnorm_forward(F(t[0]), rows, heads, d, F(t[1]), 1e-6f, F(t[2]), F(t[3]));
                       rmsnorm_backward(F(t[4]), F(t[0]), F(t[3]), rows, heads, d, F(t[1]), F(t[5]), F(t[6]));
                     },
                     1e-5 * std::sqrt(static_cast<double>(rows))});  // dw sums over rows
  cases.push_back({"rope", dims({{"rows", 7}, {"heads", 2}, {"d_h", 16}}), {{OpKind::rope, f}}, {{f, 7 * 2 * 16}},
                   [](Backend&, auto& t) {
                     static const RopeTable table(16, 10000.0, 64);
                     const std::int64_t pos[] = {0, 5, 9, 63, 2, 2, 40};  // host metadata, as a GPU gets it
                     rope_apply(F(t[0]), 7, 2, pos, table, false);
                     rope_apply(F(t[0]), 3, 2, std::span(pos).first(3), table, true);
                   }});
  for (const std::int64_t n : {1, 300, 1 << 20})
    cases.push_back({"silu / gelu", dims({{"n", n}}), {{OpKind::silu, f}, {OpKind::gelu_tanh, f}, {OpKind::gelu, f}},
                     {{f, n}, {f, n + n / 10 + 3}, {f, n + n / 10 + 3}},
                     [=](Backend&, auto& t) {
                       silu_inplace(F(t[0]), n);
                       const std::int64_t cols = std::max<std::int64_t>(1, n / 10), rows = n / cols;
                       gelu_tanh_inplace(F(t[1]), rows, cols, cols + 1);  // strided rows
                       gelu_inplace(F(t[2]), rows, cols, cols + 1);
                     }});
  for (const std::int64_t C : {1, 40, 3072})
    cases.push_back({"adaLN modulate / gated add", dims({{"rows", 6}, {"cols", C}}),
                     {{OpKind::layernorm_modulate, f}, {OpKind::gated_add, f}},
                     {{f, 6 * C}, {f, C}, {f, C}, {f, 6 * C}, {f, C}}, [=](Backend&, auto& t) {
                       layernorm_modulate(F(t[0]), 6, C, F(t[1]), F(t[2]), 1e-6f, F(t[3]));
                       gated_add(F(t[0]), 3, C, F(t[4]), F(t[3]), 2 * C);
                     }});
  cases.push_back({"qk norm + rope", dims({{"tokens", 5}, {"heads", 3}, {"d_h", 8}}), {{OpKind::qk_norm_rope, f}},
                   {{f, 5 * 3 * 2 * 8 + 5}, {f, 8}, {f, 8}, {f, 5 * 4}, {f, 5 * 4}}, [](Backend& b, auto& t) {
                     // The hook (dit/ops.hpp's wrapper takes a host AxialRope): cos / sin in device memory.
                     TensorView qkv = TensorView::contiguous(F(t[0]), DType::f32, {5, 3, 2, 8}, b.device());
                     qkv.stride[0] = 3 * 2 * 8 + 1;
                     const auto cs = [&](int i) { return ConstTensorView::contiguous(F(t[i]), DType::f32, {5, 4}, b.device()); };
                     backend_for(OpKind::qk_norm_rope, DType::f32).qk_norm_rope(qkv, t[1], t[2], 1e-6f, cs(3), cs(4));
                   }});
  cases.push_back({"qk norm across heads + rope", dims({{"tokens", 5}, {"heads", 3}, {"d_h", 8}}), {{OpKind::qk_norm_rope, f}},
                   {{f, 5 * 3 * 3 * 8 + 5}, {f, 3 * 8}, {f, 3 * 8}, {f, 5 * 4}, {f, 5 * 4}}, [](Backend& b, auto& t) {
                     // Wan's rms_norm_across_heads: the scales span a row's heads.
                     TensorView qkv = TensorView::contiguous(F(t[0]), DType::f32, {5, 3, 3, 8}, b.device());
                     qkv.stride[0] = 3 * 3 * 8 + 1;
                     const auto cs = [&](int i) { return ConstTensorView::contiguous(F(t[i]), DType::f32, {5, 4}, b.device()); };
                     backend_for(OpKind::qk_norm_rope, DType::f32).qk_norm_rope(qkv, t[1], t[2], 1e-6f, cs(3), cs(4));
                   }});
  for (const std::int64_t n : {1, 500, 1 << 20})
    cases.push_back({"swiglu / add", dims({{"n", n}}),
                     {{OpKind::swiglu_forward, f}, {OpKind::swiglu_backward, f}, {OpKind::add, f}},
                     {{f, n}, {f, n}, {f, std::max<std::int64_t>(n, 9 * 50)}, {f, n}, {f, n}, {f, n}}, [=](Backend&, auto& t) {
                       swiglu_forward(F(t[0]), F(t[1]), F(t[2]), n);
                       swiglu_backward(F(t[3]), F(t[0]), F(t[1]), F(t[4]), F(t[5]), n);
                       add_into(F(t[4]), F(t[5]), n);
                       axpy(F(t[3]), -0.37f, F(t[4]), n);
                       swiglu_rows(F(t[2]), 9, 20, 50);  // strided rows, in place (FLUX.2's fused MLP input)
                     }});
  cases.push_back({"guidance combine", dims({{"rows", 7}, {"cols", 64}}), {{OpKind::guidance_combine, f}},
                   {{f, 7 * 64}, {f, 7 * 64}, {f, 7 * 64}}, [](Backend&, auto& t) {
                     device_copy(F(t[2]), F(t[0]), 7 * 64);
                     guidance_combine(F(t[0]), F(t[1]), 7, 64, 4.f, true);
                     guidance_combine(F(t[2]), F(t[1]), 7, 64, 2.5f, false);
                   }});
  for (const std::int64_t n : {1, 333, 1 << 20})
    cases.push_back({"adamw", dims({{"n", n}}), {{OpKind::adamw_step, f}}, {{f, n}, {f, n}, {f, n}, {f, n, 0.f, 1.f}},
                     [=](Backend&, auto& t) {
                       adamw_step(F(t[0]), F(t[1]), F(t[2]), F(t[3]), n, {0.9f, 0.95f, 1e-3f, 1.2f, 1e-8f, 0.999f});
                     }});
  // The per-row statistics are host results: stored as doubles in t[3]'s bytes so they are compared too.
  cases.push_back({"cross entropy / scale_sumsq", dims({{"rows", 6}, {"vocab", 37}}),
                   {{OpKind::cross_entropy, f}, {OpKind::cross_entropy_backward, f}, {OpKind::scale_sumsq, f}},
                   {{f, 6 * 37, -4.f, 4.f}, {f, 6 * 37, -4.f, 4.f}, {f, 6 * 37, -4.f, 4.f}, {f, 100, -1.f, 1.f, OpCompare::f64_bytes},
                    {f, 101}},
                   [](Backend& b, auto& t) {
                     const std::int32_t whole[] = {0, 36, 5, 12, 17, 17}, sliced[] = {0, 46, 15, 40, 17, 9};
                     const double w[] = {0, 1, 0.5, 0.25, 1, 2};
                     std::vector<double> st(50), lse(6);
                     cross_entropy(F(t[0]), 6, 37, 0, whole, {st.data(), 24}, w);  // stats + dlogits
                     cross_entropy(F(t[1]), 6, 37, 10, sliced, {st.data() + 24, 24});  // a vocabulary slice
                     for (std::size_t i = 0; i < 6; ++i) lse[i] = st[24 + 4 * i] + std::log(st[25 + 4 * i]);
                     cross_entropy_backward(F(t[2]), 6, 37, 10, sliced, w, lse);
                     st[48] = scale_sumsq(F(t[4]), 101, 0.37);
                     st[49] = scale_sumsq(F(t[4]) + 3, 50, 1.0 / 3);
                     copy(TensorView::contiguous(t[3].data, DType::u8, {400}, b.device()),
                          ConstTensorView::contiguous(st.data(), DType::u8, {400}));
                   }});
  // DFlash2's logits: the map (multiplier, soft cap), each row's top-K as host results (the values
  // stored over t[1]'s first 30, the ids as bytes in t[2]), and the backward through the map with
  // the selector's sparse gradient.
  cases.push_back({"logit map / top-K", dims({{"rows", 5}, {"vocab", 41}, {"k", 6}}),
                   {{OpKind::logit_map, f}, {OpKind::top_k, f}, {OpKind::cross_entropy, f}, {OpKind::cross_entropy_backward, f}},
                   {{f, 5 * 41, -6.f, 6.f}, {f, 5 * 41, -6.f, 6.f}, {f, 30, -1.f, 1.f, OpCompare::exact}},
                   [](Backend& b, auto& t) {
                     const LogitMap capped{0.75f, 3.f};
                     logit_map(F(t[0]), 5, 41, capped);
                     logit_map(F(t[1]), 5, 41, {1.5f, 0.f});
                     std::vector<float> val(30);
                     std::vector<std::int32_t> ids(30);
                     top_k(F(t[0]), 5, 41, 7, val, ids);
                     const std::int32_t target[] = {7, 20, 47, 9, 30};
                     const double w[] = {1, 0.5, 0, 2, 1};
                     std::vector<double> st(20), lse(5), grad(30);
                     cross_entropy(F(t[0]), 5, 41, 7, target, st);
                     for (std::size_t i = 0; i < 5; ++i) lse[i] = st[4 * i] + std::log(st[4 * i + 1]);
                     for (std::size_t j = 0; j < 30; ++j) grad[j] = 0.1 * static_cast<double>(j % 7) - 0.3;
                     copy(TensorView::contiguous(t[2].data, DType::u8, {120}, b.device()),
                          ConstTensorView::contiguous(ids.data(), DType::u8, {120}));
                     copy(TensorView::contiguous(F(t[1]), DType::f32, {30}, b.device()),
                          ConstTensorView::contiguous(val.data(), DType::f32, {30}));
                     ids[3] = -1;  // outside the chunk: skipped
                     cross_entropy_backward(F(t[0]), 5, 41, 7, target, w, lse, capped, {ids, grad});
                   }});
  cases.push_back({"fill / convert", dims({{"n", 100}}), {{OpKind::fill, f}, {OpKind::fill, h}, {OpKind::convert, h}},
                   {{f, 100}, {h, 100}, {h, 50}}, [](Backend&, auto& t) {
                     convert(t[0], t[1]);
                     fill(t[2], -2.25f);
                     convert(t[2], TensorView::contiguous(F(t[0]), DType::f32, {50}, t[0].device));
                     fill(F(t[0]) + 60, 40, 0.1f);  // f32: every bit of the value
                     convert_rows(F(t[0]) + 10, DType::f32, 0, F(t[0]) + 20, DType::f32, 12, 3, 8);  // a broadcast
                   }});
  return cases;
}

namespace {

// The case's arrays in b's memory, from the seeded inputs.
std::vector<Buffer> make_arrays(Backend& b, const OpCase& c, std::vector<TensorView>& views) {
  std::vector<Buffer> bufs;
  std::uint64_t seed = 11;
  for (const OpArray& a : c.arrays) {
    std::vector<float> init = random_normal(static_cast<std::size_t>(a.n), seed++);
    for (float& x : init) x = a.lo + (a.hi - a.lo) * (0.5f + 0.5f * std::tanh(x));
    bufs.emplace_back(a.dtype, a.n, b);
    if (a.dtype == DType::bf16) {
      std::vector<bf16_t> hv(init.size());
      convert_to_bf16(init.data(), hv.data(), a.n);
      copy(bufs.back().view(), view_of(std::span<const bf16_t>(hv)));
    } else {
      copy(bufs.back().view(), view_of(std::span<const float>(init)));
    }
    views.push_back(bufs.back().view());
  }
  return bufs;
}

std::vector<double> values_of(const OpArray& a, const std::vector<unsigned char>& bytes) {
  std::vector<double> v;
  if (a.cmp == OpCompare::f64_bytes) {
    v.resize(bytes.size() / sizeof(double));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(double));
  } else if (a.dtype == DType::bf16) {
    for (std::size_t i = 0; i + 1 < bytes.size(); i += 2) {
      std::uint16_t bits;
      std::memcpy(&bits, bytes.data() + i, 2);
      v.push_back(bf16_to_f32(bits));
    }
  } else {
    v.resize(bytes.size() / sizeof(float));
    for (std::size_t i = 0; i < v.size(); ++i) {
      float x;
      std::memcpy(&x, bytes.data() + i * sizeof(float), sizeof(float));
      v[i] = x;
    }
  }
  return v;
}

double median_ms(Backend& b, const OpCase& c, int reps) {
  ScopedBackend on(b);
  std::vector<TensorView> views;
  std::vector<Buffer> bufs = make_arrays(b, c, views);
  c.body(b, views);  // warm-up
  b.synchronize();
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    c.body(b, views);
    b.synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(ms);
}

}  // namespace

std::vector<std::vector<unsigned char>> run_op_case(Backend& b, const OpCase& c) {
  ScopedBackend on(b);
  std::vector<TensorView> views;
  std::vector<Buffer> bufs = make_arrays(b, c, views);
  c.body(b, views);
  b.synchronize();
  std::vector<std::vector<unsigned char>> out;
  for (const Buffer& buf : bufs) {
    out.emplace_back(buf.bytes());
    TensorView host = TensorView::contiguous(out.back().data(), DType::u8, {static_cast<std::int64_t>(buf.bytes())});
    TensorView dev = TensorView::contiguous(buf.data(), DType::u8, {static_cast<std::int64_t>(buf.bytes())}, buf.device());
    copy(host, dev);
  }
  return out;
}

namespace {
bool case_matches(const OpCase& c, const std::string& op) {
  if (op.empty() || c.name.find(op) != std::string::npos) return true;
  for (const auto& [kind, dt] : c.ops)
    if (std::string(op_name(kind)).find(op) != std::string::npos) return true;
  return false;
}
}  // namespace

std::vector<OpResult> run_op_harness(Backend& b, const OpHarnessOptions& o) {
  Backend& ref_backend = o.reference != nullptr ? *o.reference : cpu_backend();
  std::vector<OpResult> results;
  for (const OpCase& c : op_cases()) {
    if (!case_matches(c, o.op)) continue;
    OpResult r;
    r.name = c.name;
    r.shape = c.shape;
    for (const OpArray& a : c.arrays) r.bytes += static_cast<double>(a.n * static_cast<std::int64_t>(dtype_size(a.dtype)));
    r.flops = c.flops;
    for (const auto& [op, dt] : c.ops)
      if (!b.supports(op, dt)) {
        r.skipped = true;
        r.skip_reason = std::string(op_name(op)) + " on " + dtype_name(dt);
      }
    if (r.skipped) {
      results.push_back(r);
      continue;
    }
    const auto ref = run_op_case(ref_backend, c);
    const auto got = run_op_case(b, c);
    std::ostringstream why;
    for (std::size_t i = 0; i < c.arrays.size(); ++i) {
      const OpArray& a = c.arrays[i];
      const std::string what = "array " + std::to_string(i) + " (" + dtype_name(a.dtype) + "[" + std::to_string(a.n) + "])";
      if (a.cmp == OpCompare::exact) {
        if (got[i] != ref[i]) why << what << ": bytes differ; ";
        continue;
      }
      const std::vector<double> x = values_of(a, got[i]), y = values_of(a, ref[i]);
      double scale = 0, err = 0;
      std::size_t at = 0;
      for (std::size_t j = 0; j < y.size(); ++j)
        if (std::isfinite(y[j])) scale = std::max(scale, std::abs(y[j]));
      for (std::size_t j = 0; j < y.size(); ++j) {
        const bool both_same_nonfinite =
            !std::isfinite(y[j]) && (std::isnan(y[j]) ? std::isnan(x[j]) : x[j] == y[j]);
        double e = !std::isfinite(y[j]) ? (both_same_nonfinite ? 0.0 : std::numeric_limits<double>::infinity())
                                         : std::abs(x[j] - y[j]) / std::max(scale, 1e-30);
        if (std::isnan(e)) e = std::numeric_limits<double>::infinity();  // a NaN where the CPU has a number
        if (e > err) err = e, at = j;
      }
      const double bound = a.dtype == DType::bf16 || a.from_bf16 ? std::max(c.bound, kBf16Bound) : c.bound;
      r.worst = std::max(r.worst, err / bound);
      if (!(err <= bound))
        why << what << ": normalised error " << err << " > bound " << bound << " (element " << at << ": " << x[at]
            << ", the reference's " << y[at] << "); ";
    }
    r.failure = why.str();
    if (o.perf) {
      r.cpu_ms = median_ms(ref_backend, c, o.reps);
      r.backend_ms = median_ms(b, c, o.reps);
    }
    results.push_back(r);
  }
  return results;
}

std::vector<OpHarnessTarget> op_harness_targets() {
  std::vector<OpHarnessTarget> out;
  for (Backend* b : registered_backends())
    if (b != &cpu_backend()) out.push_back({b->name(), b, &cpu_backend()});
  std::vector<std::string> isas;
  for (const CpuIsa& isa : cpu_isas())
    if (isa.supported) isas.push_back(isa.name);  // widest first
  if (isas.size() < 2) return out;
  const std::string base = std::find(isas.begin(), isas.end(), "generic") != isas.end() ? "generic" : isas.back();
  for (const std::string& isa : isas)
    out.push_back({"cpu:" + isa, &cpu_backend(isa), &cpu_backend(isa == base ? isas.front() : base)});
  return out;
}

}  // namespace diffcp
