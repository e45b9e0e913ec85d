#include "diffcp/io/npy.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"

namespace diffcp {

namespace {

template <typename T>
void write_impl(const std::string& path, const T* data, const std::vector<std::int64_t>& shape, const char* descr) {
  std::ostringstream dict;
  dict << "{'descr': '" << descr << "', 'fortran_order': False, 'shape': (";
  std::int64_t n = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    dict << shape[i] << (shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
    n *= shape[i];
  }
  dict << "), }";
  std::string header = dict.str();
  // magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple of 64,
  // ending in '\n'.
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  DIFFCP_CHECK(f.good(), "cannot open '", path, "' for writing");
  const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  f.write(reinterpret_cast<const char*>(magic), 8);
  const auto len = static_cast<std::uint16_t>(header.size());
  const unsigned char len_le[2] = {static_cast<unsigned char>(len & 0xff), static_cast<unsigned char>(len >> 8)};
  f.write(reinterpret_cast<const char*>(len_le), 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(static_cast<std::size_t>(n) * sizeof(T)));
  DIFFCP_CHECK(f.good(), "write to '", path, "' failed");
}

}  // namespace

void write_npy(const std::string& path, const float* data, const std::vector<std::int64_t>& shape) {
  write_impl(path, data, shape, "<f4");
}
void write_npy(const std::string& path, const double* data, const std::vector<std::int64_t>& shape) {
  write_impl(path, data, shape, "<f8");
}
void write_npy(const std::string& path, const std::int64_t* data, const std::vector<std::int64_t>& shape) {
  write_impl(path, data, shape, "<i8");
}

std::vector<float> read_npy_f32(const std::string& path, std::vector<std::int64_t>& shape) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  DIFFCP_CHECK(f.good() && !std::filesystem::is_directory(path), "cannot open '", path, "'");
  const auto size = static_cast<std::uint64_t>(f.tellg());
  f.seekg(0);
  unsigned char pre[10];
  f.read(reinterpret_cast<char*>(pre), 10);
  DIFFCP_CHECK(f.good() && pre[0] == 0x93 && std::memcmp(pre + 1, "NUMPY", 5) == 0 && pre[6] == 1,
               "'", path, "' is not a version-1 .npy file");
  const std::size_t hlen = pre[8] | (static_cast<std::size_t>(pre[9]) << 8);
  DIFFCP_CHECK(10 + hlen <= size, "'", path, "': header of ", hlen, " bytes is past the end of the ", size, "-byte file");
  std::string header(hlen, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hlen));
  // float32 as is; float16 and float64 (what numpy writes for torch's half / double) converted.
  std::size_t esize = 0;
  for (const auto& [descr, size] : {std::pair<const char*, std::size_t>{"'<f4'", 4}, {"'<f2'", 2}, {"'<f8'", 8}})
    if (header.find(std::string("'descr': ") + descr) != std::string::npos) esize = size;
  DIFFCP_CHECK(esize != 0, "'", path, "': expected dtype float32 ('<f4'; '<f2' and '<f8' are converted), header ", header);
  DIFFCP_CHECK(header.find("'fortran_order': False") != std::string::npos, "'", path, "': Fortran order unsupported");
  const auto open = header.find('('), close = header.find(')');
  DIFFCP_CHECK(open != std::string::npos && close != std::string::npos && open < close, "'", path, "': no shape in header");
  shape.clear();
  // The values must fit in the file: a header claiming more is refused before anything is allocated.
  const std::uint64_t max_values = (size - 10 - hlen) / esize;
  std::int64_t n = 1;
  std::istringstream dims(header.substr(open + 1, close - open - 1));
  for (std::string tok; std::getline(dims, tok, ',');) {
    const auto first = tok.find_first_not_of(' ');
    if (first == std::string::npos) continue;
    tok = tok.substr(first, tok.find_last_not_of(' ') - first + 1);
    DIFFCP_CHECK(tok.size() <= 18 && tok.find_first_not_of("0123456789") == std::string::npos, "'", path,
                 "': shape entry '", tok, "' is not a non-negative integer");
    const std::int64_t d = std::stoll(tok);
    DIFFCP_CHECK(d == 0 || static_cast<std::uint64_t>(n) <= max_values / static_cast<std::uint64_t>(d), "'", path,
                 "' is truncated: shape entry ", d, " makes more values than the file's ", max_values);
    shape.push_back(d);
    n *= d;
  }
  std::vector<float> data(static_cast<std::size_t>(n));
  std::vector<char> raw(esize == 4 ? 0 : static_cast<std::size_t>(n) * esize);
  char* dst = esize == 4 ? reinterpret_cast<char*>(data.data()) : raw.data();
  f.read(dst, static_cast<std::streamsize>(static_cast<std::size_t>(n) * esize));
  DIFFCP_CHECK(f.gcount() == static_cast<std::streamsize>(static_cast<std::size_t>(n) * esize), "'", path,
               "' is truncated: expected ", n, " values");
  for (std::size_t i = 0; esize != 4 && i < data.size(); ++i) {
    if (esize == 2) {
      std::uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      data[i] = f16_to_f32(h);
    } else {
      double d;
      std::memcpy(&d, raw.data() + 8 * i, 8);
      data[i] = static_cast<float>(d);
    }
  }
  return data;
}

}  // namespace diffcp
