#include "diffcp/core/dtype.hpp"

#include <deque>
#include <mutex>
#include <string>

#include "diffcp/core/error.hpp"

namespace diffcp {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::u8: return 1;
    case DType::u16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u64: return 8;
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
  }
  DIFFCP_FAIL("unknown DType ", static_cast<int>(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::u8: return "u8";
    case DType::u16: return "u16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u64: return "u64";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
  }
  return "?";
}

bool dtype_is_float(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16; }

DType compute_dtype(std::string_view name, std::string_view what) {
  DIFFCP_CHECK(name == "f32" || name == "bf16", what, " '", name, "': expected f32 or bf16");
  return name == "bf16" ? DType::bf16 : DType::f32;
}

namespace {
struct DeviceNames {
  std::mutex mu;
  std::deque<std::string> names{"host"};  // index = the Device's value; a deque keeps c_str() stable
};
DeviceNames& device_names() {
  static DeviceNames n;
  return n;
}
}  // namespace

Device register_device(const char* name) {
  DeviceNames& n = device_names();
  std::lock_guard<std::mutex> lock(n.mu);
  for (std::size_t i = 0; i < n.names.size(); ++i)
    if (n.names[i] == name) return static_cast<Device>(i);
  DIFFCP_CHECK(n.names.size() < 256, "register_device('", name, "'): 255 devices are registered already");
  n.names.emplace_back(name);
  return static_cast<Device>(n.names.size() - 1);
}

const char* device_name(Device d) {
  DeviceNames& n = device_names();
  std::lock_guard<std::mutex> lock(n.mu);
  const auto i = static_cast<std::size_t>(d);
  return i < n.names.size() ? n.names[i].c_str() : "?";
}

}  // namespace diffcp
