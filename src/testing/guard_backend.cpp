// testing/guard_backend.hpp: buffer addresses that are PROT_NONE reservations, bytes in a second
// mapping only the ops reach; every op range-checks and translates its tensors, then runs the CPU
// backend's hook now ("guard") or in stream order on a worker thread ("guard-async").
#include "diffcp/testing/guard_backend.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/ops/rope.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

struct sigaction g_previous_segv {};
std::atomic<const GuardBackend*> g_devices[2];  // the handler's view of the guard devices

// Async-signal-safe formatting for the handler (no allocation, no locale).
struct Line {
  char* out;
  std::size_t cap, n = 0;
  void put(const char* s) {
    while (*s && n < cap) out[n++] = *s++;
  }
  void hex(std::uintptr_t a) {
    char h[2 * sizeof a];
    for (int i = static_cast<int>(sizeof h) - 1; i >= 0; --i, a >>= 4) h[i] = "0123456789abcdef"[a & 15];
    for (char c : h)
      if (n < cap) out[n++] = c;
  }
  void dec(std::uint64_t v) {
    char d[24];
    int i = 0;
    do d[i++] = static_cast<char>('0' + v % 10), v /= 10;
    while (v);
    while (i && n < cap) out[n++] = d[--i];
  }
};

// A fault is the expected way a host touch of guard memory shows itself: say so and what the
// address is (write(2) only), then hand the fault to the previous handler (returning re-runs the
// access, which then takes the previous action).
void on_segv(int, siginfo_t* info, void*) {
  char buf[512];
  Line l{buf, sizeof buf};
  const auto a = reinterpret_cast<std::uintptr_t>(info->si_addr);
  l.put("guard device: SIGSEGV at 0x");
  l.hex(a);
  std::size_t detail = 0;
  for (const auto& d : g_devices)
    if (const GuardBackend* g = d.load(); g != nullptr && detail == 0) detail = g->describe_fault(a, buf + l.n, l.cap - l.n);
  l.n += detail;
  if (detail == 0)
    l.put(": host code touched guard device memory (device memory is never host memory; "
          "testing/guard_backend.hpp), or another invalid address");
  l.put("\n");
  (void)!write(STDERR_FILENO, buf, l.n);
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
}

void install_handler() {
  static const bool installed = [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
    return true;
  }();
  (void)installed;
}

// Elements a strided view spans, from its first to its last element.
template <typename View>
std::size_t extent_bytes(const View& t) {
  if (t.numel() == 0) return 0;
  std::int64_t last = 0;
  for (int d = 0; d < t.rank; ++d) last += (t.shape[static_cast<std::size_t>(d)] - 1) * t.stride[static_cast<std::size_t>(d)];
  return static_cast<std::size_t>(last + 1) * t.element_size();
}

template <typename T>
std::vector<std::remove_const_t<T>> host_copy(std::span<T> s) {
  return {s.begin(), s.end()};
}
// rows: [n] i64 host metadata, copied
std::vector<std::int64_t> host_rows(const ConstTensorView& rows) {
  DIFFCP_CHECK(rows.dtype == DType::i64 && rows.is_contiguous(), "guard: rows ", rows.describe(), ", expected [n] i64");
  const std::int64_t* r = rows.ptr<const std::int64_t>();
  return {r, r + rows.numel()};
}

}  // namespace

GuardBackend::GuardBackend(Mode mode)
    : mode_(mode), device_(register_device(mode == Mode::stream ? "guard-async" : "guard")) {
  install_handler();
  g_devices[mode == Mode::stream ? 1 : 0].store(this);
  if (mode_ == Mode::stream) worker_ = std::thread([this] { worker(); });
}

GuardBackend::~GuardBackend() {
  for (auto& d : g_devices) {
    const GuardBackend* self = this;
    d.compare_exchange_strong(self, nullptr);
  }
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  worker_.join();
}

std::string GuardBackend::describe(DType dtype) const {
  return std::string(mode_ == Mode::stream ? "stream-ordered guard device" : "guard device") + " over " +
         cpu_backend().describe(dtype);
}

// ---- the stream ----

void GuardBackend::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, nothing left
    Task t = std::move(queue_.front());
    queue_.pop_front();
    // After a failure, only frees run until it is reported (and what was queued before the report).
    const bool skip = t.kind != Task::release && (!error_.empty() || t.seq <= skip_through_ || exiting_);
    lock.unlock();
    std::string failed;
    if (!skip) {
      try {
        t.run();
      } catch (const std::exception& e) {
        failed = e.what();
      }
    }
    t.run = nullptr;  // what the task held (host copies) goes before the stream moves on
    lock.lock();
    if (!failed.empty() && error_.empty())
      error_ = detail::concat("guard-async: ", t.op, " (op ", t.seq, " on the stream) failed: ", failed);
    done_.store(t.seq);
    drained_.notify_all();
  }
}

void GuardBackend::submit(const char* op, std::function<void()> task, Task::Kind kind) {
  if (mode_ == Mode::immediate) {
    if (kind == Task::compute) {
      std::lock_guard<std::mutex> lock(mu_);
      ++counters_.ops;
    }
    task();
    return;
  }
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kind != Task::release && !error_.empty()) {  // reported at the next call, as CUDA's errors are
      failed.swap(error_);
      skip_through_ = issued_;
    } else {
      queue_.push_back({op, ++issued_, kind, std::move(task)});
      counters_.ops += kind == Task::compute;
    }
  }
  if (failed.empty()) {
    queued_.notify_one();
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  drained_.wait(lock, [&] { return done_.load() == issued_; });  // the skipped rest
  throw Error(failed);
}

void GuardBackend::wait_stream() {
  if (mode_ == Mode::immediate) return;
  std::unique_lock<std::mutex> lock(mu_);
  drained_.wait(lock, [&] { return done_.load() == issued_; });
  if (!error_.empty()) {
    std::string failed;
    failed.swap(error_);
    throw Error(failed);
  }
}

// At exit: what is still queued is not run (statics it would use may be gone), only freed.
void GuardBackend::exit_drain() noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  exiting_ = true;
  drained_.wait(lock, [&] { return done_.load() == issued_; });
}

void GuardBackend::count_host_sync() {
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.host_syncs;
}

void GuardBackend::synchronize() {
  wait_stream();
  count_host_sync();
}

GuardBackend::Counters GuardBackend::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

// ---- memory ----

// The address handed out ends (64-byte aligned) at the end of a reservation's pages; the bytes sit
// at the same offset of the store, whose next page is never opened.
void* GuardBackend::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  const std::size_t span = (bytes + page_size() - 1) / page_size() * page_size();
  void* base = mmap(nullptr, span + page_size(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  DIFFCP_CHECK(base != MAP_FAILED, "guard: cannot reserve ", bytes, " bytes: ", std::strerror(errno));
  void* store = mmap(nullptr, span + page_size(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (store == MAP_FAILED || mprotect(store, span, PROT_READ | PROT_WRITE) != 0) {
    const int err = errno;
    munmap(base, span + page_size());
    if (store != MAP_FAILED) munmap(store, span + page_size());
    DIFFCP_FAIL("guard: cannot map ", bytes, " bytes: ", std::strerror(err));
  }
  const std::uintptr_t user = reinterpret_cast<std::uintptr_t>(base) + span - (bytes + 63) / 64 * 64;
  std::lock_guard<std::mutex> lock(mu_);
  buffers_[user] = {reinterpret_cast<std::uintptr_t>(base), reinterpret_cast<std::uintptr_t>(store), span, bytes};
  return reinterpret_cast<void*>(user);
}

// Ordered after the ops issued before it: the buffer is refused to new ops at once, and unmapped
// when the stream reaches the free.
void GuardBackend::deallocate(void* p, std::size_t) noexcept {
  if (p == nullptr) return;
  const auto user = reinterpret_cast<std::uintptr_t>(p);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = buffers_.find(user);
    if (it == buffers_.end() || it->second.freed) return;  // not ours: nothing to free
    it->second.freed = true;
  }
  const auto unmap = [this, user] {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = buffers_.find(user);
    const Region r = it->second;
    buffers_.erase(it);
    munmap(reinterpret_cast<void*>(r.base), r.span + page_size());
    munmap(reinterpret_cast<void*>(r.store), r.span + page_size());
  };
  try {
    submit("free", unmap, Task::release);
  } catch (...) {  // no memory to queue it: leave the mapping (the buffer is already refused)
  }
}

bool GuardBackend::owns(const void* p, std::size_t bytes) const {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.upper_bound(a);
  if (it == buffers_.begin()) return false;
  --it;
  return !it->second.freed && a >= it->first && a + bytes <= it->first + it->second.bytes;
}

void* GuardBackend::at(const char* op, const char* what, const void* p, std::size_t bytes, bool writes) {
  if (bytes == 0) return const_cast<void*>(p);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.upper_bound(a);
  const bool inside = it != buffers_.begin() && (--it, !it->second.freed && a >= it->first &&
                                                          a + bytes <= it->first + it->second.bytes);
  DIFFCP_CHECK(inside, "guard: ", op, ": ", what, " (", bytes, " bytes at ", p,
               ") is not guard device memory: host memory handed to a device op");
  Region& r = it->second;
  if (writes) r.last_op = op, r.last_seq = issued_ + 1;  // the number submit() gives it next
  return reinterpret_cast<void*>(r.store + (a - r.base));
}

template <typename View>
View GuardBackend::checked(const char* op, const char* what, View t) {
  DIFFCP_CHECK(t.device == device_, "guard: ", op, ": ", what, " ", t.describe(), " is labelled ",
               device_name(t.device), " memory: a device op takes views of ", name(), " memory");
  t.data = static_cast<decltype(t.data)>(at(op, what, t.data, extent_bytes(t), std::is_same_v<View, TensorView>));
  t.device = Device::host;  // the CPU kernels see plain memory: the store
  return t;
}

std::size_t GuardBackend::describe_fault(std::uintptr_t addr, char* out, std::size_t cap) const {
  if (!mu_.try_lock()) return 0;
  Line l{out, cap};
  auto it = buffers_.upper_bound(addr);
  if (it != buffers_.begin()) {
    --it;
    const Region& r = it->second;
    if (addr >= r.base && addr < r.base + r.span + page_size()) {
      l.put(": host code touched ");
      l.put(name());
      l.put(" device memory (a buffer of ");
      l.dec(r.bytes);
      l.put(" bytes at 0x");
      l.hex(it->first);
      l.put(r.freed ? ", freed" : "");
      l.put("), which is never host memory: copy it to the host. ");
      if (r.last_op == nullptr) {
        l.put("No op has written it.");
      } else {
        l.put("Last written by ");
        l.put(r.last_op);
        l.put(" (op ");
        l.dec(static_cast<std::uint64_t>(r.last_seq));
        l.put(r.last_seq > done_.load() && mode_ == Mode::stream
                  ? ", still queued: a result read before a synchronize covered it)"
                  : ", finished)");
      }
    }
  }
  mu_.unlock();
  return l.n;
}

void GuardBackend::copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) {
  DIFFCP_CHECK((dst_device == Device::host || dst_device == device_) &&
                   (src_device == Device::host || src_device == device_),
               "guard: copy between ", device_name(src_device), " and ", device_name(dst_device), " memory");
  if (bytes == 0) return;
  // A side labelled host must be host memory (a device pointer in a host view is a bug a GPU
  // would not forgive).
  DIFFCP_CHECK(src_device == device_ || !owns(src, 1), "guard: copy: src ", src,
               " is guard device memory in a view labelled host");
  DIFFCP_CHECK(dst_device == device_ || !owns(dst, 1), "guard: copy: dst ", dst,
               " is guard device memory in a view labelled host");
  const bool from = src_device == device_, to = dst_device == device_;
  if (!from && !to) {
    std::memcpy(dst, src, bytes);
    return;
  }
  void* d = to ? at("copy", "dst", dst, bytes, true) : dst;
  const void* s = from ? at("copy", "src", src, bytes, false) : src;
  {
    std::lock_guard<std::mutex> lock(mu_);
    (from && to ? counters_.device_to_device : to ? counters_.host_to_device : counters_.device_to_host) += bytes;
  }
  if (!from) {  // the host source may be reused when copy() returns: the stream copies a snapshot
    auto snapshot = std::make_shared<std::vector<unsigned char>>(static_cast<const unsigned char*>(s),
                                                                 static_cast<const unsigned char*>(s) + bytes);
    submit("copy", [d, snapshot] { std::memcpy(d, snapshot->data(), snapshot->size()); }, Task::transfer);
    return;
  }
  submit("copy", [d, s, bytes] { std::memcpy(d, s, bytes); }, Task::transfer);
  if (!to) {  // into host memory: it holds the data when copy() returns (a host sync)
    wait_stream();
    count_host_sync();
  }
}

// ---- the ops: range-check and translate every tensor when issued, run the CPU backend's hook ----
#define C(x) checked(op, #x, x)

void GuardBackend::gemm(const GemmArgs& args) {
  const char* op = "gemm";
  const std::int64_t a_rows = args.trans_a ? args.K : args.M, a_cols = args.trans_a ? args.M : args.K;
  const std::int64_t b_rows = args.trans_b ? args.N : args.K, b_cols = args.trans_b ? args.K : args.N;
  const auto span = [](std::int64_t rows, std::int64_t cols, std::int64_t ld, DType t) {
    return rows == 0 || cols == 0 ? std::size_t{0} : static_cast<std::size_t>((rows - 1) * ld + cols) * dtype_size(t);
  };
  GemmArgs a = args;
  a.A = at(op, "A", a.A, span(a_rows, a_cols, a.lda, a.dtype), false);
  a.B = at(op, "B", a.B, span(b_rows, b_cols, a.ldb, a.dtype), false);
  a.C = at(op, "C", a.C, span(a.M, a.N, a.ldc, a.c_dtype), true);
  submit(op, [a] { cpu_backend().gemm(a); });
}
void GuardBackend::bias_backward(ConstTensorView dy, TensorView db) {
  const char* op = "bias_backward";
  submit(op, [dy = C(dy), db = C(db)] { cpu_backend().bias_backward(dy, db); });
}
void GuardBackend::bias_add(TensorView y, ConstTensorView b) {
  const char* op = "bias_add";
  submit(op, [y = C(y), b = C(b)] { cpu_backend().bias_add(y, b); });
}
namespace {
// The CPU's packed layout of a weight, made from the guard's bytes, freed in stream order (as a
// GPU's packed weight is device memory): ops queued with it may still read it when its owner goes.
class GuardPackedWeight final : public PackedWeight {
 public:
  GuardPackedWeight(GuardBackend& g, std::shared_ptr<PackedWeight> cpu) : g_(g), cpu_(std::move(cpu)) {}
  ~GuardPackedWeight() override { g_.release_after_stream(std::move(cpu_)); }
  std::size_t bytes() const override { return cpu_->bytes(); }
  const std::shared_ptr<PackedWeight>& cpu() const { return cpu_; }

 private:
  GuardBackend& g_;
  std::shared_ptr<PackedWeight> cpu_;
};
}  // namespace

void GuardBackend::release_after_stream(std::shared_ptr<void> held) noexcept {
  try {
    submit("free", [held = std::move(held)] {}, Task::release);  // the task holds it until the stream runs it
  } catch (...) {
  }
}

void GuardBackend::dense_linear(ConstTensorView x, ConstTensorView w, const PackedWeight* packed, ConstTensorView bias,
                                TensorView y) {
  const char* op = "dense_linear";
  std::shared_ptr<PackedWeight> cpu_packed;
  if (packed != nullptr) {
    const auto* g = dynamic_cast<const GuardPackedWeight*>(packed);
    DIFFCP_CHECK(g != nullptr, "guard: dense_linear: the packed weight was not made by ", name(), "'s pack_weight");
    cpu_packed = g->cpu();
  }
  submit(op, [x = C(x), w = C(w), cpu_packed, bias = C(bias), y = C(y)] {
    cpu_backend().dense_linear(x, w, cpu_packed.get(), bias, y);
  });
}
// The packed layout is a host object the CPU's kernels read, made from the device's bytes: the
// stream runs it and the host waits (a GPU packs on the device; not counted as a host sync).
std::unique_ptr<PackedWeight> GuardBackend::pack_weight(ConstTensorView w) {
  const char* op = "pack_weight";
  std::unique_ptr<PackedWeight> packed;
  submit(op, [w = C(w), &packed] { packed = cpu_backend().pack_weight(w); });
  wait_stream();
  if (packed == nullptr) return nullptr;
  return std::make_unique<GuardPackedWeight>(*this, std::shared_ptr<PackedWeight>(std::move(packed)));
}
void GuardBackend::attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                     TensorView o, TensorView lse, float softmax_scale) {
  const char* op = "attention_forward";
  submit(op, [mask = std::make_shared<const BlockMask>(mask), q = C(q), k = C(k), v = C(v), o = C(o), lse = C(lse),
              softmax_scale] { cpu_backend().attention_forward(*mask, q, k, v, o, lse, softmax_scale); });
}
void GuardBackend::attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                      ConstTensorView do_, ConstTensorView lse, ConstTensorView delta, TensorView dq,
                                      TensorView dk, TensorView dv, float softmax_scale) {
  const char* op = "attention_backward";
  submit(op, [mask = std::make_shared<const BlockMask>(mask), q = C(q), k = C(k), v = C(v), do_ = C(do_),
              lse = C(lse), delta = C(delta), dq = C(dq), dk = C(dk), dv = C(dv), softmax_scale] {
    cpu_backend().attention_backward(*mask, q, k, v, do_, lse, delta, dq, dk, dv, softmax_scale);
  });
}
void GuardBackend::attention_delta(ConstTensorView do_, ConstTensorView o, TensorView delta) {
  const char* op = "attention_delta";
  submit(op, [do_ = C(do_), o = C(o), delta = C(delta)] { cpu_backend().attention_delta(do_, o, delta); });
}
void GuardBackend::lse_merge(std::span<const ConstTensorView> o_parts, std::span<const ConstTensorView> lse_parts,
                             TensorView o, TensorView lse) {
  const char* op = "lse_merge";
  std::vector<ConstTensorView> os, lses;
  for (const ConstTensorView& t : o_parts) os.push_back(checked(op, "o_parts[p]", t));
  for (const ConstTensorView& t : lse_parts) lses.push_back(checked(op, "lse_parts[p]", t));
  submit(op, [os = std::move(os), lses = std::move(lses), o = C(o), lse = C(lse)] {
    cpu_backend().lse_merge(os, lses, o, lse);
  });
}
void GuardBackend::lse_rescale(TensorView o_p, ConstTensorView lse_p, ConstTensorView lse) {
  const char* op = "lse_rescale";
  submit(op, [o_p = C(o_p), lse_p = C(lse_p), lse = C(lse)] { cpu_backend().lse_rescale(o_p, lse_p, lse); });
}
void GuardBackend::lse_shift(TensorView x, ConstTensorView m, bool to_exp) {
  const char* op = "lse_shift";
  submit(op, [x = C(x), m = C(m), to_exp] { cpu_backend().lse_shift(x, m, to_exp); });
}
void GuardBackend::rmsnorm_forward(ConstTensorView x, ConstTensorView w, float eps, TensorView y, TensorView rstd) {
  const char* op = "rmsnorm_forward";
  submit(op, [x = C(x), w = C(w), eps, y = C(y), rstd = C(rstd)] { cpu_backend().rmsnorm_forward(x, w, eps, y, rstd); });
}
void GuardBackend::rmsnorm_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView rstd, ConstTensorView w,
                                    TensorView dx, TensorView dw) {
  const char* op = "rmsnorm_backward";
  submit(op, [dy = C(dy), x = C(x), rstd = C(rstd), w = C(w), dx = C(dx), dw = C(dw)] {
    cpu_backend().rmsnorm_backward(dy, x, rstd, w, dx, dw);
  });
}
// The table's rows for these positions are taken now, as a GPU backend uploads them.
void GuardBackend::rope(TensorView x, std::span<const std::int64_t> positions, const RopeTable& table, bool inverse) {
  const char* op = "rope";
  const auto n = static_cast<std::int64_t>(positions.size());
  std::vector<std::int64_t> iota(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) iota[static_cast<std::size_t>(i)] = i;
  submit(op, [x = C(x), rows = std::make_shared<const RopeTable>(table.rows(positions)), iota = std::move(iota), inverse] {
    cpu_backend().rope(x, iota, *rows, inverse);
  });
}
void GuardBackend::silu(TensorView x) {
  const char* op = "silu";
  submit(op, [x = C(x)] { cpu_backend().silu(x); });
}
void GuardBackend::gelu_tanh(TensorView x) {
  const char* op = "gelu_tanh";
  submit(op, [x = C(x)] { cpu_backend().gelu_tanh(x); });
}
void GuardBackend::gelu(TensorView x) {
  const char* op = "gelu";
  submit(op, [x = C(x)] { cpu_backend().gelu(x); });
}
void GuardBackend::layernorm_modulate(ConstTensorView x, ConstTensorView shift, ConstTensorView scale, float eps,
                                      TensorView y) {
  const char* op = "layernorm_modulate";
  submit(op, [x = C(x), shift = C(shift), scale = C(scale), eps, y = C(y)] {
    cpu_backend().layernorm_modulate(x, shift, scale, eps, y);
  });
}
void GuardBackend::gated_add(TensorView x, ConstTensorView gate, ConstTensorView y) {
  const char* op = "gated_add";
  submit(op, [x = C(x), gate = C(gate), y = C(y)] { cpu_backend().gated_add(x, gate, y); });
}
void GuardBackend::qk_norm_rope(TensorView qkv, ConstTensorView q_scale, ConstTensorView k_scale, float eps,
                                ConstTensorView cos, ConstTensorView sin) {
  const char* op = "qk_norm_rope";
  const bool rotate = cos.rank > 0;  // rank 0: no rotation (text rows), no table
  submit(op, [qkv = C(qkv), q_scale = C(q_scale), k_scale = C(k_scale), eps, cos = rotate ? C(cos) : cos,
              sin = rotate ? C(sin) : sin] { cpu_backend().qk_norm_rope(qkv, q_scale, k_scale, eps, cos, sin); });
}
void GuardBackend::swiglu_forward(ConstTensorView gate, ConstTensorView up, TensorView act) {
  const char* op = "swiglu_forward";
  submit(op, [gate = C(gate), up = C(up), act = C(act)] { cpu_backend().swiglu_forward(gate, up, act); });
}
void GuardBackend::swiglu_backward(ConstTensorView dact, ConstTensorView gate, ConstTensorView up, TensorView dgate,
                                   TensorView dup) {
  const char* op = "swiglu_backward";
  submit(op, [dact = C(dact), gate = C(gate), up = C(up), dgate = C(dgate), dup = C(dup)] {
    cpu_backend().swiglu_backward(dact, gate, up, dgate, dup);
  });
}
void GuardBackend::guidance_combine(TensorView v, ConstTensorView v_neg, float scale, bool keep_norm) {
  const char* op = "guidance_combine";
  submit(op, [v = C(v), v_neg = C(v_neg), scale, keep_norm] { cpu_backend().guidance_combine(v, v_neg, scale, keep_norm); });
}
void GuardBackend::add(TensorView y, ConstTensorView x, float alpha) {
  const char* op = "add";
  submit(op, [y = C(y), x = C(x), alpha] { cpu_backend().add(y, x, alpha); });
}
void GuardBackend::adamw_step(TensorView p, ConstTensorView g, TensorView m, TensorView v, const AdamWStepArgs& args) {
  const char* op = "adamw_step";
  submit(op, [p = C(p), g = C(g), m = C(m), v = C(v), args] { cpu_backend().adamw_step(p, g, m, v, args); });
}
void GuardBackend::fill(TensorView x, float value) {
  const char* op = "fill";
  submit(op, [x = C(x), value] { cpu_backend().fill(x, value); });
}
void GuardBackend::convert(ConstTensorView src, TensorView dst) {
  const char* op = "convert";
  submit(op, [src = C(src), dst = C(dst)] { cpu_backend().convert(src, dst); });
}
// A row list that is host metadata is copied at the call (as a GPU backend uploads it); one in
// device memory (token_rows' output) is translated and read when the op runs.
void GuardBackend::gather_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) {
  const char* op = "gather_rows";
  if (rows.device == Device::host)
    submit(op, [src = C(src), rows = host_rows(rows), dst = C(dst)] {
      cpu_backend().gather_rows(src, view_of(std::span<const std::int64_t>(rows)), dst);
    });
  else
    submit(op, [src = C(src), rows = C(rows), dst = C(dst)] { cpu_backend().gather_rows(src, rows, dst); });
}
void GuardBackend::scatter_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) {
  const char* op = "scatter_rows";
  if (rows.device == Device::host)
    submit(op, [src = C(src), rows = host_rows(rows), dst = C(dst)] {
      cpu_backend().scatter_rows(src, view_of(std::span<const std::int64_t>(rows)), dst);
    });
  else
    submit(op, [src = C(src), rows = C(rows), dst = C(dst)] { cpu_backend().scatter_rows(src, rows, dst); });
}
void GuardBackend::dynamic_conv_forward(ConstTensorView x, ConstTensorView dyn, ConstTensorView base, std::int64_t block,
                                        TensorView y) {
  const char* op = "dynamic_conv_forward";
  submit(op, [x = C(x), dyn = C(dyn), base = C(base), block, y = C(y)] {
    cpu_backend().dynamic_conv_forward(x, dyn, base, block, y);
  });
}
void GuardBackend::dynamic_conv_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView dyn, ConstTensorView base,
                                         std::int64_t block, TensorView dx, TensorView ddyn, TensorView dbase) {
  const char* op = "dynamic_conv_backward";
  submit(op, [dy = C(dy), x = C(x), dyn = C(dyn), base = C(base), block, dx = C(dx), ddyn = C(ddyn), dbase = C(dbase)] {
    cpu_backend().dynamic_conv_backward(dy, x, dyn, base, block, dx, ddyn, dbase);
  });
}
void GuardBackend::select_active(ConstTensorView parts, TensorView active) {
  const char* op = "select_active";
  submit(op, [parts = C(parts), active = C(active)] { cpu_backend().select_active(parts, active); });
}
void GuardBackend::token_rows(ConstTensorView active, ConstTensorView map, std::int64_t n, std::int64_t stride,
                              TensorView rows) {
  const char* op = "token_rows";
  submit(op, [active = C(active), map = map.rank == 0 ? map : C(map), n, stride, rows = C(rows)] {
    cpu_backend().token_rows(active, map, n, stride, rows);
  });
}
void GuardBackend::fp8_encode(ConstTensorView x, TensorView enc) {
  const char* op = "fp8_encode";
  submit(op, [x = C(x), enc = C(enc)] { cpu_backend().fp8_encode(x, enc); });
}
void GuardBackend::fp8_decode(ConstTensorView enc, TensorView x) {
  const char* op = "fp8_decode";
  submit(op, [enc = C(enc), x = C(x)] { cpu_backend().fp8_decode(enc, x); });
}
void GuardBackend::l1_distance(ConstTensorView a, ConstTensorView b, TensorView out) {
  const char* op = "l1_distance";
  submit(op, [a = C(a), b = C(b), out = C(out)] { cpu_backend().l1_distance(a, b, out); });
}
// The statistics land in host memory: the host waits for them (a host sync).
void GuardBackend::cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                                 std::span<double> stats, std::span<const double> weight, LogitMap map) {
  const char* op = "cross_entropy";
  submit(op, [logits = C(logits), v0, target, stats, weight, map] {
    cpu_backend().cross_entropy(logits, v0, target, stats, weight, map);
  });
  wait_stream();
  count_host_sync();
}
void GuardBackend::cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                                          std::span<const double> weight, std::span<const double> lse, LogitMap map,
                                          SparseLogitGrad extra) {
  const char* op = "cross_entropy_backward";
  submit(op, [logits = C(logits), v0, target = host_copy(target), weight = host_copy(weight), lse = host_copy(lse), map,
              ids = host_copy(extra.ids), grad = host_copy(extra.grad)] {
    cpu_backend().cross_entropy_backward(logits, v0, target, weight, lse, map, SparseLogitGrad{ids, grad});
  });
}
void GuardBackend::logit_map(TensorView logits, LogitMap map) {
  const char* op = "logit_map";
  submit(op, [logits = C(logits), map] { cpu_backend().logit_map(logits, map); });
}
// The candidates land in host memory: the host waits for them (a host sync).
void GuardBackend::top_k(ConstTensorView logits, std::int64_t v0, std::span<float> values, std::span<std::int32_t> ids) {
  const char* op = "top_k";
  submit(op, [logits = C(logits), v0, values, ids] { cpu_backend().top_k(logits, v0, values, ids); });
  wait_stream();
  count_host_sync();
}
// Its value is returned to the host: the host waits for it (a host sync).
double GuardBackend::scale_sumsq(TensorView x, double scale) {
  const char* op = "scale_sumsq";
  double sum = 0;
  submit(op, [x = C(x), scale, &sum] { sum = cpu_backend().scale_sumsq(x, scale); });
  wait_stream();
  count_host_sync();
  return sum;
}

#undef C

namespace {
GuardBackend& make_registered(GuardBackend::Mode mode) {
  // Never destroyed: buffers may outlive static destruction order. The stream drains at exit, so
  // no op runs while the process's statics go.
  auto* b = new GuardBackend(mode);
  register_backend(*b);
  if (mode == GuardBackend::Mode::stream) {
    static GuardBackend* async = b;
    std::atexit([] { async->exit_drain(); });
  }
  return *b;
}
}  // namespace

GuardBackend& guard_backend() {
  static GuardBackend& g = make_registered(GuardBackend::Mode::immediate);
  return g;
}

GuardBackend& guard_async_backend() {
  static GuardBackend& g = make_registered(GuardBackend::Mode::stream);
  return g;
}

bool is_guard(const Backend& b) { return dynamic_cast<const GuardBackend*>(&b) != nullptr; }

}  // namespace diffcp
