#include "diffcp/drafter/checkpoint.hpp"

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {
constexpr char kMagic[8] = {'D', 'I', 'F', 'F', 'C', 'P', 'C', 'K'};
constexpr std::uint32_t kVersion = 1;
constexpr std::uint64_t kFnvStart = 1469598103934665603ull;

std::uint64_t fnv(std::uint64_t h, const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
}  // namespace

CheckpointWriter::CheckpointWriter(const std::string& path, nlohmann::json meta, std::uint64_t n)
    : path_(path), tmp_(path + ".tmp"), n_(n), hash_(kFnvStart) {
  out_.open(tmp_, std::ios::binary | std::ios::trunc);
  DIFFCP_CHECK(out_.good(), "checkpoint: cannot write '", tmp_, "'");
  meta["n_params"] = n;
  const std::string js = meta.dump();
  const auto js_len = static_cast<std::uint64_t>(js.size());
  std::string head(kMagic, 8);
  head.append(reinterpret_cast<const char*>(&kVersion), sizeof kVersion);
  head.append(reinterpret_cast<const char*>(&js_len), sizeof js_len);
  head += js;
  hash_ = fnv(hash_, head.data(), head.size());
  out_.write(head.data(), static_cast<std::streamsize>(head.size()));
}

CheckpointWriter::~CheckpointWriter() {
  if (done_) return;
  out_.close();
  std::error_code ec;
  std::filesystem::remove(tmp_, ec);
}

void CheckpointWriter::append(const float* x, std::uint64_t count) {
  DIFFCP_CHECK(!done_ && written_ + count <= 3 * n_, "checkpoint '", path_, "': ", written_ + count,
               " values appended, the file holds 3 x ", n_);
  const std::size_t bytes = count * sizeof(float);
  hash_ = fnv(hash_, x, bytes);
  out_.write(reinterpret_cast<const char*>(x), static_cast<std::streamsize>(bytes));
  written_ += count;
}

void CheckpointWriter::commit() {
  DIFFCP_CHECK(!done_ && written_ == 3 * n_, "checkpoint '", path_, "': ", written_, " of 3 x ", n_, " values written");
  out_.write(reinterpret_cast<const char*>(&hash_), sizeof hash_);
  out_.flush();
  DIFFCP_CHECK(out_.good(), "checkpoint: write to '", tmp_, "' failed (disk full?)");
  out_.close();
  std::filesystem::rename(tmp_, path_);  // atomic on POSIX: readers see the old or the new file
  done_ = true;
}

CheckpointReader::CheckpointReader(const std::string& path) : path_(path) {
  in_.open(path, std::ios::binary | std::ios::ate);
  DIFFCP_CHECK(in_.good() && !std::filesystem::is_directory(path), "checkpoint '", path, "': cannot open it as a file");
  const auto size = static_cast<std::uint64_t>(in_.tellg());
  in_.seekg(0);
  char head[20] = {};
  if (size >= 20) in_.read(head, 20);
  DIFFCP_CHECK(size >= 8 + 4 + 8 + 8 && std::memcmp(head, kMagic, 8) == 0, "checkpoint '", path,
               "': not a diffcp checkpoint (bad magic or too short)");
  std::uint32_t version = 0;
  std::memcpy(&version, head + 8, 4);
  DIFFCP_CHECK(version == kVersion, "checkpoint '", path, "': format version ", version, ", this build reads ", kVersion);
  // The checksum covers everything before it: one streaming pass.
  std::uint64_t h = fnv(kFnvStart, head, 20), stored = 0;
  std::vector<char> buf(std::size_t{1} << 24);
  for (std::uint64_t done = 20; done < size - 8;) {
    const auto chunk = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), size - 8 - done));
    in_.read(buf.data(), static_cast<std::streamsize>(chunk));
    DIFFCP_CHECK(in_.good(), "checkpoint '", path, "': read failed at byte ", done);
    h = fnv(h, buf.data(), chunk);
    done += chunk;
  }
  in_.read(reinterpret_cast<char*>(&stored), 8);
  DIFFCP_CHECK(h == stored, "checkpoint '", path, "': checksum mismatch (corrupt or truncated file)");
  std::uint64_t js_len = 0;
  std::memcpy(&js_len, head + 12, 8);
  DIFFCP_CHECK(js_len <= size - 28, "checkpoint '", path, "': header length ", js_len, " past the end of the ", size,
               "-byte file");
  std::string js(static_cast<std::size_t>(js_len), '\0');
  in_.seekg(20);
  in_.read(js.data(), static_cast<std::streamsize>(js_len));
  try {
    meta_ = nlohmann::json::parse(js);
  } catch (const nlohmann::json::exception& e) {
    DIFFCP_FAIL("checkpoint '", path, "': header is not valid JSON: ", e.what());
  }
  DIFFCP_CHECK(meta_.is_object() && meta_.contains("n_params") && meta_["n_params"].is_number_unsigned(),
               "checkpoint '", path, "': header has no non-negative integer \"n_params\"");
  n_ = meta_["n_params"].get<std::uint64_t>();
  const std::uint64_t data_bytes = size - 28 - js_len;  // params, m, v
  DIFFCP_CHECK(n_ <= data_bytes / (3 * sizeof(float)) && 3 * n_ * sizeof(float) == data_bytes, "checkpoint '", path, "': ",
               size, " bytes do not match ", n_, " parameters");
  data_at_ = 20 + js_len;
}

void CheckpointReader::read(CkArray a, std::uint64_t at, std::uint64_t count, float* out) {
  DIFFCP_CHECK(at <= n_ && count <= n_ - at, "checkpoint '", path_, "': elements [", at, ", ", at + count,
               ") outside the ", n_, " parameters");
  if (count == 0) return;
  in_.clear();
  in_.seekg(static_cast<std::streamoff>(data_at_ + (static_cast<std::uint64_t>(a) * n_ + at) * sizeof(float)));
  in_.read(reinterpret_cast<char*>(out), static_cast<std::streamsize>(count * sizeof(float)));
  DIFFCP_CHECK(in_.good(), "checkpoint '", path_, "': read of ", count, " values failed");
}

void save_checkpoint(const std::string& path, const Checkpoint& ck) {
  const std::size_t n = ck.params.size();
  DIFFCP_CHECK(ck.m.size() == n && ck.v.size() == n, "checkpoint: parameter and moment sizes differ");
  CheckpointWriter w(path, ck.meta, n);
  for (const auto* v : {&ck.params, &ck.m, &ck.v}) w.append(v->data(), n);
  w.commit();
}

Checkpoint load_checkpoint(const std::string& path) {
  CheckpointReader r(path);
  Checkpoint ck;
  ck.meta = r.meta();
  int a = 0;
  for (auto* v : {&ck.params, &ck.m, &ck.v}) {
    v->resize(r.n());
    r.read(static_cast<CkArray>(a++), 0, r.n(), v->data());
  }
  return ck;
}

}  // namespace diffcp
