// Element types of tensors and messages, and the devices memory lives on. Every element size in
// diffcp (buffers, messages, closed-form byte counts) comes from dtype_size().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace diffcp {

// f32 / bf16: compute and storage; f64: references and statistics; the integers: indices, labels,
// raw payloads. bf16 is stored as its 16 bits (core/half.hpp converts).
enum class DType : std::uint8_t { u8, u16, i32, i64, u64, f32, f64, bf16 };
std::size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "f32", "bf16", ...
bool dtype_is_float(DType t);     // f32, f64, bf16
// The one parser of a compute dtype's name: "f32" or "bf16"; else an error
// "<what> '<name>': expected f32 or bf16" (what: the field or flag, e.g. "--dtype").
DType compute_dtype(std::string_view name, std::string_view what);

struct bf16_t {  // the storage type of DType::bf16
  std::uint16_t bits = 0;
};

template <typename T> constexpr DType dtype_of() = delete;  // only the types below are tensor elements
template <> constexpr DType dtype_of<std::uint8_t>() { return DType::u8; }
template <> constexpr DType dtype_of<std::uint16_t>() { return DType::u16; }
template <> constexpr DType dtype_of<std::int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<std::uint64_t>() { return DType::u64; }
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<bf16_t>() { return DType::bf16; }

// Where a tensor's memory lives: the host (this process's memory), or a device that a backend
// registered (register_device). Open: the library names only the host; the guard device of the
// tests (testing/guard_backend.hpp) and a GPU backend's device are registered by their backends.
enum class Device : std::uint8_t { host = 0 };
// The device called `name` ("cuda", "guard"), registered on first use: the same name gives the
// same device. Thread-safe. At most 255 devices besides the host.
Device register_device(const char* name);
const char* device_name(Device d);  // "host", a registered name, or "?"

}  // namespace diffcp
