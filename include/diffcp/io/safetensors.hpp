// safetensors files (the format the Python ecosystem writes): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}}, then the raw little-endian data. Reading validates everything: header
// length against the file size, JSON, dtypes, shapes, offsets inside the data and consistent
// with dtype*shape, no overlap. Errors name the file and the tensor.
//
// The file is mapped read-only, not copied: a tensor's bytes are read in place (bytes()), and
// release() hands its pages back, so loading a checkpoint tensor by tensor never holds more than
// one tensor of the file in memory. Changing the file while it is open is undefined (SIGBUS if it
// shrinks), as for every mmap reader.
#pragma once

#include <cstdint>
#include <cstddef>
#include <map>
#include <memory>
#include <span>
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
  ~SafeTensors();
  SafeTensors(const SafeTensors&) = delete;
  SafeTensors& operator=(const SafeTensors&) = delete;

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
  // The tensor's raw little-endian bytes, in place in the mapping (valid while this object lives).
  std::span<const std::byte> bytes(const std::string& name) const;
  // Drops the tensor's pages from this process's memory (they are re-read from the file if used
  // again). A hint: never changes what is read.
  void release(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  template <typename T>
  std::vector<T> get(const std::string& name, const char* dtype, int rank) const;
  std::string path_;
  std::map<std::string, Info> info_;
  std::map<std::string, std::string> metadata_;
  const char* map_ = nullptr;  // the whole file, mapped read-only
  std::size_t map_size_ = 0;
  const char* data_ = nullptr;  // the data section inside map_
};

// A checkpoint as Hugging Face ships large models: one .safetensors file, or shards with an index
// JSON (`*.safetensors.index.json`: {"metadata": {...}, "weight_map": {"tensor": "shard file"}},
// shard paths relative to the index's folder). Opening checks that every tensor of the weight map
// is in its shard and every tensor of a shard is in the map (errors name both), and that no name is
// in two files.
class SafeTensorsSet {
 public:
  // `path`: a .safetensors file, or an index whose name ends in ".json".
  explicit SafeTensorsSet(const std::string& path);

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;  // every tensor of every file, sorted
  // The file holding `name`; throws naming the checkpoint when there is none.
  const SafeTensors& file(const std::string& name) const;
  const SafeTensors::Info& info(const std::string& name) const { return file(name).info(name); }
  const std::string& path() const { return path_; }
  std::size_t files() const { return files_.size(); }

 private:
  std::string path_;
  std::vector<std::unique_ptr<SafeTensors>> files_;
  std::map<std::string, std::size_t> where_;  // tensor -> index into files_
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
