#include "diffcp/dit/vmajor.hpp"

#include <algorithm>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/ops.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

namespace {
std::size_t uz(std::int64_t v) { return static_cast<std::size_t>(v); }
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
  const std::int64_t n = tokens(), h = hd();
  // (a cache of another shape or wire format is refilled)
  const WireFormat f = wire_format();
  const bool cached = c.qkv_p2.size() == uz(wire_bytes(size() * n * 3 * h)) && c.v_p1.size() == uz(wire_bytes(size() * n * h)) &&
                      c.compute == f.compute && c.wire == f.wire;
  c.compute = f.compute;
  c.wire = f.wire;
  if (!cached || schedule_.full(step_, steps_)) {
    full_exchange(qkv, c);
  } else {
    selective_exchange(qkv, c, schedule_.cached_tokens(step_, steps_, n));
  }
  finish_attention(out);
}

void VMajorExchange::full_exchange(HeadRows<const float> qkv, LayerCache& c) {
  exchange_qkv(qkv, &c.v_p1);
  c.qkv_p2.assign(static_cast<const std::uint8_t*>(head_qkv_wire()), wire_bytes(head_rows() * 3 * hd()), active_device());
  ++stats_.full;
}

void VMajorExchange::selective_exchange(HeadRows<const float> qkv, LayerCache& c, std::int64_t n_c) {
  const std::int64_t P = size(), L = group_size(), G = P / L, n = tokens(), h = hd(), k = n - n_c;
  const std::int64_t me = rank();

  // 1. V's phase 1 (full): staged [G][L][n][hd], block hh*L + j = group mate j's tokens for (hh, i).
  wait_v();
  const std::byte* vs = v_p1_->output().data();

  // 2. Partial L1 over this lane's heads per group token [L][n], summed over the lanes in order; on
  //    the values in the compute dtype (fp8: both sides decoded). The selection stays on the device:
  //    the partials, the choice and the lists are device memory (no host sync).
  l1_part_.resize(L * n);
  l1_distance(decode(vs, G * L * n * h, l1_a_), decode(c.v_p1.data(), G * L * n * h, l1_b_), compute(), G, L * n, h,
              l1_part_.data());
  l1_all_.resize(L * L * n);  // [lanes][L][n]
  double t0 = now_ms();
  tapa_.intra().all_gather_async(l1_part_.data(), l1_all_.data(), uz(L * n), DType::f32)->wait();
  stats_.comm_ms += now_ms() - t0;

  // 3. Per source mate j: the n_c smallest L1 are cached, the k others active (ascending), [L][k];
  //    every source's lists [G][L][k] = [P][k] by flat source.
  act_group_.resize(L * k);
  act_all_.resize(P * k);
  select_active(l1_all_.data(), L, L, n, k, act_group_.data());
  t0 = now_ms();
  if (k > 0) tapa_.inter().all_gather_async(act_group_.data(), act_all_.data(), uz(L * k), DType::i32)->wait();
  stats_.comm_ms += now_ms() - t0;

  // 4. V^p1 mirrors what the receivers will hold: the active rows are refreshed. Rows of hd
  //    elements: vs and V^p1 index (hh, j, t) as row (hh L + j) n + t, the active ones [G][L][k].
  const std::int64_t rb = wire_bytes(h);  // bytes of one row of hd
  const std::int64_t n_rows = G * L * n, n_act = G * L * k;
  rows_.resize(std::max(n_act, P * k));
  p2_send_.resize(n_act * 3 * rb);
  if (n_act > 0) {  // through p2_send_'s v columns, which step 5 fills with the same rows anyway
    token_rows(act_group_.data(), L, k, nullptr, n, G * L, n, rows_.data());
    gather_rows(vs, DType::u8, n_rows, rb, rows_.data(), n_act, rb, p2_send_.data() + 2 * rb, DType::u8, 3 * rb);
    scatter_rows(p2_send_.data() + 2 * rb, DType::u8, 3 * rb, rows_.data(), n_act, rb, c.v_p1.data(), DType::u8, n_rows,
                 rb);
  }

  // 5. Q|K phase 1 of this rank's active rows, then one phase 2 of the active q|k|v rows.
  qk_send_.resize(P * k * 2 * h);
  if (k > 0) {  // this rank's active tokens as local rows
    const std::vector<std::int64_t>& local = layout().rows;
    if (map_host_ != local) {
      map_host_ = local;
      map_.assign(local.data(), static_cast<std::int64_t>(local.size()));
    }
    token_rows(act_all_.data() + me * k, 1, k, map_.data(), n, 1, 0, rows_.data());
    pack_qk(qkv, rows_.data(), k, qk_send_.data());
  }
  const void* qk_payload = encode(qk_send_.data(), P * k * 2 * h, qk_wire_);
  p2_recv_.resize(n_act * 3 * rb);
  t0 = now_ms();
  if (k > 0) {
    TapaPhase1 qk_p1 = tapa_.phase1_async(tapa_.plan_uniform(wire_count(k * 2 * h)), qk_payload, wire());
    qk_p1.wait();
    stats_.comm_ms += now_ms() - t0;
    // [G][L][k] rows of [q|k | v]: q|k from phase 1's output ([G][L][k][2][hd]), v placed in step 4.
    convert_rows(qk_p1.output().data(), DType::u8, 2 * rb, p2_send_.data(), DType::u8, 3 * rb, n_act, 2 * rb);
    t0 = now_ms();
    tapa_.inter().all_to_all_async(p2_send_.data(), p2_recv_.data(), wire_count(L * k * 3 * h), wire())->wait();
  }
  v_p1_.reset();
  stats_.comm_ms += now_ms() - t0;
  count_since(v_before_);
  ++stats_.calls;
  ++stats_.selective;

  // 6. Scatter the active rows into QKV^p2 (source s = g' L + j: row s n + t), then attention reads it.
  if (k > 0) {
    token_rows(act_all_.data(), P, k, nullptr, n, P, n, rows_.data());
    scatter_rows(p2_recv_.data(), DType::u8, 3 * rb, rows_.data(), P * k, 3 * rb, c.qkv_p2.data(), DType::u8, P * n,
                 3 * rb);
  }
  decode_head(c.qkv_p2.data());
}

VMajorBytes vmajor_predicted_bytes(int P, int L, std::int64_t n, std::int64_t hd, std::int64_t layers,
                                   const CacheSchedule& schedule, int steps, bool vmajor, DType payload) {
  return vmajor_predicted_bytes(P, L, n, hd, layers, schedule, steps, vmajor, WireFormat{payload, Wire::compute, 1});
}

VMajorBytes vmajor_predicted_bytes(int P, int L, std::int64_t n, std::int64_t hd, std::int64_t layers,
                                   const CacheSchedule& schedule, int steps, bool vmajor, const WireFormat& wire) {
  DIFFCP_CHECK(P >= 1 && L >= 1 && P % L == 0, "vmajor_predicted_bytes: L = ", L, " does not divide P = ", P);
  const std::uint64_t G = static_cast<std::uint64_t>(P / L), Lu = static_cast<std::uint64_t>(L);
  const std::uint64_t N = static_cast<std::uint64_t>(n);
  // Bytes (and of them scale bytes) of `rows` rows of c hd payload elements.
  const auto rows = [&](std::uint64_t r, std::int64_t c) { return r * wire.bytes(c * hd); };
  const auto scales = [&](std::uint64_t r, std::int64_t c) { return r * wire.scale_bytes(c * hd); };
  VMajorBytes out;
  for (int step = 0; step < steps; ++step) {
    std::uint64_t intra = 0, inter = 0, inter_qkv = 0, sc = 0;
    // o back: TAPA at full size.
    intra += rows((Lu - 1) * G * N, 1);
    inter += rows((G - 1) * Lu * N, 1);
    sc += scales((Lu - 1) * G * N + (G - 1) * Lu * N, 1);
    if (!vmajor || schedule.full(step, steps)) {
      intra += rows((Lu - 1) * G * N, 3);
      inter_qkv = rows((G - 1) * Lu * N, 3);
      sc += scales((Lu - 1) * G * N + (G - 1) * Lu * N, 3);
    } else {
      const std::uint64_t k = N - static_cast<std::uint64_t>(schedule.cached_tokens(step, steps, n));
      intra += rows((Lu - 1) * G * N, 1)                // V phase 1, full
               + (Lu - 1) * Lu * N * sizeof(float)     // L1 partials (f32) all-gathered in the group
               + rows((Lu - 1) * G * k, 2);            // Q|K phase 1, active rows
      inter_qkv = rows((G - 1) * Lu * k, 3);           // phase 2, active q|k|v rows
      sc += scales((Lu - 1) * G * N, 1) + scales((Lu - 1) * G * k, 2) + scales((G - 1) * Lu * k, 3);
      if (k > 0) inter += (G - 1) * Lu * k * sizeof(std::int32_t);  // active indices all-gathered
    }
    const std::uint64_t l = static_cast<std::uint64_t>(layers);
    out.intra += l * intra;
    out.inter += l * (inter + inter_qkv);
    out.inter_qkv += l * inter_qkv;
    out.scales += l * sc;
  }
  return out;
}

}  // namespace diffcp

namespace diffcp {

std::unique_ptr<AttentionExchange> make_vmajor_exchange(Communicator& world, int group_size, const CacheSchedule& schedule) {
  return std::make_unique<VMajorExchange>(world, group_size, schedule);
}

}  // namespace diffcp
