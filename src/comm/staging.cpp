// Collectives on device memory through host buffers (comm/communicator.hpp, "Device memory"): the
// send data is copied to the host by its memory's backend (backend_of), the operation runs on host
// buffers, and the received data is copied back when it completes.
#include "staging.hpp"

#include <atomic>
#include <exception>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

bool Communicator::stages(bool hierarchical, const void* a, const void* b) const {
  for (const void* p : {a, b}) {
    const Device d = p ? backend_of(p).device_of(p) : Device::host;
    if (d != Device::host && (hierarchical || !reads_device(d))) return true;
  }
  return false;
}

namespace {

// The operation on host buffers; at completion, the received bytes go back to the device.
class StagedCopyBack final : public Work {
 public:
  StagedCopyBack(WorkPtr inner, Backend& b, std::vector<unsigned char> in, std::vector<unsigned char> out,
                 void* dev_out, const unsigned char* host_out, std::size_t out_bytes, Device device,
                 Communicator::StagingStats& stats)
      : in_(std::move(in)), out_(std::move(out)), b_(b), dev_out_(dev_out), host_out_(host_out),
        out_bytes_(out_bytes), device_(device), stats_(stats), inner_(std::move(inner)) {}
  ~StagedCopyBack() override {
    if (!done_ && std::uncaught_exceptions() == 0) wait();
  }
  void wait() override {
    if (done_) return;
    inner_->wait();
    finish();
  }
  bool test() override {
    if (!done_ && inner_->test()) finish();
    return done_;
  }

 private:
  void finish() {
    if (out_bytes_ > 0) {
      b_.copy(dev_out_, device_, host_out_, Device::host, out_bytes_);
      stats_.bytes_to_device += out_bytes_;
    }
    done_ = true;  // only once the data is on the device
  }
  std::vector<unsigned char> in_, out_;  // kept alive until the operation completes (inner_ is destroyed first)
  Backend& b_;
  void* dev_out_;
  const unsigned char* host_out_;
  std::size_t out_bytes_;
  Device device_;
  Communicator::StagingStats& stats_;
  bool done_ = false;
  WorkPtr inner_;  // last: destroyed (waited) before the host buffers it reads and writes
};

}  // namespace

Staging::Staging(Communicator& c, DType type) : c_(c), type_(type) {}

namespace {
std::atomic<std::int64_t> g_staged_reads{0};
}  // namespace

std::int64_t Communicator::staged_reads() { return g_staged_reads.load(std::memory_order_relaxed); }

const void* Staging::in(const void* dev, std::size_t count) {
  const std::size_t bytes = count * dtype_size(type_);
  in_src_ = dev;
  in_.resize(bytes);
  if (bytes) {
    Backend& b = backend_of(dev);
    b.copy(in_.data(), Device::host, dev, b.device_of(dev), bytes);
    g_staged_reads.fetch_add(1, std::memory_order_relaxed);
  }
  c_.staging_.bytes_to_host += bytes;
  return in_.data();
}

void* Staging::out(void* dev, std::size_t count) {
  out_dev_ = dev;
  out_bytes_ = count * dtype_size(type_);
  if (dev == in_src_ && in_.size() >= out_bytes_) return in_.data();  // in place (all_reduce, broadcast)
  out_.resize(out_bytes_);
  return out_.data();
}

WorkPtr Staging::issue(const std::function<WorkPtr()>& op) {
  ++c_.staging_.calls;
  WorkPtr w = op();  // the same operation, on the host buffers
  const unsigned char* host_out = out_dev_ == in_src_ && out_.empty() ? in_.data() : out_.data();
  Backend& b = backend_of(out_dev_);
  const Device out_device = out_dev_ ? b.device_of(out_dev_) : Device::host;
  return std::make_unique<StagedCopyBack>(std::move(w), b, std::move(in_), std::move(out_), out_dev_, host_out,
                                          out_bytes_, out_device, c_.staging_);
}

}  // namespace diffcp
