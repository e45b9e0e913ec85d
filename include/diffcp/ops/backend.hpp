// The compute seam: every numerical op of diffcp runs on a Backend, chosen at run time.
//
// The public op functions (ops/gemm.hpp, ops/linear.hpp, ops/rmsnorm.hpp, ops/rope.hpp,
// ops/elementwise.hpp, attention/attention.hpp, attention/merge.hpp, dit/ops.hpp's dit_linear and
// qk_norm_rope) keep their plain signatures. Each one asks the active backend whether it
// supports(op, dtype), then makes ONE virtual call with views of its arguments: dispatch costs two
// virtual calls per op call, never anything per tile or per row.
//
// A backend overrides supports() and the hooks it implements. A hook it does not override, or an
// op its supports() declines, fails with diffcp::Error
//   "backend 'toy' does not support attention_forward on f32"
// instead of crashing. The CPU backend (src/cpu/) implements every op on f32.
//
// Tensor arguments of the hooks are views (core/tensor.hpp) carrying dtype and device; shapes are
// those of the public functions, repeated at each hook. Legend: Q query rows, L_k key rows, n_q /
// n_kv query / kv heads, d_h head dim, H hidden width.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "diffcp/core/dtype.hpp"
#include "diffcp/core/tensor.hpp"

namespace diffcp {

class BlockMask;  // attention/mask.hpp
class RopeTable;  // ops/rope.hpp

// One kind per public op; op_name() is the public function's name.
enum class OpKind : std::uint8_t {
  gemm,                // ops/gemm.hpp (linear_*, dit_linear go through it)
  bias_backward,       // ops/linear.hpp
  attention_forward,   // attention/attention.hpp
  attention_backward,  //
  attention_delta,     //
  lse_merge,           // attention/merge.hpp
  lse_rescale,         //
  rmsnorm_forward,     // ops/rmsnorm.hpp
  rmsnorm_backward,    //
  rope,                // ops/rope.hpp (rope_apply)
  silu,                // ops/elementwise.hpp
  gelu_tanh,           //
  layernorm_modulate,  //
  gated_add,           //
  qk_norm_rope,        //
  swiglu_forward,      // ops/elementwise.hpp (the drafter's MLP)
  swiglu_backward,     //
  add,                 // ops/elementwise.hpp (residuals, partial sums, the sampler's Euler step)
  adamw_step,          // ops/optim.hpp (the drafter's optimizer)
  bias_add,            // ops/linear.hpp
  fill,                // ops/buffer.hpp (fill, zero)
  convert,             // ops/buffer.hpp (convert: f32 <-> bf16, by the destination's dtype)
  lse_shift,           // attention/merge.hpp (the lse all-reduce from max + sum, cp/lse_reduce.hpp)
  gather_rows,         // ops/buffer.hpp (token packing: the DiT's exchanges)
  scatter_rows,        //
  l1_distance,         // dit/ops.hpp (V-Major's token similarity)
  cross_entropy,       // ops/loss.hpp (the drafter's LM head: per-row statistics, dlogits)
  cross_entropy_backward,  //
  scale_sumsq,         // ops/optim.hpp (gradient scaling and the clip norm's sum of squares)
  guidance_combine,    // ops/elementwise.hpp (the DiT sampler's classifier-free guidance)
  fp8_encode,          // ops/fp8.hpp (the DiT's --wire fp8 exchanges: e4m3 blocks with an f32 scale)
  fp8_decode,          //
  dense_linear,        // dit/ops.hpp (dit_linear on bf16 weights: fixed-shape kernels, packed weights)
  select_active,       // dit/ops.hpp (V-Major's token choice on the device: f32 scores)
  token_rows,          // dit/ops.hpp (row lists from token indices on the device: i32 indices)
  dynamic_conv_forward,   // ops/conv.hpp (DFlash2's grouped dynamic causal convolution)
  dynamic_conv_backward,  //
  logit_map,           // ops/loss.hpp (DFlash2's logits: multiplier and soft cap)
  top_k,               // ops/loss.hpp (DFlash2's candidates: each row's K largest logits)
  gelu,                // ops/elementwise.hpp (exact, erf: Wan I2V's image embedder)
};
inline constexpr int kOpKindCount = 40;

// DFlash2's map of the LM head's logits (ops/loss.hpp logit_map): y = multiplier l, then
// softcap tanh(y / softcap) when softcap > 0.
struct LogitMap {
  float multiplier = 1.f, softcap = 0.f;
  bool identity() const { return multiplier == 1.f && softcap == 0.f; }
};
// A sparse gradient on chosen logits of each row (ops/loss.hpp cross_entropy_backward):
// ids: [R, k] global token ids (outside the chunk's columns: skipped)  grad: [R, k] (host)
struct SparseLogitGrad {
  std::span<const std::int32_t> ids;
  std::span<const double> grad;
};

// One AdamW update's constants (ops/optim.hpp): p = p * decay - step * m' / (sqrt(v') *
// inv_sqrt_c2 + eps), m' = b1 m + (1 - b1) g, v' = b2 v + (1 - b2) g^2.
struct AdamWStepArgs {
  float b1 = 0.9f, b2 = 0.999f, step = 0, inv_sqrt_c2 = 1, eps = 1e-8f, decay = 1;
};
const char* op_name(OpKind op);  // "attention_forward", ...

// C[M, N] = alpha * op(A) * op(B) + beta * C, row-major; op(X) = X^T when trans_x.
//   A: [M, K] (trans_a: [K, M]) with row stride lda;  B: [K, N] (trans_b: [N, K]), ldb;
//   C: [M, N], ldc.  A and B hold `dtype`, C holds `c_dtype`: the same, or f32 with bf16 A and B
//   (the f32 GEMMs under ScopedF32GemmCompute(bf16), ops/gemm.hpp). K = 0 gives C = beta * C;
//   M = 0 or N = 0 does nothing.
struct GemmArgs {
  bool trans_a = false, trans_b = false;
  std::int64_t M = 0, N = 0, K = 0;
  float alpha = 1.f;
  const void* A = nullptr;
  std::int64_t lda = 0;
  const void* B = nullptr;
  std::int64_t ldb = 0;
  float beta = 0.f;
  void* C = nullptr;
  std::int64_t ldc = 0;
  DType dtype = DType::f32;
  DType c_dtype = DType::f32;
};

// A [K, N] bf16 weight matrix laid out once for this backend's dense_linear (Backend::pack_weight;
// CPU: oneDNN's blocked layout for its AMX / AVX-512 matmul). Owned by the caller; read-only.
class PackedWeight {
 public:
  virtual ~PackedWeight() = default;
  virtual std::size_t bytes() const = 0;  // the memory it holds
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // ---- memory: the backend owns the memory its ops run on ----
  // Raw pointers given to the public ops (ops/*.hpp, attention/*.hpp) point into device() memory
  // of the active backend, as cuBLAS pointers point into the GPU's; views carry device().
  // Default: the host (the CPU backend).
  virtual Device device() const { return Device::host; }
  // The memory `p` points into: device() for memory this backend allocated, else the host (what
  // communicators stage by, as CUDA-aware MPI asks a pointer's attributes). Default: the host.
  virtual Device device_of(const void* p) const { return Device::host; }
  // `bytes` of device() memory, 64-byte aligned, uninitialised; bytes = 0 gives nullptr.
  // Default: the host heap. Prefer Buffer (ops/buffer.hpp), which frees it.
  virtual void* allocate(std::size_t bytes);
  // Frees what allocate(bytes) returned (nullptr: nothing). Ordered after the ops issued before
  // it (a queued op may still read the memory: an asynchronous backend frees it in queue order).
  virtual void deallocate(void* p, std::size_t bytes) noexcept;
  // Copies `bytes` from src to dst; each side is host memory or device() memory, as named.
  // Ordered after the ops issued before it; when it returns, a host source may be reused and a
  // host destination holds the data.
  virtual void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes);
  // Waits until every op issued so far has finished. The ops of one backend run in the order they
  // are issued (one queue); the CPU's ops have finished when they return, so its synchronize()
  // does nothing, as its default here.
  virtual void synchronize() {}
  // Whether the hook of `op` runs on tensors of `dtype`. Checked before every call.
  virtual bool supports(OpKind op, DType dtype) const = 0;
  // What runs ops of `dtype` here, for logs and benchmark output (e.g. which oneDNN kernel and
  // instruction set serves bf16). Default: the backend's name.
  virtual std::string describe(DType dtype) const { return std::string(name()) + " (" + dtype_name(dtype) + ")"; }
  // Whether the GEMMs of `dtype` run on arithmetic that reads it (bf16: avx512_bf16's dot products,
  // AMX tiles, tensor cores) rather than on its values converted to f32 first, which costs more
  // than f32 itself (a CPU without avx512_bf16: the CLI says so when --dtype bf16 is asked for there).
  virtual bool native_arithmetic(DType dtype) const {
    (void)dtype;
    return true;
  }
  // What determines this backend's result bits, as one line of key=value words (the CPU's: its
  // kernels' version and ISA, the compiler, oneDNN's version and paths, the fused attention paths).
  // `diffcp backends --key` prints the active one; the bitwise golden is recorded under it.
  virtual std::string kernel_key() const { return name(); }

  // ---- hooks: each default fails naming this backend, the op and the dtype ----
  virtual void gemm(const GemmArgs& args);
  // dy: [M, N]  db: [N] += sum over rows of dy
  virtual void bias_backward(ConstTensorView dy, TensorView db);
  // y: [M, N] += b: [N] on every row
  virtual void bias_add(TensorView y, ConstTensorView b);
  // The layer product of inference with bf16 weights, y = x w + bias, f32 accumulation:
  //   x: [M, K] bf16 (row stride >= K)  w: [K, N] bf16 (row stride >= N)  bias: [N] f32, or empty
  //   y: [M, N] f32 out (row stride >= N)  packed: w as pack_weight made it, or null (w read as is).
  // The result does not depend on `packed` (the same kernel reads either layout).
  virtual void dense_linear(ConstTensorView x, ConstTensorView w, const PackedWeight* packed, ConstTensorView bias,
                            TensorView y);
  // w: [K, N] bf16 packed for dense_linear; null where this backend reads weights as stored
  // (default) or has no faster layout for this shape.
  virtual std::unique_ptr<PackedWeight> pack_weight(ConstTensorView w);

  // q: [Q, n_q, d_h]  k, v: [L_k, n_kv, d_h]  o: [Q, n_q, d_h] out  lse: [Q*n_q] out.
  // Rank-3 views have contiguous heads (strides {row_stride, d_h, 1}); softmax_scale <= 0: 1/sqrt(d_h).
  virtual void attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                 TensorView o, TensorView lse, float softmax_scale);
  // q, do_: [Q, n_q, d_h]  k, v: [L_k, n_kv, d_h]  lse, delta: [Q*n_q] (global)
  // dq: [Q, n_q, d_h] out  dk, dv: [L_k, n_kv, d_h] out
  virtual void attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                  ConstTensorView do_, ConstTensorView lse, ConstTensorView delta, TensorView dq,
                                  TensorView dk, TensorView dv, float softmax_scale);
  // do_, o: [Q, n_q, d_h]  delta: [Q*n_q] out
  virtual void attention_delta(ConstTensorView do_, ConstTensorView o, TensorView delta);

  // o_parts[p]: [rows, heads, dim]  lse_parts[p]: [rows*heads]  o: [rows, heads, dim] out  lse: [rows*heads] out
  virtual void lse_merge(std::span<const ConstTensorView> o_parts, std::span<const ConstTensorView> lse_parts,
                         TensorView o, TensorView lse);
  // o_p: [rows, heads, dim] in/out  lse_p, lse: [rows*heads]
  virtual void lse_rescale(TensorView o_p, ConstTensorView lse_p, ConstTensorView lse);
  // x, m: [n]. to_exp: x = exp(x - m) (0 where m = -inf); else x = m + log(x) (-inf where m = -inf)
  virtual void lse_shift(TensorView x, ConstTensorView m, bool to_exp);

  // x, y: [rows, heads, d] (may alias)  w: [d]  rstd: [rows, heads] out
  virtual void rmsnorm_forward(ConstTensorView x, ConstTensorView w, float eps, TensorView y, TensorView rstd);
  // dy, x: [rows, heads, d]  rstd: [rows, heads]  w: [d]  dx: [rows, heads, d] out (may alias dy)  dw: [d] +=
  virtual void rmsnorm_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView rstd, ConstTensorView w,
                                TensorView dx, TensorView dw);
  // x: [rows, heads, d_h] in place  positions: [rows], inside the table
  virtual void rope(TensorView x, std::span<const std::int64_t> positions, const RopeTable& table, bool inverse);

  // x: [n] in place
  virtual void silu(TensorView x);
  // x: [rows, cols] (row stride >= cols) in place
  virtual void gelu_tanh(TensorView x);
  // x: [rows, cols] (row stride >= cols) in place: the exact GELU, 0.5 x (1 + erf(x / sqrt 2))
  virtual void gelu(TensorView x);
  // x, y: [rows, H] contiguous, no alias  shift, scale: [H]
  virtual void layernorm_modulate(ConstTensorView x, ConstTensorView shift, ConstTensorView scale, float eps,
                                  TensorView y);
  // x: [rows, H] contiguous, += gate[H] * y  y: [rows, H] (row stride >= H)
  virtual void gated_add(TensorView x, ConstTensorView gate, ConstTensorView y);
  // qkv: [rows, 3, heads, d_h] (row stride >= 3*heads*d_h; q and k parts in place)
  // q_scale, k_scale: [d_h] (per-head norm) or [heads*d_h] (one norm across a row's heads: Wan)
  // cos, sin: [rows, d_h/2], or rank 0 (null) for no rotation
  virtual void qk_norm_rope(TensorView qkv, ConstTensorView q_scale, ConstTensorView k_scale, float eps,
                            ConstTensorView cos, ConstTensorView sin);
  // gate, up: [n]  act: [n] out = silu(gate) * up
  virtual void swiglu_forward(ConstTensorView gate, ConstTensorView up, TensorView act);
  // dact, gate, up: [n]  dgate, dup: [n] out (the gradients of act = silu(gate) * up)
  virtual void swiglu_backward(ConstTensorView dact, ConstTensorView gate, ConstTensorView up, TensorView dgate,
                               TensorView dup);
  // y: [n] in place += alpha * x: [n] (alpha = 1: y + x exactly)
  virtual void add(TensorView y, ConstTensorView x, float alpha);
  // v, v_neg: [rows, C]; ops/elementwise.hpp guidance_combine.
  virtual void guidance_combine(TensorView v, ConstTensorView v_neg, float scale, bool keep_norm);
  // p, m, v: [n] in place  g: [n]
  virtual void adamw_step(TensorView p, ConstTensorView g, TensorView m, TensorView v, const AdamWStepArgs& args);
  // src: [M, w] (row stride >= w), rows: [n] i64 in [0, M), dst: [n, w] (row stride >= w):
  // dst[i] = src[rows[i]] in dst's dtype (one dtype, or f32 <-> bf16); supports(op, the non-f32 side).
  // rows is host metadata (labelled host: read at the call, range-checked by the caller) or device
  // memory (made on the device by token_rows: read when the op runs, no host sync).
  virtual void gather_rows(ConstTensorView src, ConstTensorView rows, TensorView dst);
  // src: [n, w], rows: [n] i64 in [0, M), distinct, host or device memory as above, dst: [M, w]:
  // dst[rows[i]] = src[i] in dst's dtype
  virtual void scatter_rows(ConstTensorView src, ConstTensorView rows, TensorView dst);
  // a, b: [G, R, w] contiguous (f32 or bf16)  out: [R] f32 = sum over g, then i, of |a - b| in double
  // (in that order), rounded once
  virtual void l1_distance(ConstTensorView a, ConstTensorView b, TensorView out);
  // V-Major's choice (dit/ops.hpp select_active): parts: [lanes, S, n] f32  active: [S, k] i32 out
  virtual void select_active(ConstTensorView parts, TensorView active);
  // active: [S, k] i32 in [0, n)  map: [n] i64 or rank 0 (the identity)  rows: [B, k] i64 out
  // (dit/ops.hpp token_rows)
  virtual void token_rows(ConstTensorView active, ConstTensorView map, std::int64_t n, std::int64_t stride,
                          TensorView rows);
  // Cross-entropy over a chunk of logits (columns [v0, v0 + n) of the vocabulary; host metadata and
  // O(rows) host results, as gather_rows' index list):
  //   logits: [R, n] f32 (row stride >= n)  target: [R] global token ids
  //   stats: [R, 4] out, per row in double: max, sum exp(l - max), the first argmax (global id),
  //          the target's logit (0 when it is not in [v0, v0 + n))
  //   weight: [R] or empty. Given, the chunk is the whole vocabulary (v0 = 0): the logits become
  //          dlogits = w (exp(l - lse) - [v == target]) with lse = max + log(sum), in place.
  //   map: the logits are logit_map's output: the dlogits are times map'(l) (identity: 1)
  virtual void cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                             std::span<double> stats, std::span<const double> weight, LogitMap map);
  // logits: [R, n] f32 in place -> map'(y) (w (exp(y - lse) - [v0 + v == target]) + extra at its ids)
  // target, weight, lse: [R] host  extra: ids, grad [R, k] host (k = 0: none)
  virtual void cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                                      std::span<const double> weight, std::span<const double> lse, LogitMap map,
                                      SparseLogitGrad extra);
  // logits: [R, n] f32 in place -> multiplier l, soft-capped (ops/loss.hpp logit_map)
  virtual void logit_map(TensorView logits, LogitMap map);
  // logits: [R, n] f32  values: [R, k] host out  ids: [R, k] host out (global: v0 + column), by
  // value descending then id ascending, a NaN after every number (ops/loss.hpp top_k)
  virtual void top_k(ConstTensorView logits, std::int64_t v0, std::span<float> values, std::span<std::int32_t> ids);
  // x: [n] f32 in place = float(double(x) * scale); returns the sum of the new x^2 in double, in
  // index order (a scalar for the host: the gradient norm).
  virtual double scale_sumsq(TensorView x, double scale);
  // x: [n] = value (supports(fill, x.dtype))
  virtual void fill(TensorView x, float value);
  // src -> dst converted to dst's dtype, round to nearest even (f32 <-> bf16, or a plain copy for one
  // dtype): [n] contiguous, or [rows, cols] with row strides (stride[1] = 1) on both sides.
  // supports(convert, dtype) names the non-f32 side.
  virtual void convert(ConstTensorView src, TensorView dst);
  // ops/fp8.hpp's blocked e4m3 codec; supports(op, x's dtype: f32 or bf16).
  // x: [n, d] contiguous  enc: [n, d + 4] u8 contiguous out (per block: f32 scale, d e4m3 codes)
  virtual void fp8_encode(ConstTensorView x, TensorView enc);
  // enc: [n, d + 4] u8 contiguous  x: [n, d] contiguous out
  virtual void fp8_decode(ConstTensorView enc, TensorView x);
  // ops/conv.hpp, f32, blocks of `block` rows:
  //   x: [T, H]  dyn: [T, K, G] (row stride >= K G)  base: [K, H]  y: [T, H] out
  virtual void dynamic_conv_forward(ConstTensorView x, ConstTensorView dyn, ConstTensorView base, std::int64_t block,
                                    TensorView y);
  //   dy: [T, H]  dx: [T, H] out  ddyn: [T, K, G] out (row stride >= K G)  dbase: [K, H] +=
  virtual void dynamic_conv_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView dyn, ConstTensorView base,
                                     std::int64_t block, TensorView dx, TensorView ddyn, TensorView dbase);

 protected:
  [[noreturn]] void unsupported(OpKind op, DType dtype) const;
};

// The built-in CPU backend (src/cpu/): f32 for every op. Always registered, active by default.
// Its kernels are compiled once per instruction set (src/cpu/isa.hpp) and the best one this CPU
// runs is chosen at the first call; DIFFCP_CPU_ISA=<name> in the environment chooses another
// (an error if it is not compiled in or the CPU lacks it). describe() names the kernels that run.
Backend& cpu_backend();

// One instruction set the CPU backend's kernels were compiled for: "avx512" (AVX-512 F/BW/DQ/VL),
// "avx2" (AVX2 + FMA), "generic" (the x86-64 baseline, SSE2), or only "native" in a
// -DDIFFCP_NATIVE=ON build (-march=native).
struct CpuIsa {
  std::string name;
  bool supported;  // this CPU can run it
};
// The ISAs compiled in, widest first.
std::vector<CpuIsa> cpu_isas();
// The CPU backend compiled for `isa` (one of cpu_isas()); an error, naming what there is, if it is
// not compiled in or this CPU cannot run it. Tests run each ISA's kernels through it.
Backend& cpu_backend(std::string_view isa);

// ---- the registry: a backend is registered by name and selected as the active one ----
// The registry is shared and thread-safe. The active backend is the calling thread's (as CUDA's
// current device): the run that owns a backend installs it around its ops (ScopedBackend; the
// trainer, the DiT sampler and the layer runners do, from what they were built with), and the CP
// layers and the DiT model check that they run on the backend their buffers and weights live on.
// A new thread starts on the CPU backend.

// Makes `b` known to find_backend. The caller keeps `b` alive while it is registered. A second
// backend with the same name is an error; registering the same object again does nothing.
void register_backend(Backend& b);
// The registered backend called `name`; the error lists the registered names.
Backend& find_backend(std::string_view name);
// Every registered backend, in registration order (the CPU's first).
std::vector<Backend*> registered_backends();
// The backend whose memory `p` points into: the registered device backend whose device_of(p) is
// its device, else (host memory) the CPU backend. Memory knows its backend: a communicator asks it
// where a buffer lives and who copies it, whatever backend is active.
Backend& backend_of(const void* p);
// The backend the public ops run on, on this thread (cpu_backend() until changed).
Backend& active_backend();
// Its device: where the raw pointers handed to the op wrappers point (their views carry it).
inline Device active_device() { return active_backend().device(); }
// Views of such raw memory for the hooks, labelled with that device: a [rows, heads, dim] view of
// head rows, or a rank-1 view of a span.
template <typename T>
auto device_view(HeadRows<T> r) {
  auto v = r.view();
  v.device = active_device();
  return v;
}
template <typename T>
auto device_view(std::span<T> s) {
  auto v = view_of(s);
  v.device = active_device();
  return v;
}
// A rank-1 view [n] of raw memory at p in the active backend's memory (a layer's f32 pointers).
template <typename T>
auto device_view(T* p, std::int64_t n) {
  return device_view(std::span<T>(p, static_cast<std::size_t>(n)));
}
// Makes `b` this thread's active backend (it need not be registered) and returns the previous one.
Backend& set_backend(Backend& b);
// The active backend after checking that it supports (op, dtype); otherwise the error
// "backend '<name>' does not support <op> on <dtype>". What every public op calls first.
Backend& backend_for(OpKind op, DType dtype);

// Selects `b` for the lifetime of the guard, then restores the previous backend.
class ScopedBackend {
 public:
  explicit ScopedBackend(Backend& b) : previous_(set_backend(b)) {}
  ~ScopedBackend() { set_backend(previous_); }
  ScopedBackend(const ScopedBackend&) = delete;
  ScopedBackend& operator=(const ScopedBackend&) = delete;

 private:
  Backend& previous_;
};

}  // namespace diffcp
