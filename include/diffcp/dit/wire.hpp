// The payload format of the DiT's attention exchanges (--wire): what q, k, v and o look like while
// they travel (Ulysses all-to-alls, V-Major's selective sends and caches, Ring's K|V hops).
//
//   auto  the compute dtype (f32 or bf16, AttentionExchange::set_compute): e bytes per element
//   fp8   e4m3 with one f32 scale per (token, head) (ops/fp8.hpp's blocks of d_h elements):
//         1 byte per element + 4 bytes per (token, head); decoded into the compute dtype before
//         attention, attention itself unchanged. The encoder reads the rows the compute-dtype wire
//         would have sent (bf16 compute: the rows already rounded to bf16).
//
// Payload bytes are counted as whole blocks: every message of the exchanges carries whole (token,
// head) rows, so the scales are exactly 4 / (d_h + 4) of an fp8 message.
#pragma once

#include <cstdint>
#include <string>

#include "diffcp/core/dtype.hpp"

namespace diffcp {

enum class Wire : std::uint8_t { compute, fp8 };
// "auto" (the compute dtype) | "fp8"; anything else throws naming the values.
Wire parse_wire(const std::string& name);
const char* wire_name(Wire w);  // "auto", "fp8"
// fp8: throws "backend '<name>' does not support fp8_encode on <compute>" (or fp8_decode) when the
// active backend declines the codec for `compute`; local, so a caller can refuse before any
// communication. Wire::compute: nothing.
void check_wire_supported(Wire w, DType compute);

// Bytes on the wire of payload elements given as whole (token, head) blocks of head_dim.
struct WireFormat {
  DType compute = DType::f32;  // f32 or bf16: what attention reads
  Wire wire = Wire::compute;
  std::int64_t head_dim = 1;   // d_h: elements per scale (fp8)

  bool fp8() const { return wire == Wire::fp8; }
  // bytes(elements) = elements * dtype_size(compute), or (fp8) elements + 4 elements / d_h;
  // elements must be a multiple of d_h for fp8 (checked).
  std::uint64_t bytes(std::int64_t elements) const;
  // Of bytes(elements): the scales (0 unless fp8).
  std::uint64_t scale_bytes(std::int64_t elements) const;
  // Of `payload_bytes` moved as whole blocks: the scales (0 unless fp8).
  std::uint64_t scale_share(std::uint64_t payload_bytes) const;
};

}  // namespace diffcp
