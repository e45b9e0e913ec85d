#include "diffcp/dit/vmajor.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"

namespace diffcp {

namespace {
std::size_t uz(std::int64_t v) { return static_cast<std::size_t>(v); }

float value(float x) { return x; }
float value(bf16_t x) { return bf16_to_f32(x.bits); }
// s += sum_i |a_i - b_i| over n payload elements of type T (f32 differences, added in order).
template <typename T>
void add_l1(double& s, const std::byte* a, const std::byte* b, std::int64_t n) {
  const T* x = reinterpret_cast<const T*>(a);
  const T* y = reinterpret_cast<const T*>(b);
  for (std::int64_t i = 0; i < n; ++i) s += std::abs(value(x[i]) - value(y[i]));
}
}  // namespace

VMajorExchange::VMajorExchange(Communicator& world, int L, const CacheSchedule& schedule)
    : VFirstExchange(world, L, ExchangeMode::cocodiff), schedule_(schedule) {
  schedule_.validate();
}

void VMajorExchange::begin_step(int step, int steps) {
  DIFFCP_CHECK(step >= 0 && step < steps, "V-Major: step ", step, " of ", steps);
  step_ = step;
  steps_ = steps;
  layer_ = 0;
}

std::uint64_t VMajorExchange::cache_bytes() const {
  std::uint64_t n = 0;
  for (const LayerCache& c : caches_) n += c.v_p1.size() + c.qkv_p2.size();
  return n;
}

void VMajorExchange::attention(HeadRows<const float> qkv, HeadRows<float> out) {
  check_qkv(qkv);
  if (!v_p1_) start_v(qkv);
  if (layer_ >= caches_.size()) caches_.emplace_back();
  LayerCache& c = caches_[layer_++];
  const std::int64_t n = tokens(), h = hd(), e = static_cast<std::int64_t>(wire_size());
  // (a cache of another shape or payload dtype is refilled)
  const bool cached = c.qkv_p2.size() == uz(size() * n * 3 * h * e) && c.v_p1.size() == uz(size() * n * h * e);
  if (!cached || schedule_.full(step_, steps_)) {
    full_exchange(qkv, c);
  } else {
    selective_exchange(qkv, c, schedule_.cached_tokens(step_, steps_, n));
  }
  finish_attention(out);
}

void VMajorExchange::full_exchange(HeadRows<const float> qkv, LayerCache& c) {
  exchange_qkv(qkv, &c.v_p1);
  const auto* head = static_cast<const std::byte*>(head_qkv());
  c.qkv_p2.assign(head, wire_at(head, head_rows() * 3 * hd()));
  ++stats_.full;
}

void VMajorExchange::selective_exchange(HeadRows<const float> qkv, LayerCache& c, std::int64_t n_c) {
  const std::int64_t P = size(), L = group_size(), G = P / L, n = tokens(), h = hd(), k = n - n_c;
  const std::int64_t g = tapa_.group(), me = rank();

  // 1. V's phase 1 (full): staged [G][L][n][hd], block hh*L + j = group mate j's tokens for (hh, i).
  wait_v();
  const std::byte* vs = v_p1_->output().data();
  const std::size_t e = wire_size();

  // 2. Partial L1 over this lane's heads per group token [L][n], summed over the lanes in order.
  l1_part_.assign(uz(L * n), 0.f);
  for (std::int64_t j = 0; j < L; ++j)
    for (std::int64_t t = 0; t < n; ++t) {
      double s = 0;
      for (std::int64_t hh = 0; hh < G; ++hh) {
        const std::int64_t off = ((hh * L + j) * n + t) * h;
        const std::byte *now = wire_at(vs, off), *then = wire_at(c.v_p1.data(), off);
        if (wire() == DType::bf16)
          add_l1<bf16_t>(s, now, then, h);
        else
          add_l1<float>(s, now, then, h);
      }
      l1_part_[uz(j * n + t)] = static_cast<float>(s);
    }
  double t0 = now_ms();
  l1_all_.resize(uz(L * L * n));
  if (L > 1)
    tapa_.intra().all_gather<float>(l1_part_, l1_all_);
  else
    l1_all_ = l1_part_;
  stats_.comm_ms += now_ms() - t0;
  l1_.assign(uz(L * n), 0.0);
  for (std::int64_t lane = 0; lane < L; ++lane)
    for (std::int64_t x = 0; x < L * n; ++x) l1_[uz(x)] += l1_all_[uz(lane * L * n + x)];

  // 3. Per source mate j: the n_c smallest L1 are cached, the k others active (ascending).
  act_group_.resize(uz(L * k));
  order_.resize(uz(n));
  for (std::int64_t j = 0; j < L; ++j) {
    std::iota(order_.begin(), order_.end(), 0);
    const double* d = l1_.data() + j * n;
    std::sort(order_.begin(), order_.end(), [d](std::int32_t a, std::int32_t b) { return d[a] < d[b] || (d[a] == d[b] && a < b); });
    std::sort(order_.begin() + n_c, order_.end());
    std::copy(order_.begin() + n_c, order_.end(), act_group_.begin() + j * k);
  }
  act_all_.resize(uz(P * k));
  t0 = now_ms();
  if (G > 1 && k > 0)
    tapa_.inter().all_gather<std::int32_t>(act_group_, act_all_);  // [G][L][k] = [P][k] by flat source
  else
    std::copy(act_group_.begin(), act_group_.end(), act_all_.begin() + g * L * k);
  stats_.comm_ms += now_ms() - t0;

  // 4. V^p1 mirrors what the receivers will hold: the active rows are refreshed.
  for (std::int64_t hh = 0; hh < G; ++hh)
    for (std::int64_t j = 0; j < L; ++j)
      for (std::int64_t a = 0; a < k; ++a) {
        const std::int64_t off = ((hh * L + j) * n + act_group_[uz(j * k + a)]) * h;
        std::memcpy(wire_at(c.v_p1.data(), off), wire_at(vs, off), e * uz(h));
      }

  // 5. Q|K phase 1 of this rank's active rows, then one phase 2 of the active q|k|v rows.
  qk_send_.resize(uz(P * k * 2 * h));
  pack_qk(qkv, act_all_.data() + me * k, k, qk_send_.data());
  p2_send_.resize(uz(P * k * 3 * h));
  p2_recv_.resize(p2_send_.size());
  t0 = now_ms();
  if (k > 0) {
    TapaPhase1 qk_p1 = tapa_.phase1_async(tapa_.plan_uniform(uz(k * 2 * h)), qk_send_.data(), wire());
    qk_p1.wait();
    stats_.comm_ms += now_ms() - t0;
    const std::byte* qs = qk_p1.output().data();  // [G][L][k][2][hd]
    for (std::int64_t hh = 0; hh < G; ++hh)
      for (std::int64_t j = 0; j < L; ++j)
        for (std::int64_t a = 0; a < k; ++a) {
          std::byte* dst = wire_at(p2_send_.data(), ((hh * L + j) * k + a) * 3 * h);
          std::memcpy(dst, wire_at(qs, ((hh * L + j) * k + a) * 2 * h), e * uz(2 * h));
          std::memcpy(dst + e * uz(2 * h), wire_at(vs, ((hh * L + j) * n + act_group_[uz(j * k + a)]) * h), e * uz(h));
        }
    t0 = now_ms();
    tapa_.inter().all_to_all_async(p2_send_.data(), p2_recv_.data(), uz(L * k * 3 * h), wire())->wait();
  }
  v_p1_.reset();
  stats_.comm_ms += now_ms() - t0;
  count_since(v_before_);
  ++stats_.calls;
  ++stats_.selective;

  // 6. Scatter the active rows into QKV^p2 (source s = g' L + j), then attention reads it.
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t a = 0; a < k; ++a)
      std::memcpy(wire_at(c.qkv_p2.data(), (s * n + act_all_[uz(s * k + a)]) * 3 * h), wire_at(p2_recv_.data(), (s * k + a) * 3 * h),
                  e * uz(3 * h));
  std::memcpy(head_qkv(), c.qkv_p2.data(), c.qkv_p2.size());
}

VMajorBytes vmajor_predicted_bytes(int P, int L, std::int64_t n, std::int64_t hd, std::int64_t layers,
                                   const CacheSchedule& schedule, int steps, bool vmajor, DType payload) {
  DIFFCP_CHECK(P >= 1 && L >= 1 && P % L == 0, "vmajor_predicted_bytes: L = ", L, " does not divide P = ", P);
  const std::uint64_t G = static_cast<std::uint64_t>(P / L), Lu = static_cast<std::uint64_t>(L), f = dtype_size(payload);
  const std::uint64_t N = static_cast<std::uint64_t>(n), h = static_cast<std::uint64_t>(hd);
  VMajorBytes out;
  for (int step = 0; step < steps; ++step) {
    std::uint64_t intra = 0, inter = 0, inter_qkv = 0;
    // o back: TAPA at full size.
    intra += (Lu - 1) * G * N * h * f;
    inter += (G - 1) * Lu * N * h * f;
    if (!vmajor || schedule.full(step, steps)) {
      intra += (Lu - 1) * G * N * 3 * h * f;
      inter_qkv = (G - 1) * Lu * N * 3 * h * f;
    } else {
      const std::uint64_t k = N - static_cast<std::uint64_t>(schedule.cached_tokens(step, steps, n));
      intra += (Lu - 1) * G * N * h * f            // V phase 1, full
               + (Lu - 1) * Lu * N * sizeof(float)  // L1 partials (f32) all-gathered in the group
               + (Lu - 1) * G * k * 2 * h * f;      // Q|K phase 1, active rows
      inter_qkv = (G - 1) * Lu * k * 3 * h * f;     // phase 2, active q|k|v rows
      if (k > 0) inter += (G - 1) * Lu * k * sizeof(std::int32_t);  // active indices all-gathered
    }
    const std::uint64_t l = static_cast<std::uint64_t>(layers);
    out.intra += l * intra;
    out.inter += l * (inter + inter_qkv);
    out.inter_qkv += l * inter_qkv;
  }
  return out;
}

}  // namespace diffcp

namespace diffcp {

std::unique_ptr<AttentionExchange> make_vmajor_exchange(Communicator& world, int group_size, const CacheSchedule& schedule) {
  return std::make_unique<VMajorExchange>(world, group_size, schedule);
}

}  // namespace diffcp
