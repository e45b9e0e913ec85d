#include "diffcp/core/env.hpp"
#include "diffcp/comm/communicator.hpp"

#include "staging.hpp"
#include "diffcp/ops/backend.hpp"

#include <cstdlib>

#include <numeric>

#include <nlohmann/json.hpp>

namespace diffcp {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::logsumexp: return "logsumexp";
  }
  return "?";
}

void Communicator::not_implemented(const char* op) const {
  DIFFCP_FAIL("communicator backend '", backend(), "' does not implement ", op, " (communicator '", name(), "')");
}
WorkPtr Communicator::do_all_gather(const void*, void*, std::size_t, DType) { not_implemented("all_gather"); }
WorkPtr Communicator::do_all_gather_v(const void*, std::size_t, void*, std::span<const std::size_t>,
                                      std::span<const std::size_t>, DType) {
  not_implemented("all_gather_v");
}
WorkPtr Communicator::do_reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp) {
  not_implemented("reduce_scatter");
}
WorkPtr Communicator::do_reduce_scatter_v(const void*, void*, std::span<const std::size_t>, DType, ReduceOp) {
  not_implemented("reduce_scatter_v");
}
WorkPtr Communicator::do_all_reduce(const void*, void*, std::size_t, DType, ReduceOp) { not_implemented("all_reduce"); }
WorkPtr Communicator::do_all_to_all(const void*, void*, std::size_t, DType) { not_implemented("all_to_all"); }
WorkPtr Communicator::do_all_to_all_v(const void*, std::span<const std::size_t>, std::span<const std::size_t>, void*,
                                      std::span<const std::size_t>, std::span<const std::size_t>, DType) {
  not_implemented("all_to_all_v");
}
WorkPtr Communicator::do_broadcast(void*, std::size_t, DType, int) { not_implemented("broadcast"); }
WorkPtr Communicator::do_send(const void*, std::size_t, DType, int, int) { not_implemented("send"); }
WorkPtr Communicator::do_recv(void*, std::size_t, DType, int, int) { not_implemented("recv"); }
WorkPtr Communicator::do_barrier() { not_implemented("barrier"); }
std::unique_ptr<Communicator> Communicator::do_split(int, int, const std::string&) { not_implemented("split"); }
std::unique_ptr<Communicator> Communicator::do_split_node_local(const std::string&) {
  not_implemented("split_node_local");
}

void Communicator::check_reduce(ReduceOp op, DType type, const char* what) const {
  DIFFCP_CHECK(supports_reduce(op, type), what, ": communicator backend '", backend(), "' does not support ",
               reduce_op_name(op), " on ", dtype_name(type),
               op == ReduceOp::logsumexp ? " (use all_reduce_lse, cp/lse_reduce.hpp)" : "");
}

bool Communicator::supports_reduce(ReduceOp op, DType type) const {
  return op != ReduceOp::logsumexp && type != DType::u16 && type != DType::bf16;
}

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::all_gather: return "all_gather";
    case CommOp::reduce_scatter: return "reduce_scatter";
    case CommOp::all_reduce: return "all_reduce";
    case CommOp::all_to_all: return "all_to_all";
    case CommOp::send: return "send";
    case CommOp::recv: return "recv";
    case CommOp::broadcast: return "broadcast";
    case CommOp::barrier: return "barrier";
    case CommOp::count_: break;
  }
  return "?";
}

OpCounter CommStats::total() const {
  OpCounter t;
  for (const OpCounter& c : ops_) {
    t.calls += c.calls;
    t.bytes_sent += c.bytes_sent;
    t.bytes_recv += c.bytes_recv;
    t.bytes_sent_inter += c.bytes_sent_inter;
  }
  return t;
}

nlohmann::json CommStats::to_json() const {
  auto one = [](const OpCounter& c) {
    return nlohmann::json{{"calls", c.calls}, {"bytes_sent", c.bytes_sent}, {"bytes_recv", c.bytes_recv},
                          {"bytes_sent_inter", c.bytes_sent_inter}};
  };
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t i = 0; i < kNumCommOps; ++i) j[comm_op_name(static_cast<CommOp>(i))] = one(ops_[i]);
  j["total"] = one(total());
  return j;
}

nlohmann::json Communicator::stats_json() const {
  return {{"name", name_}, {"backend", backend()}, {"rank", rank()}, {"size", size()},
          {"ops", stats_.to_json()}};
}

void Communicator::check_counts(std::span<const std::size_t> counts, const char* what) const {
  DIFFCP_CHECK(counts.size() == static_cast<std::size_t>(size()), what, ": got ", counts.size(),
               " counts, expected one per rank (", size(), ")");
}

std::size_t Communicator::off_node_peers() const {
  if (!topology_) return 0;
  return static_cast<std::size_t>(size() - topology_->node_size(topology_->node_of[static_cast<std::size_t>(rank())]));
}

std::size_t Communicator::inter_part(std::span<const std::size_t> per_peer) const {
  if (!topology_) return 0;
  std::size_t n = 0;
  for (std::size_t r = 0; r < per_peer.size(); ++r)
    if (!topology_->same_node(rank(), static_cast<int>(r))) n += per_peer[r];
  return n;
}

void Communicator::check_v_sizes(const char* what, std::span<const std::size_t> counts, std::size_t mine,
                                 std::size_t whole, bool check_mine) const {
  check_counts(counts, what);
  std::size_t total = 0;
  for (std::size_t c : counts) total += c;
  DIFFCP_CHECK(total == whole, what, ": counts sum to ", total, " elements but the buffer holds ", whole);
  DIFFCP_CHECK(!check_mine || counts[static_cast<std::size_t>(rank())] == mine, what, ": counts[rank ", rank(),
               "] = ", counts[static_cast<std::size_t>(rank())], " but this rank's buffer holds ", mine);
}

void Communicator::check_peer(int peer, const char* what) const {
  DIFFCP_CHECK(peer >= 0 && peer < size(), what, ": rank ", peer, " outside [0, ", size(), ")");
}

std::vector<std::size_t> displacements(std::span<const std::size_t> counts) {
  std::vector<std::size_t> displs(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), std::size_t{0});
  return displs;
}

namespace {
std::size_t sum(std::span<const std::size_t> v) { return std::accumulate(v.begin(), v.end(), std::size_t{0}); }
}  // namespace

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  return do_split(color, key, name);
}

std::unique_ptr<Communicator> Communicator::split_node_local(const std::string& name) {
  // DIFFCP_NODE=<id> (every rank or none) overrides the backend's idea of a node: the emulated
  // hosts of scripts/emucluster.sh are separate nodes to MPI but share an emulated node's switch.
  std::int64_t node = -1;
  if (const auto env = env_value(EnvKnob::node)) {
    char* end = nullptr;
    const long long v = std::strtoll(env->c_str(), &end, 10);
    DIFFCP_CHECK(*end == '\0' && v >= 0 && v <= (1 << 30), "DIFFCP_NODE = '", *env,
                 "': expected a non-negative integer (the node this rank belongs to)");
    node = v;
  }
  // Agreement is set-up, like the split itself: it goes to the backend directly, uncounted.
  std::int64_t have = node >= 0 ? 1 : 0, ranks_with_node = 0;
  setup_op(do_all_reduce(&have, &ranks_with_node, 1, DType::i64, ReduceOp::sum), CommOp::all_reduce)->wait();
  DIFFCP_CHECK(ranks_with_node == 0 || ranks_with_node == size(), "DIFFCP_NODE is set on ", ranks_with_node,
               " of ", size(), " ranks: set it on every rank or on none");
  if (ranks_with_node == 0) return do_split_node_local(name);
  return do_split(static_cast<int>(node), rank(), name);
}

WorkPtr Communicator::all_gather_async(const void* send, void* recv, std::size_t count, DType type) {
  check_no_staged_op("all_gather");
  if (stages(false, send, recv)) {
    Staging s(*this, type);
    const void* hs = s.in(send, count);
    void* hr = s.out(recv, count * static_cast<std::size_t>(size()));
    return s.issue([&] { return all_gather_async(hs, hr, count, type); });
  }
  const std::size_t others = static_cast<std::size_t>(size() - 1);
  return issued(do_all_gather(send, recv, count, type), CommOp::all_gather, count * others, count * others, type,
                count * off_node_peers());
}

WorkPtr Communicator::all_gather_v_async(const void* send, void* recv,
                                         std::span<const std::size_t> counts, DType type, CollAlgo algo) {
  check_no_staged_op("all_gather_v");
  check_counts(counts, "all_gather_v");
  if (stages(algo == CollAlgo::hierarchical && hierarchy_useful(), send, recv)) {
    Staging s(*this, type);
    const void* hs = s.in(send, counts[static_cast<std::size_t>(rank())]);
    void* hr = s.out(recv, sum(counts));
    return s.issue([&] { return all_gather_v_async(hs, hr, counts, type, algo); });
  }
  if (algo == CollAlgo::hierarchical && hierarchy_useful()) return hier_all_gather_v(send, recv, counts, type);
  const std::size_t me = counts[static_cast<std::size_t>(rank())], all = sum(counts);
  return issued(do_all_gather_v(send, me, recv, counts, displacements(counts), type), CommOp::all_gather,
                me * static_cast<std::size_t>(size() - 1), all - me, type, me * off_node_peers());
}

WorkPtr Communicator::reduce_scatter_async(const void* send, void* recv, std::size_t count,
                                           DType type, ReduceOp op) {
  check_no_staged_op("reduce_scatter");
  check_reduce(op, type, "reduce_scatter");
  if (stages(false, send, recv)) {
    Staging s(*this, type);
    const void* hs = s.in(send, count * static_cast<std::size_t>(size()));
    void* hr = s.out(recv, count);
    return s.issue([&] { return reduce_scatter_async(hs, hr, count, type, op); });
  }
  const std::size_t others = static_cast<std::size_t>(size() - 1);
  return issued(do_reduce_scatter(send, recv, count, type, op), CommOp::reduce_scatter, count * others,
                count * others, type, count * off_node_peers());
}

WorkPtr Communicator::reduce_scatter_v_async(const void* send, void* recv,
                                             std::span<const std::size_t> counts, DType type,
                                             ReduceOp op, CollAlgo algo) {
  check_no_staged_op("reduce_scatter_v");
  check_counts(counts, "reduce_scatter_v");
  check_reduce(op, type, "reduce_scatter_v");
  if (algo == CollAlgo::hierarchical) {
    DIFFCP_CHECK(op == ReduceOp::sum && (type == DType::f32 || type == DType::f64 || type == DType::bf16),
                 "hierarchical reduce_scatter_v: supports sum of f32 / f64 / bf16, got ", dtype_name(type),
                 op == ReduceOp::sum ? "" : " with another reduction than sum");
  }
  if (stages(algo == CollAlgo::hierarchical && hierarchy_useful(), send, recv)) {
    Staging s(*this, type);
    const void* hs = s.in(send, sum(counts));
    void* hr = s.out(recv, counts[static_cast<std::size_t>(rank())]);
    return s.issue([&] { return reduce_scatter_v_async(hs, hr, counts, type, op, algo); });
  }
  if (algo == CollAlgo::hierarchical && hierarchy_useful()) return hier_reduce_scatter_v(send, recv, counts, type);
  const std::size_t me = counts[static_cast<std::size_t>(rank())], all = sum(counts);
  return issued(do_reduce_scatter_v(send, recv, counts, type, op), CommOp::reduce_scatter, all - me,
                me * static_cast<std::size_t>(size() - 1), type, inter_part(counts));
}

WorkPtr Communicator::all_reduce_async(const void* send, void* recv, std::size_t n, DType type,
                                       ReduceOp op, CollAlgo algo) {
  check_no_staged_op("all_reduce");
  check_reduce(op, type, "all_reduce");
  if (stages(algo == CollAlgo::hierarchical && hierarchy_useful(), send, recv)) {
    Staging s(*this, type);
    const void* hs = s.in(send, n);
    void* hr = s.out(recv, n);
    return s.issue([&] { return all_reduce_async(hs, hr, n, type, op, algo); });
  }
  if (algo == CollAlgo::hierarchical && hierarchy_useful()) return hier_all_reduce(send, recv, n, type, op);
  const std::size_t P = static_cast<std::size_t>(size()), p = static_cast<std::size_t>(rank());
  auto share = [&](std::size_t r) { return n / P + (r < n % P ? 1 : 0); };
  WorkPtr w = do_all_reduce(send, recv, n, type, op);
  std::size_t inter = 0;
  if (topology_)
    for (std::size_t r = 0; r < P; ++r)
      if (!topology_->same_node(rank(), static_cast<int>(r))) inter += share(r) + share(p);
  return issued(std::move(w), CommOp::all_reduce, 2 * (n - share(p)), 2 * (n - share(p)), type, inter);
}

WorkPtr Communicator::all_to_all_async(const void* send, void* recv, std::size_t count, DType type) {
  check_no_staged_op("all_to_all");
  if (stages(false, send, recv)) {
    Staging s(*this, type);
    const void* hs = s.in(send, count * static_cast<std::size_t>(size()));
    void* hr = s.out(recv, count * static_cast<std::size_t>(size()));
    return s.issue([&] { return all_to_all_async(hs, hr, count, type); });
  }
  const std::size_t others = static_cast<std::size_t>(size() - 1);
  return issued(do_all_to_all(send, recv, count, type), CommOp::all_to_all, count * others, count * others, type,
                count * off_node_peers());
}

WorkPtr Communicator::all_to_all_v_async(const void* send, std::span<const std::size_t> send_counts,
                                         void* recv, std::span<const std::size_t> recv_counts,
                                         DType type) {
  check_no_staged_op("all_to_all_v");
  check_counts(send_counts, "all_to_all_v send_counts");
  check_counts(recv_counts, "all_to_all_v recv_counts");
  if (stages(false, send, recv)) {
    Staging s(*this, type);
    const void* hs = s.in(send, sum(send_counts));
    void* hr = s.out(recv, sum(recv_counts));
    return s.issue([&] { return all_to_all_v_async(hs, send_counts, hr, recv_counts, type); });
  }
  const std::size_t me = static_cast<std::size_t>(rank());
  return issued(do_all_to_all_v(send, send_counts, displacements(send_counts), recv, recv_counts,
                                displacements(recv_counts), type),
                CommOp::all_to_all, sum(send_counts) - send_counts[me], sum(recv_counts) - recv_counts[me], type,
                inter_part(send_counts));
}

WorkPtr Communicator::broadcast_async(void* buf, std::size_t n, DType type, int root) {
  check_no_staged_op("broadcast");
  check_peer(root, "broadcast root");
  if (stages(false, buf)) {
    Staging s(*this, type);
    void* hb = rank() == root ? const_cast<void*>(s.in(buf, n)) : s.out(buf, n);  // the root's data is unchanged
    return s.issue([&] { return broadcast_async(hb, n, type, root); });
  }
  WorkPtr w = do_broadcast(buf, n, type, root);
  const bool is_root = rank() == root;
  return issued(std::move(w), CommOp::broadcast, is_root ? n * static_cast<std::size_t>(size() - 1) : 0,
                is_root ? 0 : n, type, is_root ? n * off_node_peers() : 0, root);
}

WorkPtr Communicator::send_async(const void* buf, std::size_t n, DType type, int dst, int tag) {
  check_peer(dst, "send destination");
  DIFFCP_CHECK(tag >= 0 && tag <= kMaxUserTag, "send: tag ", tag, " must be in [0, ", kMaxUserTag, "]");
  if (stages(false, buf)) {
    Staging s(*this, type);
    const void* hb = s.in(buf, n);
    return s.issue([&] { return send_async(hb, n, type, dst, tag); });
  }
  return issued(do_send(buf, n, type, dst, tag), CommOp::send, n, 0, type,
                topology_ && !topology_->same_node(rank(), dst) ? n : 0, dst);
}

WorkPtr Communicator::recv_async(void* buf, std::size_t n, DType type, int src, int tag) {
  check_peer(src, "recv source");
  DIFFCP_CHECK(tag >= 0 && tag <= kMaxUserTag, "recv: tag ", tag, " must be in [0, ", kMaxUserTag, "]");
  if (stages(false, buf)) {
    Staging s(*this, type);
    void* hb = s.out(buf, n);
    return s.issue([&] { return recv_async(hb, n, type, src, tag); });
  }
  return issued(do_recv(buf, n, type, src, tag), CommOp::recv, 0, n, type, 0, src);
}

WorkPtr Communicator::barrier_async() {
  check_no_staged_op("barrier");
  return issued(do_barrier(), CommOp::barrier, 0, 0, DType::u8);
}

}  // namespace diffcp

// ---- the view forms: dtype and memory from the tensors ----
namespace diffcp {

namespace {
// The view names the memory its data lives in (its backend's device_of: ops/backend.hpp backend_of).
void check_memory(const ConstTensorView& t) {
  const Device d = backend_of(t.data).device_of(t.data);
  DIFFCP_CHECK(t.numel() == 0 || d == t.device, "communicator: a view of ", t.describe(), " points into ",
               device_name(d), " memory");
}
// `send` and `recv` hold one dtype in one memory, contiguous, and at least their parts.
void check_pair(const char* op, const ConstTensorView& send, std::size_t send_n, const ConstTensorView& recv,
                std::size_t recv_n) {
  DIFFCP_CHECK(send.dtype == recv.dtype && send.device == recv.device && send.is_contiguous() && recv.is_contiguous(),
               op, ": send ", send.describe(), " and recv ", recv.describe(),
               " must be contiguous, of one dtype, in one memory");
  DIFFCP_CHECK(static_cast<std::size_t>(send.numel()) >= send_n && static_cast<std::size_t>(recv.numel()) >= recv_n,
               op, ": send ", send.describe(), " and recv ", recv.describe(), " hold fewer than the ", send_n, " and ",
               recv_n, " elements the counts move");
}
}  // namespace

WorkPtr Communicator::all_gather_async(ConstTensorView send, TensorView recv) {
  const std::size_t n = static_cast<std::size_t>(send.numel());
  check_pair("all_gather", send, n, recv, n * static_cast<std::size_t>(size()));
  check_memory(send), check_memory(recv);
  return all_gather_async(send.data, recv.data, n, send.dtype);
}

WorkPtr Communicator::all_gather_v_async(ConstTensorView send, TensorView recv, std::span<const std::size_t> counts,
                                         CollAlgo algo) {
  check_counts(counts, "all_gather_v");
  check_pair("all_gather_v", send, counts[static_cast<std::size_t>(rank())], recv, sum(counts));
  check_memory(send), check_memory(recv);
  return all_gather_v_async(send.data, recv.data, counts, send.dtype, algo);
}

WorkPtr Communicator::reduce_scatter_v_async(ConstTensorView send, TensorView recv,
                                             std::span<const std::size_t> counts, ReduceOp op, CollAlgo algo) {
  check_counts(counts, "reduce_scatter_v");
  check_pair("reduce_scatter_v", send, sum(counts), recv, counts[static_cast<std::size_t>(rank())]);
  check_memory(send), check_memory(recv);
  return reduce_scatter_v_async(send.data, recv.data, counts, send.dtype, op, algo);
}

WorkPtr Communicator::all_to_all_v_async(ConstTensorView send, std::span<const std::size_t> send_counts,
                                         TensorView recv, std::span<const std::size_t> recv_counts) {
  check_counts(send_counts, "all_to_all_v");
  check_counts(recv_counts, "all_to_all_v");
  check_pair("all_to_all_v", send, sum(send_counts), recv, sum(recv_counts));
  check_memory(send), check_memory(recv);
  return all_to_all_v_async(send.data, send_counts, recv.data, recv_counts, send.dtype);
}

WorkPtr Communicator::all_reduce_async(TensorView inout, ReduceOp op, CollAlgo algo) {
  DIFFCP_CHECK(inout.is_contiguous(), "all_reduce: ", inout.describe(), " is not contiguous");
  check_memory(inout);
  return all_reduce_async(inout.data, inout.data, static_cast<std::size_t>(inout.numel()), inout.dtype, op, algo);
}

WorkPtr Communicator::broadcast_async(ConstTensorView root_data, TensorView recv, int root) {
  const bool me = rank() == root;
  check_pair("broadcast", root_data, 0, recv, 0);
  check_memory(root_data), check_memory(recv);
  return broadcast_async(me ? const_cast<void*>(root_data.data) : recv.data,
                         static_cast<std::size_t>(me ? root_data.numel() : recv.numel()), root_data.dtype, root);
}

WorkPtr Communicator::send_async(ConstTensorView buf, int dst, int tag) {
  DIFFCP_CHECK(buf.is_contiguous(), "send: ", buf.describe(), " is not contiguous");
  check_memory(buf);
  return send_async(buf.data, static_cast<std::size_t>(buf.numel()), buf.dtype, dst, tag);
}

WorkPtr Communicator::recv_async(TensorView buf, int src, int tag) {
  DIFFCP_CHECK(buf.is_contiguous(), "recv: ", buf.describe(), " is not contiguous");
  check_memory(buf);
  return recv_async(buf.data, static_cast<std::size_t>(buf.numel()), buf.dtype, src, tag);
}

namespace {
// The transfers of one hop: complete when every one of them is.
class HopWork final : public Work {
 public:
  explicit HopWork(std::vector<WorkPtr> works) : works_(std::move(works)) {}
  void wait() override {
    for (WorkPtr& w : works_) w->wait();
  }
  void synchronize() override {
    for (WorkPtr& w : works_) w->synchronize();
  }
  bool test() override {
    bool all = true;
    for (WorkPtr& w : works_) all = w->test() && all;  // test every one: each drives progress
    return all;
  }

 private:
  std::vector<WorkPtr> works_;
};
}  // namespace

WorkPtr Communicator::exchange_async(std::span<const P2pOp> ops) {
  std::vector<WorkPtr> works;
  works.reserve(ops.size());
  do_group_begin();
  try {
    for (const P2pOp& op : ops) {
      if (op.is_send) {
        works.push_back(send_async(op.buf, op.peer, 0));
      } else {
        TensorView out{const_cast<void*>(op.buf.data), op.buf.dtype, op.buf.device, op.buf.rank, op.buf.shape,
                       op.buf.stride};
        works.push_back(recv_async(out, op.peer, 0));
      }
    }
  } catch (...) {
    do_group_cancel();  // none of the hop is issued where the backend can hold it back
    throw;
  }
  do_group_end();
  return std::make_unique<HopWork>(std::move(works));
}

}  // namespace diffcp
