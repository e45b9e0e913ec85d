#include "diffcp/dit/image.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>

#include "diffcp/core/error.hpp"

namespace diffcp {

std::vector<float> latent_to_rgb(const std::vector<float>& latent, const DitConfig& cfg, const DitShape& shape) {
  const std::int64_t C = cfg.latent_channels, p = cfg.patch, Cin = cfg.in_channels(), gh = shape.grid_h(),
                     gw = shape.grid_w(), Sh = gh * p, Sw = gw * p;
  const std::int64_t b = shape.batch * shape.frames;  // a video: each frame an image, frame-major
  DIFFCP_CHECK(C >= 3, "latent_to_rgb: latent_channels = ", C, ", expected >= 3 (one group per colour)");
  DIFFCP_CHECK(static_cast<std::int64_t>(latent.size()) == b * gh * gw * Cin, "latent_to_rgb: ", latent.size(),
               " values, expected b * N_img * C_in = ", b * gh * gw * Cin);
  std::vector<float> rgb(static_cast<std::size_t>(b * Sh * Sw * 3));
  for (std::int64_t j = 0; j < b; ++j)
    for (std::int64_t y = 0; y < Sh; ++y)
      for (std::int64_t x = 0; x < Sw; ++x) {
        const float* tok = latent.data() + ((j * gh + y / p) * gw + x / p) * Cin;
        const std::int64_t sub = (y % p) * p + x % p;  // (ph, pw)
        std::array<double, 3> sum{}, cnt{};
        for (std::int64_t c = 0; c < C; ++c) {
          sum[static_cast<std::size_t>(c % 3)] += tok[c * p * p + sub];
          cnt[static_cast<std::size_t>(c % 3)] += 1;
        }
        float* out = rgb.data() + ((j * Sh + y) * Sw + x) * 3;
        for (std::size_t k = 0; k < 3; ++k) out[k] = static_cast<float>(0.5 + 0.5 * std::tanh(sum[k] / cnt[k]));
      }
  return rgb;
}

std::vector<std::uint8_t> tile_rgb8(const std::vector<float>& rgb, std::int64_t batch, std::int64_t height,
                                    std::int64_t width) {
  DIFFCP_CHECK(static_cast<std::int64_t>(rgb.size()) == batch * height * width * 3, "tile_rgb8: ", rgb.size(),
               " values, expected batch * height * width * 3 = ", batch * height * width * 3);
  std::vector<std::uint8_t> out(rgb.size());
  for (std::int64_t j = 0; j < batch; ++j)
    for (std::int64_t y = 0; y < height; ++y)
      for (std::int64_t x = 0; x < width * 3; ++x) {
        const float v = std::clamp(rgb[static_cast<std::size_t>((j * height + y) * width * 3 + x)], 0.f, 1.f);
        out[static_cast<std::size_t>((y * batch + j) * width * 3 + x)] = static_cast<std::uint8_t>(std::lround(255.f * v));
      }
  return out;
}

std::uint32_t crc32(const std::uint8_t* data, std::size_t n, std::uint32_t crc) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

std::uint32_t adler32(const std::uint8_t* data, std::size_t n) {
  std::uint32_t a = 1, b = 0;
  for (std::size_t i = 0; i < n; ++i) {
    a = (a + data[i]) % 65521;
    b = (b + a) % 65521;
  }
  return (b << 16) | a;
}

namespace {

void put_be32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(v >> s));
}

// length, type, data, CRC of type + data
void put_chunk(std::vector<std::uint8_t>& out, const char* type, const std::vector<std::uint8_t>& data) {
  put_be32(out, static_cast<std::uint32_t>(data.size()));
  const std::size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  put_be32(out, crc32(out.data() + start, out.size() - start));
}

}  // namespace

void write_png(const std::string& path, const std::uint8_t* rgb, std::int64_t width, std::int64_t height) {
  DIFFCP_CHECK(width >= 1 && height >= 1 && width <= (1 << 24) && height <= (1 << 24), "write_png: ", width, " x ",
               height, " pixels, expected 1 .. 2^24 per side");
  // Raw scanlines: filter byte 0 (none), then the row's RGB bytes.
  const std::size_t row = static_cast<std::size_t>(width) * 3;
  std::vector<std::uint8_t> raw;
  raw.reserve((row + 1) * static_cast<std::size_t>(height));
  for (std::int64_t y = 0; y < height; ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), rgb + static_cast<std::size_t>(y) * row, rgb + static_cast<std::size_t>(y + 1) * row);
  }
  // zlib stream: header 0x78 0x01 (deflate, 32K window, (0x7801 % 31) == 0), stored blocks of at
  // most 65535 bytes (BFINAL on the last, BTYPE 00, LEN, ~LEN little-endian), Adler-32 big-endian.
  std::vector<std::uint8_t> z{0x78, 0x01};
  std::size_t at = 0;
  do {
    const std::size_t len = std::min<std::size_t>(65535, raw.size() - at);
    z.push_back(at + len == raw.size() ? 1 : 0);
    const auto n = static_cast<std::uint16_t>(len), nn = static_cast<std::uint16_t>(~n);
    z.insert(z.end(), {static_cast<std::uint8_t>(n), static_cast<std::uint8_t>(n >> 8), static_cast<std::uint8_t>(nn),
                       static_cast<std::uint8_t>(nn >> 8)});
    z.insert(z.end(), raw.begin() + static_cast<std::ptrdiff_t>(at), raw.begin() + static_cast<std::ptrdiff_t>(at + len));
    at += len;
  } while (at < raw.size());
  put_be32(z, adler32(raw.data(), raw.size()));

  std::vector<std::uint8_t> png{0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<std::uint8_t> ihdr;
  put_be32(ihdr, static_cast<std::uint32_t>(width));
  put_be32(ihdr, static_cast<std::uint32_t>(height));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // bit depth 8, RGB, deflate, filter method 0, no interlace
  put_chunk(png, "IHDR", ihdr);
  put_chunk(png, "IDAT", z);
  put_chunk(png, "IEND", {});

  std::ofstream f(path, std::ios::binary);
  DIFFCP_CHECK(f.good(), "`out` '", path, "': cannot open it for writing");
  f.write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
  f.close();
  DIFFCP_CHECK(f.good(), "`out` '", path, "': write failed");
}

}  // namespace diffcp
