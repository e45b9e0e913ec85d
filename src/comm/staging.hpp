// Private to src/comm/: the host staging of one operation on device memory (comm/staging.cpp).
#pragma once

#include <functional>
#include <vector>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

class Backend;

// in(): the send data copied to a host buffer; out(): the host buffer the operation receives into
// (the send buffer itself when it is the same device buffer); issue(): runs `op` on them and
// returns the Work that copies the received data back to the device when it completes.
class Staging {
 public:
  Staging(Communicator& c, DType type);
  const void* in(const void* dev, std::size_t count);
  void* out(void* dev, std::size_t count);
  WorkPtr issue(const std::function<WorkPtr()>& op);

 private:
  Communicator& c_;
  DType type_;
  std::vector<unsigned char> in_, out_;
  const void* in_src_ = nullptr;
  void* out_dev_ = nullptr;
  std::size_t out_bytes_ = 0;
};

}  // namespace diffcp
