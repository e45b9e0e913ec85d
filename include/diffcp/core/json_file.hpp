// A JSON file read whole, with the project's error wording: "<label> '<path>': cannot open it" or
// "<label> '<path>': not valid JSON: <parser message>" (diffcp::Error).
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"

namespace diffcp {

inline nlohmann::json read_json_file(const std::string& path, const std::string& label) {
  std::ifstream f(path);
  DIFFCP_CHECK(f.good() && !std::filesystem::is_directory(path), label, " '", path, "': cannot open it");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    DIFFCP_FAIL(label, " '", path, "': not valid JSON: ", e.what());
  }
}

}  // namespace diffcp
