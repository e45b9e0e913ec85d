// CPU GEMM (ops/gemm.hpp) on oneDNN (sgemm.hpp).
// Row-major throughout: C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C.
//   f32:  oneDNN's sgemm.
//   bf16: oneDNN matmul primitives (bf16 A and B, f32 accumulation, f32 or bf16 C), cached per
//         thread: oneDNN 2.x has no bf16 gemm in its C API. The attention tiles get one per fixed
//         shape (brgemm kernels); the layers' GEMMs, whose rows change every step, one per
//         (N, strides) with M and K given at run time (gemm:jit; creating a primitive costs
//         0.1-0.5 ms). All three extents at run time select oneDNN's reference kernel. Where
//         oneDNN has no bf16 matmul for the CPU (e.g. AVX2 only), the operands are converted and
//         multiplied by sgemm; bf16_gemm_path() says which path runs.
#include <oneapi/dnnl/dnnl.h>

#include <oneapi/dnnl/dnnl.hpp>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "cpu_backend.hpp"
#include "sgemm.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

void sgemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
           std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) [[unlikely]] {  // oneDNN needs K >= 1; the product is empty: C = beta * C
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const dnnl_status_t st = dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  DIFFCP_CHECK(st == dnnl_success, "dnnl_sgemm(", ta, tb, " M=", M, " N=", N, " K=", K, ") failed: status ",
               static_cast<int>(st));
}

namespace {

using dnnl_dt = dnnl::memory::data_type;

struct MatmulKey {
  bool ta, tb, c_bf16, runtime_mk;  // runtime_mk: M and K given per call (0 in the key)
  std::int64_t M, N, K, lda, ldb, ldc;
  float alpha, beta;
  bool operator==(const MatmulKey&) const = default;
};
struct MatmulKeyHash {
  std::size_t operator()(const MatmulKey& k) const {
    std::size_t h = (k.ta ? 1u : 0u) | (k.tb ? 2u : 0u) | (k.c_bf16 ? 4u : 0u) | (k.runtime_mk ? 8u : 0u);
    for (std::int64_t v : {k.M, k.N, k.K, k.lda, k.ldb, k.ldc}) h = h * 1000003u ^ static_cast<std::size_t>(v);
    std::uint32_t a, b;
    std::memcpy(&a, &k.alpha, 4);
    std::memcpy(&b, &k.beta, 4);
    return h * 1000003u ^ (static_cast<std::size_t>(a) << 32 | b);
  }
};

// One shape's primitive and its memory objects (fixed shapes: data handles set per call; run-time
// shapes: memory objects made per call). native = false when oneDNN has no (or only its reference)
// bf16 matmul for this CPU: the caller converts and uses sgemm.
struct MatmulEntry {
  dnnl::matmul prim;
  dnnl::memory a, b, c, scratch;
  std::vector<std::byte> scratch_buf;
  bool native = false;
};

dnnl::memory::desc strided(std::int64_t rows, std::int64_t cols, std::int64_t ld, bool trans, dnnl_dt dt) {
  // op(X) is [rows, cols]; stored row-major with row stride ld, or transposed.
  return {{rows, cols}, dt, trans ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1}};
}

// oneDNN's reference matmul ("ref:any") takes every data type but is ~1000x slower than a JIT
// kernel: where it is all oneDNN has for bf16, the conversion path runs instead.
bool is_reference(const dnnl::matmul::primitive_desc& pd) {
  return std::strncmp(pd.impl_info_str(), "ref", 3) == 0;
}

std::unique_ptr<MatmulEntry> make_matmul(const dnnl::engine& eng, const MatmulKey& k) {
  auto e = std::make_unique<MatmulEntry>();
  const std::int64_t M = k.runtime_mk ? DNNL_RUNTIME_DIM_VAL : k.M, K = k.runtime_mk ? DNNL_RUNTIME_DIM_VAL : k.K;
  const auto a = strided(M, K, k.lda, k.ta, dnnl_dt::bf16), b = strided(K, k.N, k.ldb, k.tb, dnnl_dt::bf16);
  const dnnl::memory::desc c({M, k.N}, k.c_bf16 ? dnnl_dt::bf16 : dnnl_dt::f32, dnnl::memory::dims{k.ldc, 1});
  dnnl::primitive_attr attr;
  // Fixed shapes: a user scratchpad per entry. Run-time shapes: oneDNN sizes its own per call.
  if (!k.runtime_mk) attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k.alpha != 1.f) attr.set_output_scales(0, {k.alpha});
  if (k.beta != 0.f) {
    dnnl::post_ops po;
    po.append_sum(k.beta);
    attr.set_post_ops(po);
  }
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, eng);
    if (is_reference(pd)) return e;  // the converted path is faster
    e->prim = dnnl::matmul(pd);
    if (!k.runtime_mk) {
      e->a = dnnl::memory(a, eng, DNNL_MEMORY_NONE);
      e->b = dnnl::memory(b, eng, DNNL_MEMORY_NONE);
      e->c = dnnl::memory(c, eng, DNNL_MEMORY_NONE);
      e->scratch_buf.resize(pd.scratchpad_desc().get_size());
      e->scratch = dnnl::memory(pd.scratchpad_desc(), eng, e->scratch_buf.data());
    }
    e->native = true;
  } catch (const dnnl::error& err) {
    DIFFCP_CHECK(err.status == dnnl_unimplemented, "oneDNN bf16 matmul (M=", k.M, " N=", k.N, " K=", k.K,
                 ") cannot be created: ", err.what());
    e->native = false;  // no bf16 matmul on this CPU: convert + sgemm
  }
  return e;
}

// dense_linear's primitives (below): one per (M, N, K, x's row stride, bias), the weights in the
// layout the primitive picks (format any).
struct LinearKey {
  std::int64_t M, N, K, ldx;  // y is dense ([M, N]; dense_linear copies into a strided one)
  bool bias;
  bool operator==(const LinearKey&) const = default;
};
struct LinearKeyHash {
  std::size_t operator()(const LinearKey& k) const {
    std::size_t h = k.bias ? 1u : 0u;
    for (std::int64_t v : {k.M, k.N, k.K, k.ldx}) h = h * 1000003u ^ static_cast<std::size_t>(v);
    return h;
  }
};
struct LinearEntry {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
  std::vector<std::byte> scratch;
  bool native = false;
};

// Per thread (oneDNN streams are per thread; the attention's tile GEMMs run on every thread): the
// engine and stream, the primitives made so far, and the scratch buffers of the calls.
struct OneDnn {
  OneDnn() : eng(dnnl::engine::kind::cpu, 0), strm(eng) {}
  dnnl::engine eng;
  dnnl::stream strm;
  std::unordered_map<MatmulKey, std::unique_ptr<MatmulEntry>, MatmulKeyHash> matmuls;
  std::unordered_map<LinearKey, std::unique_ptr<LinearEntry>, LinearKeyHash> linears;
  std::vector<float> a32, b32, c32;  // the conversion path's operands
  std::vector<float> tile;           // gemm_bf16: a product before it is added to C
  std::vector<float> dense_y;        // dense_linear: y for a strided one (kept apart: its fallback calls gemm_bf16)
  std::vector<std::byte> w_scratch;  // dense_linear: w reordered for a call without (a fitting) packed weight
};

OneDnn& onednn() {
  thread_local OneDnn o;
  return o;
}

// The entry of key k in `map`, made by make(k) on first use.
template <typename Map, typename Make>
auto& cached(Map& map, const typename Map::key_type& k, Make make) {
  auto it = map.find(k);
  if (it != map.end()) return *it->second;
  if (map.size() >= 512) map.clear();  // shapes of a run are few; bound pathological growth
  return *map.emplace(k, make(k)).first->second;
}

// Converts the [rows, cols] matrix at x (row stride ld) into a dense f32 one.
void widen(const bf16_t* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, std::vector<float>& out) {
  out.resize(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    simd::to_f32(reinterpret_cast<const std::uint16_t*>(x + r * ld), out.data() + r * cols, cols);
}

}  // namespace

void gemm_bf16(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
               const bf16_t* A, std::int64_t lda, const bf16_t* B, std::int64_t ldb, float beta, void* C,
               std::int64_t ldc, DType c_dtype, bool fixed_shape) {
  DIFFCP_CHECK(c_dtype == DType::f32 || c_dtype == DType::bf16, "gemm_bf16: C must be f32 or bf16, got ",
               dtype_name(c_dtype));
  const bool c_bf16 = c_dtype == DType::bf16;
  if (M == 0 || N == 0) return;
  OneDnn& mc = onednn();
  // f32 C += product: oneDNN's sum post-op halved the rate of the attention tile GEMMs (measured
  // 400 -> 180 GFLOP/s at 256 x 128 x 128), so the product goes to a scratch tile, added here.
  const bool add_here = !c_bf16 && beta != 0.f;
  const bool rt = !fixed_shape;
  const auto make = [&](const MatmulKey& k) { return make_matmul(mc.eng, k); };
  MatmulEntry* e = K > 0 ? &cached(mc.matmuls, {trans_a, trans_b, c_bf16, rt, rt ? 0 : M, N, rt ? 0 : K, lda, ldb,
                                                add_here ? N : ldc, alpha, add_here ? 0.f : beta}, make)
                         : nullptr;
  if (e != nullptr && e->native) {
    if (add_here) mc.tile.resize(static_cast<std::size_t>(M * N));
    void* c_out = add_here ? static_cast<void*>(mc.tile.data()) : C;
    if (rt) {  // memory objects of this call's shape
      const dnnl::memory::desc cd({M, N}, c_bf16 ? dnnl_dt::bf16 : dnnl_dt::f32,
                                  dnnl::memory::dims{add_here ? N : ldc, 1});
      e->a = dnnl::memory(strided(M, K, lda, trans_a, dnnl_dt::bf16), mc.eng, const_cast<bf16_t*>(A));
      e->b = dnnl::memory(strided(K, N, ldb, trans_b, dnnl_dt::bf16), mc.eng, const_cast<bf16_t*>(B));
      e->c = dnnl::memory(cd, mc.eng, c_out);
    } else {
      e->a.set_data_handle(const_cast<bf16_t*>(A));
      e->b.set_data_handle(const_cast<bf16_t*>(B));
      e->c.set_data_handle(c_out);
    }
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, e->a.get()},
                                    {DNNL_ARG_WEIGHTS, e->b.get()},
                                    {DNNL_ARG_DST, e->c.get()},
                                    {DNNL_ARG_SCRATCHPAD, rt ? nullptr : e->scratch.get()}};
    const dnnl_status_t st = dnnl_primitive_execute(e->prim.get(), mc.strm.get(), rt ? 3 : 4, args);
    DIFFCP_CHECK(st == dnnl_success, "oneDNN bf16 matmul (M=", M, " N=", N, " K=", K, ") failed: status ",
                 static_cast<int>(st));
    if (add_here)
      for (std::int64_t r = 0; r < M; ++r) {
        float* __restrict cr = static_cast<float*>(C) + r * ldc;
        const float* __restrict tr = mc.tile.data() + r * N;
#pragma omp simd
        for (std::int64_t j = 0; j < N; ++j) cr[j] = beta * cr[j] + tr[j];
      }
    return;
  }
  // Conversion path (and K = 0): f32 operands, sgemm, C converted back when it is bf16.
  widen(A, trans_a ? K : M, trans_a ? M : K, lda, mc.a32);
  widen(B, trans_b ? N : K, trans_b ? K : N, ldb, mc.b32);
  if (!c_bf16) {
    sgemm(trans_a, trans_b, M, N, K, alpha, mc.a32.data(), trans_a ? M : K, mc.b32.data(), trans_b ? K : N, beta,
          static_cast<float*>(C), ldc);
    return;
  }
  bf16_t* c = static_cast<bf16_t*>(C);
  widen(c, M, N, ldc, mc.c32);
  sgemm(trans_a, trans_b, M, N, K, alpha, mc.a32.data(), trans_a ? M : K, mc.b32.data(), trans_b ? K : N, beta,
        mc.c32.data(), N);
  for (std::int64_t r = 0; r < M; ++r)
    simd::to_bf16(mc.c32.data() + r * N, reinterpret_cast<std::uint16_t*>(c + r * ldc), N);
}

// ---- dense_linear: y = x w + bias with bf16 x, w; fixed-shape primitives, optionally packed w ----
//
// The layer GEMMs of inference repeat a few shapes every step (the DiT's row chunks of kPollRows,
// its text and image streams), so each (M, N, K, strides, bias) gets its own primitive: with all
// three extents known oneDNN 2.6 picks brgemm (AMX where the CPU has it) instead of the run-time-shape
// gemm:jit, and with w in the layout the primitive asks for (pack_weight, once per weight) it skips
// the per-call repacking of w: 2.3x the run-time-shape GEMM on this machine's DiT shapes (issue #54).
// The result does not depend on `packed`: a call without it (or whose M wants another layout)
// reorders w into the primitive's layout itself, so every caller runs the same kernel. The DiT
// packs replicated weights once and sharded ones per gather window; the guard backend packs here.

namespace {

constexpr std::int64_t kPackProbeRows = 64;  // the M a packed layout is chosen for (kPollRows)

struct CpuPackedWeight final : PackedWeight {
  dnnl::memory mem;  // oneDNN-owned, in desc's layout
  dnnl::memory::desc desc;
  std::int64_t K = 0, N = 0;
  std::size_t bytes() const override { return desc.get_size(); }
};

dnnl::matmul::primitive_desc linear_pd(const dnnl::engine& eng, const LinearKey& k) {
  const dnnl::memory::desc x({k.M, k.K}, dnnl_dt::bf16, dnnl::memory::dims{k.ldx, 1});
  const dnnl::memory::desc w({k.K, k.N}, dnnl_dt::bf16, dnnl::memory::format_tag::any);
  const dnnl::memory::desc y({k.M, k.N}, dnnl_dt::f32, dnnl::memory::dims{k.N, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (!k.bias) return {dnnl::matmul::desc(x, w, y), attr, eng};
  const dnnl::memory::desc b({1, k.N}, dnnl_dt::f32, dnnl::memory::dims{k.N, 1});
  return {dnnl::matmul::desc(x, w, b, y), attr, eng};
}

std::unique_ptr<LinearEntry> make_linear(const dnnl::engine& eng, const LinearKey& k) {
  auto e = std::make_unique<LinearEntry>();
  try {
    e->pd = linear_pd(eng, k);
    if (!is_reference(e->pd)) {
      e->prim = dnnl::matmul(e->pd);
      e->scratch.resize(e->pd.scratchpad_desc().get_size());
      e->native = true;
    }
  } catch (const dnnl::error& err) {
    DIFFCP_CHECK(err.status == dnnl_unimplemented, "oneDNN bf16 linear (M=", k.M, " N=", k.N, " K=", k.K,
                 ") cannot be created: ", err.what());
  }
  return e;
}

LinearEntry& linear_entry(OneDnn& o, const LinearKey& k) {
  return cached(o.linears, k, [&](const LinearKey& key) { return make_linear(o.eng, key); });
}

}  // namespace

std::unique_ptr<PackedWeight> CpuBackend::pack_weight(ConstTensorView w) {
  DIFFCP_CHECK(w.dtype == DType::bf16 && w.rank == 2 && w.stride[1] == 1, "pack_weight: expected a bf16 [K, N] matrix ",
               "with unit column stride");
  const std::int64_t K = w.shape[0], N = w.shape[1], ldw = w.stride[0];
  if (K == 0 || N == 0) return nullptr;
  OneDnn& lc = onednn();
  const LinearEntry& q = linear_entry(lc, {kPackProbeRows, N, K, K, false});
  if (!q.native) return nullptr;
  auto pw = std::make_unique<CpuPackedWeight>();
  pw->K = K;
  pw->N = N;
  pw->desc = q.pd.weights_desc();
  pw->mem = dnnl::memory(pw->desc, lc.eng);
  dnnl::memory src({{K, N}, dnnl_dt::bf16, dnnl::memory::dims{ldw, 1}}, lc.eng, const_cast<void*>(w.data));
  dnnl::reorder(src, pw->mem).execute(lc.strm, src, pw->mem);
  lc.strm.wait();
  return pw;
}

void CpuBackend::dense_linear(ConstTensorView x, ConstTensorView w, const PackedWeight* packed, ConstTensorView bias,
                              TensorView y) {
  DIFFCP_CHECK(x.dtype == DType::bf16 && w.dtype == DType::bf16 && y.dtype == DType::f32 &&
                   (bias.numel() == 0 || bias.dtype == DType::f32),
               "dense_linear: expected bf16 x and w, f32 bias and y");
  const std::int64_t M = x.shape[0], K = x.shape[1], N = w.shape[1];
  DIFFCP_CHECK(w.shape[0] == K && y.shape[0] == M && y.shape[1] == N && (bias.numel() == 0 || bias.numel() == N),
               "dense_linear: x [", M, ", ", K, "], w [", w.shape[0], ", ", N, "], y [", y.shape[0], ", ", y.shape[1],
               "], bias [", bias.numel(), "] do not match");
  if (M == 0 || N == 0) return;
  // oneDNN's brgemm writes dense rows only: a strided y (a column slice of a wider row, e.g. V-First's
  // v columns) is computed into a dense tile and copied, in blocks of kPackProbeRows rows so that
  // the tile stays in L2; so every y layout runs the same kernel.
  if (y.stride[0] != N && M > kPackProbeRows) {
    for (std::int64_t r0 = 0; r0 < M; r0 += kPackProbeRows) {
      const std::int64_t m = std::min(kPackProbeRows, M - r0);
      ConstTensorView xb = x;
      TensorView yb = y;
      xb.data = static_cast<const bf16_t*>(x.data) + r0 * x.stride[0];
      xb.shape[0] = yb.shape[0] = m;
      yb.data = static_cast<float*>(y.data) + r0 * y.stride[0];
      dense_linear(xb, w, packed, bias, yb);
    }
    return;
  }
  const bool has_bias = bias.numel() > 0;
  float* const y_out = y.ptr<float>();
  const std::int64_t ldx = x.stride[0], ldw = w.stride[0], ldy_out = y.stride[0];
  OneDnn& lc = onednn();
  const bool dense_y = ldy_out == N;
  if (!dense_y) lc.dense_y.resize(static_cast<std::size_t>(M * N));
  float* const yp = dense_y ? y_out : lc.dense_y.data();
  const std::int64_t ldy = N;
  const auto* pw = dynamic_cast<const CpuPackedWeight*>(packed);
  DIFFCP_CHECK(packed == nullptr || (pw != nullptr && pw->K == K && pw->N == N),
               "dense_linear: the packed weight is not this backend's or not [K, N]");
  // One primitive per shape, weights in the layout it asks for: `packed` when it is that layout,
  // else w reordered into it here (so the kernel, and the result, never depend on `packed`).
  LinearEntry* e = K > 0 ? &linear_entry(lc, {M, N, K, ldx, has_bias}) : nullptr;
  if (e == nullptr || !e->native) {  // K = 0, or no native bf16 matmul: bias rows, then the converted GEMM
    for (std::int64_t r = 0; r < M; ++r) {
      float* yr = yp + r * ldy;
      if (has_bias)
        std::memcpy(yr, bias.ptr<float>(), sizeof(float) * N);
      else
        std::memset(yr, 0, sizeof(float) * N);
    }
    gemm_bf16(false, false, M, N, K, 1.f, x.ptr<bf16_t>(), ldx, w.ptr<bf16_t>(), ldw, 1.f, yp, ldy, DType::f32,
              /*fixed_shape=*/false);
  } else {
    dnnl::memory xm(e->pd.src_desc(), lc.eng, const_cast<void*>(x.data));
    dnnl::memory wm;
    if (pw != nullptr && e->pd.weights_desc() == pw->desc) {
      wm = pw->mem;
    } else {
      const dnnl::memory::desc stored({K, N}, dnnl_dt::bf16, dnnl::memory::dims{ldw, 1});
      dnnl::memory src(stored, lc.eng, const_cast<void*>(w.data));
      lc.w_scratch.resize(e->pd.weights_desc().get_size());
      wm = dnnl::memory(e->pd.weights_desc(), lc.eng, lc.w_scratch.data());
      dnnl::reorder(src, wm).execute(lc.strm, src, wm);
    }
    dnnl::memory ym(e->pd.dst_desc(), lc.eng, yp);
    dnnl::memory sm(e->pd.scratchpad_desc(), lc.eng, e->scratch.data());
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym},
                                               {DNNL_ARG_SCRATCHPAD, sm}};
    if (has_bias)
      args.emplace(DNNL_ARG_BIAS, dnnl::memory(e->pd.bias_desc(), lc.eng, const_cast<void*>(bias.data)));
    e->prim.execute(lc.strm, args);
  }
  if (!dense_y)
    for (std::int64_t r = 0; r < M; ++r) std::memcpy(y_out + r * ldy_out, yp + r * N, sizeof(float) * N);
}

namespace {
// What oneDNN runs here for a bf16 matmul, probed once with one primitive at a typical tile shape.
struct Bf16Probe {
  const char* isa;   // oneDNN's effective ISA
  std::string impl;  // its matmul implementation; "" where it has none or only its reference one
  bool reference;
};
const char* onednn_isa() {
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_sse41: return "sse41";
    default: return "other";
  }
}
const Bf16Probe& bf16_probe() {
  static const Bf16Probe probe = [] {
    Bf16Probe p{onednn_isa(), "", false};
    dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    const dnnl::memory::desc a({64, 128}, dnnl_dt::bf16, dnnl::memory::format_tag::ab);
    const dnnl::memory::desc b({128, 256}, dnnl_dt::bf16, dnnl::memory::format_tag::ab);
    const dnnl::memory::desc c({64, 256}, dnnl_dt::f32, dnnl::memory::format_tag::ab);
    try {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), eng);
      p.reference = is_reference(pd);
      if (!p.reference) p.impl = pd.impl_info_str();
    } catch (const dnnl::error&) {
    }
    return p;
  }();
  return probe;
}
}  // namespace

bool bf16_gemm_native() {
  const Bf16Probe& p = bf16_probe();
  return !p.impl.empty() &&
         (std::strcmp(p.isa, "avx512_core_bf16") == 0 || std::strcmp(p.isa, "avx512_core_amx") == 0);
}

std::string bf16_gemm_path() {
  const Bf16Probe& p = bf16_probe();
  if (p.impl.empty())
    return std::string("bf16 converted to f32 + oneDNN sgemm (oneDNN has ") +
           (p.reference ? "only its reference bf16 matmul" : "no bf16 matmul") + " on ISA " + p.isa + ")";
  return "oneDNN bf16 matmul (" + p.impl + ", ISA " + p.isa +
         (bf16_gemm_native() ? ", native bf16 instructions)" : ", bf16 emulated in f32 units)");
}

std::string onednn_key() {
  const dnnl_version_t* v = dnnl_version();
  const Bf16Probe& p = bf16_probe();
  return "onednn=" + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         " onednn_isa=" + p.isa + " bf16_gemm=" + (p.impl.empty() ? std::string("converted") : p.impl);
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
