#include "diffcp/core/dtype.hpp"

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

const char* device_name(Device d) {
  switch (d) {
    case Device::host: return "host";
    case Device::guard: return "guard";
  }
  return "?";
}

}  // namespace diffcp
