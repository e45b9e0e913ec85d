// safetensors files (the format the Python ecosystem writes): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}}, then the raw little-endian data. Reading validates everything: header
// length against the file size, JSON, dtypes, shapes, offsets inside the data and consistent
// with dtype*shape, no overlap. Errors name the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace diffcp {

class SafeTensors {
 public:
  struct Info {
    std::string dtype;  // "F32", "F64", "I32", "I64", "U8", ...
    std::vector<std::int64_t> shape;
    std::int64_t begin = 0, end = 0;  // byte offsets into the data section
  };

  explicit SafeTensors(const std::string& path);

  bool has(const std::string& name) const { return info_.count(name) != 0; }
  std::vector<std::string> names() const;  // every tensor, sorted
  // The header's __metadata__ (string values; others are refused at open).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const Info& info(const std::string& name) const;
  // Typed copies; throw unless the dtype matches (and the rank when `rank` >= 0).
  std::vector<float> f32(const std::string& name, int rank = -1) const;
  std::vector<std::int32_t> i32(const std::string& name, int rank = -1) const;
  std::vector<std::int64_t> i64(const std::string& name, int rank = -1) const;
  std::vector<std::uint8_t> u8(const std::string& name, int rank = -1) const;
  // Floating-point tensors of any width as f32: F32 copied, BF16 and F16 converted exactly.
  std::vector<float> to_f32(const std::string& name, int rank = -1) const;
  const std::string& path() const { return path_; }

 private:
  template <typename T>
  std::vector<T> get(const std::string& name, const char* dtype, int rank) const;
  std::string path_;
  std::map<std::string, Info> info_;
  std::map<std::string, std::string> metadata_;
  std::vector<char> data_;
};

struct NamedTensor {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  const void* data;  // prod(shape) * dtype size bytes
};
// Writes a safetensors file (atomically: temp file + rename), with an optional __metadata__.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace diffcp
