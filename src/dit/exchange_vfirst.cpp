#include "diffcp/dit/exchange_vfirst.hpp"

#include <chrono>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

double VFirstExchange::now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void VFirstExchange::start_v(HeadRows<const float> qkv) {
  check_qkv(qkv);
  DIFFCP_CHECK(!v_p1_, "V-First: start_v() called twice without attention() in between");
  const ExchangeLayout& l = layout();
  const std::int64_t P = size(), hp = l.heads / P, h = hd(), bn = tokens();
  v_send_.resize(P * bn * h);
  // v_send: [P][b n_p][hd]: for destination r, each token's v slice of r's heads (compute dtype;
  // fp8: then encoded into v_wire_, which stays untouched while V's phase 1 flies).
  for (std::int64_t r = 0; r < P; ++r)
    gather_rows(qkv.at(0, 2 * l.heads + r * hp), DType::f32, qkv.rows, qkv.row_stride, l.rows, h,
                compute_at(v_send_.data(), r * bn * h), compute(), h);
  const void* payload = encode(v_send_.data(), P * bn * h, v_wire_);
  v_before_ = counters();
  const double t0 = now_ms();
  v_p1_.emplace(tapa_.phase1_async(tapa_.plan_uniform(wire_count(bn * h)), payload, wire()));
  stats_.comm_ms += now_ms() - t0;
  v_done_ = false;
  ++stats_.v_started;
}

void VFirstExchange::poll() {
  if (!v_p1_ || v_done_) return;
  const double t0 = now_ms();
  v_done_ = v_p1_->test();
  stats_.comm_ms += now_ms() - t0;
}

void VFirstExchange::wait_v() {
  DIFFCP_CHECK(v_p1_.has_value(), "V-First: no V exchange in flight");
  if (v_done_) ++stats_.v_hidden;
  const double t0 = now_ms();
  v_p1_->wait();
  const double dt = now_ms() - t0;
  stats_.v_wait_ms += dt;
  stats_.comm_ms += dt;
  v_done_ = true;
}

void VFirstExchange::pack_qk(HeadRows<const float> qkv, const std::int64_t* rows, std::int64_t count, void* dst) const {
  const ExchangeLayout& l = layout();
  const std::int64_t P = size(), hp = l.heads / P, h = hd();
  DIFFCP_CHECK(rows != nullptr || count == static_cast<std::int64_t>(l.rows.size()), "pack_qk: ", count, " rows of ",
               l.rows.size());
  for (std::int64_t r = 0; r < P; ++r)
    for (std::int64_t c = 0; c < 2; ++c) {
      const float* src = qkv.at(0, c * l.heads + r * hp);
      void* out = compute_at(dst, (r * count * 2 + c) * h);
      if (rows)
        gather_rows(src, DType::f32, qkv.rows, qkv.row_stride, rows, count, h, out, compute(), 2 * h);
      else
        gather_rows(src, DType::f32, qkv.rows, qkv.row_stride, l.rows, h, out, compute(), 2 * h);
    }
}

void VFirstExchange::attention(HeadRows<const float> qkv, HeadRows<float> out) {
  exchange_qkv(qkv, nullptr);
  finish_attention(out);
}

void VFirstExchange::exchange_qkv(HeadRows<const float> qkv, DeviceVector<std::uint8_t>* v_p1_copy) {
  check_qkv(qkv);
  if (!v_p1_) start_v(qkv);
  const std::int64_t P = size(), h = hd(), bn = tokens();
  qk_send_.resize(P * bn * 2 * h);
  qk_recv_.resize(wire_bytes(P * bn * 2 * h));
  v_recv_.resize(wire_bytes(P * bn * h));
  pack_qk(qkv, nullptr, bn, qk_send_.data());
  const void* qk_payload = encode(qk_send_.data(), P * bn * 2 * h, qk_wire_);

  double t0 = now_ms();
  TapaPhase1 qk_p1 = tapa_.phase1_async(tapa_.plan_uniform(wire_count(bn * 2 * h)), qk_payload, wire());
  stats_.comm_ms += now_ms() - t0;
  wait_v();
  if (v_p1_copy) {
    const std::span<const std::byte> staged = v_p1_->output();
    v_p1_copy->resize(static_cast<std::int64_t>(staged.size()));
    copy(v_p1_copy->view(), ConstTensorView::contiguous(staged.data(), DType::u8, {static_cast<std::int64_t>(staged.size())},
                                                        active_device()));
  }
  t0 = now_ms();
  tapa_.phase2(std::move(*v_p1_), v_recv_.data());
  v_p1_.reset();
  tapa_.phase2(std::move(qk_p1), qk_recv_.data());
  stats_.comm_ms += now_ms() - t0;
  count_since(v_before_);
  ++stats_.calls;

  // Head layout [P b n_p][3][hd] in the wire format: q|k from the q|k exchange, v from V's (row
  // copies of bytes); then decoded for attention (fp8).
  void* head = head_qkv_wire();
  const std::int64_t qk = wire_bytes(2 * h), row = wire_bytes(3 * h), v = wire_bytes(h);
  convert_rows(qk_recv_.data(), DType::u8, qk, head, DType::u8, row, P * bn, qk);
  convert_rows(v_recv_.data(), DType::u8, v, wire_at(head, 2 * h), DType::u8, row, P * bn, v);
  decode_head();
}

std::unique_ptr<AttentionExchange> make_vfirst_exchange(Communicator& world, int group_size) {
  return std::make_unique<VFirstExchange>(world, group_size);
}

}  // namespace diffcp
