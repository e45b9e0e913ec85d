// Topology and the hierarchical (two-level) collectives of Communicator; the algorithms and their
// byte counts are described in comm/communicator.hpp.
#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/half.hpp"

namespace diffcp {

namespace {

// A chain of operations: each stage launches one backend operation (or does local work and
// returns nullptr); test() advances through completed stages, wait() through all of them.
class StagedWork final : public Work {
 public:
  using Stage = std::function<WorkPtr()>;
  // in_flight: the communicator's count of unfinished staged operations (+1 until done).
  StagedWork(std::vector<Stage> stages, int& in_flight) : stages_(std::move(stages)), in_flight_(in_flight) {
    ++in_flight_;
    advance();
  }
  ~StagedWork() override {
    if (!done_ && std::uncaught_exceptions() == 0) wait();
  }
  void wait() override {
    while (!done_) {
      cur_->wait();
      advance();
    }
  }
  bool test() override {
    while (!done_ && cur_->test()) advance();
    return done_;
  }

 private:
  void advance() {
    cur_.reset();
    while (next_ < stages_.size())
      if ((cur_ = stages_[next_++]())) return;
    done_ = true;
    --in_flight_;
  }
  std::vector<Stage> stages_;
  std::size_t next_ = 0;
  WorkPtr cur_;
  bool done_ = false;
  int& in_flight_;
};

template <typename T> void add_received(T* out, const unsigned char* in, std::size_t n) {
  const T* x = reinterpret_cast<const T*>(in);
  for (std::size_t i = 0; i < n; ++i) out[i] += x[i];
}
// out += in (bytes received from another node) on `type` (the sums a reduce-scatter supports: f32, f64, bf16 added in f32 and rounded).
void add_received(DType type, void* out, const unsigned char* in, std::size_t n) {
  switch (type) {
    case DType::f32: return add_received(static_cast<float*>(out), in, n);
    case DType::f64: return add_received(static_cast<double*>(out), in, n);
    case DType::bf16: {
      auto* o = static_cast<std::uint16_t*>(out);
      const auto* x = reinterpret_cast<const std::uint16_t*>(in);
      for (std::size_t i = 0; i < n; ++i) o[i] = f32_to_bf16(bf16_to_f32(o[i]) + bf16_to_f32(x[i]));
      return;
    }
    default: DIFFCP_FAIL("hierarchical reduce: sum on ", dtype_name(type), " is not supported");
  }
}

}  // namespace

int Topology::owner(int r, int n) const {
  const int l = local_of[static_cast<std::size_t>(r)];
  return node_of[static_cast<std::size_t>(r)] == n ? l : l % node_size(n);
}

std::string Topology::describe() const {
  std::string s = std::to_string(nodes()) + (nodes() == 1 ? " node (" : " nodes (");
  for (int n = 0; n < nodes(); ++n) {
    if (n > 0) s += '+';
    s += std::to_string(node_size(n));
  }
  s += " ranks)";
  return s;
}

Topology Topology::from_labels(std::span<const std::int64_t> labels) {
  Topology t;
  std::vector<std::int64_t> seen;  // node label of node n, numbered by first (lowest) rank
  for (std::size_t r = 0; r < labels.size(); ++r) {
    const auto it = std::find(seen.begin(), seen.end(), labels[r]);
    const int n = static_cast<int>(it - seen.begin());
    if (it == seen.end()) {
      seen.push_back(labels[r]);
      t.members.emplace_back();
    }
    t.node_of.push_back(n);
    t.local_of.push_back(static_cast<int>(t.members[static_cast<std::size_t>(n)].size()));
    t.members[static_cast<std::size_t>(n)].push_back(static_cast<int>(r));
  }
  return t;
}

CollAlgo parse_coll_algo(const std::string& name) {
  if (name == "flat") return CollAlgo::flat;
  if (name == "hierarchical") return CollAlgo::hierarchical;
  DIFFCP_FAIL("collective algorithm '", name, "': expected flat or hierarchical");
}

const char* coll_algo_name(CollAlgo algo) { return algo == CollAlgo::flat ? "flat" : "hierarchical"; }

void Communicator::set_topology(std::int64_t node_label) {
  check_no_staged_op("set_topology");
  const auto P = static_cast<std::size_t>(size());
  std::vector<std::int64_t> labels(P);
  const std::vector<std::size_t> ones(P, 1);
  setup_op(do_all_gather_v(&node_label, 1, labels.data(), ones, displacements(ones), DType::i64), CommOp::all_gather)->wait();
  auto t = std::make_unique<Topology>(Topology::from_labels(labels));
  const int me = rank();
  node_comm_ = do_split(t->node_of[static_cast<std::size_t>(me)], me, name_ + ".node");
  leader_comm_ = do_split(t->local_of[static_cast<std::size_t>(me)] == 0 ? 0 : -1, me, name_ + ".leaders");
  topology_ = std::move(t);
}

void Communicator::discover_topology() {
  const auto local = split_node_local(name_ + ".node_probe");
  std::int64_t neg = -static_cast<std::int64_t>(rank()), lowest = 0;
  local->setup_op(local->do_all_reduce(&neg, &lowest, 1, DType::i64, ReduceOp::max), CommOp::all_reduce)->wait();
  set_topology(-lowest);
}

void Communicator::check_no_staged_op(const char* what) const {
  DIFFCP_CHECK(staged_in_flight_ == 0, what, " on communicator '", name_,
               "' while a hierarchical operation is in flight: wait() for it first (its later stages start "
               "inside test()/wait(), so another collective now could be issued in a different order on other ranks)");
}

const Topology& Communicator::topology() const {
  DIFFCP_CHECK(topology_ != nullptr, "communicator '", name_, "' has no topology (set_topology / discover_topology)");
  return *topology_;
}

bool Communicator::hierarchy_useful() const {
  const Topology& t = topology();
  return t.nodes() > 1 && t.nodes() < size();
}

WorkPtr Communicator::hier_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts,
                                        DType type) {
  const Topology& t = *topology_;
  const int me = rank(), n = t.node_of[static_cast<std::size_t>(me)], l = t.local_of[static_cast<std::size_t>(me)];
  const int L = t.node_size(n), N = t.nodes();
  const auto P = static_cast<std::size_t>(size());
  const std::size_t es = dtype_size(type), mine = counts[static_cast<std::size_t>(me)];
  struct State {
    std::vector<std::size_t> counts, displs, sc, sd, rc, node_counts;
    std::vector<std::vector<int>> held;  // [L] blocks local rank k holds after phase 1 (rank order)
    std::vector<unsigned char> contribution, stage;
  };
  auto s = std::make_shared<State>();
  s->counts.assign(counts.begin(), counts.end());
  s->displs = displacements(counts);
  s->held.resize(static_cast<std::size_t>(L));
  s->sc.assign(P, 0), s->sd.assign(P, 0), s->rc.assign(P, 0), s->node_counts.assign(static_cast<std::size_t>(L), 0);
  for (std::size_t r = 0; r < P; ++r) {
    const int k = t.owner(static_cast<int>(r), n);
    s->held[static_cast<std::size_t>(k)].push_back(static_cast<int>(r));
    s->node_counts[static_cast<std::size_t>(k)] += counts[r];
    const int m = t.node_of[r];
    if (m == n) continue;
    if (t.local_of[r] == t.owner(me, m)) s->sc[r] = mine;  // phase 1: my block to node m's owner
    if (k == l) s->rc[r] = counts[r];                       // phase 1: blocks I hold for my node
  }
  auto* out = static_cast<unsigned char*>(recv);
  std::memmove(out + s->displs[static_cast<std::size_t>(me)] * es, send, mine * es);
  const std::size_t rc_total = std::accumulate(s->rc.begin(), s->rc.end(), std::size_t{0});
  const std::size_t node_total = std::accumulate(s->node_counts.begin(), s->node_counts.end(), std::size_t{0});
  const std::size_t held_mine = s->node_counts[static_cast<std::size_t>(l)];
  std::vector<StagedWork::Stage> stages;
  stages.emplace_back([this, s, send, out, type] {  // phase 1 (inter): blocks land in place
    return do_all_to_all_v(send, s->sc, s->sd, out, s->rc, s->displs, type);
  });
  stages.emplace_back([this, s, out, l, es, node_total, type] {  // phase 2 (intra): all-gather what each holds
    s->contribution.clear();
    for (int r : s->held[static_cast<std::size_t>(l)])
      s->contribution.insert(s->contribution.end(), out + s->displs[static_cast<std::size_t>(r)] * es,
                             out + (s->displs[static_cast<std::size_t>(r)] + s->counts[static_cast<std::size_t>(r)]) * es);
    s->stage.resize(node_total * es);
    return node_comm_->do_all_gather_v(s->contribution.data(), s->node_counts[static_cast<std::size_t>(l)],
                                       s->stage.data(), s->node_counts, displacements(s->node_counts), type);
  });
  stages.emplace_back([s, out, l, es]() -> WorkPtr {  // unpack the other local ranks' blocks
    std::size_t off = 0;
    for (std::size_t k = 0; k < s->held.size(); ++k)
      for (int r : s->held[k]) {
        const std::size_t bytes = s->counts[static_cast<std::size_t>(r)] * es;
        if (static_cast<int>(k) != l) std::memcpy(out + s->displs[static_cast<std::size_t>(r)] * es, s->stage.data() + off, bytes);
        off += bytes;
      }
    return nullptr;
  });
  auto w = std::make_unique<StagedWork>(std::move(stages), staged_in_flight_);
  const std::size_t inter = mine * static_cast<std::size_t>(N - 1);
  return issued(std::move(w), CommOp::all_gather, inter + held_mine * static_cast<std::size_t>(L - 1),
                rc_total + node_total - held_mine, type, inter);
}

WorkPtr Communicator::hier_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts,
                                            DType type) {
  const Topology& t = *topology_;
  const int me = rank(), n = t.node_of[static_cast<std::size_t>(me)], l = t.local_of[static_cast<std::size_t>(me)];
  const int L = t.node_size(n);
  const auto P = static_cast<std::size_t>(size());
  const std::size_t es = dtype_size(type), mine = counts[static_cast<std::size_t>(me)];
  struct State {
    std::vector<std::size_t> node_counts, sc, sd, rc, rd;
    std::vector<unsigned char> packed, held, from_nodes;
    std::size_t own_offset = 0;  // of my own block in `held`, in elements
  };
  auto s = std::make_shared<State>();
  const auto displs = displacements(counts);
  s->node_counts.assign(static_cast<std::size_t>(L), 0);
  s->sc.assign(P, 0), s->sd.assign(P, 0), s->rc.assign(P, 0), s->rd.assign(P, 0);
  // Phase 1 input: the blocks in order of the local rank that will hold them, rank order within.
  std::vector<std::vector<int>> held(static_cast<std::size_t>(L));
  for (std::size_t r = 0; r < P; ++r) held[static_cast<std::size_t>(t.owner(static_cast<int>(r), n))].push_back(static_cast<int>(r));
  const auto* in = static_cast<const unsigned char*>(send);
  for (std::size_t k = 0; k < held.size(); ++k)
    for (int r : held[k]) {
      const auto ur = static_cast<std::size_t>(r);
      if (static_cast<int>(k) == l) {
        if (t.node_of[ur] != n) s->sc[ur] = counts[ur], s->sd[ur] = s->node_counts[k];
        if (r == me) s->own_offset = s->node_counts[k];
      }
      s->packed.insert(s->packed.end(), in + displs[ur] * es, in + (displs[ur] + counts[ur]) * es);
      s->node_counts[k] += counts[ur];
    }
  // Phase 2: the node sum of my block from owner(me, m) of every other node m, in rank order.
  std::size_t from = 0;
  for (std::size_t r = 0; r < P; ++r) {
    const int m = t.node_of[r];
    if (m != n && t.local_of[r] == t.owner(me, m)) s->rc[r] = mine, s->rd[r] = from, from += mine;
  }
  s->held.resize(s->node_counts[static_cast<std::size_t>(l)] * es);
  s->from_nodes.resize(from * es);
  std::vector<StagedWork::Stage> stages;
  stages.emplace_back([this, s, type] {  // phase 1 (intra): node sums to the holders
    return node_comm_->do_reduce_scatter_v(s->packed.data(), s->held.data(), s->node_counts, type, ReduceOp::sum);
  });
  stages.emplace_back([this, s, type] {  // phase 2 (inter): node sums to the block's rank
    return do_all_to_all_v(s->held.data(), s->sc, s->sd, s->from_nodes.data(), s->rc, s->rd, type);
  });
  stages.emplace_back([s, recv, mine, es, type]() -> WorkPtr {  // my node's sum + the others' in rank order
    std::memcpy(recv, s->held.data() + s->own_offset * es, mine * es);
    for (std::size_t off = 0; off < s->from_nodes.size(); off += mine * es) {
      add_received(type, recv, s->from_nodes.data() + off, mine);
    }
    return nullptr;
  });
  const std::size_t total = s->packed.size() / es, held_mine = s->node_counts[static_cast<std::size_t>(l)];
  const std::size_t inter = std::accumulate(s->sc.begin(), s->sc.end(), std::size_t{0});
  auto w = std::make_unique<StagedWork>(std::move(stages), staged_in_flight_);
  return issued(std::move(w), CommOp::reduce_scatter, total - held_mine + inter,
                held_mine * static_cast<std::size_t>(L - 1) + from, type, inter);
}

WorkPtr Communicator::hier_all_reduce(const void* send, void* recv, std::size_t n, DType type, ReduceOp op) {
  const Topology& t = *topology_;
  const int me = rank(), node = t.node_of[static_cast<std::size_t>(me)], l = t.local_of[static_cast<std::size_t>(me)];
  const auto L = static_cast<std::size_t>(t.node_size(node)), N = static_cast<std::size_t>(t.nodes());
  auto share = [n](std::size_t r, std::size_t of) { return n / of + (r < n % of ? 1 : 0); };
  std::vector<StagedWork::Stage> stages;
  stages.emplace_back([this, send, recv, n, type, op] { return node_comm_->do_all_reduce(send, recv, n, type, op); });
  if (leader_comm_)
    stages.emplace_back([this, recv, n, type, op] { return leader_comm_->do_all_reduce(recv, recv, n, type, op); });
  stages.emplace_back([this, recv, n, type] { return node_comm_->do_broadcast(recv, n, type, 0); });
  auto w = std::make_unique<StagedWork>(std::move(stages), staged_in_flight_);
  const std::size_t intra_ar = 2 * (n - share(static_cast<std::size_t>(l), L));
  const std::size_t inter = leader_comm_ ? 2 * (n - share(static_cast<std::size_t>(node), N)) : 0;
  const std::size_t bcast_sent = l == 0 ? n * (L - 1) : 0, bcast_recv = l == 0 ? 0 : n;
  return issued(std::move(w), CommOp::all_reduce, intra_ar + inter + bcast_sent, intra_ar + inter + bcast_recv,
                type, inter);
}

}  // namespace diffcp
