// Exceptions must not escape an OpenMP region (that is std::terminate). Loop bodies that may
// throw run through ParallelErrors::run; the first exception is rethrown after the region.
#pragma once

#include <exception>
#include <mutex>

namespace diffcp {

class ParallelErrors {
 public:
  template <typename F>
  void run(F&& body) noexcept {
    try {
      body();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!first_) first_ = std::current_exception();
    }
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::mutex mu_;
  std::exception_ptr first_;
};

}  // namespace diffcp
