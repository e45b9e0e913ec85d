#include "comm/communicator.hpp"

#include <numeric>

#include <nlohmann/json.hpp>

namespace diffcp {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::u8: return 1;
    case DType::u16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::f32: return 4;
    case DType::f64: return 8;
  }
  DIFFCP_FAIL("unknown DType ", static_cast<int>(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::u8: return "u8";
    case DType::u16: return "u16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
  }
  return "?";
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
  }
  return t;
}

nlohmann::json CommStats::to_json() const {
  auto one = [](const OpCounter& c) {
    return nlohmann::json{{"calls", c.calls}, {"bytes_sent", c.bytes_sent}, {"bytes_recv", c.bytes_recv}};
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

void Communicator::check_peer(int peer, const char* what) const {
  DIFFCP_CHECK(peer >= 0 && peer < size(), what, ": rank ", peer, " outside [0, ", size(), ")");
}

namespace {
std::vector<std::size_t> exclusive_scan(std::span<const std::size_t> counts) {
  std::vector<std::size_t> displs(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), std::size_t{0});
  return displs;
}
std::size_t sum(std::span<const std::size_t> v) { return std::accumulate(v.begin(), v.end(), std::size_t{0}); }
}  // namespace

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  return do_split(color, key, name);
}

std::unique_ptr<Communicator> Communicator::split_node_local(const std::string& name) {
  return do_split_node_local(name);
}

WorkPtr Communicator::all_gather_async(const void* send, void* recv, std::size_t count, DType type) {
  std::vector<std::size_t> counts(static_cast<std::size_t>(size()), count);
  return all_gather_v_async(send, recv, counts, type);
}

WorkPtr Communicator::all_gather_v_async(const void* send, void* recv,
                                         std::span<const std::size_t> counts, DType type) {
  check_counts(counts, "all_gather_v");
  const std::size_t me = counts[static_cast<std::size_t>(rank())], all = sum(counts);
  OpCounter& c = stats_[CommOp::all_gather];
  c.calls += 1;
  c.bytes_sent += me * static_cast<std::size_t>(size() - 1) * dtype_size(type);
  c.bytes_recv += (all - me) * dtype_size(type);
  const auto displs = exclusive_scan(counts);
  return do_all_gather_v(send, me, recv, counts, displs, type);
}

WorkPtr Communicator::reduce_scatter_async(const void* send, void* recv, std::size_t count,
                                           DType type, ReduceOp op) {
  std::vector<std::size_t> counts(static_cast<std::size_t>(size()), count);
  return reduce_scatter_v_async(send, recv, counts, type, op);
}

WorkPtr Communicator::reduce_scatter_v_async(const void* send, void* recv,
                                             std::span<const std::size_t> counts, DType type,
                                             ReduceOp op) {
  check_counts(counts, "reduce_scatter_v");
  const std::size_t me = counts[static_cast<std::size_t>(rank())], all = sum(counts);
  OpCounter& c = stats_[CommOp::reduce_scatter];
  c.calls += 1;
  c.bytes_sent += (all - me) * dtype_size(type);
  c.bytes_recv += me * static_cast<std::size_t>(size() - 1) * dtype_size(type);
  return do_reduce_scatter_v(send, recv, counts, type, op);
}

WorkPtr Communicator::all_reduce_async(const void* send, void* recv, std::size_t count, DType type,
                                       ReduceOp op) {
  const std::size_t P = static_cast<std::size_t>(size()), p = static_cast<std::size_t>(rank());
  const std::size_t share = count / P + (p < count % P ? 1 : 0);
  OpCounter& c = stats_[CommOp::all_reduce];
  c.calls += 1;
  c.bytes_sent += 2 * (count - share) * dtype_size(type);
  c.bytes_recv += 2 * (count - share) * dtype_size(type);
  return do_all_reduce(send, recv, count, type, op);
}

WorkPtr Communicator::all_to_all_async(const void* send, void* recv, std::size_t count, DType type) {
  std::vector<std::size_t> counts(static_cast<std::size_t>(size()), count);
  return all_to_all_v_async(send, counts, recv, counts, type);
}

WorkPtr Communicator::all_to_all_v_async(const void* send, std::span<const std::size_t> send_counts,
                                         void* recv, std::span<const std::size_t> recv_counts,
                                         DType type) {
  check_counts(send_counts, "all_to_all_v send_counts");
  check_counts(recv_counts, "all_to_all_v recv_counts");
  const std::size_t me = static_cast<std::size_t>(rank());
  OpCounter& c = stats_[CommOp::all_to_all];
  c.calls += 1;
  c.bytes_sent += (sum(send_counts) - send_counts[me]) * dtype_size(type);
  c.bytes_recv += (sum(recv_counts) - recv_counts[me]) * dtype_size(type);
  const auto sd = exclusive_scan(send_counts), rd = exclusive_scan(recv_counts);
  return do_all_to_all_v(send, send_counts, sd, recv, recv_counts, rd, type);
}

WorkPtr Communicator::broadcast_async(void* buf, std::size_t count, DType type, int root) {
  check_peer(root, "broadcast root");
  OpCounter& c = stats_[CommOp::broadcast];
  c.calls += 1;
  if (rank() == root)
    c.bytes_sent += count * static_cast<std::size_t>(size() - 1) * dtype_size(type);
  else
    c.bytes_recv += count * dtype_size(type);
  return do_broadcast(buf, count, type, root);
}

WorkPtr Communicator::send_async(const void* buf, std::size_t count, DType type, int dst, int tag) {
  check_peer(dst, "send destination");
  DIFFCP_CHECK(tag >= 0, "send: tag ", tag, " must be >= 0");
  OpCounter& c = stats_[CommOp::send];
  c.calls += 1;
  c.bytes_sent += count * dtype_size(type);
  return do_send(buf, count, type, dst, tag);
}

WorkPtr Communicator::recv_async(void* buf, std::size_t count, DType type, int src, int tag) {
  check_peer(src, "recv source");
  DIFFCP_CHECK(tag >= 0, "recv: tag ", tag, " must be >= 0");
  OpCounter& c = stats_[CommOp::recv];
  c.calls += 1;
  c.bytes_recv += count * dtype_size(type);
  return do_recv(buf, count, type, src, tag);
}

WorkPtr Communicator::barrier_async() {
  stats_[CommOp::barrier].calls += 1;
  return do_barrier();
}

}  // namespace diffcp
