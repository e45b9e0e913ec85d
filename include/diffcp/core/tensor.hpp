// Views of row-major activation tensors with a named row stride.
//
// HeadRows<T> views a tensor of shape [rows, heads, dim] whose element (r, h, d) lives at
// data[r * row_stride + h * dim + d]: the heads of one row are contiguous, rows may be padded or
// interleaved with other tensors (e.g. a fused q|k|v projection output, row_stride = 3*heads*dim).
#pragma once

#include <cstdint>
#include <vector>

#include "diffcp/core/error.hpp"

namespace diffcp {

template <typename T>
struct HeadRows {
  T* data = nullptr;
  std::int64_t rows = 0, heads = 0, dim = 0;
  std::int64_t row_stride = 0;  // elements between consecutive rows, >= heads * dim

  T* at(std::int64_t r, std::int64_t h) const { return data + r * row_stride + h * dim; }
  operator HeadRows<const T>() const { return {data, rows, heads, dim, row_stride}; }
};

// A contiguous view (row_stride = heads * dim) of a vector holding [rows, heads, dim].
template <typename T>
HeadRows<T> head_rows(std::vector<T>& v, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  DIFFCP_CHECK(static_cast<std::int64_t>(v.size()) == rows * heads * dim, "head_rows: buffer has ",
               v.size(), " elements, expected rows*heads*dim = ", rows, "*", heads, "*", dim);
  return {v.data(), rows, heads, dim, heads * dim};
}
template <typename T>
HeadRows<const T> head_rows(const std::vector<T>& v, std::int64_t rows, std::int64_t heads,
                            std::int64_t dim) {
  DIFFCP_CHECK(static_cast<std::int64_t>(v.size()) == rows * heads * dim, "head_rows: buffer has ",
               v.size(), " elements, expected rows*heads*dim = ", rows, "*", heads, "*", dim);
  return {v.data(), rows, heads, dim, heads * dim};
}

}  // namespace diffcp
