#include "diffcp/dit/ring_attention.hpp"

#include <chrono>
#include <utility>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/ops/fp8.hpp"

namespace diffcp {

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::uint64_t ring_kv_bytes(int R, std::int64_t tokens_p, std::int64_t hidden, DType payload) {
  DIFFCP_CHECK(R >= 1 && tokens_p >= 0 && hidden >= 0, "ring_kv_bytes: R = ", R, ", tokens_p = ", tokens_p,
               ", hidden = ", hidden, "; expected R >= 1, the others >= 0");
  return ring_kv_bytes(R, tokens_p, hidden, WireFormat{payload, Wire::compute, 1});
}

std::uint64_t ring_kv_bytes(int R, std::int64_t tokens_p, std::int64_t hidden, const WireFormat& wire) {
  DIFFCP_CHECK(R >= 1 && tokens_p >= 0 && hidden >= 0, "ring_kv_bytes: R = ", R, ", tokens_p = ", tokens_p,
               ", hidden = ", hidden, "; expected R >= 1, the others >= 0");
  return static_cast<std::uint64_t>(R - 1) * static_cast<std::uint64_t>(tokens_p) * wire.bytes(2 * hidden);
}


RingAttention::RingAttention(std::unique_ptr<Communicator> ring) : ring_(std::move(ring)) {
  DIFFCP_CHECK(ring_ != nullptr, "ring attention: no ring communicator");
}

RingTraffic RingAttention::forward(std::span<const BlockMask> masks, ConstTensorView q, ConstTensorView k,
                                   ConstTensorView v, TensorView o, std::span<float> lse, const RingWire* fp8) {
  const DType T = q.dtype;
  DIFFCP_CHECK(q.rank == 3, "ring attention: q is ", q.describe(), ", expected [M, h_p, d_h]");
  const std::int64_t M = q.shape[0], h = q.shape[1], d = q.shape[2], hd = h * d;
  for (const ConstTensorView& t : {k, v, ConstTensorView(o)})
    DIFFCP_CHECK(t.rank == 3 && t.shape[0] == M && t.shape[1] == h && t.shape[2] == d && t.dtype == T,
                 "ring attention: a tensor is ", t.describe(), ", expected q's ", q.describe());
  const int R = size(), g = rank(), next = (g + 1) % R, prev = (g + R - 1) % R;
  DIFFCP_CHECK(static_cast<int>(masks.size()) == R, "ring attention: ", masks.size(), " masks, expected one per group (", R, ")");
  for (const BlockMask& mask : masks)
    DIFFCP_CHECK(mask.key_rows() == M && static_cast<std::int64_t>(lse.size()) == M * h, "ring attention: mask of ",
                 mask.key_rows(), " key rows and lse of ", lse.size(), ", expected ", M, " and ", M * h);
  const std::int64_t count = M * 2 * hd;
  for (auto* b : {&kv_[0], &kv_[1]}) b->resize(T, count);
  // What a hop moves: count elements of T, or (fp8) M rows of 2 hd elements as blocks, in bytes.
  const std::int64_t row_bytes = fp8 ? static_cast<std::int64_t>(fp8->wire.bytes(2 * hd)) : 0;
  if (fp8)
    for (auto* b : {&kv_wire_[0], &kv_wire_[1]}) b->resize(M * row_bytes);
  for (auto* b : {&o_run_, &o_part_, &o_tmp_}) b->resize(M * hd);
  for (auto* b : {&lse_run_, &lse_part_, &lse_tmp_}) b->resize(M * h);
  const auto view = [&](DeviceVector<float>& b) { return HeadRows<float>{b.data(), M, h, d, hd}; };
  // This group's K|V, one contiguous message: kv[i] = [k row i | v row i], [M][2][hd] (row copies;
  // fp8: the blocks' rows, [M] rows of row_bytes).
  if (fp8) {
    convert_rows(fp8->kv, DType::u8, fp8->ld, kv_wire_[0].data(), DType::u8, row_bytes, M, row_bytes);
  } else {
    convert_rows(k.data, T, k.stride[0], kv_[0].view().data, T, 2 * hd, M, hd);
    convert_rows(v.data, T, v.stride[0], head_view(kv_[0].view(), M, h, d, hd, 2 * hd).data, T, 2 * hd, M, hd);
  }
  const auto hop_buf = [&](int i) { return fp8 ? kv_wire_[i].view() : kv_[i].view(); };
  // The partial (o, lse) of q against the K|V `kt`, `vt` into f32 `o32`, `l32` (computed in T).
  const auto partial = [&](const BlockMask& mask, ConstTensorView kt, ConstTensorView vt, DeviceVector<float>& o32,
                           DeviceVector<float>& l32) {
    const TensorView o_c = compute_out(o32.view(), T, o_c_);
    attention_forward(mask, q, kt, vt, head_view(o_c, M, h, d), l32);
    from_compute(o_c, o32.view());
  };
  RingTraffic traffic;
  int cur = 0;
  for (int t = 0; t < R; ++t) {
    WorkPtr hop;
    if (t + 1 < R) {  // group g-t-1's block flies while group g-t's is computed: one hop
      const double t0 = now_ms();
      const Communicator::P2pOp ops[] = {Communicator::P2pOp::send(hop_buf(cur), next),
                                         Communicator::P2pOp::recv(hop_buf(1 - cur), prev)};
      hop = ring_->exchange_async(ops);
      traffic.comm_ms += now_ms() - t0;
      traffic.bytes += static_cast<std::uint64_t>(hop_buf(cur).numel()) * hop_buf(cur).element_size();
      ++traffic.messages;
    }
    // fp8: the visiting blocks decoded into kv_[0] ([M][2][hd] of T) while the next ones fly.
    const int at = fp8 ? 0 : cur;
    if (fp8) fp8_decode(kv_wire_[cur].data(), M * 2 * h, d, kv_[0].view().data, T);
    const ConstTensorView kt = head_view(kv_[at].view(), M, h, d, 0, 2 * hd), vt = head_view(kv_[at].view(), M, h, d, hd, 2 * hd);
    const BlockMask& mask = masks[static_cast<std::size_t>((g - t + R) % R)];  // group g - t's keys
    if (R == 1) {
      attention_forward(mask, q, kt, vt, o, lse);
    } else if (t == 0) {
      partial(mask, kt, vt, o_run_, lse_run_);
    } else {
      partial(mask, kt, vt, o_part_, lse_part_);
      const HeadRows<const float> o_parts[] = {view(o_run_), view(o_part_)};
      const std::span<const float> lse_parts[] = {lse_run_, lse_part_};
      if (t + 1 < R) {
        lse_merge(o_parts, lse_parts, view(o_tmp_), lse_tmp_);
        std::swap(o_run_, o_tmp_);
        std::swap(lse_run_, lse_tmp_);
      } else {  // the last merge, in f32, then the output's rows (rounded once in bf16)
        lse_merge(o_parts, lse_parts, view(o_tmp_), lse);
        convert_rows(o_tmp_.data(), DType::f32, hd, o.data, T, o.stride[0], M, hd);
      }
    }
    if (hop) {
      const double t0 = now_ms();
      hop->wait();
      traffic.comm_ms += now_ms() - t0;
      cur = 1 - cur;
    }
  }
  return traffic;
}

}  // namespace diffcp
