#include "diffcp/dit/ring_attention.hpp"

#include <chrono>
#include <type_traits>
#include <utility>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/ops/fp8.hpp"

namespace diffcp {

namespace {
constexpr int kTagKV = 0;  // a visiting K|V block (the ring communicator carries nothing else)

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::size_t uz(std::int64_t v) { return static_cast<std::size_t>(v); }
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

RingTraffic RingAttention::forward(std::span<const BlockMask> masks, HeadRows<const float> q, HeadRows<const float> k,
                                   HeadRows<const float> v, HeadRows<float> o, std::span<float> lse, const RingWire* fp8) {
  return forward_t(masks, q, k, v, o, lse, fp8);
}
RingTraffic RingAttention::forward(std::span<const BlockMask> masks, HeadRows<const bf16_t> q, HeadRows<const bf16_t> k,
                                   HeadRows<const bf16_t> v, HeadRows<bf16_t> o, std::span<float> lse, const RingWire* fp8) {
  return forward_t(masks, q, k, v, o, lse, fp8);
}

template <typename T>
RingTraffic RingAttention::forward_t(std::span<const BlockMask> masks, HeadRows<const T> q, HeadRows<const T> k,
                                     HeadRows<const T> v, HeadRows<T> o, std::span<float> lse, const RingWire* fp8) {
  constexpr bool bf16 = std::is_same_v<T, bf16_t>;
  const std::int64_t M = q.rows, h = q.heads, d = q.dim, hd = h * d;
  for (const HeadRows<const T>& t : {k, v, HeadRows<const T>(o)})
    DIFFCP_CHECK(t.rows == M && t.heads == h && t.dim == d, "ring attention: a tensor has shape [", t.rows, ", ",
                 t.heads, ", ", t.dim, "], expected q's [", M, ", ", h, ", ", d, "]");
  const int R = size(), g = rank(), next = (g + 1) % R, prev = (g + R - 1) % R;
  DIFFCP_CHECK(static_cast<int>(masks.size()) == R, "ring attention: ", masks.size(), " masks, expected one per group (", R, ")");
  for (const BlockMask& mask : masks)
    DIFFCP_CHECK(mask.key_rows() == M && static_cast<std::int64_t>(lse.size()) == M * h, "ring attention: mask of ",
                 mask.key_rows(), " key rows and lse of ", lse.size(), ", expected ", M, " and ", M * h);
  const std::size_t count = uz(M * 2 * hd);
  for (auto* b : {&kv_[0], &kv_[1]}) b->resize(static_cast<std::int64_t>(count));
  // What a hop moves: count elements of T, or (fp8) M rows of 2 hd elements as blocks, in bytes.
  const std::int64_t row_bytes = fp8 ? static_cast<std::int64_t>(fp8->wire.bytes(2 * hd)) : 0;
  const std::size_t hop = fp8 ? uz(M * row_bytes) : count;
  const DType hop_t = fp8 ? DType::u8 : dtype_of<T>();
  if (fp8)
    for (auto* b : {&kv_wire_[0], &kv_wire_[1]}) b->resize(M * row_bytes);
  for (auto* b : {&o_run_, &o_part_, &o_tmp_}) b->resize(M * hd);
  for (auto* b : {&lse_run_, &lse_part_, &lse_tmp_}) b->resize(M * h);
  if (bf16) o16_.resize(M * hd);
  const auto view = [&](DeviceVector<float>& b) { return HeadRows<float>{b.data(), M, h, d, hd}; };
  const auto kv = [&](int i) { return reinterpret_cast<T*>(kv_[i].data()); };
  // This group's K|V, one contiguous message: kv[i] = [k row i | v row i], [M][2][hd] (row copies;
  // fp8: the blocks' rows, [M] rows of row_bytes).
  if (fp8) {
    convert_rows(fp8->kv, DType::u8, fp8->ld, kv_wire_[0].data(), DType::u8, row_bytes, M, row_bytes);
  } else {
    convert_rows(k.data, dtype_of<T>(), k.row_stride, kv(0), dtype_of<T>(), 2 * hd, M, hd);
    convert_rows(v.data, dtype_of<T>(), v.row_stride, kv(0) + hd, dtype_of<T>(), 2 * hd, M, hd);
  }
  const auto hop_buf = [&](int i) -> void* { return fp8 ? static_cast<void*>(kv_wire_[i].data()) : static_cast<void*>(kv(i)); };
  // The partial (o, lse) of q against the K|V `kt`, `vt` into f32 `o32`, `l32` (bf16: widened).
  const auto partial = [&](const BlockMask& mask, HeadRows<const T> kt, HeadRows<const T> vt, DeviceVector<float>& o32, DeviceVector<float>& l32) {
    if constexpr (bf16) {
      attention_forward(mask, q, kt, vt, HeadRows<bf16_t>{o16_.data(), M, h, d, hd}, l32);
      convert(o16_.data(), o32.data(), M * hd);
    } else {
      attention_forward(mask, q, kt, vt, view(o32), l32);
    }
  };
  RingTraffic traffic;
  int cur = 0;
  for (int t = 0; t < R; ++t) {
    WorkPtr send, recv;
    if (t + 1 < R) {  // group g-t-1's block flies while group g-t's is computed
      const double t0 = now_ms();
      recv = ring_->recv_async(hop_buf(1 - cur), hop, hop_t, prev, kTagKV);
      send = ring_->send_async(hop_buf(cur), hop, hop_t, next, kTagKV);
      traffic.comm_ms += now_ms() - t0;
      traffic.bytes += hop * dtype_size(hop_t);
      ++traffic.messages;
    }
    // fp8: the visiting blocks decoded into kv_[0] ([M][2][hd] of T) while the next ones fly.
    const int at = fp8 ? 0 : cur;
    if (fp8) fp8_decode(kv_wire_[cur].data(), M * 2 * h, d, kv(0), dtype_of<T>());
    const HeadRows<const T> kt{kv(at), M, h, d, 2 * hd}, vt{kv(at) + hd, M, h, d, 2 * hd};
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
      } else if constexpr (bf16) {  // the merged output rounded once
        lse_merge(o_parts, lse_parts, view(o_tmp_), lse);
        convert_rows(o_tmp_.data(), DType::f32, hd, o.data, DType::bf16, o.row_stride, M, hd);
      } else {
        lse_merge(o_parts, lse_parts, o, lse);  // the last partial merges straight into the output
      }
    }
    if (send) {
      const double t0 = now_ms();
      recv->wait();
      send->wait();
      traffic.comm_ms += now_ms() - t0;
      cur = 1 - cur;
    }
  }
  return traffic;
}

}  // namespace diffcp
