#include "diffcp/cp/cp_layer.hpp"

#include <utility>

#include "diffcp/cp/cp_common.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

CpAttentionLayer::CpAttentionLayer(Communicator& cp, const AttnLayerConfig& cfg, const char* method, DType compute)
    : comm_(cp), cfg_(cfg), compute_(compute) {
  cfg_.validate();
  DIFFCP_CHECK(compute == DType::f32 || compute == DType::bf16, method, ": compute ", dtype_name(compute),
               ", expected f32 or bf16");
}

void CpAttentionLayer::reshard(CpShard shard) {
  DIFFCP_CHECK(shard.P == comm_.size() && shard.p == comm_.rank(), name(), ": shard is for rank ", shard.p, " of ",
               shard.P, " but the communicator is rank ", comm_.rank(), " of ", comm_.size());
  shard_ = std::move(shard);
  ++generation_;
  backend_ = &active_backend();
  on_reshard();
}

void CpAttentionLayer::check_memory() const {
  const Backend& b = active_backend();
  DIFFCP_CHECK(&b == backend_, name(), ": the active backend is '", b.name(), "', but the layer's buffers were sized on '",
               backend_->name(), "' (reshard() under the backend that runs the layer)");
}

CpSaved CpAttentionLayer::forward(const AttnLayerParams& w, ConstTensorView x_p, ConstTensorView ctx_p, TensorView y_p) {
  const std::int64_t Qp = shard_.own_query_rows(), Cp = shard_.context_rows(), H = cfg_.hidden;
  check_memory();
  const Device device = active_backend().device();
  check_view("x_p", x_p, dtype(), {Qp, H}, device);
  check_view("ctx_p", ctx_p, dtype(), {Cp, H}, device);
  check_view("y_p", y_p, dtype(), {Qp, H}, device);
  CpSaved saved;
  saved.state_ = spare_ ? std::move(spare_) : new_state();
  timings_ = {};
  {
    const ScopedF32GemmCompute precision(compute_);  // bf16: the projections' GEMMs too
    const auto t0 = CpClock::now();
    forward_impl(*saved.state_, w, x_p.ptr<float>(), ctx_p.ptr<float>(), y_p.ptr<float>());
    timings_.fwd_ms = elapsed_ms(t0);
  }
  saved.layer_ = this;
  saved.generation_ = generation_;
  saved.x_p_ = x_p;
  saved.ctx_p_ = ctx_p;
  return saved;
}

std::unique_ptr<CpSavedState> CpAttentionLayer::take_state(CpSaved& saved, const char* what, bool any_generation) const {
  DIFFCP_CHECK(saved.state_ != nullptr, name(), ": ", what,
               "() needs the saved context its forward() returned; this one is empty (default-made, moved from or "
               "already consumed)");
  DIFFCP_CHECK(saved.layer_ == this, name(), ": ", what, "() got a saved context made by another layer's forward()");
  DIFFCP_CHECK(any_generation || saved.generation_ == generation_, name(), ": ", what,
               "() got a saved context of a forward() before the last reshard(); run forward() on the new shard first");
  return std::move(saved.state_);
}

void CpAttentionLayer::backward(CpSaved&& saved, const AttnLayerParams& w, ConstTensorView dy_p, TensorView dx_p,
                                TensorView dctx_p, AttnLayerParams& grad) {
  const std::int64_t Qp = shard_.own_query_rows(), Cp = shard_.context_rows(), H = cfg_.hidden;
  check_memory();
  const Device device = active_backend().device();
  check_view("dy_p", dy_p, dtype(), {Qp, H}, device);
  check_view("dx_p", dx_p, dtype(), {Qp, H}, device);
  check_view("dctx_p", dctx_p, dtype(), {Cp, H}, device);
  std::unique_ptr<CpSavedState> st = take_state(saved, "backward", false);
  {
    const ScopedF32GemmCompute precision(compute_);
    const auto t0 = CpClock::now();
    backward_impl(*st, w, saved.x_p_.ptr<float>(), saved.ctx_p_.ptr<float>(), dy_p.ptr<float>(), dx_p.ptr<float>(),
                  dctx_p.ptr<float>(), grad);
    timings_.bwd_ms = elapsed_ms(t0);
  }
  spare_ = std::move(st);
}

void CpAttentionLayer::discard(CpSaved&& saved) {
  if (!saved) return;
  spare_ = take_state(saved, "discard", true);
}

void allreduce_grads(Communicator& group, AttnLayerParams& grad) {
  group.all_reduce_async(device_view(grad.all()), ReduceOp::sum)->wait();
}

}  // namespace diffcp
