// NumPy .npy files (format 1.0, little-endian, C order): what `--dump` writes so that anyone can
// check diffcp's results with their own tools.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diffcp {

// Writes data (prod(shape) values) as '<f4' / '<f8' / '<i8'. Throws diffcp::Error on I/O failure.
void write_npy(const std::string& path, const float* data, const std::vector<std::int64_t>& shape);
void write_npy(const std::string& path, const double* data, const std::vector<std::int64_t>& shape);
void write_npy(const std::string& path, const std::int64_t* data, const std::vector<std::int64_t>& shape);

// Reads a '<f4' C-order file ('<f2' and '<f8' converted to float32); shape is filled in. Throws
// diffcp::Error naming what is wrong.
std::vector<float> read_npy_f32(const std::string& path, std::vector<std::int64_t>& shape);

}  // namespace diffcp
