#include "diffcp/cuda/backend.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/core/env.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/ops/rope.hpp"
#include "kernels.hpp"
#include "plan.hpp"

namespace diffcp {

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  DIFFCP_CHECK(e == cudaSuccess, "cuda: ", what, ": ", cudaGetErrorString(e));
}
void launched(int e, const char* op) { cuda_ok(static_cast<cudaError_t>(e), op); }
void lt_ok(cublasStatus_t s, const char* what) {
  DIFFCP_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuda: cublasLt ", what, ": status ", static_cast<int>(s));
}

// [rows, cols] and the row stride of a rank-1 view (one row) or of a rank-2 view (its own stride,
// contiguous or not: both sides of a copy must agree on the rows).
struct Rows {
  std::int64_t rows, cols, ld;
};
template <typename View>
Rows rows_of(const View& t) {
  if (t.rank < 2) return {1, t.numel(), t.numel()};
  return {t.size(0), t.size(1), t.stride[0]};
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    int devices = 0;
    cuda_ok(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    ordinal_ = cuda_device_ordinal();
    cuda_ok(cudaSetDevice(ordinal_), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    // Stream-ordered allocations stay in the device's pool when freed (a layer's scratch, an
    // attention chunk's score tiles): no trip to the driver per step (as PyTorch's caching
    // allocator); allocate() and cuda_release_cached_memory() give the unused part back when needed.
    cudaMemPool_t pool = nullptr;
    cuda_ok(cudaDeviceGetDefaultMemPool(&pool, ordinal_), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep = UINT64_MAX;
    cuda_ok(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
    lt_ok(cublasLtCreate(&lt_), "create");
    cuda_ok(cudaMalloc(&workspace_, kWorkspace), "cudaMalloc(cuBLASLt workspace)");
    cudaDeviceProp p{};
    cuda_ok(cudaGetDeviceProperties(&p, ordinal_), "cudaGetDeviceProperties");
    device_name_ = "GPU " + std::to_string(ordinal_) + " of " + std::to_string(devices) + ": " + p.name + ", sm_" +
                   std::to_string(p.major) + std::to_string(p.minor);
  }
  const char* name() const override { return "cuda"; }
  cudaStream_t stream() const { return stream_; }  // for cuda_stream() (the NCCL communicator)
  Device device() const override { return device_; }
  // Device (or managed) memory by its CUDA attributes, as a CUDA-aware MPI asks them.
  Device device_of(const void* p) const override {
    cudaPointerAttributes a{};
    if (p == nullptr || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();  // a host pointer CUDA never saw: clear the sticky-free error
      return Device::host;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? device_ : Device::host;
  }
  std::string describe(DType dtype) const override {
    return "cuda (" + device_name_ + "): " + (dtype == DType::bf16 ? "cuBLASLt bf16, f32 accumulation" : "cuBLASLt f32 (no TF32)");
  }
  bool supports(OpKind op, DType dtype) const override {
    const bool f32_or_bf16 = dtype == DType::f32 || dtype == DType::bf16;
    if (dtype == DType::u8)  // raw rows: same-dtype copies, gathers and scatters
      return op == OpKind::convert || op == OpKind::gather_rows || op == OpKind::scatter_rows;
    if (dtype == DType::i32) return op == OpKind::token_rows;  // token indices -> row lists
    switch (op) {
      case OpKind::gemm:
      case OpKind::fill:
      case OpKind::convert:
        return dtype == DType::f32 || dtype == DType::bf16;
      case OpKind::add:
      case OpKind::silu:
      case OpKind::gelu_tanh:
      case OpKind::gelu:
      case OpKind::swiglu_forward:
      case OpKind::swiglu_backward:
      case OpKind::bias_add:
      case OpKind::bias_backward:
      case OpKind::lse_rescale:
      case OpKind::lse_shift:
      case OpKind::rmsnorm_forward:
      case OpKind::rmsnorm_backward:
      case OpKind::gated_add:
      case OpKind::adamw_step:
      case OpKind::layernorm_modulate:
      case OpKind::scale_sumsq:
      case OpKind::lse_merge:
      case OpKind::rope:
      case OpKind::qk_norm_rope:
      case OpKind::guidance_combine:
      case OpKind::cross_entropy:
      case OpKind::cross_entropy_backward:
      case OpKind::logit_map:
      case OpKind::top_k:
      case OpKind::select_active:
      case OpKind::dynamic_conv_forward:
      case OpKind::dynamic_conv_backward:
        return dtype == DType::f32;
      case OpKind::attention_delta:
      case OpKind::attention_forward:
      case OpKind::attention_backward:
      case OpKind::gather_rows:
      case OpKind::scatter_rows:
      case OpKind::l1_distance:
      case OpKind::fp8_encode:
      case OpKind::fp8_decode:
        return f32_or_bf16;
      case OpKind::dense_linear:
        return dtype == DType::bf16;
      default:
        return false;
    }
  }

  // From the stream-ordered pool, which keeps what is freed; when the device is out of memory the
  // pool's unused memory goes back (after the stream has run) and the allocation is tried again.
  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, stream_) == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      release_cached_memory();
      p = nullptr;
      cuda_ok(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync (after returning the pool's unused memory)");
    }
    DIFFCP_CHECK(p != nullptr, "cuda: cudaMallocAsync of ", bytes, " bytes gave no memory");
    return p;
  }
  // The pool's unused memory back to the device (for allocations outside it: NCCL's buffers).
  void release_cached_memory() {
    synchronize();
    cudaMemPool_t pool = nullptr;
    cuda_ok(cudaDeviceGetDefaultMemPool(&pool, ordinal_), "cudaDeviceGetDefaultMemPool");
    cuda_ok(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
  }
  void deallocate(void* p, std::size_t) noexcept override {
    if (p != nullptr) (void)cudaFreeAsync(p, stream_);  // ordered after the ops issued before it
  }
  void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) override {
    if (bytes == 0) return;
    DIFFCP_CHECK((dst_device == Device::host || dst_device == device_) && (src_device == Device::host || src_device == device_),
                 "cuda: copy between ", device_name(src_device), " and ", device_name(dst_device), " memory");
    cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    // A host destination holds the data when copy() returns: the host waits (a host sync). A
    // pageable host source has been taken into the driver's staging when cudaMemcpyAsync returns:
    // it may be reused, and the host does not wait for the stream; a pinned one is read by the
    // DMA later, so the host waits for it.
    if (dst_device == Device::host || (src_device == Device::host && cuda_page_locked(src))) synchronize();
  }
  void synchronize() override { cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  void fill(TensorView x, float value) override {
    if (x.dtype == DType::bf16)
      launched(cuda::fill_bf16(static_cast<std::uint16_t*>(x.data), x.numel(), f32_to_bf16(value), stream_), "fill");
    else
      launched(cuda::fill_f32(x.ptr<float>(), x.numel(), value, stream_), "fill");
  }
  void convert(ConstTensorView src, TensorView dst) override {
    const bool flat = src.is_contiguous() && dst.is_contiguous();
    // flat: one row of n; else [rows, cols] with each side's row stride (0 on the source: a broadcast)
    const Rows s = flat ? Rows{1, src.numel(), src.numel()} : rows_of(src),
               d = flat ? Rows{1, dst.numel(), dst.numel()} : rows_of(dst);
    DIFFCP_CHECK(s.rows == d.rows && s.cols == d.cols, "cuda: convert: ", src.describe(), " -> ", dst.describe());
    if (src.dtype == dst.dtype && s.ld != 0)
      launched(cuda::copy_rows(src.data, s.ld, dst.data, d.ld, s.rows, s.cols, static_cast<int>(src.element_size()), stream_),
               "convert");
    else if (src.dtype == dst.dtype) {  // a broadcast of one row: as an f32 or bf16 "conversion" to itself
      DIFFCP_CHECK(src.dtype != DType::u8, "cuda: convert: a broadcast row of u8 (", src.describe(), ")");
      launched(src.dtype == DType::bf16
                   ? cuda::copy_rows_broadcast_u16(static_cast<const std::uint16_t*>(src.data), static_cast<std::uint16_t*>(dst.data),
                                                   d.ld, d.rows, d.cols, stream_)
                   : cuda::copy_rows_broadcast_f32(static_cast<const float*>(src.data), static_cast<float*>(dst.data), d.ld,
                                                   d.rows, d.cols, stream_),
               "convert");
    } else if (dst.dtype == DType::bf16)
      launched(cuda::convert_f32_bf16(static_cast<const float*>(src.data), s.ld, static_cast<std::uint16_t*>(dst.data), d.ld,
                                      s.rows, s.cols, stream_),
               "convert");
    else
      launched(cuda::convert_bf16_f32(static_cast<const std::uint16_t*>(src.data), s.ld, static_cast<float*>(dst.data), d.ld,
                                      s.rows, s.cols, stream_),
               "convert");
  }
  void add(TensorView y, ConstTensorView x, float alpha) override {
    launched(cuda::axpy(y.ptr<float>(), x.ptr<float>(), alpha, y.numel(), stream_), "add");
  }
  void silu(TensorView x) override { launched(cuda::silu(x.ptr<float>(), x.numel(), stream_), "silu"); }
  void gelu_tanh(TensorView x) override {
    launched(cuda::gelu_tanh(x.ptr<float>(), x.size(0), x.size(1), x.stride[0], stream_), "gelu_tanh");
  }
  void gelu(TensorView x) override {
    launched(cuda::gelu(x.ptr<float>(), x.size(0), x.size(1), x.stride[0], stream_), "gelu");
  }
  void swiglu_forward(ConstTensorView gate, ConstTensorView up, TensorView act) override {
    if (act.rank == 1) {
      launched(cuda::swiglu_forward(gate.ptr<float>(), 0, up.ptr<float>(), 0, act.ptr<float>(), 0, 1, act.numel(), stream_),
               "swiglu_forward");
      return;
    }
    launched(cuda::swiglu_forward(gate.ptr<float>(), gate.stride[0], up.ptr<float>(), up.stride[0], act.ptr<float>(),
                                  act.stride[0], act.size(0), act.size(1), stream_),
             "swiglu_forward");
  }
  void swiglu_backward(ConstTensorView dact, ConstTensorView gate, ConstTensorView up, TensorView dgate,
                       TensorView dup) override {
    launched(cuda::swiglu_backward(dact.ptr<float>(), gate.ptr<float>(), up.ptr<float>(), dgate.ptr<float>(), dup.ptr<float>(),
                                   dact.numel(), stream_),
             "swiglu_backward");
  }
  void bias_add(TensorView y, ConstTensorView b) override {
    launched(cuda::bias_add_rows(y.ptr<float>(), y.size(1), b.ptr<float>(), y.size(0), y.size(1), stream_), "bias_add");
  }
  void bias_backward(ConstTensorView dy, TensorView db) override {
    launched(cuda::bias_backward(dy.ptr<float>(), db.ptr<float>(), dy.size(0), dy.size(1), stream_), "bias_backward");
  }

  void lse_rescale(TensorView o, ConstTensorView lse_p, ConstTensorView lse) override {
    launched(cuda::lse_rescale(o.ptr<float>(), o.size(0), o.size(1), o.size(2), o.stride[0], lse_p.ptr<float>(),
                               lse.ptr<float>(), stream_),
             "lse_rescale");
  }
  void lse_shift(TensorView x, ConstTensorView m, bool to_exp) override {
    launched(cuda::lse_shift(x.ptr<float>(), m.ptr<float>(), x.numel(), to_exp, stream_), "lse_shift");
  }
  void attention_delta(ConstTensorView do_, ConstTensorView o, TensorView delta) override {
    DIFFCP_CHECK(do_.rank == 3 && o.rank == 3 && do_.shape == o.shape && do_.dtype == o.dtype &&
                     delta.numel() == do_.size(0) * do_.size(1),
                 "cuda: attention_delta: do ", do_.describe(), ", o ", o.describe(), ", delta ", delta.describe());
    if (do_.dtype == DType::bf16)
      launched(cuda::attention_delta_bf16(static_cast<const std::uint16_t*>(do_.data), do_.stride[0],
                                          static_cast<const std::uint16_t*>(o.data), o.stride[0], delta.ptr<float>(),
                                          do_.size(0), do_.size(1), do_.size(2), stream_),
               "attention_delta");
    else
      launched(cuda::attention_delta_f32(do_.ptr<float>(), do_.stride[0], o.ptr<float>(), o.stride[0], delta.ptr<float>(),
                                         do_.size(0), do_.size(1), do_.size(2), stream_),
               "attention_delta");
  }
  void rmsnorm_forward(ConstTensorView x, ConstTensorView w, float eps, TensorView y, TensorView rstd) override {
    DIFFCP_CHECK(x.is_contiguous() && y.is_contiguous(), "cuda: rmsnorm_forward: ", x.describe(), " -> ", y.describe(),
                 " (contiguous rows expected)");
    launched(cuda::rmsnorm_forward(x.ptr<float>(), w.ptr<float>(), eps, y.ptr<float>(), rstd.ptr<float>(),
                                   x.size(0) * x.size(1), x.size(2), stream_),
             "rmsnorm_forward");
  }
  void rmsnorm_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView rstd, ConstTensorView w, TensorView dx,
                        TensorView dw) override {
    DIFFCP_CHECK(dy.is_contiguous() && x.is_contiguous() && dx.is_contiguous(), "cuda: rmsnorm_backward: contiguous rows expected");
    launched(cuda::rmsnorm_backward(dy.ptr<float>(), x.ptr<float>(), rstd.ptr<float>(), w.ptr<float>(), dx.ptr<float>(),
                                    dw.ptr<float>(), x.size(0) * x.size(1), x.size(2), stream_),
             "rmsnorm_backward");
  }
  void gated_add(TensorView x, ConstTensorView gate, ConstTensorView y) override {
    launched(cuda::gated_add(x.ptr<float>(), gate.ptr<float>(), y.ptr<float>(), y.stride[0], x.size(0), x.size(1), stream_),
             "gated_add");
  }
  void layernorm_modulate(ConstTensorView x, ConstTensorView shift, ConstTensorView scale, float eps,
                          TensorView y) override {
    launched(cuda::layernorm_modulate(x.ptr<float>(), shift.ptr<float>(), scale.ptr<float>(), eps, y.ptr<float>(),
                                      x.size(0), x.size(1), stream_),
             "layernorm_modulate");
  }
  void attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView o,
                         TensorView lse, float softmax_scale) override {
    cuda::AttentionDims a = attention_dims(mask, q, k, v, softmax_scale);
    check_heads("o", o, a.Q, a.n_q, a.d);
    check_stats("lse", lse, a);
    a.ld_o = o.stride[0];
    if (simt_attention_ || !gemm_shapes(a, {q, k, v, o})) {
      launched(cuda::attention_forward(q.dtype == DType::bf16, q.data, k.data, v.data, o.data, lse.ptr<float>(),
                                       prepare(mask, false).at(0), a, stream_),
               "attention_forward");
      return;
    }
    gemm_attention_forward(mask, a, q, k, v, o, lse);
  }
  void attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          ConstTensorView do_, ConstTensorView lse, ConstTensorView delta, TensorView dq, TensorView dk,
                          TensorView dv, float softmax_scale) override {
    cuda::AttentionDims a = attention_dims(mask, q, k, v, softmax_scale);
    check_heads("do", do_, a.Q, a.n_q, a.d);
    check_heads("dq", dq, a.Q, a.n_q, a.d);
    check_heads("dk", dk, a.L_k, a.n_kv, a.d);
    check_heads("dv", dv, a.L_k, a.n_kv, a.d);
    check_stats("lse", lse, a);
    check_stats("delta", delta, a);
    a.ld_do = do_.stride[0];
    a.ld_dq = dq.stride[0];
    a.ld_dk = dk.stride[0];
    a.ld_dv = dv.stride[0];
    if (!simt_attention_ && gemm_shapes(a, {q, k, v, do_, dq, dk, dv}))
      return gemm_attention_backward(mask, a, q, k, v, do_, lse, delta, dq, dk, dv);
    // The forward plan (dQ) and the key plan (dK, dV), prepared once for the mask.
    const PreparedMask& pm = prepare(mask, true);
    launched(cuda::attention_backward(q.dtype == DType::bf16, q.data, k.data, v.data, do_.data, lse.ptr<float>(),
                                      delta.ptr<float>(), dq.data, dk.data, dv.data, pm.at(0), pm.at(pm.key_at), a,
                                      stream_),
             "attention_backward");
  }
  void lse_merge(std::span<const ConstTensorView> o_parts, std::span<const ConstTensorView> lse_parts, TensorView o,
                 TensorView lse) override {
    DIFFCP_CHECK(o.rank == 3 && o.stride[1] == o.size(2) && o.stride[2] == 1 && o_parts.size() == lse_parts.size() &&
                     lse.numel() == o.size(0) * o.size(1),
                 "cuda: lse_merge: o ", o.describe(), ", lse ", lse.describe(), ", ", o_parts.size(), " o parts, ",
                 lse_parts.size(), " lse parts");
    HostArgs h;
    for (std::size_t p = 0; p < o_parts.size(); ++p) {
      const ConstTensorView& x = o_parts[p];
      DIFFCP_CHECK(x.rank == 3 && x.shape == o.shape && x.stride[1] == o.size(2) && x.stride[2] == 1 &&
                       lse_parts[p].numel() == lse.numel(),
                   "cuda: lse_merge: part ", p, " is ", x.describe(), " with lse ", lse_parts[p].describe(), ", output ",
                   o.describe());
      const std::int64_t words[3] = {static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(x.data)), x.stride[0],
                                     static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(lse_parts[p].data))};
      h.add(std::span<const std::int64_t>(words));
    }
    const auto* parts = static_cast<const std::int64_t*>(upload(h));
    launched(cuda::lse_merge(parts, static_cast<std::int64_t>(o_parts.size()), o.ptr<float>(), o.stride[0], lse.ptr<float>(),
                             o.size(0), o.size(1), o.size(2), stream_),
             "lse_merge");
  }
  void rope(TensorView x, std::span<const std::int64_t> positions, const RopeTable& table, bool inverse) override {
    DIFFCP_CHECK(x.rank == 3 && x.is_contiguous() && x.size(2) == table.d_h() &&
                     static_cast<std::int64_t>(positions.size()) == x.size(0),
                 "cuda: rope: x ", x.describe(), ", ", positions.size(), " positions, table d_h ", table.d_h());
    // Each row's table entries (RopeTable::rows: the table is host memory), staged in one copy.
    const RopeTable rows = table.rows(positions);
    const std::size_t n = positions.size() * static_cast<std::size_t>(table.d_h() / 2);
    HostArgs h;
    h.add(std::span<const float>(rows.cos(0), n));
    const std::size_t sin_at = h.add(std::span<const float>(rows.sin(0), n));
    const auto* base = static_cast<const unsigned char*>(upload(h));
    const auto* cs = reinterpret_cast<const float*>(base);
    const auto* sn = reinterpret_cast<const float*>(base + sin_at);
    launched(cuda::rope(x.ptr<float>(), cs, sn, x.size(0), x.size(1), x.size(2), inverse ? -1.f : 1.f,
                        stream_),
             "rope");
  }
  void qk_norm_rope(TensorView qkv, ConstTensorView q_scale, ConstTensorView k_scale, float eps, ConstTensorView cos,
                    ConstTensorView sin) override {
    DIFFCP_CHECK(qkv.rank == 4 && qkv.size(1) == 3 && qkv.stride[3] == 1 && qkv.stride[2] == qkv.size(3) &&
                     qkv.stride[1] == qkv.size(2) * qkv.size(3),
                 "cuda: qk_norm_rope: qkv ", qkv.describe(), " (expected [rows, 3, heads, d_h], contiguous in a row)");
    DIFFCP_CHECK((q_scale.size(0) == qkv.size(3) || q_scale.size(0) == qkv.size(2) * qkv.size(3)) &&
                     k_scale.size(0) == q_scale.size(0),
                 "cuda: qk_norm_rope: scales [", q_scale.size(0), "] and [", k_scale.size(0), "], expected both [d_h] or both [heads * d_h]");
    const bool rotate = cos.rank != 0;
    launched(cuda::qk_norm_rope(qkv.ptr<float>(), qkv.stride[0], qkv.size(0), qkv.size(2), qkv.size(3), q_scale.ptr<float>(),
                                k_scale.ptr<float>(), eps, rotate ? cos.ptr<float>() : nullptr,
                                rotate ? sin.ptr<float>() : nullptr, q_scale.size(0) != qkv.size(3), stream_),
             "qk_norm_rope");
  }
  void gather_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) override { move_rows(src, rows, dst, false); }
  void scatter_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) override { move_rows(src, rows, dst, true); }
  void select_active(ConstTensorView parts, TensorView active) override {
    DIFFCP_CHECK(parts.rank == 3 && parts.is_contiguous() && active.rank == 2 && active.is_contiguous() &&
                     active.size(0) == parts.size(1) && active.size(1) <= parts.size(2),
                 "cuda: select_active: parts ", parts.describe(), ", active ", active.describe());
    const std::int64_t S = parts.size(1), n = parts.size(2);
    // scratch: the summed distances [S, n] f64 and the active flags [S, n] i32, freed in stream order
    void* scratch = allocate(static_cast<std::size_t>(S * n) * (sizeof(double) + sizeof(std::int32_t)));
    const int rc = cuda::select_active(parts.ptr<const float>(), parts.size(0), S, n, active.size(1),
                                       active.ptr<std::int32_t>(), static_cast<double*>(scratch), stream_);
    deallocate(scratch, 0);  // in stream order, after the kernels; also when the launch failed
    launched(rc, "select_active");
  }
  void dynamic_conv_forward(ConstTensorView x, ConstTensorView dyn, ConstTensorView base, std::int64_t block,
                            TensorView y) override {
    DIFFCP_CHECK(x.is_contiguous() && y.is_contiguous() && base.is_contiguous() && dyn.stride[2] == 1 &&
                     dyn.stride[1] == dyn.size(2),
                 "cuda: dynamic_conv_forward: x ", x.describe(), ", dyn ", dyn.describe(), ", y ", y.describe());
    launched(cuda::dynamic_conv_forward(x.ptr<const float>(), dyn.ptr<const float>(), dyn.stride[0], base.ptr<const float>(),
                                        x.size(0), x.size(1), dyn.size(1), dyn.size(2), block, y.ptr<float>(), stream_),
             "dynamic_conv_forward");
  }
  void dynamic_conv_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView dyn, ConstTensorView base,
                             std::int64_t block, TensorView dx, TensorView ddyn, TensorView dbase) override {
    DIFFCP_CHECK(dy.is_contiguous() && x.is_contiguous() && dx.is_contiguous() && base.is_contiguous() &&
                     dbase.is_contiguous() && dyn.stride[2] == 1 && dyn.stride[1] == dyn.size(2) && ddyn.stride[2] == 1 &&
                     ddyn.stride[1] == ddyn.size(2),
                 "cuda: dynamic_conv_backward: dy ", dy.describe(), ", dyn ", dyn.describe(), ", ddyn ", ddyn.describe());
    launched(cuda::dynamic_conv_backward(dy.ptr<const float>(), x.ptr<const float>(), dyn.ptr<const float>(), dyn.stride[0],
                                         base.ptr<const float>(), x.size(0), x.size(1), dyn.size(1), dyn.size(2), block,
                                         dx.ptr<float>(), ddyn.ptr<float>(), ddyn.stride[0], dbase.ptr<float>(), stream_),
             "dynamic_conv_backward");
  }
  void token_rows(ConstTensorView active, ConstTensorView map, std::int64_t n, std::int64_t stride,
                  TensorView rows) override {
    DIFFCP_CHECK(active.rank == 2 && active.is_contiguous() && rows.rank == 2 && rows.is_contiguous() &&
                     rows.size(1) == active.size(1) && (map.rank == 0 || map.numel() == n),
                 "cuda: token_rows: active ", active.describe(), ", map ", map.describe(), ", rows ", rows.describe());
    launched(cuda::token_rows(active.ptr<const std::int32_t>(), active.size(0), active.size(1),
                              map.rank == 0 ? nullptr : map.ptr<const std::int64_t>(), n, rows.size(0), stride,
                              rows.ptr<std::int64_t>(), stream_),
             "token_rows");
  }
  void l1_distance(ConstTensorView a, ConstTensorView b, TensorView out) override {
    DIFFCP_CHECK(a.rank == 3 && a.is_contiguous() && b.is_contiguous() && a.shape == b.shape && a.dtype == b.dtype &&
                     out.numel() == a.size(1),
                 "cuda: l1_distance: a ", a.describe(), ", b ", b.describe(), ", out ", out.describe());
    launched(cuda::l1_distance(a.data, b.data, a.dtype == DType::bf16, out.ptr<float>(), a.size(0), a.size(1), a.size(2),
                               stream_),
             "l1_distance");
  }
  void guidance_combine(TensorView v, ConstTensorView v_neg, float scale, bool keep_norm) override {
    DIFFCP_CHECK(v.rank == 2 && v.is_contiguous() && v_neg.is_contiguous() && v.shape == v_neg.shape,
                 "cuda: guidance_combine: v ", v.describe(), ", v_neg ", v_neg.describe());
    launched(cuda::guidance_combine(v.ptr<float>(), v_neg.ptr<float>(), scale, keep_norm, v.size(0), v.size(1), stream_),
             "guidance_combine");
  }
  void cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target, std::span<double> stats,
                     std::span<const double> weight, LogitMap map) override {
    const std::int64_t R = logits.size(0), n = logits.size(1);
    DIFFCP_CHECK(logits.rank == 2 && static_cast<std::int64_t>(target.size()) == R &&
                     static_cast<std::int64_t>(stats.size()) == 4 * R && (weight.empty() || static_cast<std::int64_t>(weight.size()) == R),
                 "cuda: cross_entropy: logits ", logits.describe(), ", ", target.size(), " targets, ", stats.size(),
                 " stats, ", weight.size(), " weights");
    if (R == 0) return;
    // Device: [R, 4] stats out, then the targets and weights staged in.
    HostArgs h;
    h.add(std::span<const double>(stats.data(), stats.size()));  // room for the stats
    const std::size_t w_at = h.add(weight), t_at = h.add(target);
    auto* base = static_cast<unsigned char*>(const_cast<void*>(upload(h)));
    auto* st = reinterpret_cast<double*>(base);
    launched(cuda::cross_entropy(logits.ptr<float>(), logits.stride[0], R, n, v0, reinterpret_cast<const std::int32_t*>(base + t_at),
                                 st, weight.empty() ? nullptr : reinterpret_cast<const double*>(base + w_at),
                                 map.multiplier, map.softcap, stream_),
             "cross_entropy");
    copy(stats.data(), Device::host, st, device_, sizeof(double) * stats.size());  // O(R) results for the host
  }
  void cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                              std::span<const double> weight, std::span<const double> lse, LogitMap map,
                              SparseLogitGrad extra) override {
    const std::int64_t R = logits.size(0), k = R > 0 ? static_cast<std::int64_t>(extra.ids.size()) / R : 0;
    DIFFCP_CHECK(logits.rank == 2 && static_cast<std::int64_t>(target.size()) == R &&
                     static_cast<std::int64_t>(weight.size()) == R && static_cast<std::int64_t>(lse.size()) == R &&
                     extra.ids.size() == extra.grad.size() && static_cast<std::int64_t>(extra.ids.size()) == R * k,
                 "cuda: cross_entropy_backward: logits ", logits.describe(), ", ", target.size(), " targets, ", weight.size(),
                 " weights, ", lse.size(), " lse, ", extra.ids.size(), " extra ids");
    if (R == 0) return;
    HostArgs h;
    const std::size_t w_at = h.add(weight), l_at = h.add(lse), g_at = h.add(extra.grad), t_at = h.add(target),
                      i_at = h.add(extra.ids);
    const auto* base = static_cast<const unsigned char*>(upload(h));
    // scratch: the extras' terms [R, k] f64, freed in stream order
    void* add = k > 0 ? allocate(static_cast<std::size_t>(R * k) * sizeof(double)) : nullptr;
    const int rc = cuda::cross_entropy_backward(
        logits.ptr<float>(), logits.stride[0], R, logits.size(1), v0, reinterpret_cast<const std::int32_t*>(base + t_at),
        reinterpret_cast<const double*>(base + w_at), reinterpret_cast<const double*>(base + l_at), map.multiplier,
        map.softcap, reinterpret_cast<const std::int32_t*>(base + i_at), reinterpret_cast<const double*>(base + g_at), k,
        static_cast<double*>(add), stream_);
    if (add != nullptr) deallocate(add, 0);  // in stream order; also when a launch failed
    launched(rc, "cross_entropy_backward");
  }
  void logit_map(TensorView logits, LogitMap map) override {
    DIFFCP_CHECK(logits.rank == 2 && logits.stride[1] == 1, "cuda: logit_map: logits ", logits.describe());
    launched(cuda::logit_map(logits.ptr<float>(), logits.stride[0], logits.size(0), logits.size(1), map.multiplier,
                             map.softcap, stream_),
             "logit_map");
  }
  void top_k(ConstTensorView logits, std::int64_t v0, std::span<float> values, std::span<std::int32_t> ids) override {
    const std::int64_t R = logits.size(0), k = R > 0 ? static_cast<std::int64_t>(values.size()) / R : 0;
    DIFFCP_CHECK(logits.rank == 2 && logits.stride[1] == 1 && values.size() == ids.size() &&
                     static_cast<std::int64_t>(values.size()) == R * k,
                 "cuda: top_k: logits ", logits.describe(), ", ", values.size(), " values, ", ids.size(), " ids");
    if (R == 0) return;
    // device [R, k] values then ids, copied back for the host (O(R k) results)
    void* out = allocate(static_cast<std::size_t>(R * k) * (sizeof(float) + sizeof(std::int32_t)));
    auto* v = static_cast<float*>(out);
    auto* i = reinterpret_cast<std::int32_t*>(v + R * k);
    const int rc = cuda::top_k(logits.ptr<const float>(), logits.stride[0], R, logits.size(1), v0, k, v, i, stream_);
    if (rc == 0) {
      copy(values.data(), Device::host, v, device_, sizeof(float) * values.size());
      copy(ids.data(), Device::host, i, device_, sizeof(std::int32_t) * ids.size());
    }
    deallocate(out, 0);
    launched(rc, "top_k");
  }
  void fp8_encode(ConstTensorView x, TensorView enc) override {
    DIFFCP_CHECK(x.rank == 2 && x.is_contiguous() && enc.is_contiguous() && enc.numel() == x.size(0) * (x.size(1) + 4),
                 "cuda: fp8_encode: x ", x.describe(), ", enc ", enc.describe());
    launched(cuda::fp8_encode(x.data, x.dtype == DType::bf16, static_cast<std::uint8_t*>(enc.data), x.size(0), x.size(1),
                              stream_),
             "fp8_encode");
  }
  void fp8_decode(ConstTensorView enc, TensorView x) override {
    DIFFCP_CHECK(x.rank == 2 && x.is_contiguous() && enc.is_contiguous() && enc.numel() == x.size(0) * (x.size(1) + 4),
                 "cuda: fp8_decode: enc ", enc.describe(), ", x ", x.describe());
    launched(cuda::fp8_decode(static_cast<const std::uint8_t*>(enc.data), x.data, x.dtype == DType::bf16, x.size(0),
                              x.size(1), stream_),
             "fp8_decode");
  }
  // y = x w + bias through cuBLASLt (bf16 operands, f32 accumulation and output); no packed layout.
  void dense_linear(ConstTensorView x, ConstTensorView w, const PackedWeight*, ConstTensorView bias, TensorView y) override {
    DIFFCP_CHECK(x.rank == 2 && w.rank == 2 && y.rank == 2 && x.dtype == DType::bf16 && w.dtype == DType::bf16 &&
                     y.dtype == DType::f32 && x.size(1) == w.size(0) && y.size(0) == x.size(0) && y.size(1) == w.size(1) &&
                     x.stride[1] == 1 && w.stride[1] == 1 && y.stride[1] == 1,
                 "cuda: dense_linear: x ", x.describe(), ", w ", w.describe(), ", y ", y.describe());
    GemmArgs g;
    g.M = x.size(0);
    g.N = w.size(1);
    g.K = x.size(1);
    g.A = x.data;
    g.lda = x.stride[0];
    g.B = w.data;
    g.ldb = w.stride[0];
    g.C = y.data;
    g.ldc = y.stride[0];
    g.dtype = DType::bf16;
    g.c_dtype = DType::f32;
    gemm(g);
    if (bias.numel() > 0)
      launched(cuda::bias_add_rows(y.ptr<float>(), y.stride[0], bias.ptr<float>(), g.M, g.N, stream_), "dense_linear (bias)");
  }
  double scale_sumsq(TensorView x, double scale) override {
    if (sumsq_ == nullptr) cuda_ok(cudaMalloc(&sumsq_, sizeof(double)), "cudaMalloc(scale_sumsq)");
    launched(cuda::scale_sumsq(x.ptr<float>(), x.numel(), scale, sumsq_, stream_), "scale_sumsq");
    double host = 0;
    cuda_ok(cudaMemcpyAsync(&host, sumsq_, sizeof(double), cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
    synchronize();  // a scalar for the host (the gradient norm)
    return host;
  }
  void adamw_step(TensorView p, ConstTensorView g, TensorView m, TensorView v, const AdamWStepArgs& a) override {
    launched(cuda::adamw_step(p.ptr<float>(), g.ptr<float>(), m.ptr<float>(), v.ptr<float>(), p.numel(), a.b1, a.b2,
                              a.step, a.inv_sqrt_c2, a.eps, a.decay, stream_),
             "adamw_step");
  }

  // Row-major C = alpha op(A) op(B) + beta C as cuBLASLt's column-major C^T = op(B)^T op(A)^T: a
  // row-major [r, c] matrix with row stride ld is the column-major [c, r] matrix with leading dim ld.
  void gemm(const GemmArgs& g) override { matmul(g, {}); }
  // Strided batches of one GEMM: batch i reads A + i stride_a, B + i stride_b and writes
  // C + i stride_c (elements).
  struct Batch {
    int count = 1;
    std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  };
  void matmul(const GemmArgs& g, const Batch& bt) {
    if (g.M == 0 || g.N == 0 || bt.count == 0) return;
    DIFFCP_CHECK(g.c_dtype == DType::f32 || g.c_dtype == g.dtype, "cuda: gemm: C in ", dtype_name(g.c_dtype), " with ",
                 dtype_name(g.dtype), " operands");
    if (g.K == 0) {  // C = beta C
      DIFFCP_CHECK(g.c_dtype == DType::f32 && bt.count == 1, "cuda: gemm: K = 0 with a bf16 C or a batch");
      launched(cuda::scale_f32(static_cast<float*>(g.C), g.M, g.N, g.ldc, g.beta, stream_), "gemm (K = 0)");
      return;
    }
    // The algorithm for these pointers' alignment (a column slice of a weight may be 16-byte aligned
    // only; cuBLASLt's implicit choice assumes its default, 256), every batch's included.
    const std::size_t es = g.dtype == DType::bf16 ? 2 : 4, ec = g.c_dtype == DType::bf16 ? 2 : 4;
    const auto aligned = [&](const void* p, std::int64_t stride, std::size_t e) {
      const std::uint32_t a = alignment(p);
      return bt.count > 1 ? std::min(a, alignment(reinterpret_cast<const void*>(static_cast<std::uintptr_t>(stride) * e))) : a;
    };
    const LtPlan& plan = lt_plan(g, bt, aligned(g.B, bt.stride_b, es), aligned(g.A, bt.stride_a, es),
                                 aligned(g.C, bt.stride_c, ec));
    const float alpha = g.alpha, beta = g.beta;
    lt_ok(cublasLtMatmul(lt_, plan.desc, &alpha, g.B, plan.la, g.A, plan.lb, &beta, g.C, plan.lc, g.C, plan.lc, &plan.algo,
                         workspace_, kWorkspace, stream_),
          "matmul");
  }
  // cuBLASLt's descriptors and chosen algorithm for one GEMM shape (dims, leading dims, transposes,
  // dtypes, batch and the pointers' alignments), made at the first call and reused: the heuristic
  // runs once per shape, not per call. At most kLtPlans kept (DFlash masks give new span lengths
  // every step): past that the cache starts over.
  struct LtPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  static void destroy(LtPlan& p) {
    if (p.la != nullptr) cublasLtMatrixLayoutDestroy(p.la);
    if (p.lb != nullptr) cublasLtMatrixLayoutDestroy(p.lb);
    if (p.lc != nullptr) cublasLtMatrixLayoutDestroy(p.lc);
    if (p.desc != nullptr) cublasLtMatmulDescDestroy(p.desc);
  }
  const LtPlan& lt_plan(const GemmArgs& g, const Batch& bt, std::uint32_t al_a, std::uint32_t al_b, std::uint32_t al_c) {
    const LtKey key{g.M, g.N, g.K, g.lda, g.ldb, g.ldc, g.trans_a, g.trans_b, static_cast<std::int64_t>(g.dtype),
                    static_cast<std::int64_t>(g.c_dtype), bt.count, bt.stride_a, bt.stride_b, bt.stride_c, al_a, al_b, al_c};
    if (const auto it = lt_plans_.find(key); it != lt_plans_.end()) return it->second;
    if (lt_plans_.size() >= kLtPlans) {
      for (auto& [k, p] : lt_plans_) destroy(p);
      lt_plans_.clear();
    }
    LtPlan p;
    struct Guard {  // frees a half-made plan if a call below throws
      LtPlan& p;
      bool keep = false;
      ~Guard() {
        if (!keep) destroy(p);
      }
    } guard{p};
    const cudaDataType_t ab = g.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cudaDataType_t c = g.c_dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    lt_ok(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
    const cublasOperation_t ta = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_ok(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "transa");
    lt_ok(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "transb");
    // cuBLASLt's A = our B: op N: [N, K] (col-major), op T: [K, N]; its B = our A: op N: [K, M], op T: [M, K].
    lt_ok(cublasLtMatrixLayoutCreate(&p.la, ab, g.trans_b ? g.K : g.N, g.trans_b ? g.N : g.K, g.ldb), "layout A");
    lt_ok(cublasLtMatrixLayoutCreate(&p.lb, ab, g.trans_a ? g.M : g.K, g.trans_a ? g.K : g.M, g.lda), "layout B");
    lt_ok(cublasLtMatrixLayoutCreate(&p.lc, c, g.N, g.M, g.ldc), "layout C");
    if (bt.count > 1) {
      const std::int32_t n = bt.count;
      const auto batch = [&](cublasLtMatrixLayout_t l, std::int64_t stride) {
        lt_ok(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n), "batch count");
        lt_ok(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
              "batch stride");
      };
      batch(p.la, bt.stride_b);
      batch(p.lb, bt.stride_a);
      batch(p.lc, bt.stride_c);
    }
    cublasLtMatmulPreference_t pref = nullptr;
    lt_ok(cublasLtMatmulPreferenceCreate(&pref), "preference");
    const std::uint64_t ws = kWorkspace;
    const auto set = [&](cublasLtMatmulPreferenceAttributes_t a, const void* v, std::size_t n) {
      const cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, a, v, n);
      if (st != CUBLAS_STATUS_SUCCESS) cublasLtMatmulPreferenceDestroy(pref);
      lt_ok(st, "preference");
    };
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c);
    cublasLtMatmulHeuristicResult_t best{};
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &best, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    lt_ok(hs, "algorithm heuristic");
    DIFFCP_CHECK(found > 0, "cuda: cublasLt: no algorithm for gemm M ", g.M, " N ", g.N, " K ", g.K, " (",
                 dtype_name(g.dtype), ", batch ", bt.count, ", alignments ", al_a, "/", al_b, "/", al_c, ")");
    p.algo = best.algo;
    guard.keep = true;
    return lt_plans_.emplace(key, p).first->second;
  }
  // The largest power of two (<= 256) that divides the address: cuBLASLt's alignment preference.
  static std::uint32_t alignment(const void* p) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::uint32_t r = 256;
    while (r > 1 && a % r != 0) r /= 2;
    return r;
  }

 private:
  // ---- attention: shapes and the mask's plan (src/cuda/attention.hpp) ----
  static void check_heads(const char* name, const ConstTensorView& t, std::int64_t rows, std::int64_t heads, std::int64_t d) {
    DIFFCP_CHECK(t.rank == 3 && t.size(0) == rows && t.size(1) == heads && t.size(2) == d && t.stride[1] == d &&
                     t.stride[2] == 1 && t.stride[0] >= heads * d && (rows == 0 || t.data != nullptr),
                 "cuda: attention: ", name, " is ", t.describe(), ", expected [", rows, ", ", heads, ", ", d,
                 "] with contiguous heads");
  }
  static void check_stats(const char* name, const ConstTensorView& t, const cuda::AttentionDims& a) {
    DIFFCP_CHECK(t.numel() == a.Q * a.n_q && t.dtype == DType::f32, "cuda: attention: ", name, " is ", t.describe(),
                 ", expected Q*n_q = ", a.Q * a.n_q, " f32 entries");
  }
  static cuda::AttentionDims attention_dims(const BlockMask& mask, const ConstTensorView& q, const ConstTensorView& k,
                                            const ConstTensorView& v, float softmax_scale) {
    DIFFCP_CHECK(q.rank == 3 && k.rank == 3, "cuda: attention: q ", q.describe(), ", k ", k.describe(), " (rank 3 expected)");
    cuda::AttentionDims a;
    a.Q = mask.query_rows();
    a.L_k = mask.key_rows();
    a.N = mask.num_blocks();
    a.B = mask.block();
    a.n_q = q.size(1);
    a.n_kv = k.size(1);
    a.d = q.size(2);
    DIFFCP_CHECK(a.n_q >= 1 && a.n_kv >= 1 && a.n_q % a.n_kv == 0 && a.d >= 1 && a.d <= cuda::kMaxHeadDim,
                 "cuda: attention: n_q = ", a.n_q, ", n_kv = ", a.n_kv, ", d_h = ", a.d, " (n_q a multiple of n_kv, 1 <= d_h <= ",
                 cuda::kMaxHeadDim, ")");
    check_heads("q", q, a.Q, a.n_q, a.d);
    check_heads("k", k, mask.key_rows(), a.n_kv, a.d);
    check_heads("v", v, mask.key_rows(), a.n_kv, a.d);
    a.window = mask.window().window;
    a.causal = mask.window().causal;
    a.scale = softmax_scale > 0.f ? softmax_scale : 1.f / std::sqrt(static_cast<float>(a.d));
    a.ld_q = q.stride[0];
    a.ld_k = k.stride[0];
    a.ld_v = v.stride[0];
    return a;
  }
  // ---- attention on the tensor cores (DIFFCP_CUDA_ATTENTION=gemm, the default) ----
  // Per run of consecutive blocks of one sample group, the key spans are the union of its blocks'
  // visible ranges; the products with the spans are batched cuBLASLt GEMMs (a batch per kv head,
  // one call per q head of the group g and span), the mask is applied per element by the kernels in
  // between. Masked pairs inside the spans are computed and discarded: at most the group's own
  // context, never another sample's. Rows go in chunks so the f32 score tiles stay within
  // kScoreBytes.
  // Whether the GEMM path's operands are what cuBLASLt's tensor-core kernels take: d_h and every
  // row stride multiples of 8 elements, every tensor 16-byte aligned. Else the SIMT kernels run.
  static bool gemm_shapes(const cuda::AttentionDims& a, std::initializer_list<ConstTensorView> views) {
    if (a.d % 8 != 0) return false;
    for (const ConstTensorView& t : views)
      if (t.stride[0] % 8 != 0 || alignment(t.data) < 16) return false;
    return true;
  }
  using Run = cuda::AttentionRun;
  struct Runs : cuda::AttentionRuns {
    const std::int64_t* plan = nullptr;    // device: the plan
    const std::int64_t* dspans = nullptr;  // device: the spans
  };
  // The runs of `mask` (cuda/plan.hpp), with the plan and the spans on the device, prepared once.
  Runs attention_runs(const BlockMask& mask) {
    const PreparedMask& pm = prepare(mask, false);
    Runs R;
    static_cast<cuda::AttentionRuns&>(R) = pm.runs;
    R.plan = pm.at(0);
    R.dspans = pm.at(pm.spans_at);
    return R;
  }
  // ---- a mask's plans, prepared once (as FlexAttention builds its BlockMask once per batch) ----
  // The plan (both paths), the GEMM path's runs and spans and, once a SIMT backward asks, the key
  // plan, in one device buffer per mask, keyed by BlockMask::id(): a mask made once per batch is
  // planned and uploaded once, not at every call. The least recently used of kPreparedMasks goes
  // (its buffer freed in stream order, after the kernels that read it).
  struct PreparedMask {
    std::uint64_t id = 0, used = 0;
    std::vector<std::int64_t> plan;  // host: attention_plan
    cuda::AttentionRuns runs;        // host: the GEMM path's work list
    void* dev = nullptr;             // [plan | spans | key plan]
    std::size_t bytes = 0, spans_at = 0, key_at = 0;
    bool has_key_plan = false;
    const std::int64_t* at(std::size_t offset) const {
      return reinterpret_cast<const std::int64_t*>(static_cast<const unsigned char*>(dev) + offset);
    }
  };
  static constexpr std::size_t kPreparedMasks = 32;
  const PreparedMask& prepare(const BlockMask& mask, bool key_plan) {
    auto it = std::find_if(prepared_.begin(), prepared_.end(), [&](const PreparedMask& m) { return m.id == mask.id(); });
    if (it == prepared_.end()) {
      if (prepared_.size() == kPreparedMasks) {
        const auto lru = std::min_element(prepared_.begin(), prepared_.end(),
                                          [](const PreparedMask& x, const PreparedMask& y) { return x.used < y.used; });
        deallocate(lru->dev, lru->bytes);
        prepared_.erase(lru);
      }
      PreparedMask m;
      m.id = mask.id();
      cuda::attention_plan(mask, m.plan);
      m.runs = cuda::attention_runs(mask, m.plan);
      prepared_.push_back(std::move(m));
      it = prepared_.end() - 1;
    }
    PreparedMask& p = *it;
    p.used = ++prepared_clock_;
    if (p.dev != nullptr && (p.has_key_plan || !key_plan)) return p;
    HostArgs h;
    h.add(std::span<const std::int64_t>(p.plan));
    p.spans_at = h.add(std::span<const std::int64_t>(p.runs.spans));
    if (key_plan || p.has_key_plan) {
      std::vector<std::int64_t> kp;
      cuda::attention_key_plan(mask, p.plan, kp);
      p.key_at = h.add(std::span<const std::int64_t>(kp));
      p.has_key_plan = true;
    }
    deallocate(p.dev, p.bytes);  // a key plan added: the buffer is made again (stream-ordered free)
    p.dev = nullptr;
    p.bytes = 0;
    p.dev = allocate(std::max<std::size_t>(h.bytes().size(), 8));
    p.bytes = std::max<std::size_t>(h.bytes().size(), 8);
    stage(h, p.dev);
    return p;
  }
  std::vector<PreparedMask> prepared_;
  std::uint64_t prepared_clock_ = 0;
  // For each q head g of a kv group and each span of `run`: one GEMM batched over the kv heads, its
  // arguments filled by fill(args, batch, g, the span's first key row, its length, its first
  // column, whether it is the run's first span).
  template <typename Fill>
  void per_span(const Runs& R, const Run& run, std::int64_t G, std::int64_t n_kv, Fill fill) {
    for (std::int64_t g = 0; g < G; ++g)
      for (std::int64_t sp = run.span0; sp < run.span0 + run.n_spans; ++sp) {
        const std::int64_t* span = R.spans.data() + 3 * sp;
        GemmArgs m;
        Batch bt;
        bt.count = static_cast<int>(n_kv);
        fill(m, bt, g, span[0], span[1] - span[0], span[2], sp == run.span0);
        matmul(m, bt);
      }
  }
  // rows x cols f32 (row stride ld_src) -> dst in the storage dtype (row stride ld_dst)
  void store_rows(const float* src, std::int64_t ld_src, void* dst, std::int64_t ld_dst, std::int64_t rows,
                  std::int64_t cols, bool bf16) {
    launched(bf16 ? cuda::convert_f32_bf16(src, ld_src, static_cast<std::uint16_t*>(dst), ld_dst, rows, cols, stream_)
                  : cuda::copy_rows(src, ld_src, dst, ld_dst, rows, cols, 4, stream_),
             "attention (store)");
  }

  void gemm_attention_forward(const BlockMask& mask, const cuda::AttentionDims& a, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v, const TensorView& o, const TensorView& lse) {
    const Runs R = attention_runs(mask);
    const bool bf16 = q.dtype == DType::bf16;
    const std::int64_t G = a.n_q / a.n_kv, d = a.d, es = bf16 ? 2 : 4;
    const auto at = [es](const void* p, std::int64_t elems) { return static_cast<const char*>(p) + elems * es; };
    for (const Run& run : R.runs) {
      if (run.L == 0) {  // rows that see no key: o = 0, lse = -inf
        cuda_ok(cudaMemset2DAsync(static_cast<char*>(o.data) + run.row0 * a.ld_o * es, a.ld_o * es, 0, a.n_q * d * es,
                                  run.rows, stream_),
                "cudaMemset2DAsync");
        launched(cuda::fill_f32(lse.ptr<float>() + run.row0 * a.n_q, run.rows * a.n_q, -INFINITY, stream_), "attention_forward");
        continue;
      }
      const std::int64_t rc_max = std::max<std::int64_t>(1, kScoreBytes / (4 * a.n_q * run.L));
      for (std::int64_t r0 = run.row0; r0 < run.row0 + run.rows; r0 += rc_max) {
        const std::int64_t rc = std::min(rc_max, run.row0 + run.rows - r0), tile = rc * run.L;
        const std::size_t s_bytes = sizeof(float) * static_cast<std::size_t>(a.n_q * tile);
        const std::size_t p_bytes = bf16 ? s_bytes / 2 : 0, o_bytes = sizeof(float) * static_cast<std::size_t>(rc * a.n_q * d),
                          l_bytes = sizeof(float) * static_cast<std::size_t>(rc * a.n_q);
        auto* S = static_cast<float*>(allocate(s_bytes));
        void* P = bf16 ? allocate(p_bytes) : S;
        auto* O = static_cast<float*>(allocate(o_bytes));
        auto* inv_l = static_cast<float*>(allocate(l_bytes));
        // S[h G + g] (the span's columns) = c q k^T
        per_span(R, run, G, a.n_kv, [&](GemmArgs& m, Batch& bt, std::int64_t g, std::int64_t k0, std::int64_t len, std::int64_t col, bool) {
          m.trans_b = true;
          m.M = rc, m.N = len, m.K = d, m.alpha = a.scale * 1.4426950408889634f;
          m.A = at(q.data, r0 * a.ld_q + g * d), m.lda = a.ld_q;
          m.B = at(k.data, k0 * a.ld_k), m.ldb = a.ld_k;
          m.C = S + g * tile + col, m.ldc = run.L;
          m.dtype = q.dtype;
          bt.stride_a = G * d, bt.stride_b = d, bt.stride_c = G * tile;
        });
        launched(cuda::masked_softmax(bf16, S, P, r0, rc, run.L, R.dspans + 3 * run.span0, run.n_spans, R.plan,
                                      lse.ptr<float>(), inv_l, a, stream_),
                 "attention_forward (softmax)");
        // O[:, h G + g] (+)= P[h G + g] (the span's columns) v
        per_span(R, run, G, a.n_kv, [&](GemmArgs& m, Batch& bt, std::int64_t g, std::int64_t k0, std::int64_t len, std::int64_t col, bool first) {
          m.M = rc, m.N = d, m.K = len, m.beta = first ? 0.f : 1.f;
          m.A = at(P, g * tile + col), m.lda = run.L;
          m.B = at(v.data, k0 * a.ld_v), m.ldb = a.ld_v;
          m.C = O + g * d, m.ldc = a.n_q * d;
          m.dtype = q.dtype;
          bt.stride_a = G * tile, bt.stride_b = d, bt.stride_c = G * d;
        });
        launched(cuda::scale_rows(bf16, O, inv_l, o.data, r0, rc, a, stream_), "attention_forward (1 / l)");
        deallocate(inv_l, l_bytes);
        deallocate(O, o_bytes);
        if (bf16) deallocate(P, p_bytes);
        deallocate(S, s_bytes);
      }
    }
  }

  // The backward as FlashAttention-2's five products, each a GEMM over the spans: S = c q k^T ->
  // P (from the global lse, masked) ; dP = dO v^T -> dS = P (dP - D) ; dV += P^T dO ;
  // dK += scale dS^T q ; dQ = scale dS k. dK, dV in f32 over all runs, stored once at the end.
  void gemm_attention_backward(const BlockMask& mask, const cuda::AttentionDims& a, const ConstTensorView& q,
                               const ConstTensorView& k, const ConstTensorView& v, const ConstTensorView& dout,
                               const ConstTensorView& lse, const ConstTensorView& delta, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv) {
    const Runs R = attention_runs(mask);
    const bool bf16 = q.dtype == DType::bf16;
    const std::int64_t G = a.n_q / a.n_kv, d = a.d, es = bf16 ? 2 : 4, kvw = a.n_kv * d;
    const auto at = [es](const void* p, std::int64_t elems) { return static_cast<const char*>(p) + elems * es; };
    const std::size_t kv_bytes = sizeof(float) * static_cast<std::size_t>(a.L_k * kvw);
    auto* dk_acc = static_cast<float*>(allocate(kv_bytes));
    auto* dv_acc = static_cast<float*>(allocate(kv_bytes));
    if (kv_bytes > 0) {
      cuda_ok(cudaMemsetAsync(dk_acc, 0, kv_bytes, stream_), "cudaMemsetAsync");
      cuda_ok(cudaMemsetAsync(dv_acc, 0, kv_bytes, stream_), "cudaMemsetAsync");
    }
    for (const Run& run : R.runs) {
      if (run.L == 0) {  // rows that see no key: dq = 0
        cuda_ok(cudaMemset2DAsync(static_cast<char*>(dq.data) + run.row0 * a.ld_dq * es, a.ld_dq * es, 0, a.n_q * d * es,
                                  run.rows, stream_),
                "cudaMemset2DAsync");
        continue;
      }
      const std::int64_t rc_max = std::max<std::int64_t>(1, kScoreBytes / (8 * a.n_q * run.L));
      for (std::int64_t r0 = run.row0; r0 < run.row0 + run.rows; r0 += rc_max) {
        const std::int64_t rc = std::min(rc_max, run.row0 + run.rows - r0), tile = rc * run.L;
        const std::size_t s_bytes = sizeof(float) * static_cast<std::size_t>(a.n_q * tile), b_bytes = bf16 ? s_bytes / 2 : 0,
                          q_bytes = sizeof(float) * static_cast<std::size_t>(rc * a.n_q * d);
        auto* S = static_cast<float*>(allocate(s_bytes));   // scores, then P
        auto* dP = static_cast<float*>(allocate(s_bytes));  // dP, then dS
        auto* Pb = static_cast<std::uint16_t*>(allocate(b_bytes));
        auto* dSb = static_cast<std::uint16_t*>(allocate(b_bytes));
        auto* dq_acc = static_cast<float*>(allocate(q_bytes));
        const void* P = bf16 ? static_cast<const void*>(Pb) : S;
        const void* dS = bf16 ? static_cast<const void*>(dSb) : dP;
        const auto scores = [&](float* C, const ConstTensorView& x, std::int64_t ld_x, const ConstTensorView& y,
                                std::int64_t ld_y, float alpha) {  // C[h G + g] = alpha x y^T (the span's rows of y)
          per_span(R, run, G, a.n_kv, [&](GemmArgs& m, Batch& bt, std::int64_t g, std::int64_t k0, std::int64_t len, std::int64_t col, bool) {
            m.trans_b = true;
            m.M = rc, m.N = len, m.K = d, m.alpha = alpha;
            m.A = at(x.data, r0 * ld_x + g * d), m.lda = ld_x;
            m.B = at(y.data, k0 * ld_y), m.ldb = ld_y;
            m.C = C + g * tile + col, m.ldc = run.L;
            m.dtype = q.dtype;
            bt.stride_a = G * d, bt.stride_b = d, bt.stride_c = G * tile;
          });
        };
        const auto to_keys = [&](float* acc, const void* W, const ConstTensorView& x, std::int64_t ld_x, float alpha) {
          // acc[span rows, h] += alpha W[h G + g]^T x[:, h G + g]
          per_span(R, run, G, a.n_kv, [&](GemmArgs& m, Batch& bt, std::int64_t g, std::int64_t k0, std::int64_t len, std::int64_t col, bool) {
            m.trans_a = true;
            m.M = len, m.N = d, m.K = rc, m.alpha = alpha, m.beta = 1.f;
            m.A = at(W, g * tile + col), m.lda = run.L;
            m.B = at(x.data, r0 * ld_x + g * d), m.ldb = ld_x;
            m.C = acc + k0 * kvw, m.ldc = kvw;
            m.dtype = q.dtype;
            bt.stride_a = G * tile, bt.stride_b = G * d, bt.stride_c = d;
          });
        };
        scores(S, q, a.ld_q, k, a.ld_k, a.scale * 1.4426950408889634f);
        launched(cuda::masked_probs(lse.ptr<float>(), S, bf16 ? Pb : nullptr, r0, rc, run.L, R.dspans + 3 * run.span0,
                                    run.n_spans, R.plan, a, stream_),
                 "attention_backward (P)");
        scores(dP, dout, a.ld_do, v, a.ld_v, 1.f);
        launched(cuda::softmax_grad(S, dP, bf16 ? dSb : nullptr, delta.ptr<float>(), r0, rc, run.L, a, stream_),
                 "attention_backward (dS)");
        to_keys(dv_acc, P, dout, a.ld_do, 1.f);
        to_keys(dk_acc, dS, q, a.ld_q, a.scale);
        // dQ[:, h G + g] (+)= scale dS[h G + g] k (the span's rows)
        per_span(R, run, G, a.n_kv, [&](GemmArgs& m, Batch& bt, std::int64_t g, std::int64_t k0, std::int64_t len, std::int64_t col, bool first) {
          m.M = rc, m.N = d, m.K = len, m.alpha = a.scale, m.beta = first ? 0.f : 1.f;
          m.A = at(dS, g * tile + col), m.lda = run.L;
          m.B = at(k.data, k0 * a.ld_k), m.ldb = a.ld_k;
          m.C = dq_acc + g * d, m.ldc = a.n_q * d;
          m.dtype = q.dtype;
          bt.stride_a = G * tile, bt.stride_b = d, bt.stride_c = G * d;
        });
        store_rows(dq_acc, a.n_q * d, static_cast<char*>(dq.data) + r0 * a.ld_dq * es, a.ld_dq, rc, a.n_q * d, bf16);
        deallocate(dq_acc, q_bytes);
        deallocate(dSb, b_bytes);
        deallocate(Pb, b_bytes);
        deallocate(dP, s_bytes);
        deallocate(S, s_bytes);
      }
    }
    store_rows(dk_acc, kvw, dk.data, a.ld_dk, a.L_k, kvw, bf16);
    store_rows(dv_acc, kvw, dv.data, a.ld_dv, a.L_k, kvw, bf16);
    deallocate(dv_acc, kv_bytes);
    deallocate(dk_acc, kv_bytes);
  }
  // ---- host metadata of one op (index lists, a mask's plan, table rows), staged in one copy ----
  class HostArgs {
   public:
    // Appends `v` at an 8-byte aligned offset; returns the offset.
    template <typename T>
    std::size_t add(std::span<const T> v) {
      const std::size_t at = (bytes_.size() + 7) / 8 * 8;
      bytes_.resize(at + v.size_bytes());
      if (!v.empty()) std::memcpy(bytes_.data() + at, v.data(), v.size_bytes());
      return at;
    }
    const std::vector<unsigned char>& bytes() const { return bytes_; }

   private:
    std::vector<unsigned char> bytes_;
  };
  // `h` in device memory for the op about to be issued: one device buffer, reused by the next op
  // (its copy is ordered after the kernels that read this one), staged through a ring of pinned
  // slots. The host waits only for the copy that last read the slot it reuses, kUploadSlots
  // uploads ago: no host sync per op while the device is fewer ops behind than that.
  const void* upload(const HostArgs& h) {
    const std::size_t bytes = h.bytes().size();
    if (bytes > upload_bytes_) {  // (no pointer left dangling if an allocation throws)
      deallocate(upload_, upload_bytes_);
      upload_ = nullptr;
      upload_bytes_ = 0;
      const std::size_t grown = std::max<std::size_t>(bytes * 2, 4096);
      upload_ = allocate(grown);
      upload_bytes_ = grown;
    }
    if (bytes == 0) return upload_;
    stage(h, upload_);
    return upload_;
  }
  // h's bytes copied to `dev` on the stream, through the next pinned slot of the ring.
  void stage(const HostArgs& h, void* dev) {
    const std::size_t bytes = h.bytes().size();
    if (bytes == 0) return;
    // Small uploads take the ring's next slot; a large one (above kSlotBytes: e.g. a long context's
    // RoPE rows) the one large slot, whose previous copy the host waits for: at most
    // kUploadSlots * kSlotBytes of pinned memory, plus the largest upload.
    Slot& slot = bytes <= kSlotBytes ? upload_slots_[upload_next_++ % kUploadSlots] : large_slot_;
    if (slot.copied == nullptr) cuda_ok(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming), "cudaEventCreate");
    cuda_ok(cudaEventSynchronize(slot.copied), "cudaEventSynchronize(upload slot)");  // done long ago, as a rule
    if (bytes > slot.bytes) {
      void* pinned = std::exchange(slot.pinned, nullptr);
      slot.bytes = 0;
      if (pinned != nullptr) cuda_ok(cudaFreeHost(pinned), "cudaFreeHost");
      const std::size_t grown = bytes <= kSlotBytes ? kSlotBytes : bytes * 2;
      cuda_ok(cudaMallocHost(&pinned, grown), "cudaMallocHost(upload)");
      slot.pinned = pinned;
      slot.bytes = grown;
    }
    std::memcpy(slot.pinned, h.bytes().data(), bytes);
    cuda_ok(cudaMemcpyAsync(dev, slot.pinned, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync(upload)");
    cuda_ok(cudaEventRecord(slot.copied, stream_), "cudaEventRecord(upload)");
  }
  // rows: [n] i64, host metadata (range-checked by the caller, uploaded) or device memory (token_rows'
  // output: read by the kernel, which skips a row outside [0, M)).
  void move_rows(const ConstTensorView& src, const ConstTensorView& rows, const TensorView& dst, bool scatter) {
    const std::int64_t n = rows.numel(), w = scatter ? src.size(1) : dst.size(1);
    const ConstTensorView& many = scatter ? static_cast<const ConstTensorView&>(dst) : src;  // the [M, w] side
    DIFFCP_CHECK(src.rank == 2 && dst.rank == 2 && src.stride[1] == 1 && dst.stride[1] == 1 && src.size(1) == dst.size(1) &&
                     (scatter ? src.size(0) : dst.size(0)) == n && rows.dtype == DType::i64 && rows.is_contiguous() &&
                     (src.dtype == dst.dtype || (src.dtype != DType::u8 && dst.dtype != DType::u8)),
                 "cuda: ", scatter ? "scatter_rows" : "gather_rows", ": src ", src.describe(), ", dst ", dst.describe(),
                 ", rows ", rows.describe());
    if (n == 0 || w == 0) return;
    const std::int64_t* idx = rows.ptr<const std::int64_t>();
    if (rows.device == Device::host) {
      HostArgs h;
      h.add(std::span<const std::int64_t>(idx, static_cast<std::size_t>(n)));
      idx = static_cast<const std::int64_t*>(upload(h));
    }
    launched(cuda::move_rows(src.data, src.stride[0], static_cast<int>(src.element_size()), dst.data, dst.stride[0],
                             static_cast<int>(dst.element_size()), idx, many.size(0), n, w, scatter, stream_),
             scatter ? "scatter_rows" : "gather_rows");
  }
  void* upload_ = nullptr;        // device
  std::size_t upload_bytes_ = 0;
  struct Slot {
    void* pinned = nullptr;  // host, pinned
    std::size_t bytes = 0;
    cudaEvent_t copied = nullptr;  // after the last copy out of it
  };
  static constexpr std::size_t kUploadSlots = 64, kSlotBytes = std::size_t{64} << 10;
  std::array<Slot, kUploadSlots> upload_slots_{};
  Slot large_slot_;
  std::size_t upload_next_ = 0;

  static constexpr std::size_t kWorkspace = std::size_t{32} << 20;
  using LtKey = std::array<std::int64_t, 17>;
  static constexpr std::size_t kLtPlans = 4096;
  std::map<LtKey, LtPlan> lt_plans_;
  static constexpr std::int64_t kScoreBytes = std::int64_t{1} << 30;  // the GEMM forward's scores per chunk
  // DIFFCP_CUDA_ATTENTION: gemm (default: the tensor-core forward) | simt (the warp-per-row kernel)
  bool simt_attention_ = [] {
    const std::string v = env_value(EnvKnob::cuda_attention).value_or("gemm");
    DIFFCP_CHECK(v == "gemm" || v == "simt", env_name(EnvKnob::cuda_attention), " = '", v, "': expected gemm or simt");
    return v == "simt";
  }();
  int ordinal_ = 0;  // this rank's GPU
  Device device_ = register_device("cuda");
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  double* sumsq_ = nullptr;  // scale_sumsq's result on the device
  std::string device_name_;
};

}  // namespace

bool cuda_device_present(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n < 1) {
    if (why != nullptr) *why = e != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e) : "no CUDA device";
    return false;
  }
  return true;
}

int cuda_device_ordinal() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices <= 0) {
    cudaGetLastError();
    return 0;
  }
  const NodeLocal here = node_local();
  return here.rank >= 0 ? here.rank % devices : 0;
}

Backend& cuda_backend() {
  static Backend& b = []() -> Backend& {
    std::string why;
    DIFFCP_CHECK(cuda_device_present(&why), "backend 'cuda': ", why);
    auto* cb = new CudaBackend;  // never destroyed: device buffers may outlive static destruction order
    register_backend(*cb);
    return *cb;
  }();
  return b;
}

// ---- cuda_stream() (cuda/backend.hpp): the compute stream the NCCL communicator orders against ----
void* cuda_stream() { return static_cast<CudaBackend&>(cuda_backend()).stream(); }

bool cuda_page_locked(const void* p) {
  cudaPointerAttributes a{};
  if (p == nullptr || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // a pointer CUDA never saw: clear the error
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

void cuda_release_cached_memory() { static_cast<CudaBackend&>(cuda_backend()).release_cached_memory(); }

}  // namespace diffcp
