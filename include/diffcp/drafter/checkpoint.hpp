// Training checkpoints: "DIFFCPCK", format version, a JSON header (model config, step, seed,
// mesh, optimizer step), parameters, AdamW moments, and an FNV-1a 64 checksum of all of it.
// Written atomically (temp file + flushed write + rename); corrupt, truncated or mismatched files
// are refused with a message that says which.
//
// The file holds the full flat vectors whatever the mesh was, so a run may resume on another
// number of ranks (each rank reads the slices it owns). Writer and reader stream: neither holds
// the whole state, which is what lets sharded training (drafter/sharded_state.hpp) checkpoint a
// model that no single rank could hold.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace diffcp {

struct Checkpoint {
  nlohmann::json meta;                 // {"config": {...}, "step": k, "seed": s, ...}
  std::vector<float> params, m, v;     // [n] each
};

// The three arrays of the file, in file order.
enum class CkArray : int { params = 0, m = 1, v = 2 };

// Appends params [n], then m [n], then v [n], in order, in pieces of any size; commit() writes
// the checksum and renames the temp file over `path`. Destroyed without commit(): the temp file
// is removed and `path` is untouched.
class CheckpointWriter {
 public:
  CheckpointWriter(const std::string& path, nlohmann::json meta, std::uint64_t n);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  void append(const float* x, std::uint64_t count);
  void commit();

 private:
  std::string path_, tmp_;
  std::ofstream out_;
  std::uint64_t n_ = 0, written_ = 0, hash_ = 0;
  bool done_ = false;
};

// Validates the whole file (magic, version, header, size, checksum) on open, then reads slices.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);
  const nlohmann::json& meta() const { return meta_; }
  std::uint64_t n() const { return n_; }
  // Elements [at, at + count) of one array into out [count].
  void read(CkArray a, std::uint64_t at, std::uint64_t count, float* out);

 private:
  std::string path_;
  std::ifstream in_;
  nlohmann::json meta_;
  std::uint64_t n_ = 0, data_at_ = 0;
};

void save_checkpoint(const std::string& path, const Checkpoint& ck);
Checkpoint load_checkpoint(const std::string& path);

}  // namespace diffcp
