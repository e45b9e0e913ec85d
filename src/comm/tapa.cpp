#include "diffcp/comm/tapa.hpp"

#include <cstring>
#include <numeric>

namespace diffcp {

namespace {

std::size_t uz(int v) { return static_cast<std::size_t>(v); }

void check_group_size(int P, int L) {
  DIFFCP_CHECK(P >= 1 && L >= 1 && P % L == 0, "TAPA: group size L = ", L,
               " does not divide the number of ranks P = ", P, " (need L >= 1 and P % L == 0)");
}

// Phase 2 owns the phase-1 output until the inter all-to-all-v that reads it completes.
class Phase2Work final : public Work {
 public:
  Phase2Work(std::unique_ptr<std::byte[]> staged, Buffer staged_dev, WorkPtr inner)
      : staged_(std::move(staged)), staged_dev_(std::move(staged_dev)), inner_(std::move(inner)) {}
  void wait() override { inner_->wait(); }
  void synchronize() override { inner_->synchronize(); }
  bool test() override { return inner_->test(); }

 private:
  std::unique_ptr<std::byte[]> staged_;  // before inner_: destroyed after inner_ has waited
  Buffer staged_dev_;
  WorkPtr inner_;
};

}  // namespace

TapaBytes tapa_uniform_bytes(int P, int L, std::size_t count, std::size_t elem_bytes,
                             bool count_exchange) {
  check_group_size(P, L);
  const std::uint64_t G = uz(P / L), block = count * elem_bytes;
  return {.phase1 = uz(L - 1) * G * block,
          .phase2 = (G - 1) * uz(L) * block,
          .count_exchange = count_exchange ? uz(L - 1) * G * sizeof(std::uint64_t) : 0};
}

void tapa_check_buffer(const char* what, std::span<const std::size_t> counts, int P,
                       std::size_t elements) {
  DIFFCP_CHECK(counts.size() == uz(P), what, ": got ", counts.size(), " counts, expected one per rank (P = ",
               P, ")");
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  DIFFCP_CHECK(total == elements, what, ": counts sum to ", total, " elements but the buffer holds ",
               elements);
}

// ---- TapaPhase1 ----

bool TapaPhase1::test() {
  bool done = true;
  for (WorkPtr& w : works_) done = w->test() && done;  // test every one: each drives progress
  return done;
}

void TapaPhase1::wait() {
  for (WorkPtr& w : works_) w->wait();
}

// ---- TapaAllToAll ----

TapaAllToAll::TapaAllToAll(Communicator& flat, int group_size)
    : flat_(&flat), P_(flat.size()), L_(group_size) {
  check_group_size(P_, L_);  // before any communication, identically on every rank
  const int r = flat.rank();
  group_ = r / L_;
  local_ = r % L_;
  intra_ = flat.split(group_, r, "tapa_intra_group");
  inter_ = flat.split(local_, r, "tapa_inter_group");
  // Ranks that passed different L get groups of the wrong size; say so rather than mis-route.
  DIFFCP_CHECK(intra_->size() == L_ && inter_->size() == P_ / L_, "TAPA: group size L = ", L_,
               " on rank ", r, " but the groups formed have ", intra_->size(), " (intra) and ",
               inter_->size(), " (inter) ranks; every rank must pass the same L");
}

TapaAllToAll TapaAllToAll::node_local(Communicator& flat) {
  auto node = flat.split_node_local("tapa_node");
  const int r = flat.rank(), n = node->size();
  // Lowest flat rank on this node (max of -rank: ReduceOp has no min).
  std::int64_t neg_first = -r;
  node->all_reduce<std::int64_t>(std::span(&neg_first, 1), ReduceOp::max);
  const std::int64_t first = -neg_first;
  const bool consecutive = node->rank() == r - first && first % n == 0;
  // One flat reduction so that every rank takes the same decision: {max n, max -n, any bad}.
  std::int64_t v[3] = {n, -n, consecutive ? 0 : 1};
  flat.all_reduce<std::int64_t>(v, ReduceOp::max);
  DIFFCP_CHECK(v[0] == -v[1], "TAPA node-local grouping: nodes have between ", -v[1], " and ", v[0],
               " ranks; the group size L must be the same on every node");
  DIFFCP_CHECK(v[2] == 0, "TAPA node-local grouping: the ranks of a node (L = ", n,
               ") are not L consecutive ranks starting at a multiple of L; fill nodes one after the "
               "other (Open MPI's default mapping by slot does, --map-by node does not)");
  return TapaAllToAll(flat, n);
}

void TapaAllToAll::reset_stats() {
  intra_->stats().reset();
  inter_->stats().reset();
}

void TapaAllToAll::check_plan(const TapaPlan& plan) const {
  DIFFCP_CHECK(plan.P_ == P_ && plan.L_ == L_, "TAPA: the plan was made for P = ", plan.P_, ", L = ",
               plan.L_, " but this exchange has P = ", P_, ", L = ", L_);
}

// Everything but the staged counts follows from the caller's counts; shared by both plan kinds.
TapaPlan TapaAllToAll::make_plan(int P, int L, std::vector<std::size_t> send_counts,
                          std::vector<std::size_t> staged_counts,
                          std::span<const std::size_t> recv_counts) {
  const std::size_t G = uz(P / L);
  TapaPlan plan;
  plan.P_ = P;
  plan.L_ = L;
  plan.send_offsets_ = displacements(send_counts);
  plan.staged_offsets_ = displacements(staged_counts);
  plan.staged_total_ = std::accumulate(staged_counts.begin(), staged_counts.end(), std::size_t{0});
  plan.phase2_send_counts_.assign(G, 0);
  plan.phase2_recv_counts_.assign(G, 0);
  for (std::size_t k = 0; k < uz(P); ++k) {
    plan.phase2_send_counts_[k / uz(L)] += staged_counts[k];
    plan.phase2_recv_counts_[k / uz(L)] += recv_counts[k];
  }
  plan.send_counts_ = std::move(send_counts);
  plan.staged_counts_ = std::move(staged_counts);
  return plan;
}

TapaPlan TapaAllToAll::plan(std::span<const std::size_t> send_counts,
                            std::span<const std::size_t> recv_counts) {
  DIFFCP_CHECK(send_counts.size() == uz(P_) && recv_counts.size() == uz(P_), "TAPA plan: got ",
               send_counts.size(), " send and ", recv_counts.size(),
               " recv counts, expected one per rank (P = ", P_, ")");
  const std::size_t G = uz(num_groups()), L = uz(L_);
  // Count exchange: mate j gets send_counts[h*L + j] for h in [0, G), i.e. out is [L][G] (host
  // metadata, whatever the exchange's device).
  std::vector<std::uint64_t> out(L * G), in(L * G);
  for (std::size_t j = 0; j < L; ++j)
    for (std::size_t h = 0; h < G; ++h) out[j * G + h] = send_counts[h * L + j];
  intra_->all_to_all_async(out.data(), in.data(), G, DType::u64)->wait();
  // in[j*G + h] = count of block (g, j) -> (h, i); the staged layout is [h][j].
  std::vector<std::size_t> staged(uz(P_));
  for (std::size_t j = 0; j < L; ++j)
    for (std::size_t h = 0; h < G; ++h) staged[h * L + j] = static_cast<std::size_t>(in[j * G + h]);
  // Blocks from this rank's own group are final in both views: a cheap consistency check.
  for (std::size_t j = 0; j < L; ++j) {
    const std::size_t s = uz(group_) * L + j;
    DIFFCP_CHECK(staged[s] == recv_counts[s], "TAPA plan: rank ", s, " announces ", staged[s],
                 " elements for rank ", flat_->rank(), " but recv_counts[", s, "] = ", recv_counts[s]);
  }
  return make_plan(P_, L_, {send_counts.begin(), send_counts.end()}, std::move(staged), recv_counts);
}

TapaPlan TapaAllToAll::plan_uniform(std::size_t count) const {
  const std::vector<std::size_t> all(uz(P_), count);
  return make_plan(P_, L_, all, all, all);
}

TapaPhase1 TapaAllToAll::phase1_async(const TapaPlan& plan, const void* send, DType type) {
  check_plan(plan);
  const std::size_t es = dtype_size(type), L = uz(L_), G = uz(num_groups()), i = uz(local_);
  TapaPhase1 p1;
  p1.type_ = type;
  p1.phase2_send_counts_ = plan.phase2_send_counts_;
  p1.phase2_recv_counts_ = plan.phase2_recv_counts_;
  p1.staged_bytes_ = plan.staged_total_ * es;
  Backend& owner = backend_of(send);  // the exchange's buffers' backend, whatever is active
  const Device device = owner.device_of(send);
  if (device == Device::host)
    p1.staged_.reset(new std::byte[p1.staged_bytes_]);  // default-initialised: no page touched yet
  else
    p1.staged_dev_ = Buffer(DType::u8, static_cast<std::int64_t>(p1.staged_bytes_), owner);
  std::byte* staged = p1.staged();
  const auto* src = static_cast<const std::byte*>(send);
  // One message per non-empty block: a mate's G blocks are neither contiguous in `send` nor in the
  // staged layout. All of them one hop (exchange_async: one NCCL group); between two ranks the
  // blocks go and are received in the order of h (messages match in order, no tags). Both sides
  // skip the same empty blocks (the counts were exchanged).
  std::vector<Communicator::P2pOp> ops;
  const auto view = [&](const std::byte* p, std::size_t n) {
    return ConstTensorView::contiguous(p, type, {static_cast<std::int64_t>(n)}, device);
  };
  for (std::size_t h = 0; h < G; ++h)
    for (std::size_t j = 0; j < L; ++j) {
      const std::size_t k = h * L + j, n = plan.staged_counts_[k];
      if (j != i && n > 0)
        ops.push_back(Communicator::P2pOp::recv(
            TensorView::contiguous(staged + plan.staged_offsets_[k] * es, type, {static_cast<std::int64_t>(n)}, device),
            static_cast<int>(j)));
    }
  for (std::size_t h = 0; h < G; ++h)
    for (std::size_t j = 0; j < L; ++j) {
      const std::size_t d = h * L + j, n = plan.send_counts_[d];
      if (j != i && n > 0) ops.push_back(Communicator::P2pOp::send(view(src + plan.send_offsets_[d] * es, n), static_cast<int>(j)));
    }
  if (!ops.empty()) p1.works_.push_back(intra_->exchange_async(ops));
  // The blocks to local index i stay on this rank: block (g, i) -> (h, i) is staged index h*L + i.
  for (std::size_t h = 0; h < G; ++h) {
    const std::size_t d = h * L + i, n = plan.send_counts_[d];
    if (n == 0) continue;
    if (device == Device::host)
      std::memcpy(staged + plan.staged_offsets_[d] * es, src + plan.send_offsets_[d] * es, n * es);
    else
      owner.copy(staged + plan.staged_offsets_[d] * es, device, src + plan.send_offsets_[d] * es, device, n * es);
  }
  return p1;
}

WorkPtr TapaAllToAll::phase2_async(TapaPhase1&& p1, void* recv) {
  DIFFCP_CHECK(!p1.consumed_ && (p1.staged() != nullptr || p1.staged_bytes_ == 0),
               "TAPA phase 2: this phase-1 handle was already consumed");
  DIFFCP_CHECK(p1.phase2_send_counts_.size() == uz(num_groups()), "TAPA phase 2: the phase-1 handle has ",
               p1.phase2_send_counts_.size(), " groups, this exchange ", num_groups());
  p1.wait();
  WorkPtr w = inter_->all_to_all_v_async(p1.staged(), p1.phase2_send_counts_, recv,
                                         p1.phase2_recv_counts_, p1.type_);
  p1.staged_bytes_ = 0;  // output() of the consumed handle is empty
  p1.consumed_ = true;
  return std::make_unique<Phase2Work>(std::move(p1.staged_), std::move(p1.staged_dev_), std::move(w));
}

void TapaAllToAll::phase2(TapaPhase1&& p1, void* recv) { phase2_async(std::move(p1), recv)->wait(); }

void TapaAllToAll::all_to_all_v(const void* send, std::span<const std::size_t> send_counts, void* recv,
                                std::span<const std::size_t> recv_counts, DType type) {
  const TapaPlan p = plan(send_counts, recv_counts);
  phase2(phase1_async(p, send, type), recv);
}

void TapaAllToAll::all_to_all(const void* send, void* recv, std::size_t count, DType type) {
  const TapaPlan p = plan_uniform(count);
  phase2(phase1_async(p, send, type), recv);
}

}  // namespace diffcp
