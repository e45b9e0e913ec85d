// The Backend hooks' defaults (fail naming backend, op and dtype) and the backend registry.
#include "diffcp/ops/backend.hpp"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "diffcp/core/error.hpp"

namespace diffcp {

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::gemm: return "gemm";
    case OpKind::bias_backward: return "bias_backward";
    case OpKind::attention_forward: return "attention_forward";
    case OpKind::attention_backward: return "attention_backward";
    case OpKind::attention_delta: return "attention_delta";
    case OpKind::lse_merge: return "lse_merge";
    case OpKind::lse_rescale: return "lse_rescale";
    case OpKind::rmsnorm_forward: return "rmsnorm_forward";
    case OpKind::rmsnorm_backward: return "rmsnorm_backward";
    case OpKind::rope: return "rope";
    case OpKind::silu: return "silu";
    case OpKind::gelu_tanh: return "gelu_tanh";
    case OpKind::layernorm_modulate: return "layernorm_modulate";
    case OpKind::gated_add: return "gated_add";
    case OpKind::qk_norm_rope: return "qk_norm_rope";
    case OpKind::swiglu_forward: return "swiglu_forward";
    case OpKind::swiglu_backward: return "swiglu_backward";
    case OpKind::add: return "add";
    case OpKind::adamw_step: return "adamw_step";
    case OpKind::bias_add: return "bias_add";
    case OpKind::fill: return "fill";
    case OpKind::convert: return "convert";
    case OpKind::lse_shift: return "lse_shift";
    case OpKind::gather_rows: return "gather_rows";
    case OpKind::scatter_rows: return "scatter_rows";
    case OpKind::l1_distance: return "l1_distance";
    case OpKind::cross_entropy: return "cross_entropy";
    case OpKind::cross_entropy_backward: return "cross_entropy_backward";
    case OpKind::scale_sumsq: return "scale_sumsq";
    case OpKind::guidance_combine: return "guidance_combine";
    case OpKind::fp8_encode: return "fp8_encode";
    case OpKind::fp8_decode: return "fp8_decode";
    case OpKind::dense_linear: return "dense_linear";
    case OpKind::select_active: return "select_active";
    case OpKind::token_rows: return "token_rows";
    case OpKind::dynamic_conv_forward: return "dynamic_conv_forward";
    case OpKind::dynamic_conv_backward: return "dynamic_conv_backward";
    case OpKind::logit_map: return "logit_map";
    case OpKind::top_k: return "top_k";
    case OpKind::gelu: return "gelu";
  }
  return "?";
}

namespace {
[[noreturn]] void fail_unsupported(const Backend& b, OpKind op, DType dtype) {
  DIFFCP_FAIL("backend '", b.name(), "' does not support ", op_name(op), " on ", dtype_name(dtype));
}
}  // namespace

void Backend::unsupported(OpKind op, DType dtype) const { fail_unsupported(*this, op, dtype); }

void Backend::gemm(const GemmArgs& a) { unsupported(OpKind::gemm, a.dtype); }
void Backend::bias_backward(ConstTensorView dy, TensorView) { unsupported(OpKind::bias_backward, dy.dtype); }
void Backend::bias_add(TensorView y, ConstTensorView) { unsupported(OpKind::bias_add, y.dtype); }
void Backend::dense_linear(ConstTensorView x, ConstTensorView, const PackedWeight*, ConstTensorView, TensorView) {
  unsupported(OpKind::dense_linear, x.dtype);
}
std::unique_ptr<PackedWeight> Backend::pack_weight(ConstTensorView) { return nullptr; }
void Backend::attention_forward(const BlockMask&, ConstTensorView q, ConstTensorView, ConstTensorView, TensorView,
                                TensorView, float) {
  unsupported(OpKind::attention_forward, q.dtype);
}
void Backend::attention_backward(const BlockMask&, ConstTensorView q, ConstTensorView, ConstTensorView,
                                 ConstTensorView, ConstTensorView, ConstTensorView, TensorView, TensorView,
                                 TensorView, float) {
  unsupported(OpKind::attention_backward, q.dtype);
}
void Backend::attention_delta(ConstTensorView do_, ConstTensorView, TensorView) {
  unsupported(OpKind::attention_delta, do_.dtype);
}
void Backend::lse_merge(std::span<const ConstTensorView>, std::span<const ConstTensorView>, TensorView o,
                        TensorView) {
  unsupported(OpKind::lse_merge, o.dtype);
}
void Backend::lse_rescale(TensorView o_p, ConstTensorView, ConstTensorView) {
  unsupported(OpKind::lse_rescale, o_p.dtype);
}
void Backend::rmsnorm_forward(ConstTensorView x, ConstTensorView, float, TensorView, TensorView) {
  unsupported(OpKind::rmsnorm_forward, x.dtype);
}
void Backend::rmsnorm_backward(ConstTensorView dy, ConstTensorView, ConstTensorView, ConstTensorView, TensorView,
                               TensorView) {
  unsupported(OpKind::rmsnorm_backward, dy.dtype);
}
void Backend::rope(TensorView x, std::span<const std::int64_t>, const RopeTable&, bool) {
  unsupported(OpKind::rope, x.dtype);
}
void Backend::silu(TensorView x) { unsupported(OpKind::silu, x.dtype); }
void Backend::gelu_tanh(TensorView x) { unsupported(OpKind::gelu_tanh, x.dtype); }
void Backend::gelu(TensorView x) { unsupported(OpKind::gelu, x.dtype); }
void Backend::layernorm_modulate(ConstTensorView x, ConstTensorView, ConstTensorView, float, TensorView) {
  unsupported(OpKind::layernorm_modulate, x.dtype);
}
void Backend::gated_add(TensorView x, ConstTensorView, ConstTensorView) { unsupported(OpKind::gated_add, x.dtype); }
void Backend::swiglu_forward(ConstTensorView gate, ConstTensorView, TensorView) {
  unsupported(OpKind::swiglu_forward, gate.dtype);
}
void Backend::swiglu_backward(ConstTensorView dact, ConstTensorView, ConstTensorView, TensorView, TensorView) {
  unsupported(OpKind::swiglu_backward, dact.dtype);
}
void Backend::add(TensorView y, ConstTensorView, float) { unsupported(OpKind::add, y.dtype); }
void Backend::guidance_combine(TensorView v, ConstTensorView, float, bool) { unsupported(OpKind::guidance_combine, v.dtype); }
void Backend::adamw_step(TensorView p, ConstTensorView, TensorView, TensorView, const AdamWStepArgs&) {
  unsupported(OpKind::adamw_step, p.dtype);
}
void Backend::lse_shift(TensorView x, ConstTensorView, bool) { unsupported(OpKind::lse_shift, x.dtype); }
void Backend::l1_distance(ConstTensorView a, ConstTensorView, TensorView) { unsupported(OpKind::l1_distance, a.dtype); }
void Backend::select_active(ConstTensorView parts, TensorView) { unsupported(OpKind::select_active, parts.dtype); }
void Backend::token_rows(ConstTensorView active, ConstTensorView, std::int64_t, std::int64_t, TensorView) {
  unsupported(OpKind::token_rows, active.dtype);
}
void Backend::gather_rows(ConstTensorView, ConstTensorView, TensorView dst) {
  unsupported(OpKind::gather_rows, dst.dtype);
}
void Backend::fp8_encode(ConstTensorView x, TensorView) { unsupported(OpKind::fp8_encode, x.dtype); }
void Backend::fp8_decode(ConstTensorView, TensorView x) { unsupported(OpKind::fp8_decode, x.dtype); }
void Backend::dynamic_conv_forward(ConstTensorView x, ConstTensorView, ConstTensorView, std::int64_t, TensorView) {
  unsupported(OpKind::dynamic_conv_forward, x.dtype);
}
void Backend::dynamic_conv_backward(ConstTensorView dy, ConstTensorView, ConstTensorView, ConstTensorView, std::int64_t,
                                    TensorView, TensorView, TensorView) {
  unsupported(OpKind::dynamic_conv_backward, dy.dtype);
}
void Backend::scatter_rows(ConstTensorView src, ConstTensorView, TensorView) {
  unsupported(OpKind::scatter_rows, src.dtype);
}
void Backend::cross_entropy(TensorView logits, std::int64_t, std::span<const std::int32_t>, std::span<double>,
                            std::span<const double>, LogitMap) {
  unsupported(OpKind::cross_entropy, logits.dtype);
}
void Backend::cross_entropy_backward(TensorView logits, std::int64_t, std::span<const std::int32_t>,
                                     std::span<const double>, std::span<const double>, LogitMap, SparseLogitGrad) {
  unsupported(OpKind::cross_entropy_backward, logits.dtype);
}
void Backend::logit_map(TensorView logits, LogitMap) { unsupported(OpKind::logit_map, logits.dtype); }
void Backend::top_k(ConstTensorView logits, std::int64_t, std::span<float>, std::span<std::int32_t>) {
  unsupported(OpKind::top_k, logits.dtype);
}
double Backend::scale_sumsq(TensorView x, double) { unsupported(OpKind::scale_sumsq, x.dtype); }
void Backend::fill(TensorView x, float) { unsupported(OpKind::fill, x.dtype); }
void Backend::convert(ConstTensorView src, TensorView dst) {
  unsupported(OpKind::convert, src.dtype == DType::f32 ? dst.dtype : src.dtype);
}

void* Backend::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  DIFFCP_CHECK(p != nullptr, "backend '", name(), "': out of host memory allocating ", bytes, " bytes");
  return p;
}
void Backend::deallocate(void* p, std::size_t) noexcept { std::free(p); }
void Backend::copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) {
  DIFFCP_CHECK(dst_device == Device::host && src_device == Device::host, "backend '", name(),
               "' copies host memory only; asked for ", device_name(src_device), " -> ", device_name(dst_device));
  if (bytes) std::memcpy(dst, src, bytes);
}

void Backend::qk_norm_rope(TensorView qkv, ConstTensorView, ConstTensorView, float, ConstTensorView,
                           ConstTensorView) {
  unsupported(OpKind::qk_norm_rope, qkv.dtype);
}

namespace {

struct Registry {
  std::mutex mu;
  std::vector<Backend*> backends{&cpu_backend()};
};
Registry& registry() {
  static Registry r;
  return r;
}
// The calling thread's current backend (CUDA's current device, PyTorch's current stream): a run
// installs its own (ScopedBackend) and another thread's choice never reaches it.
Backend*& active() {
  thread_local Backend* a = &cpu_backend();
  return a;
}

}  // namespace

void register_backend(Backend& b) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (Backend* known : r.backends) {
    if (known == &b) return;
    DIFFCP_CHECK(std::string_view(known->name()) != b.name(), "register_backend: a backend named '", b.name(),
                 "' is already registered");
  }
  r.backends.push_back(&b);
}

Backend& find_backend(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::string names;
  for (Backend* b : r.backends) {
    if (name == b->name()) return *b;
    names += (names.empty() ? "" : ", ") + std::string(b->name());
  }
  DIFFCP_FAIL("unknown backend '", name, "'; registered backends: ", names);
}

std::vector<Backend*> registered_backends() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.backends;
}

Backend& backend_of(const void* p) {
  if (p != nullptr) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (Backend* b : r.backends)
      if (b->device() != Device::host && b->device_of(p) == b->device()) return *b;
  }
  return cpu_backend();
}

Backend& active_backend() { return *active(); }

Backend& set_backend(Backend& b) { return *std::exchange(active(), &b); }

Backend& backend_for(OpKind op, DType dtype) {
  Backend& b = active_backend();
  if (!b.supports(op, dtype)) [[unlikely]]
    fail_unsupported(b, op, dtype);
  return b;
}

}  // namespace diffcp
