#include "diffcp/io/safetensors.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/json_int.hpp"

namespace diffcp {

namespace {
std::int64_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "U8" || d == "I8" || d == "BOOL") return 1;
  return 0;
}
constexpr std::uint64_t kMaxHeader = 100u << 20;
// A JSON array of integers below 2^63. nlohmann's get<std::vector<std::int64_t>>() would also take
// floats and cast them (undefined behaviour for 1e300).
std::vector<std::int64_t> int_array(const nlohmann::json& a, const std::string& path, const std::string& tensor,
                                    const char* field) {
  DIFFCP_CHECK(a.is_array(), "safetensors '", path, "': tensor '", tensor, "' ", field, " is not an array");
  std::vector<std::int64_t> out;
  for (const auto& x : a) {
    const auto v = json_int64(x);
    DIFFCP_CHECK(v.has_value(), "safetensors '", path, "': tensor '", tensor, "' ", field, " holds ", x.dump(),
                 ", expected integers below 2^63");
    out.push_back(*v);
  }
  return out;
}
}  // namespace

SafeTensors::SafeTensors(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DIFFCP_CHECK(fd >= 0, "safetensors '", path, "': cannot open it (", std::strerror(errno), ")");
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat sb {};
  DIFFCP_CHECK(::fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode), "safetensors '", path, "': cannot open it (not a regular file)");
  const auto size = static_cast<std::uint64_t>(sb.st_size);
  DIFFCP_CHECK(size >= 8, "safetensors '", path, "': ", size, " bytes, too short for the 8-byte header length");
  unsigned char len8[8];
  DIFFCP_CHECK(::pread(fd, len8, 8, 0) == 8, "safetensors '", path, "': short read");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len8[i];
  DIFFCP_CHECK(n <= kMaxHeader && n <= size - 8, "safetensors '", path, "': header length ", n,
               " exceeds the file (", size, " bytes) or the 100 MiB limit");
  std::string header(n, '\0');
  DIFFCP_CHECK(::pread(fd, header.data(), n, 8) == static_cast<ssize_t>(n), "safetensors '", path, "': short read");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    DIFFCP_FAIL("safetensors '", path, "': header is not valid JSON: ", e.what());
  }
  DIFFCP_CHECK(j.is_object(), "safetensors '", path, "': header is not a JSON object");
  const std::uint64_t data_size = size - 8 - n;
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      DIFFCP_CHECK(it.value().is_object(), "safetensors '", path, "': __metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        DIFFCP_CHECK(m.value().is_string(), "safetensors '", path, "': __metadata__ '", m.key(), "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const auto& t = it.value();
    Info info;
    try {
      info.dtype = t.at("dtype").get<std::string>();
      info.shape = int_array(t.at("shape"), path, it.key(), "shape");
      const auto off = int_array(t.at("data_offsets"), path, it.key(), "data_offsets");
      DIFFCP_CHECK(off.size() == 2, "safetensors '", path, "': tensor '", it.key(), "' data_offsets needs 2 entries");
      info.begin = off[0];
      info.end = off[1];
    } catch (const nlohmann::json::exception& e) {
      DIFFCP_FAIL("safetensors '", path, "': tensor '", it.key(), "' entry malformed: ", e.what());
    }
    const std::int64_t eb = dtype_bytes(info.dtype);
    DIFFCP_CHECK(eb > 0, "safetensors '", path, "': tensor '", it.key(), "' has unknown dtype '", info.dtype, "'");
    std::int64_t count = 1;
    for (std::int64_t d : info.shape) {
      DIFFCP_CHECK(d >= 0 && (d == 0 || count <= (std::int64_t{1} << 50) / d), "safetensors '", path, "': tensor '",
                   it.key(), "' has a bad shape");
      count *= d;
    }
    DIFFCP_CHECK(0 <= info.begin && info.begin <= info.end && static_cast<std::uint64_t>(info.end) <= data_size,
                 "safetensors '", path, "': tensor '", it.key(), "' offsets [", info.begin, ", ", info.end,
                 ") outside the ", data_size, "-byte data section (truncated file?)");
    DIFFCP_CHECK(info.end - info.begin == count * eb, "safetensors '", path, "': tensor '", it.key(), "' spans ",
                 info.end - info.begin, " bytes but dtype ", info.dtype, " x shape needs ", count * eb);
    spans.push_back({info.begin, info.end});
    info_[it.key()] = std::move(info);
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    DIFFCP_CHECK(spans[i - 1].second <= spans[i].first, "safetensors '", path, "': tensors overlap in the data section");
  // The whole file is mapped read-only (the header included: mmap offsets are page-aligned); the
  // data is read in place and its pages can be handed back tensor by tensor (release()).
  if (data_size > 0) {
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    DIFFCP_CHECK(m != MAP_FAILED, "safetensors '", path, "': cannot map it (", std::strerror(errno), ")");
    map_ = static_cast<const char*>(m);
    map_size_ = size;
    data_ = map_ + 8 + n;
  }
}

SafeTensors::~SafeTensors() {
  if (map_ != nullptr) ::munmap(const_cast<char*>(map_), map_size_);
}

std::span<const std::byte> SafeTensors::bytes(const std::string& name) const {
  const Info& i = info(name);
  return {reinterpret_cast<const std::byte*>(data_ + i.begin), static_cast<std::size_t>(i.end - i.begin)};
}

void SafeTensors::release(const std::string& name) const {
  const Info& i = info(name);
  if (map_ == nullptr || i.end == i.begin) return;
  // Whole pages around the tensor: a read-only private mapping re-reads a dropped page from the
  // file if a neighbour needs it again, so rounding outward is safe.
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto lo = reinterpret_cast<std::uintptr_t>(data_ + i.begin) & ~(page - 1);
  const auto hi = reinterpret_cast<std::uintptr_t>(data_ + i.end);
  ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

const SafeTensors::Info& SafeTensors::info(const std::string& name) const {
  const auto it = info_.find(name);
  DIFFCP_CHECK(it != info_.end(), "safetensors '", path_, "': no tensor named '", name, "'");
  return it->second;
}

template <typename T>
std::vector<T> SafeTensors::get(const std::string& name, const char* dtype, int rank) const {
  const Info& i = info(name);
  DIFFCP_CHECK(i.dtype == dtype, "safetensors '", path_, "': tensor '", name, "' is ", i.dtype, ", expected ", dtype);
  DIFFCP_CHECK(rank < 0 || static_cast<int>(i.shape.size()) == rank, "safetensors '", path_, "': tensor '", name,
               "' has rank ", i.shape.size(), ", expected ", rank);
  std::vector<T> out(static_cast<std::size_t>(i.end - i.begin) / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), data_ + i.begin, static_cast<std::size_t>(i.end - i.begin));
  return out;
}

std::vector<float> SafeTensors::f32(const std::string& n, int r) const { return get<float>(n, "F32", r); }
std::vector<std::int32_t> SafeTensors::i32(const std::string& n, int r) const { return get<std::int32_t>(n, "I32", r); }
std::vector<std::int64_t> SafeTensors::i64(const std::string& n, int r) const { return get<std::int64_t>(n, "I64", r); }
std::vector<std::uint8_t> SafeTensors::u8(const std::string& n, int r) const { return get<std::uint8_t>(n, "U8", r); }

std::vector<std::string> SafeTensors::names() const {
  std::vector<std::string> out;
  for (const auto& kv : info_) out.push_back(kv.first);
  return out;
}

std::vector<float> SafeTensors::to_f32(const std::string& n, int r) const {
  const std::string& dt = info(n).dtype;
  if (dt == "F32") return get<float>(n, "F32", r);
  DIFFCP_CHECK(dt == "BF16" || dt == "F16", "safetensors '", path_, "': tensor '", n, "' is ", dt,
               ", expected a floating-point dtype (F32, BF16 or F16)");
  const auto raw = get<std::uint16_t>(n, dt.c_str(), r);
  std::vector<float> out(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) out[i] = dt == "BF16" ? bf16_to_f32(raw[i]) : f16_to_f32(raw[i]);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json j = nlohmann::json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::int64_t off = 0;
  for (const auto& t : tensors) {
    std::int64_t count = 1;
    for (std::int64_t d : t.shape) count *= d;
    const std::int64_t bytes = count * dtype_bytes(t.dtype);
    DIFFCP_CHECK(dtype_bytes(t.dtype) > 0, "write_safetensors: unknown dtype ", t.dtype);
    j[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    DIFFCP_CHECK(f.good(), "cannot write '", tmp, "'");
    unsigned char len8[8];
    std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) len8[i] = static_cast<unsigned char>(n >> (8 * i));
    f.write(reinterpret_cast<const char*>(len8), 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& t : tensors) {
      std::int64_t count = 1;
      for (std::int64_t d : t.shape) count *= d;
      f.write(static_cast<const char*>(t.data), static_cast<std::streamsize>(count * dtype_bytes(t.dtype)));
    }
    DIFFCP_CHECK(f.good(), "write to '", tmp, "' failed");
  }
  std::filesystem::rename(tmp, path);
}

SafeTensorsSet::SafeTensorsSet(const std::string& path) : path_(path) {
  if (!path.ends_with(".json")) {
    files_.push_back(std::make_unique<SafeTensors>(path));
    for (const std::string& n : files_[0]->names()) where_[n] = 0;
    return;
  }
  nlohmann::json j = read_json_file(path, "safetensors index");
  DIFFCP_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), "safetensors index '", path,
               "': expected an object with a \"weight_map\" object {tensor: file} (Hugging Face's sharded format)");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::map<std::string, std::size_t> file_index;  // shard name -> index into files_
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    DIFFCP_CHECK(it.value().is_string(), "safetensors index '", path, "': weight_map['", it.key(), "'] is not a file name");
    const std::string shard = it.value().get<std::string>();
    bool inside = !shard.empty() && std::filesystem::path(shard).is_relative();
    for (const auto& part : std::filesystem::path(shard)) inside = inside && part != "..";
    DIFFCP_CHECK(inside, "safetensors index '", path, "': weight_map['", it.key(), "'] = '", shard,
                 "', expected a file name relative to the index's folder (no '..')");
    auto [fit, fresh] = file_index.emplace(shard, files_.size());
    if (fresh) files_.push_back(std::make_unique<SafeTensors>((dir / shard).string()));
    DIFFCP_CHECK(files_[fit->second]->has(it.key()), "safetensors index '", path, "': tensor '", it.key(),
                 "' is mapped to '", shard, "', which does not hold it");
    where_[it.key()] = fit->second;
  }
  for (std::size_t i = 0; i < files_.size(); ++i)
    for (const std::string& n : files_[i]->names()) {
      const auto w = where_.find(n);
      DIFFCP_CHECK(w != where_.end(), "safetensors index '", path, "': shard '", files_[i]->path(), "' holds tensor '", n,
                   "', which the weight_map does not list");
      DIFFCP_CHECK(w->second == i, "safetensors index '", path, "': tensor '", n, "' is in both '", files_[i]->path(),
                   "' and '", files_[w->second]->path(), "'");
    }
}

std::vector<std::string> SafeTensorsSet::names() const {
  std::vector<std::string> out;
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

const SafeTensors& SafeTensorsSet::file(const std::string& name) const {
  const auto it = where_.find(name);
  DIFFCP_CHECK(it != where_.end(), "checkpoint '", path_, "': no tensor named '", name, "'");
  return *files_[it->second];
}

}  // namespace diffcp
