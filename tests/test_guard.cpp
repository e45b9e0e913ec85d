// The guard device (testing/guard_backend.hpp) and the backend's memory (ops/buffer.hpp):
//  - a host touch of guard memory faults at once (the guard works);
//  - a host pointer handed to a guard op is refused with an error naming the op and the tensor;
//  - every op computes on the guard bit for bit what it computes on the CPU backend, each op's
//    arguments living in guard buffers and reaching the host only through the backend's copy;
//  - Buffer, fill, convert and copy on both backends.
#include <csignal>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/dit/ops.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/fp8.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/loss.hpp"
#include "diffcp/ops/optim.hpp"
#include "diffcp/ops/rmsnorm.hpp"
#include "diffcp/ops/rope.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "error_of.hpp"

namespace diffcp {
namespace {

TEST(GuardDevice, HostReadOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Buffer b(DType::f32, 16, guard_backend());
  EXPECT_EXIT(
      {
        const volatile float* p = b.ptr<float>();
        std::printf("%f\n", static_cast<double>(p[3]));
      },
      testing::KilledBySignal(SIGSEGV), "guard device: SIGSEGV");
}

TEST(GuardDevice, HostWriteOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Buffer b(DType::bf16, 1000, guard_backend());
  EXPECT_EXIT({ static_cast<volatile bf16_t*>(b.data())[999].bits = 1; }, testing::KilledBySignal(SIGSEGV),
              "guard device: SIGSEGV");
}

TEST(GuardDevice, HostPointersInDeviceOpsAreRefused) {
  std::vector<float> y(8, 1.f), x(8, 2.f);
  Buffer dy(DType::f32, 8, guard_backend());
  ScopedBackend on(guard_backend());
  const std::string e = error_of([&] { add_into(y.data(), x.data(), 8); });
  EXPECT_TRUE(e.starts_with("guard: add: ") && e.find(" (32 bytes at ") != std::string::npos &&
              e.find("is not guard device memory: host memory handed to a device op") != std::string::npos)
      << e;
  // A view one element past the buffer's end is refused as well (the allocated size is checked,
  // not the page-rounded mapping), and so is guard memory in a view labelled host.
  Buffer small(DType::f32, 10, guard_backend());
  EXPECT_NE(error_of([&] { add_into(small.ptr<float>(), small.ptr<float>(), 11); }).find("is not guard device memory"),
            std::string::npos);
  EXPECT_NO_THROW(add_into(small.ptr<float>(), small.ptr<float>(), 10));
  std::vector<float> host(10);
  EXPECT_NE(error_of([&] {
              copy(view_of(std::span<float>(host)), ConstTensorView::contiguous(small.data(), DType::f32, {10}));
            }).find("is guard device memory in a view labelled host"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fill(view_of(std::span<float>(y)), 0.f); }).find("is not a contiguous view of guard memory"),
            std::string::npos);
}

TEST(GuardDevice, BuffersCopiesFillAndConvert) {
  for (Backend* b : {&cpu_backend(), static_cast<Backend*>(&guard_backend())}) {
    SCOPED_TRACE(b->name());
    ScopedBackend on(*b);
    const std::vector<float> host = random_normal(1000, 5);
    Buffer f = to_device(std::span<const float>(host), *b);
    EXPECT_EQ(f.device(), b->device());
    EXPECT_EQ(f.bytes(), 4000u);
    Buffer h(DType::bf16, 1000, *b), back(DType::f32, 1000, *b);
    convert(f.view(), h.view());
    convert(h.view(), back.view());
    const std::vector<float> round = to_host<float>(back.view());
    for (std::size_t i = 0; i < host.size(); ++i) ASSERT_EQ(round[i], bf16_to_f32(f32_to_bf16(host[i]))) << i;
    // [rows, cols] with a row stride: the middle 3 of every 10 values.
    Buffer mid(DType::bf16, 300, *b);
    TensorView rows = f.view({100, 10});
    rows.data = f.ptr<float>() + 4;
    rows.shape[1] = 3;
    convert(rows, mid.view({100, 3}));
    const std::vector<bf16_t> m = to_host<bf16_t>(mid.view());
    for (int r = 0; r < 100; ++r)
      for (int c = 0; c < 3; ++c) ASSERT_EQ(m[r * 3 + c].bits, f32_to_bf16(host[r * 10 + 4 + c]));
    fill(h.view(), 1.5f);
    for (bf16_t v : to_host<bf16_t>(h.view())) ASSERT_EQ(bf16_to_f32(v.bits), 1.5f);
    // reserve() grows only; a grown buffer is a fresh allocation of the same backend.
    f.reserve(10);
    EXPECT_EQ(f.numel(), 1000);
    f.reserve(5000);
    EXPECT_EQ(f.numel(), 5000);
    EXPECT_EQ(f.backend(), b);
    EXPECT_NE(error_of([&] { (void)f.view({5001}); }).find("does not fit"), std::string::npos);
    EXPECT_NE(error_of([&] { convert(f.view({10}), h.view({11})); }).find("differ in shape"), std::string::npos);
  }
  const GuardBackend::Counters c = guard_backend().counters();
  EXPECT_GE(c.host_to_device, 4000u);
  EXPECT_GE(c.device_to_host, 4000u + 600u + 2000u);
}

// ---- every op: the guard computes what the CPU computes, bit for bit ----

struct Array {
  DType dtype;
  std::int64_t n;
  float lo = -1.f, hi = 1.f;  // initial values uniform in [lo, hi) (bf16: rounded)
};
// The op under test, given its arrays as views of the backend's memory (bodies call the public ops;
// the active backend is the one under test).
using Body = std::function<void(Backend& b, std::vector<TensorView>& t)>;
struct OpCase {
  const char* name;
  std::vector<OpKind> ops;
  std::vector<Array> arrays;
  Body body;
};

std::vector<std::vector<unsigned char>> run_case(Backend& b, const OpCase& c) {
  ScopedBackend on(b);
  std::vector<Buffer> bufs;
  std::vector<TensorView> views;
  std::uint64_t seed = 11;
  for (const Array& a : c.arrays) {
    std::vector<float> init = random_normal(static_cast<std::size_t>(a.n), seed++);
    for (float& x : init) x = a.lo + (a.hi - a.lo) * (0.5f + 0.5f * std::tanh(x));
    bufs.emplace_back(a.dtype, a.n, b);
    if (a.dtype == DType::bf16) {
      std::vector<bf16_t> h(init.size());
      convert_to_bf16(init.data(), h.data(), a.n);
      copy(bufs.back().view(), view_of(std::span<const bf16_t>(h)));
    } else {
      copy(bufs.back().view(), view_of(std::span<const float>(init)));
    }
    views.push_back(bufs.back().view());
  }
  c.body(b, views);
  std::vector<std::vector<unsigned char>> out;
  for (const Buffer& buf : bufs) {
    out.emplace_back(buf.bytes());
    TensorView host = TensorView::contiguous(out.back().data(), DType::u8, {static_cast<std::int64_t>(buf.bytes())});
    TensorView dev = TensorView::contiguous(buf.data(), DType::u8, {static_cast<std::int64_t>(buf.bytes())}, buf.device());
    copy(host, dev);
  }
  return out;
}

float* F(const TensorView& t) { return t.ptr<float>(); }
bf16_t* H(const TensorView& t) { return t.ptr<bf16_t>(); }
template <typename T>
HeadRows<T> rows_of(const TensorView& t, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  return {t.ptr<T>(), rows, heads, dim, heads * dim};
}

// Two blocks of B = 4 over a 24-row context (anchors 10 and 20) plus their own rows: L_k = 32.
const BlockMask& mask() {
  static const BlockMask m(4, 32, {{0, 0, 24}}, {{0, 10, 24}, {0, 20, 28}});
  return m;
}
constexpr std::int64_t kQ = 8, kLk = 32, kNq = 4, kNkv = 2, kD = 16;

template <typename T>
OpCase attention_case(const char* name, DType dt) {
  const std::int64_t q = kQ * kNq * kD, kv = kLk * kNkv * kD, st = kQ * kNq;
  // q k v o lse delta do dq dk dv
  return {name,
          {OpKind::attention_forward, OpKind::attention_delta, OpKind::attention_backward},
          {{dt, q}, {dt, kv}, {dt, kv}, {dt, q}, {DType::f32, st}, {DType::f32, st}, {dt, q}, {dt, q}, {dt, kv}, {dt, kv}},
          [](Backend&, std::vector<TensorView>& t) {
            const auto Qr = [&](int i) { return rows_of<T>(t[i], kQ, kNq, kD); };
            const auto Kr = [&](int i) { return rows_of<T>(t[i], kLk, kNkv, kD); };
            const std::span<float> lse(F(t[4]), kQ * kNq), delta(F(t[5]), kQ * kNq);
            attention_forward(mask(), Qr(0), Kr(1), Kr(2), Qr(3), lse);
            attention_delta(Qr(6), Qr(3), delta);
            attention_backward(mask(), Qr(0), Kr(1), Kr(2), Qr(6), lse, delta, Qr(7), Kr(8), Kr(9));
          }};
}

std::vector<OpCase> op_cases() {
  const DType f = DType::f32, h = DType::bf16;
  std::vector<OpCase> cases;
  cases.push_back({"gemm f32", {OpKind::gemm}, {{f, 24 * 20}, {f, 16 * 24}, {f, 20 * 18}}, [](Backend&, auto& t) {
                     gemm(true, true, 20, 16, 24, 0.5f, F(t[0]), 20, F(t[1]), 24, 0.25f, F(t[2]), 18);
                   }});
  cases.push_back({"gemm bf16", {OpKind::gemm}, {{h, 20 * 24}, {h, 24 * 16}, {f, 20 * 16}}, [](Backend&, auto& t) {
                     gemm_bf16_f32acc(false, false, 20, 16, 24, 1.f, H(t[0]), 24, H(t[1]), 16, 1.f, F(t[2]), 16);
                   }});
  cases.push_back({"gemm f32 with bf16 compute (convert)", {OpKind::gemm, OpKind::convert},
                   {{f, 20 * 30}, {f, 24 * 16}, {f, 20 * 16}}, [](Backend&, auto& t) {
                     set_f32_gemm_compute(DType::bf16);
                     gemm(false, false, 20, 16, 24, 1.f, F(t[0]), 30, F(t[1]), 16, 0.f, F(t[2]), 16);
                     set_f32_gemm_compute(DType::f32);
                   }});
  // The DiT's bf16-weight product: a column slice of a wider weight into a column slice of a wider
  // y, as stored and packed (the packed one made from guard memory by the guard backend).
  cases.push_back({"dense_linear (dit_linear on bf16 weights)", {OpKind::dense_linear, OpKind::convert},
                   {{f, 20 * 30}, {h, 24 * 40}, {f, 40}, {f, 20 * 18}, {f, 20 * 18}}, [](Backend& b, auto& t) {
                     dit_linear(F(t[0]), 30, 20, 24, H(t[1]) + 8, 40, 16, F(t[2]) + 8, F(t[3]), 18);
                     ConstTensorView w = ConstTensorView::contiguous(H(t[1]) + 8, DType::bf16, {24, 16}, b.device());
                     w.stride[0] = 40;
                     const std::unique_ptr<PackedWeight> packed = b.pack_weight(w);
                     dit_linear(F(t[0]), 30, 20, 24, H(t[1]) + 8, 40, 16, F(t[2]) + 8, F(t[4]), 18, packed.get());
                   }});
  cases.push_back({"bias", {OpKind::bias_add, OpKind::bias_backward}, {{f, 12 * 40}, {f, 40}, {f, 40}},
                   [](Backend&, auto& t) {
                     bias_add(F(t[0]), 12, 40, F(t[1]));
                     bias_backward(F(t[0]), 12, 40, F(t[2]));
                   }});
  cases.push_back(attention_case<float>("attention f32", f));
  cases.push_back(attention_case<bf16_t>("attention bf16", h));
  cases.push_back({"lse merge / rescale", {OpKind::lse_merge, OpKind::lse_rescale},
                   {{f, 6 * 2 * 8}, {f, 6 * 2 * 8}, {f, 12}, {f, 12}, {f, 6 * 2 * 8}, {f, 12}},
                   [](Backend&, auto& t) {
                     const HeadRows<const float> parts[] = {rows_of<float>(t[0], 6, 2, 8), rows_of<float>(t[1], 6, 2, 8)};
                     const std::span<const float> lses[] = {{F(t[2]), 12}, {F(t[3]), 12}};
                     lse_merge(parts, lses, rows_of<float>(t[4], 6, 2, 8), {F(t[5]), 12});
                     lse_rescale(rows_of<float>(t[0], 6, 2, 8), {F(t[2]), 12}, {F(t[5]), 12});
                   }});
  cases.push_back({"gather / scatter rows", {OpKind::gather_rows, OpKind::scatter_rows},
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
  cases.push_back({"l1 distance", {OpKind::l1_distance}, {{f, 3 * 4 * 5}, {f, 3 * 4 * 5}, {h, 60}, {h, 60}, {f, 4}, {f, 4}},
                   [](Backend&, auto& t) {
                     l1_distance(F(t[0]), F(t[1]), DType::f32, 3, 4, 5, F(t[4]));
                     l1_distance(H(t[2]), H(t[3]), DType::bf16, 3, 4, 5, F(t[5]));
                   }});
  // The fp8 codec (the DiT's --wire fp8): f32 and bf16 blocks of 16 encoded (6 x 20 bytes, held in
  // f32 arrays' memory) and decoded.
  cases.push_back({"fp8 encode / decode", {OpKind::fp8_encode, OpKind::fp8_decode},
                   {{f, 6 * 16, -30.f, 30.f}, {h, 6 * 16}, {f, 30}, {f, 30}, {f, 6 * 16}, {h, 6 * 16}},
                   [](Backend&, auto& t) {
                     fp8_encode(F(t[0]), DType::f32, 6, 16, F(t[2]));
                     fp8_encode(H(t[1]), DType::bf16, 6, 16, F(t[3]));
                     fp8_decode(F(t[2]), 6, 16, F(t[4]), DType::f32);
                     fp8_decode(F(t[3]), 6, 16, H(t[5]), DType::bf16);
                   }});
  cases.push_back({"lse shift", {OpKind::lse_shift}, {{f, 40}, {f, 40}, {f, 40}}, [](Backend& b, auto& t) {
                     fill(F(t[1]) + 7, 3, -std::numeric_limits<float>::infinity());  // rows no rank saw
                     device_copy(F(t[2]), F(t[0]), 40);
                     lse_shift_to_exp({F(t[2]), 40}, {F(t[1]), 40});
                     lse_shift_from_exp({F(t[2]), 40}, {F(t[1]), 40});
                   }});
  cases.push_back({"rmsnorm", {OpKind::rmsnorm_forward, OpKind::rmsnorm_backward},
                   {{f, 5 * 3 * 16}, {f, 16}, {f, 5 * 3 * 16}, {f, 15}, {f, 5 * 3 * 16}, {f, 5 * 3 * 16}, {f, 16}},
                   [](Backend&, auto& t) {
                     rmsnorm_forward(F(t[0]), 5, 3, 16, F(t[1]), 1e-6f, F(t[2]), F(t[3]));
                     rmsnorm_backward(F(t[4]), F(t[0]), F(t[3]), 5, 3, 16, F(t[1]), F(t[5]), F(t[6]));
                   }});
  cases.push_back({"rope", {OpKind::rope}, {{f, 7 * 2 * 16}}, [](Backend&, auto& t) {
                     static const RopeTable table(16, 10000.0, 64);
                     const std::int64_t pos[] = {0, 5, 9, 63, 2, 2, 40};  // host metadata, as a GPU gets it
                     rope_apply(F(t[0]), 7, 2, pos, table, false);
                     rope_apply(F(t[0]), 3, 2, std::span(pos).first(3), table, true);
                   }});
  cases.push_back({"silu / gelu", {OpKind::silu, OpKind::gelu_tanh}, {{f, 300}, {f, 9 * 33}}, [](Backend&, auto& t) {
                     silu_inplace(F(t[0]), 300);
                     gelu_tanh_inplace(F(t[1]), 9, 30, 33);
                   }});
  cases.push_back({"adaLN modulate / gated add", {OpKind::layernorm_modulate, OpKind::gated_add},
                   {{f, 6 * 40}, {f, 40}, {f, 40}, {f, 6 * 40}, {f, 40}}, [](Backend&, auto& t) {
                     layernorm_modulate(F(t[0]), 6, 40, F(t[1]), F(t[2]), 1e-6f, F(t[3]));
                     gated_add(F(t[0]), 3, 40, F(t[4]), F(t[3]), 80);
                   }});
  cases.push_back({"qk norm + rope", {OpKind::qk_norm_rope},
                   {{f, 5 * 3 * 2 * 8 + 5}, {f, 8}, {f, 8}, {f, 5 * 4}, {f, 5 * 4}}, [](Backend& b, auto& t) {
                     // The hook (dit/ops.hpp's wrapper takes a host AxialRope): cos / sin in device memory.
                     TensorView qkv = TensorView::contiguous(F(t[0]), DType::f32, {5, 3, 2, 8}, b.device());
                     qkv.stride[0] = 3 * 2 * 8 + 1;
                     const auto cs = [&](int i) { return ConstTensorView::contiguous(F(t[i]), DType::f32, {5, 4}, b.device()); };
                     backend_for(OpKind::qk_norm_rope, DType::f32).qk_norm_rope(qkv, t[1], t[2], 1e-6f, cs(3), cs(4));
                   }});
  cases.push_back({"swiglu / add", {OpKind::swiglu_forward, OpKind::swiglu_backward, OpKind::add},
                   {{f, 500}, {f, 500}, {f, 500}, {f, 500}, {f, 500}, {f, 500}}, [](Backend&, auto& t) {
                     swiglu_forward(F(t[0]), F(t[1]), F(t[2]), 500);
                     swiglu_backward(F(t[3]), F(t[0]), F(t[1]), F(t[4]), F(t[5]), 500);
                     add_into(F(t[4]), F(t[5]), 500);
                     axpy(F(t[3]), -0.37f, F(t[4]), 500);
                     swiglu_rows(F(t[2]), 9, 20, 50);  // strided rows, in place (FLUX.2's fused MLP input)
                   }});
  cases.push_back({"guidance combine", {OpKind::guidance_combine}, {{f, 7 * 64}, {f, 7 * 64}, {f, 7 * 64}},
                   [](Backend&, auto& t) {
                     device_copy(F(t[2]), F(t[0]), 7 * 64);
                     guidance_combine(F(t[0]), F(t[1]), 7, 64, 4.f, true);
                     guidance_combine(F(t[2]), F(t[1]), 7, 64, 2.5f, false);
                   }});
  cases.push_back({"adamw", {OpKind::adamw_step}, {{f, 333}, {f, 333}, {f, 333}, {f, 333, 0.f, 1.f}},
                   [](Backend&, auto& t) {
                     adamw_step(F(t[0]), F(t[1]), F(t[2]), F(t[3]), 333, {0.9f, 0.95f, 1e-3f, 1.2f, 1e-8f, 0.999f});
                   }});
  // The per-row statistics are host results: stored as raw bytes in t[3] so they are compared too.
  cases.push_back({"cross entropy / scale_sumsq",
                   {OpKind::cross_entropy, OpKind::cross_entropy_backward, OpKind::scale_sumsq},
                   {{f, 6 * 37, -4.f, 4.f}, {f, 6 * 37, -4.f, 4.f}, {f, 6 * 37, -4.f, 4.f}, {f, 100}, {f, 101}},
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
  cases.push_back({"fill / convert", {OpKind::fill, OpKind::convert}, {{f, 100}, {h, 100}, {h, 50}}, [](Backend&, auto& t) {
                     convert(t[0], t[1]);
                     fill(t[2], -2.25f);
                     convert(t[2], TensorView::contiguous(F(t[0]), DType::f32, {50}, t[0].device));
                     fill(F(t[0]) + 60, 40, 0.1f);  // f32: every bit of the value
                     convert_rows(F(t[0]) + 10, DType::f32, 0, F(t[0]) + 20, DType::f32, 12, 3, 8);  // a broadcast
                   }});
  return cases;
}

TEST(GuardDevice, EveryOpComputesWhatTheCpuComputes) {
  std::set<OpKind> covered;
  for (const OpCase& c : op_cases()) {
    SCOPED_TRACE(c.name);
    const std::int64_t ops_before = guard_backend().counters().ops;
    const auto cpu = run_case(cpu_backend(), c);
    const auto guard = run_case(guard_backend(), c);
    EXPECT_GE(guard_backend().counters().ops - ops_before, static_cast<std::int64_t>(c.ops.size()));
    ASSERT_EQ(cpu.size(), guard.size());
    for (std::size_t i = 0; i < cpu.size(); ++i) EXPECT_TRUE(cpu[i] == guard[i]) << "array " << i << " differs";
    covered.insert(c.ops.begin(), c.ops.end());
  }
  for (int k = 0; k < kOpKindCount; ++k)
    EXPECT_TRUE(covered.count(static_cast<OpKind>(k))) << op_name(static_cast<OpKind>(k)) << " has no guard case";
}

}  // namespace
}  // namespace diffcp
