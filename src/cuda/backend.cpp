#include "diffcp/cuda/backend.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "kernels.hpp"

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
    cuda_ok(cudaSetDevice(0), "cudaSetDevice(0)");
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    lt_ok(cublasLtCreate(&lt_), "create");
    cuda_ok(cudaMalloc(&workspace_, kWorkspace), "cudaMalloc(cuBLASLt workspace)");
    cudaDeviceProp p{};
    cuda_ok(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
    device_name_ = std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor);
  }
  const char* name() const override { return "cuda"; }
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
    switch (op) {
      case OpKind::gemm:
      case OpKind::fill:
      case OpKind::convert:
        return dtype == DType::f32 || dtype == DType::bf16;
      case OpKind::add:
      case OpKind::silu:
      case OpKind::gelu_tanh:
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
        return dtype == DType::f32;
      case OpKind::attention_delta:
        return dtype == DType::f32 || dtype == DType::bf16;
      default:
        return false;
    }
  }

  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    cuda_ok(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync");
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override {
    if (p != nullptr) (void)cudaFreeAsync(p, stream_);  // ordered after the ops issued before it
  }
  void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) override {
    if (bytes == 0) return;
    DIFFCP_CHECK((dst_device == Device::host || dst_device == device_) && (src_device == Device::host || src_device == device_),
                 "cuda: copy between ", device_name(src_device), " and ", device_name(dst_device), " memory");
    cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    // A host source may be reused and a host destination holds the data when copy() returns.
    if (dst_device == Device::host || src_device == Device::host) synchronize();
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
    else if (src.dtype == dst.dtype)  // a broadcast of one row: as an f32 or bf16 "conversion" to itself
      launched(src.dtype == DType::bf16
                   ? cuda::copy_rows_broadcast_u16(static_cast<const std::uint16_t*>(src.data), static_cast<std::uint16_t*>(dst.data),
                                                   d.ld, d.rows, d.cols, stream_)
                   : cuda::copy_rows_broadcast_f32(static_cast<const float*>(src.data), static_cast<float*>(dst.data), d.ld,
                                                   d.rows, d.cols, stream_),
               "convert");
    else if (dst.dtype == DType::bf16)
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
    launched(cuda::bias_add(y.ptr<float>(), b.ptr<float>(), y.size(0), y.size(1), stream_), "bias_add");
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
  void gemm(const GemmArgs& g) override {
    if (g.M == 0 || g.N == 0) return;
    DIFFCP_CHECK(g.c_dtype == DType::f32 || g.c_dtype == g.dtype, "cuda: gemm: C in ", dtype_name(g.c_dtype), " with ",
                 dtype_name(g.dtype), " operands");
    if (g.K == 0) {  // C = beta C
      DIFFCP_CHECK(g.c_dtype == DType::f32, "cuda: gemm: K = 0 with a bf16 C");
      launched(cuda::scale_f32(static_cast<float*>(g.C), g.M, g.N, g.ldc, g.beta, stream_), "gemm (K = 0)");
      return;
    }
    const cudaDataType_t ab = g.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cudaDataType_t c = g.c_dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    cublasLtMatmulDesc_t desc = nullptr;
    lt_ok(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
    const cublasOperation_t ta = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "transa");
    lt_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "transb");
    // cuBLASLt's A = our B: op N: [N, K] (col-major), op T: [K, N]; its B = our A: op N: [K, M], op T: [M, K].
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    lt_ok(cublasLtMatrixLayoutCreate(&la, ab, g.trans_b ? g.K : g.N, g.trans_b ? g.N : g.K, g.ldb), "layout A");
    lt_ok(cublasLtMatrixLayoutCreate(&lb, ab, g.trans_a ? g.M : g.K, g.trans_a ? g.K : g.M, g.lda), "layout B");
    lt_ok(cublasLtMatrixLayoutCreate(&lc, c, g.N, g.M, g.ldc), "layout C");
    const float alpha = g.alpha, beta = g.beta;
    const cublasStatus_t s = cublasLtMatmul(lt_, desc, &alpha, g.B, la, g.A, lb, &beta, g.C, lc, g.C, lc, nullptr,
                                            workspace_, kWorkspace, stream_);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    lt_ok(s, "matmul");
  }

 private:
  static constexpr std::size_t kWorkspace = std::size_t{32} << 20;
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

}  // namespace diffcp
