// Training checkpoints: "DIFFCPCK", format version, a JSON header (model config, step, seed,
// mesh, optimizer step), parameters, AdamW moments, and an FNV-1a 64 checksum of all of it.
// Written atomically (temp file + fsync'd write + rename); corrupt, truncated or mismatched files
// are refused with a message that says which.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace diffcp {

struct Checkpoint {
  nlohmann::json meta;                 // {"config": {...}, "step": k, "seed": s, ...}
  std::vector<float> params, m, v;     // [n] each
};

void save_checkpoint(const std::string& path, const Checkpoint& ck);
Checkpoint load_checkpoint(const std::string& path);

}  // namespace diffcp
