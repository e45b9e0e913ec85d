// The guard device: a test backend (ops/backend.hpp) whose memory the host cannot touch.
//
// Its buffers are host pages kept PROT_NONE (mprotect) except while one of its own ops or copies
// runs, so any host code that reads or writes device memory between ops faults at once (SIGSEGV,
// after a line on stderr naming the guard device; the fault then goes to the previous handler).
// Each buffer ends at the end of its pages, followed by a page that is never opened. Its ops
// forward to the CPU backend, so they compute exactly what the CPU computes; before each, every
// tensor argument is checked to lie inside the bytes one of its buffers was allocated with
// ("guard: gemm: A ... is not guard device memory"), as a GPU would fault on a host pointer; a
// copy refuses guard memory on a side labelled host. A code path that runs on the guard device therefore keeps its data on
// the device and moves it only through the backend's copies. What it cannot show: it runs every op
// at once, on the calling thread, on one device, so stream order, overlap, a host read of a result
// not yet synchronized and a host sync per op all pass here and still matter on a GPU; and it says
// nothing about NCCL's grouping and matching (the rendezvous communicator proves those:
// comm/rendezvous_communicator.hpp). docs/gpu.md says what each double proves.
//
// Host-side op parameters stay on the host, as a GPU backend receives them: the BlockMask, the
// RopeTable and the RoPE positions (a device backend uploads and caches them).
//
// While an op runs, all guard buffers are accessible (not only the op's): host code running on
// another thread during that time is not caught.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

class GuardBackend final : public Backend {
 public:
  GuardBackend();
  const char* name() const override { return "guard"; }
  Device device() const override { return device_; }
  Device device_of(const void* p) const override { return p != nullptr && owns(p, 1) ? device_ : Device::host; }
  bool supports(OpKind op, DType dtype) const override { return cpu_backend().supports(op, dtype); }
  std::string describe(DType dtype) const override;

  void* allocate(std::size_t bytes) override;
  void deallocate(void* p, std::size_t bytes) noexcept override;
  void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) override;

  void gemm(const GemmArgs& args) override;
  void bias_backward(ConstTensorView dy, TensorView db) override;
  void bias_add(TensorView y, ConstTensorView b) override;
  // Packed weights are the CPU backend's (host memory only its kernels read), made from guard memory.
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
  void gather_rows(ConstTensorView src, std::span<const std::int64_t> rows, TensorView dst) override;
  void l1_distance(ConstTensorView a, ConstTensorView b, TensorView out) override;
  void cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target, std::span<double> stats,
                     std::span<const double> weight) override;
  void cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                              std::span<const double> weight, std::span<const double> lse) override;
  double scale_sumsq(TensorView x, double scale) override;
  void synchronize() override;  // counts a host sync (the guard's ops have finished when they return)
  void scatter_rows(ConstTensorView src, std::span<const std::int64_t> rows, TensorView dst) override;

  // What crossed between the host and the device, and how many ops ran (tests read them).
  struct Counters {
    std::int64_t ops = 0;
    std::size_t host_to_device = 0, device_to_host = 0, device_to_device = 0;  // bytes
    // Where a GPU's host would wait for the device (a host sync): a copy into host memory, an op
    // that returns a value or statistics to the host (scale_sumsq, cross_entropy), synchronize().
    std::int64_t host_syncs = 0;
  };
  Counters counters() const;
  // Whether [p, p + bytes) lies inside one live guard buffer.
  bool owns(const void* p, std::size_t bytes) const;

 private:
  class Open;  // makes every buffer accessible for one op or copy (nestable)
  template <typename View>
  View checked(const char* op, const char* what, View t) const;  // a host-labelled copy of `t`, after the range check
  void check_range(const char* op, const char* what, const void* p, std::size_t bytes) const;

  struct Region {
    std::uintptr_t base;  // the mapping: `span` bytes of the buffer's pages, then one page never opened
    std::size_t span, bytes;  // bytes: what was asked for (the range checks use it)
  };
  Device device_ = register_device("guard");
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Region> buffers_;  // the pointer handed out -> its region
  int open_depth_ = 0;
  Counters counters_;
};

// The process's guard device, registered as "guard". Select it with ScopedBackend.
GuardBackend& guard_backend();
// Its device (registered as "guard").
inline Device guard_device() { return guard_backend().device(); }

}  // namespace diffcp
