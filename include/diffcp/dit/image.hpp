// From the DiT's latent to an image file, without a VAE: a fixed, documented latent -> RGB map and
// a minimal PNG writer (8-bit RGB, zlib stream of stored deflate blocks: no compression library).
//
// Legend as in dit/config.hpp; S_h = g_h * patch, S_w = g_w * patch latent pixels (height / 8, width / 8).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "diffcp/dit/config.hpp"

namespace diffcp {

// latent: [b, N_img, C_in] (tokens row-major over the g_h x g_w grid, channels (c, ph, pw)) -> RGB
// [b F, S_h, S_w, 3] in [0, 1] (a video's F frames each an image, image-major), one pixel per latent pixel: latent pixel (y, x) = (row * patch + ph,
// col * patch + pw) has channels z_0..z_{C_lat-1}, and colour k (0 = R, 1 = G, 2 = B) is
//   0.5 + 0.5 * tanh(mean of z_c over the channels c with c % 3 == k).
// Throws unless latent_channels >= 3.
std::vector<float> latent_to_rgb(const std::vector<float>& latent, const DitConfig& cfg, const DitShape& shape);

// rgb: [b, height, width, 3] in [0, 1] -> 8-bit [height, b * width, 3]: the images side by side,
// round(255 * clamp(v, 0, 1)).
std::vector<std::uint8_t> tile_rgb8(const std::vector<float>& rgb, std::int64_t batch, std::int64_t height,
                                    std::int64_t width);

// Writes an 8-bit RGB PNG (colour type 2, no interlace, filter 0 on every row). rgb: [height, width, 3].
// Throws diffcp::Error naming the path when it cannot be written.
void write_png(const std::string& path, const std::uint8_t* rgb, std::int64_t width, std::int64_t height);

// CRC-32 (ISO-HDLC, as PNG chunks use) and Adler-32 (as zlib streams end with); exposed for tests.
std::uint32_t crc32(const std::uint8_t* data, std::size_t n, std::uint32_t crc = 0);
std::uint32_t adler32(const std::uint8_t* data, std::size_t n);

}  // namespace diffcp
