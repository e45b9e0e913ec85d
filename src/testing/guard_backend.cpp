// testing/guard_backend.hpp: PROT_NONE pages opened only while the guard's own ops run; every op
// range-checks its tensors and forwards host-labelled views to the CPU backend.
#include "diffcp/testing/guard_backend.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

struct sigaction g_previous_segv {};

// A fault is the expected way a host touch of guard memory shows itself: say so (write(2) only:
// async-signal-safe), then hand the fault to the previous handler (returning re-runs the access).
void on_segv(int, siginfo_t* info, void*) {
  static const char head[] = "guard device: SIGSEGV at 0x";
  static const char tail[] =
      ": host code touched guard device memory (only accessible inside the backend's ops; "
      "testing/guard_backend.hpp), or another invalid address\n";
  char hex[2 * sizeof(std::uintptr_t)];
  auto a = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (int i = static_cast<int>(sizeof hex) - 1; i >= 0; --i, a >>= 4) hex[i] = "0123456789abcdef"[a & 15];
  (void)!write(STDERR_FILENO, head, sizeof head - 1);
  (void)!write(STDERR_FILENO, hex, sizeof hex);
  (void)!write(STDERR_FILENO, tail, sizeof tail - 1);
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
}

// Elements a strided view spans, from its first to its last element.
template <typename View>
std::size_t extent_bytes(const View& t) {
  if (t.numel() == 0) return 0;
  std::int64_t last = 0;
  for (int d = 0; d < t.rank; ++d) last += (t.shape[static_cast<std::size_t>(d)] - 1) * t.stride[static_cast<std::size_t>(d)];
  return static_cast<std::size_t>(last + 1) * t.element_size();
}

}  // namespace

class GuardBackend::Open {
 public:
  explicit Open(GuardBackend& g) : g_(g) {
    std::lock_guard<std::mutex> lock(g_.mu_);
    if (g_.open_depth_ == 0 && !protect(PROT_READ | PROT_WRITE)) {
      protect(PROT_NONE);
      DIFFCP_FAIL("guard: mprotect failed: ", std::strerror(errno));
    }
    ++g_.open_depth_;
  }
  ~Open() {
    std::lock_guard<std::mutex> lock(g_.mu_);
    if (--g_.open_depth_ == 0 && !protect(PROT_NONE)) std::abort();  // memory left open: the guard is void
  }
  Open(const Open&) = delete;
  Open& operator=(const Open&) = delete;

 private:
  bool protect(int prot) {
    bool ok = true;
    for (const auto& [user, r] : g_.buffers_) ok = mprotect(reinterpret_cast<void*>(r.base), r.span, prot) == 0 && ok;
    return ok;
  }
  GuardBackend& g_;
};

GuardBackend::GuardBackend() {
  struct sigaction sa {};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous_segv);
}

std::string GuardBackend::describe(DType dtype) const { return "guard device over " + cpu_backend().describe(dtype); }

// The buffer ends (64-byte aligned) at the end of its pages, followed by one page that is never
// opened: an overrun past the 64-byte-rounded end faults even inside an op.
void* GuardBackend::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  const std::size_t span = (bytes + page_size() - 1) / page_size() * page_size();
  std::lock_guard<std::mutex> lock(mu_);
  void* p = mmap(nullptr, span + page_size(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  DIFFCP_CHECK(p != MAP_FAILED, "guard: cannot map ", bytes, " bytes: ", std::strerror(errno));
  const auto base = reinterpret_cast<std::uintptr_t>(p);
  if (open_depth_ > 0) mprotect(p, span, PROT_READ | PROT_WRITE);
  const std::uintptr_t user = base + span - (bytes + 63) / 64 * 64;
  buffers_[user] = {base, span, bytes};
  return reinterpret_cast<void*>(user);
}

void GuardBackend::deallocate(void* p, std::size_t) noexcept {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = buffers_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == buffers_.end()) return;  // not ours: nothing to free (a Buffer only frees what it allocated)
  munmap(reinterpret_cast<void*>(it->second.base), it->second.span + page_size());
  buffers_.erase(it);
}

bool GuardBackend::owns(const void* p, std::size_t bytes) const {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.upper_bound(a);
  if (it == buffers_.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second.bytes;
}

void GuardBackend::check_range(const char* op, const char* what, const void* p, std::size_t bytes) const {
  if (bytes == 0) return;
  DIFFCP_CHECK(owns(p, bytes), "guard: ", op, ": ", what, " (", bytes, " bytes at ", p,
               ") is not guard device memory: host memory handed to a device op");
}

template <typename View>
View GuardBackend::checked(const char* op, const char* what, View t) const {
  DIFFCP_CHECK(t.device == device_, "guard: ", op, ": ", what, " ", t.describe(),
               " is labelled ", device_name(t.device), " memory: a device op takes guard views");
  check_range(op, what, t.data, extent_bytes(t));
  t.device = Device::host;  // the CPU kernels see plain memory, open for the op's duration
  return t;
}

GuardBackend::Counters GuardBackend::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void GuardBackend::copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) {
  DIFFCP_CHECK((dst_device == Device::host || dst_device == device_) &&
                   (src_device == Device::host || src_device == device_),
               "guard: copy between ", device_name(src_device), " and ", device_name(dst_device), " memory");
  if (bytes == 0) return;
  if (src_device == device_) check_range("copy", "src", src, bytes);
  if (dst_device == device_) check_range("copy", "dst", dst, bytes);
  // A side labelled host must be host memory (a device pointer in a host view is a bug a GPU
  // would not forgive).
  DIFFCP_CHECK(src_device == device_ || !owns(src, 1), "guard: copy: src ", src,
               " is guard device memory in a view labelled host");
  DIFFCP_CHECK(dst_device == device_ || !owns(dst, 1), "guard: copy: dst ", dst,
               " is guard device memory in a view labelled host");
  {
    Open open(*this);
    std::memcpy(dst, src, bytes);
  }
  std::lock_guard<std::mutex> lock(mu_);
  const bool from = src_device == device_, to = dst_device == device_;
  (from && to ? counters_.device_to_device : to ? counters_.host_to_device : counters_.device_to_host) +=
      from || to ? bytes : 0;
  counters_.host_syncs += from && !to;
}

// Each hook: range-check every tensor, open the buffers, run the CPU backend's hook.
#define DIFFCP_GUARD_OP(OP, ...)                 \
  do {                                           \
    {                                            \
      std::lock_guard<std::mutex> lock(mu_);     \
      ++counters_.ops;                           \
    }                                            \
    Open open(*this);                            \
    cpu_backend().OP(__VA_ARGS__);               \
  } while (0)
#define C(x) checked(op, #x, x)

void GuardBackend::gemm(const GemmArgs& a) {
  const char* op = "gemm";
  const std::int64_t a_rows = a.trans_a ? a.K : a.M, a_cols = a.trans_a ? a.M : a.K;
  const std::int64_t b_rows = a.trans_b ? a.N : a.K, b_cols = a.trans_b ? a.K : a.N;
  const auto span = [](std::int64_t rows, std::int64_t cols, std::int64_t ld, DType t) {
    return rows == 0 || cols == 0 ? std::size_t{0} : static_cast<std::size_t>((rows - 1) * ld + cols) * dtype_size(t);
  };
  check_range(op, "A", a.A, span(a_rows, a_cols, a.lda, a.dtype));
  check_range(op, "B", a.B, span(b_rows, b_cols, a.ldb, a.dtype));
  check_range(op, "C", a.C, span(a.M, a.N, a.ldc, a.c_dtype));
  DIFFCP_GUARD_OP(gemm, a);
}
void GuardBackend::bias_backward(ConstTensorView dy, TensorView db) {
  const char* op = "bias_backward";
  DIFFCP_GUARD_OP(bias_backward, C(dy), C(db));
}
void GuardBackend::bias_add(TensorView y, ConstTensorView b) {
  const char* op = "bias_add";
  DIFFCP_GUARD_OP(bias_add, C(y), C(b));
}
void GuardBackend::dense_linear(ConstTensorView x, ConstTensorView w, const PackedWeight* packed, ConstTensorView bias,
                                TensorView y) {
  const char* op = "dense_linear";
  DIFFCP_GUARD_OP(dense_linear, C(x), C(w), packed, C(bias), C(y));
}
std::unique_ptr<PackedWeight> GuardBackend::pack_weight(ConstTensorView w) {
  const ConstTensorView host = checked("pack_weight", "w", w);
  Open open(*this);
  return cpu_backend().pack_weight(host);
}
void GuardBackend::attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                     TensorView o, TensorView lse, float softmax_scale) {
  const char* op = "attention_forward";
  DIFFCP_GUARD_OP(attention_forward, mask, C(q), C(k), C(v), C(o), C(lse), softmax_scale);
}
void GuardBackend::attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                      ConstTensorView do_, ConstTensorView lse, ConstTensorView delta, TensorView dq,
                                      TensorView dk, TensorView dv, float softmax_scale) {
  const char* op = "attention_backward";
  DIFFCP_GUARD_OP(attention_backward, mask, C(q), C(k), C(v), C(do_), C(lse), C(delta), C(dq), C(dk), C(dv),
                  softmax_scale);
}
void GuardBackend::attention_delta(ConstTensorView do_, ConstTensorView o, TensorView delta) {
  const char* op = "attention_delta";
  DIFFCP_GUARD_OP(attention_delta, C(do_), C(o), C(delta));
}
void GuardBackend::lse_merge(std::span<const ConstTensorView> o_parts, std::span<const ConstTensorView> lse_parts,
                             TensorView o, TensorView lse) {
  const char* op = "lse_merge";
  std::vector<ConstTensorView> os, lses;
  for (const ConstTensorView& t : o_parts) os.push_back(checked(op, "o_parts[p]", t));
  for (const ConstTensorView& t : lse_parts) lses.push_back(checked(op, "lse_parts[p]", t));
  DIFFCP_GUARD_OP(lse_merge, os, lses, C(o), C(lse));
}
void GuardBackend::lse_rescale(TensorView o_p, ConstTensorView lse_p, ConstTensorView lse) {
  const char* op = "lse_rescale";
  DIFFCP_GUARD_OP(lse_rescale, C(o_p), C(lse_p), C(lse));
}
void GuardBackend::lse_shift(TensorView x, ConstTensorView m, bool to_exp) {
  const char* op = "lse_shift";
  DIFFCP_GUARD_OP(lse_shift, C(x), C(m), to_exp);
}
void GuardBackend::rmsnorm_forward(ConstTensorView x, ConstTensorView w, float eps, TensorView y, TensorView rstd) {
  const char* op = "rmsnorm_forward";
  DIFFCP_GUARD_OP(rmsnorm_forward, C(x), C(w), eps, C(y), C(rstd));
}
void GuardBackend::rmsnorm_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView rstd, ConstTensorView w,
                                    TensorView dx, TensorView dw) {
  const char* op = "rmsnorm_backward";
  DIFFCP_GUARD_OP(rmsnorm_backward, C(dy), C(x), C(rstd), C(w), C(dx), C(dw));
}
void GuardBackend::rope(TensorView x, std::span<const std::int64_t> positions, const RopeTable& table, bool inverse) {
  const char* op = "rope";
  DIFFCP_GUARD_OP(rope, C(x), positions, table, inverse);
}
void GuardBackend::silu(TensorView x) {
  const char* op = "silu";
  DIFFCP_GUARD_OP(silu, C(x));
}
void GuardBackend::gelu_tanh(TensorView x) {
  const char* op = "gelu_tanh";
  DIFFCP_GUARD_OP(gelu_tanh, C(x));
}
void GuardBackend::layernorm_modulate(ConstTensorView x, ConstTensorView shift, ConstTensorView scale, float eps,
                                      TensorView y) {
  const char* op = "layernorm_modulate";
  DIFFCP_GUARD_OP(layernorm_modulate, C(x), C(shift), C(scale), eps, C(y));
}
void GuardBackend::gated_add(TensorView x, ConstTensorView gate, ConstTensorView y) {
  const char* op = "gated_add";
  DIFFCP_GUARD_OP(gated_add, C(x), C(gate), C(y));
}
void GuardBackend::qk_norm_rope(TensorView qkv, ConstTensorView q_scale, ConstTensorView k_scale, float eps,
                                ConstTensorView cos, ConstTensorView sin) {
  const char* op = "qk_norm_rope";
  const bool rotate = cos.rank > 0;  // rank 0: no rotation (text rows), no table
  DIFFCP_GUARD_OP(qk_norm_rope, C(qkv), C(q_scale), C(k_scale), eps, rotate ? C(cos) : cos, rotate ? C(sin) : sin);
}
void GuardBackend::swiglu_forward(ConstTensorView gate, ConstTensorView up, TensorView act) {
  const char* op = "swiglu_forward";
  DIFFCP_GUARD_OP(swiglu_forward, C(gate), C(up), C(act));
}
void GuardBackend::swiglu_backward(ConstTensorView dact, ConstTensorView gate, ConstTensorView up, TensorView dgate,
                                   TensorView dup) {
  const char* op = "swiglu_backward";
  DIFFCP_GUARD_OP(swiglu_backward, C(dact), C(gate), C(up), C(dgate), C(dup));
}
void GuardBackend::guidance_combine(TensorView v, ConstTensorView v_neg, float scale, bool keep_norm) {
  const char* op = "guidance_combine";
  DIFFCP_GUARD_OP(guidance_combine, C(v), C(v_neg), scale, keep_norm);
}
void GuardBackend::add(TensorView y, ConstTensorView x, float alpha) {
  const char* op = "add";
  DIFFCP_GUARD_OP(add, C(y), C(x), alpha);
}
void GuardBackend::adamw_step(TensorView p, ConstTensorView g, TensorView m, TensorView v, const AdamWStepArgs& args) {
  const char* op = "adamw_step";
  DIFFCP_GUARD_OP(adamw_step, C(p), C(g), C(m), C(v), args);
}
void GuardBackend::fill(TensorView x, float value) {
  const char* op = "fill";
  DIFFCP_GUARD_OP(fill, C(x), value);
}
void GuardBackend::convert(ConstTensorView src, TensorView dst) {
  const char* op = "convert";
  DIFFCP_GUARD_OP(convert, C(src), C(dst));
}

void GuardBackend::gather_rows(ConstTensorView src, std::span<const std::int64_t> rows, TensorView dst) {
  const char* op = "gather_rows";
  DIFFCP_GUARD_OP(gather_rows, C(src), rows, C(dst));
}
void GuardBackend::scatter_rows(ConstTensorView src, std::span<const std::int64_t> rows, TensorView dst) {
  const char* op = "scatter_rows";
  DIFFCP_GUARD_OP(scatter_rows, C(src), rows, C(dst));
}

void GuardBackend::fp8_encode(ConstTensorView x, TensorView enc) {
  const char* op = "fp8_encode";
  DIFFCP_GUARD_OP(fp8_encode, C(x), C(enc));
}
void GuardBackend::fp8_decode(ConstTensorView enc, TensorView x) {
  const char* op = "fp8_decode";
  DIFFCP_GUARD_OP(fp8_decode, C(enc), C(x));
}
void GuardBackend::l1_distance(ConstTensorView a, ConstTensorView b, TensorView out) {
  const char* op = "l1_distance";
  DIFFCP_GUARD_OP(l1_distance, C(a), C(b), C(out));
}
void GuardBackend::cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                                 std::span<double> stats, std::span<const double> weight) {
  const char* op = "cross_entropy";
  DIFFCP_GUARD_OP(cross_entropy, C(logits), v0, target, stats, weight);
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.host_syncs;  // the statistics land in host memory
}
void GuardBackend::cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                                          std::span<const double> weight, std::span<const double> lse) {
  const char* op = "cross_entropy_backward";
  DIFFCP_GUARD_OP(cross_entropy_backward, C(logits), v0, target, weight, lse);
}
double GuardBackend::scale_sumsq(TensorView x, double scale) {
  const char* op = "scale_sumsq";
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++counters_.ops;
    ++counters_.host_syncs;  // its value is returned to the host
  }
  Open open(*this);
  return cpu_backend().scale_sumsq(C(x), scale);
}

void GuardBackend::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.host_syncs;
}

#undef C
#undef DIFFCP_GUARD_OP

GuardBackend& guard_backend() {
  static GuardBackend* g = [] {
    auto* b = new GuardBackend;  // never destroyed: buffers may outlive static destruction order
    register_backend(*b);
    return b;
  }();
  return *g;
}

}  // namespace diffcp
