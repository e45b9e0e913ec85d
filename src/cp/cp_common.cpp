#include "diffcp/cp/cp_common.hpp"

#include <algorithm>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/rmsnorm.hpp"

namespace diffcp {

namespace {
// Row chunks of a projection that overlaps a nonblocking operation (see OwnRows::project_kv).
constexpr int kPollChunks = 8;

// y[M, N] = x[M, K] W[K, N], polling `inflight` (may be null) between row chunks.
void linear_polled(const float* x, std::int64_t M, std::int64_t K, const float* W, std::int64_t N, float* y,
                   Work* inflight) {
  const std::int64_t chunk = std::max<std::int64_t>(1, (M + kPollChunks - 1) / kPollChunks);
  for (std::int64_t r0 = 0; r0 < M; r0 += chunk) {
    linear_forward(x + r0 * K, std::min(chunk, M - r0), K, W, N, y + r0 * N);
    if (inflight) inflight->test();
  }
}
void poll(Work* inflight) {
  if (inflight) inflight->test();
}
}  // namespace

std::int64_t KeyRows::rows(std::int64_t B) const {
  std::int64_t n = blocks.size() * B;
  for (const PosRange& c : chunks) n += c.end - c.begin;
  return n;
}

std::vector<Shard> block_ranges(const CpShard& s) {
  std::vector<Shard> out;
  std::int64_t begin = 0;
  for (std::int64_t rows : s.query_rows) {
    DIFFCP_CHECK(rows % s.batch.block == 0, "shard: ", rows, " query rows is not a multiple of B = ", s.batch.block);
    out.push_back({begin, begin + rows / s.batch.block});
    begin = out.back().end;
  }
  DIFFCP_CHECK(static_cast<int>(out.size()) == s.P && begin == s.batch.num_blocks() &&
                   out[static_cast<std::size_t>(s.p)].begin == s.blocks.begin &&
                   out[static_cast<std::size_t>(s.p)].end == s.blocks.end,
               "shard: query_rows of ", out.size(), " ranks cover ", begin, " of N = ", s.batch.num_blocks(),
               " blocks or disagree with rank ", s.p, "'s blocks [", s.blocks.begin, ", ", s.blocks.end, ")");
  return out;
}

KeyRows own_key_rows(const CpShard& s) { return {s.chunks, s.blocks}; }

std::vector<KeyRows> gather_key_rows(Communicator& cp, const CpShard& s) {
  const std::size_t P = static_cast<std::size_t>(cp.size());
  // The chunk lists: host metadata.
  std::vector<std::int64_t> mine;  // begin, end of each chunk
  for (const PosRange& c : s.chunks) mine.insert(mine.end(), {c.begin, c.end});
  std::vector<std::int64_t> n_mine{static_cast<std::int64_t>(mine.size())}, n_all(P);
  cp.all_gather_async(view_of(n_mine, {1}), view_of(n_all, {cp.size()}))->wait();
  std::vector<std::size_t> counts(n_all.begin(), n_all.end());
  std::size_t total = 0;
  for (std::size_t c : counts) total += c;
  std::vector<std::int64_t> all(total);
  cp.all_gather_v_async(view_of(std::span<const std::int64_t>(mine)), view_of(std::span<std::int64_t>(all)), counts)
      ->wait();
  const std::vector<Shard> blocks = block_ranges(s);
  std::vector<KeyRows> out(P);
  std::size_t at = 0;
  for (std::size_t r = 0; r < P; ++r) {
    for (std::size_t j = 0; j < counts[r]; j += 2) out[r].chunks.push_back({all[at + j], all[at + j + 1]});
    at += counts[r];
    out[r].blocks = blocks[r];
  }
  return out;
}

BlockMask cross_mask(const PackedBatch& batch, Shard queries, std::span<const KeyRows> keys, KeyWindow window) {
  const std::int64_t B = batch.block;
  const auto refs = batch.blocks();
  std::vector<MaskBlock> blocks;
  for (std::int64_t i = queries.begin; i < queries.end; ++i)
    blocks.push_back({refs[static_cast<std::size_t>(i)].sample_start, refs[static_cast<std::size_t>(i)].anchor, -1});
  std::vector<ContextSegment> segments;
  std::int64_t row = 0;
  for (const KeyRows& k : keys) {
    for (const PosRange& c : k.chunks) {
      segments.push_back({row, c.begin, c.end - c.begin});
      row += c.end - c.begin;
    }
    for (std::int64_t i = k.blocks.begin; i < k.blocks.end; ++i, row += B)
      if (queries.begin <= i && i < queries.end) blocks[static_cast<std::size_t>(i - queries.begin)].own_row = row;
  }
  return BlockMask(B, row, std::move(segments), std::move(blocks), window);
}

void merge_two(HeadRows<const float> o_a, std::span<const float> lse_a, HeadRows<const float> o_b,
               std::span<const float> lse_b, HeadRows<float> o_out, std::span<float> lse_out) {
  const HeadRows<const float> o_parts[] = {o_a, o_b};
  const std::span<const float> lse_parts[] = {lse_a, lse_b};
  lse_merge(o_parts, lse_parts, o_out, lse_out);
}

void pack_head_slices(std::span<const float* const> src, std::int64_t rows, std::int64_t P, std::int64_t hd,
                      float* dst) {
  const std::int64_t n = static_cast<std::int64_t>(src.size()), width = P * hd;
  for (std::int64_t r = 0; r < P; ++r)  // slice r of src[j]: [rows, hd] (row stride width) -> rows of stride n*hd
    for (std::int64_t j = 0; j < n; ++j)
      convert_rows(src[static_cast<std::size_t>(j)] + r * hd, DType::f32, width, dst + (r * rows * n + j) * hd, DType::f32,
                   n * hd, rows, hd);
}

void unpack_head_slices(const float* src, std::int64_t rows, std::int64_t P, std::int64_t hd,
                        std::span<float* const> dst) {
  const std::int64_t n = static_cast<std::int64_t>(dst.size()), width = P * hd;
  for (std::int64_t r = 0; r < P; ++r)
    for (std::int64_t j = 0; j < n; ++j)
      convert_rows(src + (r * rows * n + j) * hd, DType::f32, n * hd, dst[static_cast<std::size_t>(j)] + r * hd, DType::f32,
                   width, rows, hd);
}

// ---- OwnRows ----

void OwnRows::reshard(const AttnLayerConfig& cfg, const CpShard& s, std::int64_t padded_key_rows) {
  cfg_ = cfg;
  Qp_ = s.own_query_rows();
  Cp_ = s.context_rows();
  Lk_ = padded_key_rows > 0 ? padded_key_rows : Lp();
  DIFFCP_CHECK(Lk_ >= Lp(), "OwnRows: padded key rows ", Lk_, " < real key rows ", Lp());
  query_pos_ = s.block_positions();
  key_pos_ = s.context_positions();
  key_pos_.insert(key_pos_.end(), query_pos_.begin(), query_pos_.end());
  const auto& len = s.batch.lengths;
  const std::int64_t max_len = *std::max_element(len.begin(), len.end());
  if (rope_.d_h() != cfg_.d_h || rope_.max_pos() < max_len) rope_ = RopeTable(cfg_.d_h, cfg_.rope_theta, max_len);
}

float* OwnRows::grow(DeviceVector<float>& v, std::int64_t n) {
  if (v.resize(n)) ++allocations_;
  return v.data();
}

void OwnRows::project_q(const AttnLayerParams& w, const float* x_p, OwnActivations& a) {
  using Params = AttnLayerParams;
  const std::int64_t qw = cfg_.q_width(), kvw = cfg_.kv_width();
  grow(a.q_lin, Qp_ * qw);
  grow(a.q, Qp_ * qw);
  grow(a.q_rstd, Qp_ * cfg_.n_q);
  grow(a.k_lin, Lk_ * kvw);
  grow(a.k_rstd, Lk_ * cfg_.n_kv);
  grow(a.kv, 2 * Lk_ * kvw);
  grow(a.o, Qp_ * qw);
  grow(a.lse, Qp_ * cfg_.n_q);
  linear_forward(x_p, Qp_, cfg_.hidden, w[Params::wq], qw, a.q_lin.data());
  rmsnorm_forward(a.q_lin.data(), Qp_, cfg_.n_q, cfg_.d_h, w[Params::q_norm], static_cast<float>(cfg_.rms_eps), a.q.data(),
                  a.q_rstd.data());
  rope_apply(a.q.data(), Qp_, cfg_.n_q, query_pos_, rope_, false);
}

void OwnRows::project_kv(const AttnLayerParams& w, const float* x_p, const float* ctx_p, OwnActivations& a,
                         Work* inflight) {
  using Params = AttnLayerParams;
  const std::int64_t H = cfg_.hidden, kvw = cfg_.kv_width(), Lp = this->Lp();
  float* k = a.kv.data();
  float* v = a.kv.data() + Lk_ * kvw;
  float* k_lin = a.k_lin.data();
  linear_polled(ctx_p, Cp_, H, w[Params::wk], kvw, k_lin, inflight);
  linear_polled(x_p, Qp_, H, w[Params::wk], kvw, k_lin + Cp_ * kvw, inflight);
  linear_polled(ctx_p, Cp_, H, w[Params::wv], kvw, v, inflight);
  linear_polled(x_p, Qp_, H, w[Params::wv], kvw, v + Cp_ * kvw, inflight);
  fill(k + Lp * kvw, (Lk_ - Lp) * kvw, 0.f);  // padding rows: zero, and masked
  fill(v + Lp * kvw, (Lk_ - Lp) * kvw, 0.f);
  rmsnorm_forward(k_lin, Lp, cfg_.n_kv, cfg_.d_h, w[Params::k_norm], static_cast<float>(cfg_.rms_eps), k, a.k_rstd.data());
  poll(inflight);
  rope_apply(k, Lp, cfg_.n_kv, key_pos_, rope_, false);
}

void OwnRows::output_forward(const AttnLayerParams& w, const OwnActivations& a, float* y_p) const {
  using Params = AttnLayerParams;
  const std::int64_t H = cfg_.hidden;
  linear_forward(a.o.data(), Qp_, cfg_.q_width(), w[Params::wo], H, y_p);
  bias_add(y_p, Qp_, H, w[Params::bo]);
}

void OwnRows::output_backward(const AttnLayerParams& w, const OwnActivations& a, const float* dy_p,
                              AttnLayerParams& grad, bool with_delta) {
  using Params = AttnLayerParams;
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width();
  grow(dout_, Qp_ * qw);
  grow(delta_, Qp_ * cfg_.n_q);
  bias_backward(dy_p, Qp_, H, grad[Params::bo]);
  linear_backward_weight(a.o.data(), Qp_, qw, dy_p, H, grad[Params::wo]);
  linear_backward_input(dy_p, Qp_, H, w[Params::wo], qw, dout_.data());
  if (with_delta)
    attention_delta(head_view(dout_.data(), Qp_, cfg_.n_q, cfg_.d_h), head_view(a.o.data(), Qp_, cfg_.n_q, cfg_.d_h),
                    delta_);
}

void OwnRows::backward_q(const AttnLayerParams& w, const OwnActivations& a, const float* x_p, float* dq_p, float* dx_p,
                         float beta, AttnLayerParams& grad) {
  using Params = AttnLayerParams;
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width();
  rope_apply(dq_p, Qp_, cfg_.n_q, query_pos_, rope_, true);
  rmsnorm_backward(dq_p, a.q_lin.data(), a.q_rstd.data(), Qp_, cfg_.n_q, cfg_.d_h, w[Params::q_norm], dq_p, grad[Params::q_norm]);
  linear_backward_weight(x_p, Qp_, H, dq_p, qw, grad[Params::wq]);
  linear_backward_input(dq_p, Qp_, qw, w[Params::wq], H, dx_p, beta);
}

void OwnRows::backward_kv(const AttnLayerParams& w, const OwnActivations& a, const float* x_p, const float* ctx_p,
                          float* dkv_p, float* dx_p, float beta, float* dctx_p, AttnLayerParams& grad, Work* inflight) {
  using Params = AttnLayerParams;
  const std::int64_t H = cfg_.hidden, kvw = cfg_.kv_width();
  float* dk = dkv_p;
  float* dv = dkv_p + Lk_ * kvw;
  rope_apply(dk, Lp(), cfg_.n_kv, key_pos_, rope_, true);
  rmsnorm_backward(dk, a.k_lin.data(), a.k_rstd.data(), Lp(), cfg_.n_kv, cfg_.d_h, w[Params::k_norm], dk, grad[Params::k_norm]);
  poll(inflight);
  linear_backward_weight(ctx_p, Cp_, H, dk, kvw, grad[Params::wk]);
  linear_backward_weight(x_p, Qp_, H, dk + Cp_ * kvw, kvw, grad[Params::wk]);
  poll(inflight);
  linear_backward_weight(ctx_p, Cp_, H, dv, kvw, grad[Params::wv]);
  linear_backward_weight(x_p, Qp_, H, dv + Cp_ * kvw, kvw, grad[Params::wv]);
  poll(inflight);
  linear_backward_input(dk, Cp_, kvw, w[Params::wk], H, dctx_p);
  linear_backward_input(dv, Cp_, kvw, w[Params::wv], H, dctx_p, 1.f);
  poll(inflight);
  linear_backward_input(dk + Cp_ * kvw, Qp_, kvw, w[Params::wk], H, dx_p, beta);
  linear_backward_input(dv + Cp_ * kvw, Qp_, kvw, w[Params::wv], H, dx_p, 1.f);
}

}  // namespace diffcp
