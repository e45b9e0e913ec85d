// The CPU backend (ops/backend.hpp): f32 on every op; bf16 storage with f32 accumulation on GEMM
// and attention. OpenMP over rows / work items, GEMMs on oneDNN (sgemm.hpp). Compiled once per ISA
// (isa.hpp) into namespace diffcp::cpu::<isa>; dispatch.cpp picks the instance that runs. One file
// per op family defines its hooks: linear.cpp, attention.cpp, merge.cpp, rmsnorm.cpp, rope.cpp,
// elementwise.cpp, optim.cpp, fp8.cpp; backend.cpp holds name(), supports(), describe() and the instance.
// Private to src/cpu/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "diffcp/ops/backend.hpp"
#include "sgemm.hpp"

#if !defined(DIFFCP_CPU_ISA)
#error "src/cpu kernel files are compiled once per ISA with -DDIFFCP_CPU_ISA=<isa> (src/CMakeLists.txt)"
#endif

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// The CPU kernels' arithmetic version: bump it in the change that makes any CPU kernel's result
// differ by one bit on purpose (a new reduction order, a new fused path). It is part of
// kernel_key(), so the bitwise golden (tests/project/bitwise_golden.sh) asks for a new recording instead
// of failing; a change that must not change bits (a refactor) leaves it alone and is checked.
inline constexpr int kCpuKernelsVersion = 1;

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  bool supports(OpKind op, DType dtype) const override;
  std::string describe(DType dtype) const override;
  bool native_arithmetic(DType dtype) const override;
  std::string kernel_key() const override;

  void gemm(const GemmArgs& args) override;
  void bias_backward(ConstTensorView dy, TensorView db) override;
  void bias_add(TensorView y, ConstTensorView b) override;
  void dense_linear(ConstTensorView x, ConstTensorView w, const PackedWeight* packed, ConstTensorView bias,
                    TensorView y) override;  // gemm.cpp
  std::unique_ptr<PackedWeight> pack_weight(ConstTensorView w) override;
  void attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         TensorView o, TensorView lse, float softmax_scale) override;
  void attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          ConstTensorView do_, ConstTensorView lse, ConstTensorView delta, TensorView dq,
                          TensorView dk, TensorView dv, float softmax_scale) override;
  void attention_delta(ConstTensorView do_, ConstTensorView o, TensorView delta) override;
  void lse_merge(std::span<const ConstTensorView> o_parts, std::span<const ConstTensorView> lse_parts, TensorView o,
                 TensorView lse) override;
  void lse_rescale(TensorView o_p, ConstTensorView lse_p, ConstTensorView lse) override;
  void lse_shift(TensorView x, ConstTensorView m, bool to_exp) override;
  void rmsnorm_forward(ConstTensorView x, ConstTensorView w, float eps, TensorView y, TensorView rstd) override;
  void rmsnorm_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView rstd, ConstTensorView w,
                        TensorView dx, TensorView dw) override;
  void rope(TensorView x, std::span<const std::int64_t> positions, const RopeTable& table, bool inverse) override;
  void silu(TensorView x) override;
  void swiglu_forward(ConstTensorView gate, ConstTensorView up, TensorView act) override;
  void swiglu_backward(ConstTensorView dact, ConstTensorView gate, ConstTensorView up, TensorView dgate,
                       TensorView dup) override;
  void add(TensorView y, ConstTensorView x, float alpha) override;
  void guidance_combine(TensorView v, ConstTensorView v_neg, float scale, bool keep_norm) override;
  void adamw_step(TensorView p, ConstTensorView g, TensorView m, TensorView v, const AdamWStepArgs& args) override;
  void fill(TensorView x, float value) override;
  void convert(ConstTensorView src, TensorView dst) override;
  void fp8_encode(ConstTensorView x, TensorView enc) override;  // fp8.cpp
  void fp8_decode(ConstTensorView enc, TensorView x) override;
  void gather_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) override;
  void l1_distance(ConstTensorView a, ConstTensorView b, TensorView out) override;
  void select_active(ConstTensorView parts, TensorView active) override;
  void token_rows(ConstTensorView active, ConstTensorView map, std::int64_t n, std::int64_t stride,
                  TensorView rows) override;
  void scatter_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) override;
  void dynamic_conv_forward(ConstTensorView x, ConstTensorView dyn, ConstTensorView base, std::int64_t block,
                            TensorView y) override;
  void dynamic_conv_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView dyn, ConstTensorView base,
                             std::int64_t block, TensorView dx, TensorView ddyn, TensorView dbase) override;
  void cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target, std::span<double> stats,
                     std::span<const double> weight, LogitMap map) override;
  void cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                              std::span<const double> weight, std::span<const double> lse, LogitMap map,
                              SparseLogitGrad extra) override;
  void logit_map(TensorView logits, LogitMap map) override;
  void top_k(ConstTensorView logits, std::int64_t v0, std::span<float> values, std::span<std::int32_t> ids) override;
  double scale_sumsq(TensorView x, double scale) override;
  void gelu_tanh(TensorView x) override;
  void gelu(TensorView x) override;
  void layernorm_modulate(ConstTensorView x, ConstTensorView shift, ConstTensorView scale, float eps,
                          TensorView y) override;
  void gated_add(TensorView x, ConstTensorView gate, ConstTensorView y) override;
  void qk_norm_rope(TensorView qkv, ConstTensorView q_scale, ConstTensorView k_scale, float eps, ConstTensorView cos,
                    ConstTensorView sin) override;
};

// This ISA's instance.
Backend& backend();

// attention_amx.cpp: the bf16 attention of one dense block on AMX tiles (issue #54).
// amx_attention_ready(d): these kernels carry it, the CPU and the OS grant AMX, DIFFCP_CPU_AMX is
// not 0, and d (d_h) is a multiple of 32. amx_attention_block: q [GB, d], k, v [n, d] (dense bf16
// rows, n >= 1), c = softmax scale * log2(e); writes o [GB, d] f32 (unnormalised), m [GB] (the
// base-2 row max), l [GB] (row sums at m): the tile path's accumulators (attention.cpp).
// Tile loads and stores of a row that crosses a cache line run at half the rate (measured: a
// B tile at an address 16 mod 64 halved the dot products' rate), so every tile buffer starts on a
// 64-byte line and every row stride here is a multiple of 64 bytes.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using LineVector = std::vector<T, LineAligned<T>>;

// One run of at most kAmxChunk keys for amx_attention_chunks: K^T and V packed as B tiles
// (amx_pack_keys / amx_pack_values, `keys` of them: a multiple of 32, the first `valid` real, the
// rest zero), their positions pos, pos + 1, ...; edge: a window's edge may cross the chunk.
struct AmxChunk {
  const std::uint16_t* kp;
  const std::uint16_t* vp;
  std::int64_t keys, valid, pos;
  bool edge;
};
// Each query row's visible key positions [lo[row], hi[row]) in the chunks whose edge is set.
struct AmxRowWindow {
  const std::int64_t* lo;
  const std::int64_t* hi;
};
struct AmxScratch {
  LineVector<std::uint16_t> q, kp, vp, p;
  LineVector<float> s, o, lv;
  std::vector<float> m;
  std::vector<std::pair<std::int64_t, std::int64_t>> order;  // the steps (query tile, chunk)
  std::vector<AmxChunk> chunks;
};
bool amx_attention_ready(std::int64_t d);
constexpr std::int64_t kAmxHeadDim = 32;  // d_h: a multiple of this
constexpr std::int64_t kAmxChunk = 64;    // keys per chunk at most
void amx_attention_block(const std::uint16_t* q, std::int64_t GB, const std::uint16_t* k, const std::uint16_t* v,
                         std::int64_t n, std::int64_t d, float c, float* o, float* m, float* l, AmxScratch& w);
// The same over a list of packed key chunks, in order (the block-sparse attention's visible
// ranges; every chunk has valid >= 1), with an optional window: q [GB, d]; o, m, l as above.
void amx_attention_chunks(const std::uint16_t* q, std::int64_t GB, std::int64_t d, float c,
                          std::span<const AmxChunk> chunks, const AmxRowWindow* window, float* o, float* m, float* l,
                          AmxScratch& w);
// The bf16 backward on AMX tiles (issue #69), key chunk by key chunk over the blocks that see it.
// A block's operands and dQ accumulator (amx_backward_block_begin: q, dout [GB, d] its packed rows,
// lse2 [GB] base-2 lse, +inf on a row that sees no key, delta [GB]); amx_backward_block_end writes
// its dq [GB, d] (f32).
struct AmxBackBlock {
  LineVector<std::uint16_t> qt, dot, qv, dov;  // q, dout packed as keys and as values
  LineVector<float> dqt, shift, delta;          // dQ^T [d, GBp]; per column: lse2 and D (0: masked)
  std::vector<std::uint16_t> live;              // per 16 columns: the rows that see keys
  std::int64_t GB = 0, GBp = 0, d = 0;
};
// A chunk of at most kAmxChunk key rows (`keys` a multiple of 32, the first `valid` real, the rest
// zero): kd, vd its K and V rows ([keys, d] dense), kt its K^T (d rows ldt elements apart).
struct AmxBackKeys {
  const std::uint16_t* kd;
  const std::uint16_t* vd;
  const std::uint16_t* kt;
  std::int64_t ldt, keys, valid;
};
// A block that sees the chunk's rows [r0, r1) (row r0 at position pos); window: its rows' visible
// positions where the window's edge may cross them (else null).
struct AmxBackEntry {
  AmxBackBlock* block;
  std::int64_t r0, r1, pos;
  const AmxRowWindow* window;
};
struct AmxBackScratch {
  LineVector<std::uint16_t> p, ds, dsv, kt;
  LineVector<float> s, dp, dks, dvs, dkp, dvp;  // dkp, dvp: an entry's own, where it covers part of its rows
  std::vector<std::int32_t> lo, hi;
};
void amx_backward_block_begin(const std::uint16_t* q, const std::uint16_t* dout, std::int64_t GB, std::int64_t d,
                              const float* lse2, const float* delta, AmxBackBlock& b);
void amx_backward_block_end(const AmxBackBlock& b, float* dq);
// The entries' contributions on one chunk: their dQ accumulators, and dk, dv (f32, the chunk's
// rows ld_kv elements apart) += its dK, dV on the rows some entry sees. c = softmax scale *
// log2(e). Rounding as the tile path's bf16 backward: P and scale * dS rounded to bf16 as
// operands, f32 accumulation.
void amx_backward_chunk(const AmxBackKeys& keys, std::span<const AmxBackEntry> entries, float c, float scale,
                        float* dk, float* dv, std::int64_t ld_kv, AmxBackScratch& w);
// k [n, d] rows ld elements apart -> kp [n_pad * d] (n_pad a multiple of 32; keys past n zero):
// K^T as the B tiles of q K^T. amx_pack_values: V as the B tiles of P V, same sizes. The tiles
// of keys [j, j + 32) start at kp + j * d (j a multiple of 32).
void amx_pack_keys(const std::uint16_t* k, std::int64_t ld, std::int64_t n, std::int64_t n_pad, std::int64_t d,
                   std::uint16_t* kp);
void amx_pack_values(const std::uint16_t* v, std::int64_t ld, std::int64_t n, std::int64_t n_pad, std::int64_t d,
                     std::uint16_t* vp);

// attention_vec.cpp: the attention of one dense block fused on vector registers (issue #54): f32
// on the FMA units (AVX-512 or AVX2), bf16 on avx512_bf16's dot products (where AMX does not run
// it). vec_attention_ready(dtype, d): these kernels carry it (avx512: f32 and bf16, where the CPU
// has avx512_bf16; avx2: f32), DIFFCP_CPU_FUSED is not 0, and d (d_h) is a multiple of 32. vec_attention_block: q
// [GB, d], k, v [n, d] (dense rows of the storage type, n >= 1), c = softmax scale * log2(e);
// writes o [GB, d] f32 (unnormalised), m [GB] (the base-2 row max), l [GB] (row sums at m).
template <typename E>
struct VecScratch {
  LineVector<E> kt, vp, q;  // K^T by chunks, bf16 V in key pairs, a group of query strips
  LineVector<float> o, lv;
  std::vector<float> m;
};
bool vec_attention_ready(DType dtype, std::int64_t d);
constexpr std::int64_t kVecHeadDim = 32;  // d_h: a multiple of this
void vec_attention_block(const float* q, std::int64_t GB, const float* k, const float* v, std::int64_t n,
                         std::int64_t d, float c, float* o, float* m, float* l, VecScratch<float>& w);
void vec_attention_block(const std::uint16_t* q, std::int64_t GB, const std::uint16_t* k, const std::uint16_t* v,
                         std::int64_t n, std::int64_t d, float c, float* o, float* m, float* l,
                         VecScratch<std::uint16_t>& w);

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
