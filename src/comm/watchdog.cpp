// The collective watchdog (described in comm/communicator.hpp): an operation issued while the
// timeout is on is wrapped in a WatchedWork whose wait()/test() check a deadline; on expiry the
// ranks tell each other where they are and the operation fails with one message saying which
// ranks had not arrived.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <sstream>
#include <thread>

#include "diffcp/core/env.hpp"
#include "diffcp/comm/communicator.hpp"

namespace diffcp {

namespace {

using Clock = std::chrono::steady_clock;

// The process-wide timeout: unset until set_watchdog_timeout or the first read, which takes
// DIFFCP_COMM_TIMEOUT (0 when unset).
std::optional<double>& timeout_setting() {
  static std::optional<double> seconds;
  return seconds;
}

double timeout_from_env() {
  const auto env = env_value(EnvKnob::comm_timeout);
  if (!env) return 0.0;
  char* end = nullptr;
  const double v = std::strtod(env->c_str(), &end);
  DIFFCP_CHECK(*end == '\0' && std::isfinite(v) && v >= 0, "DIFFCP_COMM_TIMEOUT = '", *env,
               "': expected a number of seconds >= 0 (0 = no watchdog)");
  return v;
}

bool is_p2p(CommOp op) { return op == CommOp::send || op == CommOp::recv; }

std::string human_bytes(std::uint64_t b) {
  std::ostringstream os;
  os.precision(3);
  if (b < 1024) os << b << " B";
  else if (b < (1u << 20)) os << static_cast<double>(b) / 1024.0 << " KiB";
  else if (b < (1u << 30)) os << static_cast<double>(b) / (1u << 20) << " MiB";
  else os << static_cast<double>(b) / (1u << 30) << " GiB";
  return os.str();
}

std::string op_label(const WatchdogReport& r) {
  const auto op = static_cast<CommOp>(r.op);
  if (r.peer == WatchdogReport::kSetup)
    return std::string("set-up ") + comm_op_name(op) + " (split / topology, after collective #" + std::to_string(r.seq) + ")";
  if (is_p2p(op)) return std::string(comm_op_name(op)) + (op == CommOp::send ? " to rank " : " from rank ") +
                         std::to_string(r.peer);
  return std::string(comm_op_name(op)) + " #" + std::to_string(r.seq);
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

// An operation under the watchdog: completes as the backend's does, or fails at the deadline.
class WatchedWork final : public Work {
 public:
  // Saturating: a timeout beyond what the clock can count (~292 years) never expires.
  static Clock::time_point deadline(Clock::time_point from, double seconds) {
    const double room = std::chrono::duration<double>(Clock::time_point::max() - from).count();
    if (seconds >= room * 0.5) return Clock::time_point::max();
    return from + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }
  WatchedWork(WorkPtr inner, Communicator& comm, WatchdogReport what, std::uint64_t sent, std::uint64_t recvd,
              double timeout_s)
      : inner_(std::move(inner)), comm_(comm), what_(what), sent_(sent), recvd_(recvd), timeout_s_(timeout_s),
        issued_(Clock::now()), deadline_(deadline(issued_, timeout_s)) {}
  ~WatchedWork() override {
    if (done_ || ordered_ || std::uncaught_exceptions() != 0) return;
    try {
      wait();
    } catch (const std::exception& e) {  // a destructor cannot throw: end the process (the job with it)
      std::fprintf(stderr, "diffcp: error: %s\n", e.what());
      std::fflush(stderr);
      std::abort();
    }
  }
  // On a device stream (NCCL): the compute stream waits, the backend's own watch keeps the
  // deadline; on the host: poll until complete, or fail at the deadline.
  void wait() override {
    if (done_ || ordered_) return;
    if (inner_->order_stream(deadline_, describe())) {
      ordered_ = true;
      return;
    }
    synchronize();
  }
  void synchronize() override {
    while (!test()) std::this_thread::yield();  // a peer on the same core gets to run
  }
  bool test() override {
    if (done_) return true;
    if (inner_->test()) return done_ = true;
    const Clock::time_point now = Clock::now();
    if (now >= deadline_) {
      what_.waited_s = std::chrono::duration<double>(now - issued_).count();
      comm_.watchdog_expired(what_, sent_, recvd_, timeout_s_);
    }
    return false;
  }

 private:
  WorkPtr inner_;
  Communicator& comm_;
  WatchdogReport what_;
  std::uint64_t sent_, recvd_;
  double timeout_s_;
  // "all_gather (collective 12) on 'cp'": what a device-side watch names when it expires.
  std::string describe() const {
    const auto op = static_cast<CommOp>(what_.op);
    return std::string(comm_op_name(op)) +
           (is_p2p(op) ? " with rank " + std::to_string(what_.peer) : " (collective " + std::to_string(what_.seq) + ")") +
           " on '" + comm_.name() + "'";
  }
  Clock::time_point issued_, deadline_;
  bool done_ = false;     // complete (the host saw it)
  bool ordered_ = false;  // handed to the device stream (wait() on NCCL)
};

void Communicator::set_watchdog_timeout(double seconds) {
  DIFFCP_CHECK(std::isfinite(seconds) && seconds >= 0, "communicator timeout = ", seconds,
               " s: expected a number of seconds >= 0 (0 = no watchdog)");
  timeout_setting() = seconds;
}

double Communicator::watchdog_timeout() {
  if (!timeout_setting()) timeout_setting() = timeout_from_env();
  return *timeout_setting();
}

WorkPtr Communicator::issued(WorkPtr w, CommOp op, std::size_t sent, std::size_t recvd, DType type,
                             std::size_t sent_inter, int peer) {
  const std::uint64_t es = dtype_size(type), sent_b = sent * es, recvd_b = recvd * es;
  OpCounter& c = stats_[op];
  c.calls += 1;
  c.bytes_sent += sent_b;
  c.bytes_recv += recvd_b;
  c.bytes_sent_inter += sent_inter * es;
  if (!is_p2p(op)) ++coll_seq_;
  return watch(std::move(w), op, peer, sent_b, recvd_b);
}

WorkPtr Communicator::setup_op(WorkPtr w, CommOp op) { return watch(std::move(w), op, WatchdogReport::kSetup, 0, 0); }

WorkPtr Communicator::watch(WorkPtr w, CommOp op, int peer, std::uint64_t sent_b, std::uint64_t recvd_b) {
  const double timeout = watchdog_timeout();
  if (timeout <= 0) return w;
  const WatchdogReport what{coll_seq_, static_cast<std::uint32_t>(op), peer, 0.0};
  return std::make_unique<WatchedWork>(std::move(w), *this, what, sent_b, recvd_b, timeout);
}

std::vector<std::optional<WatchdogReport>> Communicator::do_watchdog_exchange(const WatchdogReport&,
                                                                              std::span<const int>, double) {
  return std::vector<std::optional<WatchdogReport>>(static_cast<std::size_t>(size()));
}

void Communicator::watchdog_expired(const WatchdogReport& mine, std::uint64_t bytes_sent, std::uint64_t bytes_recv,
                                    double timeout_s) {
  const auto op = static_cast<CommOp>(mine.op);
  // Who should be in this operation with us: the peer of a send / recv, else every rank.
  std::vector<int> wanted;
  if (is_p2p(op)) {
    if (mine.peer != rank()) wanted.push_back(mine.peer);
  } else {
    for (int r = 0; r < size(); ++r)
      if (r != rank()) wanted.push_back(r);
  }
  const double grace = std::min(2.0, timeout_s);
  const auto reports = do_watchdog_exchange(mine, wanted, grace);

  std::vector<int> silent, same;
  std::ostringstream elsewhere;
  for (int r : wanted) {
    const auto& got = reports[static_cast<std::size_t>(r)];
    if (!got) silent.push_back(r);
    else if (!is_p2p(op) && got->seq == mine.seq && got->op == mine.op && got->peer == mine.peer) same.push_back(r);
    else {
      char waited[32];
      std::snprintf(waited, sizeof waited, "%.1f", got->waited_s);
      elsewhere << "; rank " << r << " is stuck in " << op_label(*got) << " (for " << waited << " s)";
    }
  }
  std::ostringstream msg;
  msg << "watchdog: " << op_label(mine) << " on communicator '" << name_ << "' (rank " << rank() << " of " << size();
  if (mine.peer != WatchdogReport::kSetup)
    msg << "; this rank sends " << human_bytes(bytes_sent) << ", receives " << human_bytes(bytes_recv);
  msg << ") did not complete within " << timeout_s << " s (`comm_timeout` / DIFFCP_COMM_TIMEOUT)";
  if (!silent.empty())
    msg << "; not arrived: " << rank_list(silent) << " (no answer within " << grace
        << " s: stalled, busy outside the communicator, dead or unreachable)";
  if (!same.empty()) msg << "; arrived and waiting in it too: " << rank_list(same);
  msg << elsewhere.str();
  // One message, not one per rank: the lowest of the ranks that arrived together reports at once;
  // the others give it a second to end the job first (they report too if it does not).
  if (!same.empty() && same.front() < rank()) std::this_thread::sleep_for(std::chrono::seconds(1));
  DIFFCP_FAIL(msg.str());
}

}  // namespace diffcp
