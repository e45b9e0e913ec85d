#include "diffcp/dit/exchange.hpp"

#include <algorithm>
#include <chrono>

#include "diffcp/attention/attention.hpp"
#include "diffcp/comm/tapa.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/ops/fp8.hpp"

namespace diffcp {

ExchangeMode parse_exchange_mode(const std::string& name) {
  if (name == "flat") return ExchangeMode::flat;
  if (name == "tapa") return ExchangeMode::tapa;
  if (name == "vfirst") return ExchangeMode::vfirst;
  if (name == "cocodiff") return ExchangeMode::cocodiff;
  DIFFCP_FAIL("`mode` '", name, "': unknown mode, expected flat, tapa, vfirst or cocodiff");
}

const char* exchange_mode_name(ExchangeMode mode) {
  switch (mode) {
    case ExchangeMode::flat: return "flat";
    case ExchangeMode::tapa: return "tapa";
    case ExchangeMode::vfirst: return "vfirst";
    case ExchangeMode::cocodiff: return "cocodiff";
  }
  return "?";
}

AttentionExchange::AttentionExchange(ExchangeMode mode, int rank, int P, int L)
    : mode_(mode), p_(rank), P_(P), L_(L), link_L_(L) {}

void AttentionExchange::set_layout(ExchangeLayout layout) {
  const std::int64_t b = layout.batch, n = layout.tokens_p;
  DIFFCP_CHECK(b >= 1 && n >= 1 && layout.heads >= 1 && layout.head_dim >= 1, "attention exchange: batch = ", b,
               ", tokens_p = ", n, ", heads = ", layout.heads, ", head_dim = ", layout.head_dim, "; expected all >= 1");
  DIFFCP_CHECK(layout.heads % P_ == 0, "attention exchange: P = ", P_, " ranks do not divide the ", layout.heads,
               " heads", ring_ ? " (P here: the Ulysses degree U of USP)" : "");
  DIFFCP_CHECK(static_cast<std::int64_t>(layout.rows.size()) == b * n, "attention exchange: ", layout.rows.size(),
               " row indices, expected batch * tokens_p = ", b * n);
  for (const std::int64_t r : layout.rows)
    DIFFCP_CHECK(r >= 0 && r < layout.local_rows, "attention exchange: local row ", r, " outside [0, ",
                 layout.local_rows, ")");
  const std::int64_t P_seq = seq_size();
  DIFFCP_CHECK(layout.valid.empty() || static_cast<std::int64_t>(layout.valid.size()) == P_seq,
               "attention exchange: ", layout.valid.size(), " valid counts, expected one per rank (", P_seq, ")");
  if (layout.valid.empty()) layout.valid.assign(static_cast<std::size_t>(P_seq), n);
  std::int64_t any = 0;
  for (const std::int64_t v : layout.valid) {
    DIFFCP_CHECK(v >= 0 && v <= n, "attention exchange: ", v, " valid tokens of a rank, expected [0, ", n, "]");
    any += v;
  }
  DIFFCP_CHECK(any > 0, "attention exchange: no rank holds a real token");
  layout_ = std::move(layout);

  // One query block per (source rank r, image j), n_p rows each, in the order the all-to-all
  // delivers them; image j's keys are the P segments (r, j) of the group's ranks' real tokens,
  // placed at positions [j N, (j+1) N) (padding rows lie in no segment).
  const std::int64_t N = P_ * n;
  masks_.clear();
  for (int g = 0; g < ring_degree(); ++g) {
    std::vector<ContextSegment> segments;
    std::vector<MaskBlock> blocks;
    for (std::int64_t r = 0; r < P_; ++r)
      for (std::int64_t j = 0; j < b; ++j) {
        const std::int64_t v = layout_.valid[static_cast<std::size_t>(g * P_ + r)];
        if (v > 0) segments.push_back({(r * b + j) * n, j * N + r * n, v});
        blocks.push_back({j * N, (j + 1) * N, -1});
      }
    masks_.emplace_back(n, head_rows(), std::move(segments), std::move(blocks));
  }

  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  send_.resize(sz(head_rows() * 3 * hd()));
  qkv_head_.resize(send_.size());
  o_head_.resize(sz(head_rows() * hd()));
  o_recv_.resize(o_head_.size());
  lse_.resize(sz(head_rows() * layout_.heads / P_));
}

const BlockMask& AttentionExchange::mask(int g) const {
  DIFFCP_CHECK(!masks_.empty(), "attention exchange: set_layout() was not called");
  DIFFCP_CHECK(g >= 0 && g < ring_degree(), "attention exchange: group ", g, " of ", ring_degree());
  return masks_[static_cast<std::size_t>(g)];
}

void AttentionExchange::timed_all_to_all(const void* send, void* recv, std::size_t count) {
  const auto t0 = std::chrono::steady_clock::now();
  all_to_all(send, recv, count);
  stats_.comm_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.calls;
}

void AttentionExchange::check_qkv(HeadRows<const float> qkv) const {
  mask();  // layout set
  const ExchangeLayout& l = layout_;
  DIFFCP_CHECK(qkv.rows == l.local_rows && qkv.heads == 3 * l.heads && qkv.dim == l.head_dim,
               "attention exchange: qkv has shape [", qkv.rows, ", ", qkv.heads, ", ", qkv.dim, "], expected [",
               l.local_rows, ", ", 3 * l.heads, ", ", l.head_dim, "]");
}

void AttentionExchange::seq_to_head(HeadRows<const float> qkv) {
  check_qkv(qkv);
  const ExchangeLayout& l = layout_;
  const std::int64_t hp = l.heads / P_, h = hd(), bn = l.batch * l.tokens_p;
  // send: [P][b n_p][3][hd]: for destination r, each token's q, k, v slices of r's heads (a row
  // gather per (r, c), rounded to the compute dtype; fp8: then encoded).
  for (std::int64_t r = 0; r < P_; ++r)
    for (std::int64_t c = 0; c < 3; ++c)
      gather_rows(qkv.at(0, c * l.heads + r * hp), DType::f32, qkv.rows, qkv.row_stride, l.rows, h,
                  compute_at(send_.data(), (r * bn * 3 + c) * h), compute_, 3 * h);
  const std::int64_t all = P_ * bn * 3 * h;
  timed_all_to_all(encode(send_.data(), all, send_wire_), head_qkv_wire(), static_cast<std::size_t>(bn * 3 * h));
  decode_head();
}

const void* AttentionExchange::encode(const void* x, std::int64_t elements, DeviceVector<std::uint8_t>& enc) const {
  if (wire_ != Wire::fp8) return x;
  const std::int64_t d = wire_format().head_dim;
  enc.resize(wire_bytes(elements));
  fp8_encode(x, compute_, elements / d, d, enc.data());
  return enc.data();
}

const void* AttentionExchange::decode(const void* w, std::int64_t elements, DeviceVector<std::uint8_t>& dec) const {
  if (wire_ != Wire::fp8) return w;
  dec.resize(elements * static_cast<std::int64_t>(dtype_size(compute_)));
  decode_to(w, elements, dec.data());
  return dec.data();
}

void AttentionExchange::decode_to(const void* w, std::int64_t elements, void* x) const {
  const std::int64_t d = wire_format().head_dim;
  fp8_decode(w, elements / d, d, x, compute_);
}

void* AttentionExchange::head_qkv_wire() {
  if (wire_ != Wire::fp8) return qkv_head_.data();
  qkv_wire_.resize(wire_bytes(head_rows() * 3 * hd()));
  return qkv_wire_.data();
}

void AttentionExchange::decode_head(const void* from) {
  const std::int64_t all = head_rows() * 3 * hd();
  if (wire_ == Wire::fp8) {
    head_wire_src_ = from ? from : qkv_wire_.data();  // what the ring hops carry (V-Major: this layer's cache)
    decode_to(head_wire_src_, all, qkv_head_.data());
  } else if (from && from != qkv_head_.data()) {
    const std::int64_t bytes = all * static_cast<std::int64_t>(dtype_size(compute_));
    copy(TensorView::contiguous(qkv_head_.data(), DType::u8, {bytes}, active_device()),
         ConstTensorView::contiguous(from, DType::u8, {bytes}, active_device()));
  }
}

void AttentionExchange::head_to_seq(HeadRows<float> out) {
  const ExchangeLayout& l = layout_;
  DIFFCP_CHECK(out.rows == l.local_rows && out.heads == l.heads && out.dim == l.head_dim,
               "attention exchange: out has shape [", out.rows, ", ", out.heads, ", ", out.dim, "], expected [",
               l.local_rows, ", ", l.heads, ", ", l.head_dim, "]");
  const std::int64_t hp = l.heads / P_, h = hd(), bn = l.batch * l.tokens_p;
  // o rows of source rank r are contiguous in head layout: block r goes back to rank r.
  const std::int64_t all = P_ * bn * h;
  const bool fp8 = wire_ == Wire::fp8;
  if (fp8) o_recv_wire_.resize(wire_bytes(all));
  timed_all_to_all(encode(o_head_.data(), all, send_wire_), fp8 ? static_cast<void*>(o_recv_wire_.data()) : o_recv_.data(),
                   static_cast<std::size_t>(bn * h));
  if (fp8) decode_to(o_recv_wire_.data(), all, o_recv_.data());
  // o_recv: [P][b n_p][hd] in the compute dtype: from rank r, this rank's tokens' outputs of r's
  // heads (a row scatter per r, widened to f32).
  for (std::int64_t r = 0; r < P_; ++r)
    scatter_rows(compute_at(o_recv_.data(), r * bn * h), compute_, h, l.rows, h, out.at(0, r * hp), DType::f32, out.rows,
                 out.row_stride);
}

void AttentionExchange::set_compute(DType compute) {
  DIFFCP_CHECK(compute == DType::f32 || compute == DType::bf16, "attention exchange: compute ", dtype_name(compute),
               ", expected f32 or bf16");
  check_wire_supported(wire_, compute);
  compute_ = compute;
}

void AttentionExchange::set_wire(Wire w) {
  check_wire_supported(w, compute_);
  wire_ = w;
}

void AttentionExchange::attend() {
  const std::int64_t M = head_rows(), hp = layout_.heads / P_, d = layout_.head_dim, h = hd();
  const Device dev = active_device();
  const ConstTensorView qkv = ConstTensorView::contiguous(qkv_head_.data(), compute_, {M * 3 * h}, dev);
  const ConstTensorView q = head_view(qkv, M, hp, d, 0, 3 * h), k = head_view(qkv, M, hp, d, h, 3 * h),
                        v = head_view(qkv, M, hp, d, 2 * h, 3 * h);
  const TensorView o = head_view(TensorView::contiguous(o_head_.data(), compute_, {M * h}, dev), M, hp, d);
  if (!ring_) {
    attention_forward(mask(), q, k, v, o, lse_);
    return;
  }
  // fp8: the hops carry the K|V blocks as received (columns k|v of the wire head layout decode_head()
  // read: the exchange's, or V-Major's cache of this layer on a selective step).
  DIFFCP_CHECK(wire_ != Wire::fp8 || head_wire_src_ != nullptr, "attention exchange: fp8 ring hops before decode_head()");
  const RingWire kv_wire{wire_at(head_wire_src_, h), wire_bytes(3 * h), wire_format()};
  const RingTraffic t = ring_->forward(masks_, q, k, v, o, lse_, wire_ == Wire::fp8 ? &kv_wire : nullptr);
  (ring_intra_ ? stats_.bytes_intra : stats_.bytes_inter) += t.bytes;
  stats_.ring_bytes += t.bytes;
  stats_.scale_bytes += wire_format().scale_share(t.bytes);
  stats_.messages += t.messages;
  stats_.comm_ms += t.comm_ms;
}

void AttentionExchange::finish_attention(HeadRows<float> out) {
  attend();
  head_to_seq(out);
}

void AttentionExchange::attention(HeadRows<const float> qkv, HeadRows<float> out) {
  seq_to_head(qkv);
  finish_attention(out);
}

namespace {
std::unique_ptr<AttentionExchange> make_mode_exchange(ExchangeMode mode, Communicator& comm, int L,
                                                      const CacheSchedule& schedule) {
  switch (mode) {
    case ExchangeMode::flat: return make_flat_exchange(comm, L);
    case ExchangeMode::tapa: return make_tapa_exchange(comm, L);
    case ExchangeMode::vfirst: return make_vfirst_exchange(comm, L);
    case ExchangeMode::cocodiff: return make_vmajor_exchange(comm, L, schedule);
  }
  DIFFCP_FAIL("attention exchange: unknown mode ", static_cast<int>(mode));
}
}  // namespace


ExchangeStats& ExchangeStats::operator+=(const ExchangeStats& o) {
  bytes_intra += o.bytes_intra;
  bytes_inter += o.bytes_inter;
  messages += o.messages;
  ring_bytes += o.ring_bytes;
  scale_bytes += o.scale_bytes;
  calls += o.calls;
  comm_ms += o.comm_ms;
  v_started += o.v_started;
  v_hidden += o.v_hidden;
  v_wait_ms += o.v_wait_ms;
  selective += o.selective;
  full += o.full;
  return *this;
}

std::unique_ptr<AttentionExchange> make_attention_exchange(ExchangeMode mode, Communicator& world, int group_size,
                                                           const CacheSchedule& schedule, int ulysses_degree) {
  DIFFCP_CHECK(group_size >= 0, "`group_size` = ", group_size, ", expected >= 1 (or 0: the ranks of a node)");
  schedule.validate();
  const int P = world.size(), U = ulysses_degree == 0 ? P : ulysses_degree;
  DIFFCP_CHECK(U >= 1 && P % U == 0, "`ulysses_degree` U = ", U, " does not divide P = ", P, " ranks");
  const int L = group_size == 0 ? node_local_group_size(world) : group_size;
  DIFFCP_CHECK(P % L == 0, "`group_size` L = ", L, " does not divide P = ", P, " ranks (groups of L consecutive ranks)");
  if (U == P) return make_mode_exchange(mode, world, L, schedule);

  // USP (dit/usp.hpp): Ulysses inside each group of U consecutive ranks, Ring across the groups.
  const int Lu = usp_ulysses_group_size(L, U);
  UspGroups groups = make_usp_groups(world, U);
  std::unique_ptr<AttentionExchange> ex = make_mode_exchange(mode, *groups.ulysses, Lu, schedule);
  ex->ulysses_comm_ = std::move(groups.ulysses);
  ex->ring_ = std::make_unique<RingAttention>(std::move(groups.ring));
  ex->ring_intra_ = ring_next_in_group(world.rank(), U, P / U, L);
  ex->link_L_ = L;
  return ex;
}

int node_local_group_size(Communicator& world) {
  // TAPA's node-local constructor already checks equal node sizes and consecutive ranks on every
  // rank alike; its sub-communicators are simply dropped.
  return TapaAllToAll::node_local(world).group_size();
}

}  // namespace diffcp
