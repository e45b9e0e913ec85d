// A JSON value read as an int64 only when it is a JSON integer below 2^63. nlohmann's
// get<std::int64_t>() would also take a float and cast it (undefined behaviour for 1e300, 63.9
// silently becomes 63) or wrap an unsigned value past 2^63. Callers word their own error.
#pragma once

#include <cstdint>
#include <optional>

#include <nlohmann/json.hpp>

namespace diffcp {

inline std::optional<std::int64_t> json_int64(const nlohmann::json& x) {
  if (!x.is_number_integer() || (x.is_number_unsigned() && x.get<std::uint64_t>() > (~std::uint64_t{0} >> 1)))
    return std::nullopt;
  return x.get<std::int64_t>();
}

}  // namespace diffcp
