// The guard devices: test backends (ops/backend.hpp) whose memory the host cannot touch, in the
// two execution models a code path must survive.
//
//  - "guard" (guard_backend()): every op runs when it is called, on the calling thread.
//  - "guard-async" (guard_async_backend()): CUDA's execution model. Every op, copy and free is
//    queued on one stream and run in issue order by a worker thread; the call returns at once.
//    The host waits only where a GPU's host waits: synchronize(), a copy into host memory, the ops
//    that return values to the host (scale_sumsq, cross_entropy's statistics, top_k) and pack_weight.
//    Host arguments are taken at the call, as a GPU backend uploads them (index lists, the RoPE
//    rows of the positions, loss targets and weights, the BlockMask, the source of a
//    host-to-device copy); a packed weight is freed in stream order, as device memory. An op that fails on the stream is reported at the next host
//    wait or the next call, once, naming it ("guard-async: attention_forward (op 12 on the
//    stream) failed: ..."); the ops queued after it are skipped until then.
//
// Memory: a buffer's address is a reservation of PROT_NONE pages that never becomes accessible,
// as a GPU address is no host address, so any host read or write of device memory faults at once,
// on any thread, whatever runs meanwhile (SIGSEGV, after a line on stderr naming the guard device,
// the buffer and the last op queued to write it, with whether that op had run or was still queued:
// the host read a result not yet synchronized). The bytes live in a second mapping that only the
// backend's ops reach (each op's views are translated to it when it is issued); that mapping ends
// at the end of its pages, followed by a page never opened, so an op that overruns a buffer past
// its 64-byte-rounded end faults too. Before each op, every tensor argument is checked to lie
// inside the bytes one live buffer was allocated with ("guard: gemm: A ... is not guard device
// memory"), as a GPU faults on a host pointer; a copy refuses guard memory on a side labelled
// host. The ops forward to the CPU backend, so both devices compute what the CPU computes, bit for
// bit.
//
// What they cannot show: one device, one stream (the communicators stage through host memory and
// wait for the stream first; NCCL's own stream and its grouping and matching are the rendezvous
// communicator's to prove: comm/rendezvous_communicator.hpp); the CPU's kernels are not a GPU's
// (numerics, speed, memory). docs/gpu.md says what each double proves and what only a GPU can.
//
// One host thread issues a guard device's ops (as one thread drives a CUDA stream).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

class GuardBackend final : public Backend {
 public:
  enum class Mode { immediate, stream };  // "guard", "guard-async"
  explicit GuardBackend(Mode mode);
  ~GuardBackend() override;
  const char* name() const override { return mode_ == Mode::stream ? "guard-async" : "guard"; }
  Mode mode() const { return mode_; }
  Device device() const override { return device_; }
  Device device_of(const void* p) const override { return p != nullptr && owns(p, 1) ? device_ : Device::host; }
  bool supports(OpKind op, DType dtype) const override { return cpu_backend().supports(op, dtype); }
  std::string describe(DType dtype) const override;
  bool native_arithmetic(DType dtype) const override { return cpu_backend().native_arithmetic(dtype); }

  void* allocate(std::size_t bytes) override;
  void deallocate(void* p, std::size_t bytes) noexcept override;
  void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) override;

  void gemm(const GemmArgs& args) override;
  void bias_backward(ConstTensorView dy, TensorView db) override;
  void bias_add(TensorView y, ConstTensorView b) override;
  // Packed weights are the CPU backend's (host memory only its kernels read), made from guard memory
  // and freed in stream order; dense_linear takes only the ones this device made.
  void dense_linear(ConstTensorView x, ConstTensorView w, const PackedWeight* packed, ConstTensorView bias,
                    TensorView y) override;
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
  void gelu_tanh(TensorView x) override;
  void gelu(TensorView x) override;
  void layernorm_modulate(ConstTensorView x, ConstTensorView shift, ConstTensorView scale, float eps,
                          TensorView y) override;
  void gated_add(TensorView x, ConstTensorView gate, ConstTensorView y) override;
  void qk_norm_rope(TensorView qkv, ConstTensorView q_scale, ConstTensorView k_scale, float eps, ConstTensorView cos,
                    ConstTensorView sin) override;
  void swiglu_forward(ConstTensorView gate, ConstTensorView up, TensorView act) override;
  void swiglu_backward(ConstTensorView dact, ConstTensorView gate, ConstTensorView up, TensorView dgate,
                       TensorView dup) override;
  void add(TensorView y, ConstTensorView x, float alpha) override;
  void guidance_combine(TensorView v, ConstTensorView v_neg, float scale, bool keep_norm) override;
  void adamw_step(TensorView p, ConstTensorView g, TensorView m, TensorView v, const AdamWStepArgs& args) override;
  void fill(TensorView x, float value) override;
  void convert(ConstTensorView src, TensorView dst) override;
  void fp8_encode(ConstTensorView x, TensorView enc) override;
  void fp8_decode(ConstTensorView enc, TensorView x) override;
  void gather_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) override;
  void l1_distance(ConstTensorView a, ConstTensorView b, TensorView out) override;
  void select_active(ConstTensorView parts, TensorView active) override;
  void token_rows(ConstTensorView active, ConstTensorView map, std::int64_t n, std::int64_t stride,
                  TensorView rows) override;
  void cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target, std::span<double> stats,
                     std::span<const double> weight, LogitMap map) override;
  void cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                              std::span<const double> weight, std::span<const double> lse, LogitMap map,
                              SparseLogitGrad extra) override;
  void logit_map(TensorView logits, LogitMap map) override;
  void top_k(ConstTensorView logits, std::int64_t v0, std::span<float> values, std::span<std::int32_t> ids) override;
  double scale_sumsq(TensorView x, double scale) override;
  void synchronize() override;  // waits for the stream (guard-async); counts a host sync
  void scatter_rows(ConstTensorView src, ConstTensorView rows, TensorView dst) override;
  void dynamic_conv_forward(ConstTensorView x, ConstTensorView dyn, ConstTensorView base, std::int64_t block,
                            TensorView y) override;
  void dynamic_conv_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView dyn, ConstTensorView base,
                             std::int64_t block, TensorView dx, TensorView ddyn, TensorView dbase) override;

  // What crossed between the host and the device, and how many ops ran (tests read them).
  struct Counters {
    std::int64_t ops = 0;
    std::size_t host_to_device = 0, device_to_host = 0, device_to_device = 0;  // bytes
    // Where a GPU's host would wait for the device (a host sync): a copy into host memory, an op
    // that returns a value or statistics to the host (scale_sumsq, cross_entropy), synchronize().
    std::int64_t host_syncs = 0;
  };
  Counters counters() const;
  // Whether [p, p + bytes) lies inside one live guard buffer (allocated, not yet freed).
  bool owns(const void* p, std::size_t bytes) const;

  // Drops `held` (a host object queued ops may read: a packed weight) once the stream has run
  // everything issued so far, as device memory is freed.
  void release_after_stream(std::shared_ptr<void> held) noexcept;

  // The SIGSEGV handler's description of `addr` (best effort: empty when it is no buffer of this
  // device or the device's lock is held); async-signal-safe formatting into `out`.
  std::size_t describe_fault(std::uintptr_t addr, char* out, std::size_t cap) const;

 private:
  struct Region {
    std::uintptr_t base;   // the address reservation: `span` bytes of PROT_NONE pages, then one more
    std::uintptr_t store;  // the bytes: `span` bytes, then one page never opened
    std::size_t span, bytes;  // bytes: what was asked for (the range checks use it)
    bool freed = false;       // deallocated by the host; unmapped when the stream reaches the free
    const char* last_op = nullptr;  // the last op issued that writes it, and its number on the stream
    std::int64_t last_seq = 0;
  };
  // `bytes` at p inside one live buffer (else the error naming op and what), translated to where
  // the ops read it; `writes`: the op's output (the fault message names the last writer).
  void* at(const char* op, const char* what, const void* p, std::size_t bytes, bool writes);
  template <typename View>
  View checked(const char* op, const char* what, View t);  // a host-labelled, translated copy of `t`
  // The stream (guard-async): tasks in issue order, numbered from 1.
  struct Task {
    // compute: an op (counted in Counters::ops); transfer: a copy; release: a free, which runs
    // even after a failure (the memory still goes)
    enum Kind { compute, transfer, release };
    const char* op;
    std::int64_t seq;
    Kind kind;
    std::function<void()> run;
  };
  // Runs `task` now (immediate) or queues it on the stream.
  void submit(const char* op, std::function<void()> task, Task::Kind kind = Task::compute);
  // Waits until the stream has run everything issued; reports a failed op (once).
  void wait_stream();
  void count_host_sync();
  void worker();
 public:
  // Called at exit (std::atexit) and by a program's main before it returns: ops still queued are
  // skipped (they would run while the process's statics go), frees run; no error is reported.
  void exit_drain() noexcept;

 private:

  Mode mode_;
  Device device_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Region> buffers_;  // the pointer handed out -> its region
  Counters counters_;
  std::deque<Task> queue_;
  std::condition_variable queued_, drained_;
  std::int64_t issued_ = 0;
  std::atomic<std::int64_t> done_{0};
  std::string error_;  // the first failure on the stream, until reported
  std::int64_t skip_through_ = 0;  // tasks issued before a failure was reported are skipped
  bool stop_ = false;
  bool exiting_ = false;  // exit_drain(): compute and copies are skipped
  std::thread worker_;
};

// The process's guard devices, registered as "guard" and "guard-async". Select one with ScopedBackend.
GuardBackend& guard_backend();
GuardBackend& guard_async_backend();
// Their devices (registered under the same names).
inline Device guard_device() { return guard_backend().device(); }
// Whether `b` is one of the guard devices.
bool is_guard(const Backend& b);

}  // namespace diffcp
