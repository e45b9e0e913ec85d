#include "drafter/checkpoint.hpp"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

namespace diffcp {

namespace {
constexpr char kMagic[8] = {'D', 'I', 'F', 'F', 'C', 'P', 'C', 'K'};
constexpr std::uint32_t kVersion = 1;

struct Fnv {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

template <typename T>
void put(std::string& buf, const T& x) {
  buf.append(reinterpret_cast<const char*>(&x), sizeof x);
}
}  // namespace

void save_checkpoint(const std::string& path, const Checkpoint& ck) {
  const std::size_t n = ck.params.size();
  DIFFCP_CHECK(ck.m.size() == n && ck.v.size() == n, "checkpoint: parameter and moment sizes differ");
  std::string buf(kMagic, 8);
  put(buf, kVersion);
  nlohmann::json meta = ck.meta;
  meta["n_params"] = n;
  const std::string js = meta.dump();
  put(buf, static_cast<std::uint64_t>(js.size()));
  buf += js;
  for (const auto* v : {&ck.params, &ck.m, &ck.v}) buf.append(reinterpret_cast<const char*>(v->data()), n * sizeof(float));
  Fnv f;
  f.add(buf.data(), buf.size());
  put(buf, f.h);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    DIFFCP_CHECK(out.good(), "checkpoint: cannot write '", tmp, "'");
    out.write(buf.data(), static_cast<std::streamsize>(buf.size()));
    out.flush();
    DIFFCP_CHECK(out.good(), "checkpoint: write to '", tmp, "' failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);  // atomic on POSIX: readers see the old or the new file
}

Checkpoint load_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  DIFFCP_CHECK(in.good() && !std::filesystem::is_directory(path), "checkpoint '", path, "': cannot open it as a file");
  const auto size = static_cast<std::size_t>(in.tellg());
  in.seekg(0);
  std::string buf(size, '\0');
  in.read(buf.data(), static_cast<std::streamsize>(size));
  DIFFCP_CHECK(size >= 8 + 4 + 8 + 8 && std::memcmp(buf.data(), kMagic, 8) == 0, "checkpoint '", path,
               "': not a diffcp checkpoint (bad magic or too short)");
  std::uint32_t version = 0;
  std::memcpy(&version, buf.data() + 8, 4);
  DIFFCP_CHECK(version == kVersion, "checkpoint '", path, "': format version ", version, ", this build reads ", kVersion);
  std::uint64_t stored = 0;
  std::memcpy(&stored, buf.data() + size - 8, 8);
  Fnv f;
  f.add(buf.data(), size - 8);
  DIFFCP_CHECK(f.h == stored, "checkpoint '", path, "': checksum mismatch (corrupt or truncated file)");
  std::uint64_t js_len = 0;
  std::memcpy(&js_len, buf.data() + 12, 8);
  DIFFCP_CHECK(js_len <= size - 28, "checkpoint '", path, "': header length ", js_len, " past the end of the ", size,
               "-byte file");
  Checkpoint ck;
  try {
    ck.meta = nlohmann::json::parse(buf.substr(20, js_len));
  } catch (const nlohmann::json::exception& e) {
    DIFFCP_FAIL("checkpoint '", path, "': header is not valid JSON: ", e.what());
  }
  DIFFCP_CHECK(ck.meta.is_object() && ck.meta.contains("n_params") && ck.meta["n_params"].is_number_unsigned(),
               "checkpoint '", path, "': header has no non-negative integer \"n_params\"");
  const std::uint64_t n = ck.meta["n_params"].get<std::uint64_t>();
  const std::uint64_t data_bytes = size - 28 - js_len;  // params, m, v
  DIFFCP_CHECK(n <= data_bytes / (3 * sizeof(float)) && 3 * n * sizeof(float) == data_bytes, "checkpoint '", path, "': ",
               size, " bytes do not match ", n, " parameters");
  const char* p = buf.data() + 20 + js_len;
  for (auto* v : {&ck.params, &ck.m, &ck.v}) {
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), p, n * sizeof(float));
    p += n * sizeof(float);
  }
  return ck;
}

}  // namespace diffcp
