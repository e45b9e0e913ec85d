#include "diffcp/dit/wire.hpp"

#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/fp8.hpp"

namespace diffcp {

Wire parse_wire(const std::string& name) {
  if (name == "auto") return Wire::compute;
  if (name == "fp8") return Wire::fp8;
  DIFFCP_FAIL("`wire` '", name, "': unknown wire format, expected auto (the compute dtype) or fp8 (e4m3 with one f32 scale per (token, head))");
}

const char* wire_name(Wire w) { return w == Wire::fp8 ? "fp8" : "auto"; }

void check_wire_supported(Wire w, DType compute) {
  if (w != Wire::fp8) return;
  backend_for(OpKind::fp8_encode, compute);
  backend_for(OpKind::fp8_decode, compute);
}

std::uint64_t WireFormat::bytes(std::int64_t elements) const {
  DIFFCP_CHECK(elements >= 0, "wire: ", elements, " elements");
  if (!fp8()) return static_cast<std::uint64_t>(elements) * dtype_size(compute);
  DIFFCP_CHECK(head_dim >= 1 && elements % head_dim == 0, "fp8 wire: ", elements, " elements are not whole blocks of d_h = ", head_dim);
  return static_cast<std::uint64_t>(fp8_encoded_bytes(elements / head_dim, head_dim));
}

std::uint64_t WireFormat::scale_bytes(std::int64_t elements) const {
  return fp8() ? bytes(elements) - static_cast<std::uint64_t>(elements) : 0;
}

std::uint64_t WireFormat::scale_share(std::uint64_t payload_bytes) const {
  if (!fp8()) return 0;
  const std::uint64_t block = static_cast<std::uint64_t>(head_dim + kFp8ScaleBytes);
  DIFFCP_CHECK(payload_bytes % block == 0, "fp8 wire: ", payload_bytes, " payload bytes are not whole blocks of ", block);
  return payload_bytes / block * kFp8ScaleBytes;
}

}  // namespace diffcp
