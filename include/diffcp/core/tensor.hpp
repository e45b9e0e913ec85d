// Non-owning tensor views: what every op and layer interface of diffcp takes.
//
// TensorView / ConstTensorView: pointer, shape, strides (in elements), dtype and device of a
// strided tensor of rank 0..4. Shapes are validated where a view enters an op (check_view), so a
// wrong shape or dtype is an error naming the tensor, not a wrong answer.
//
// HeadRows<T> is the typed rank-3 use of a view that the attention kernels take: [rows, heads, dim]
// with element (r, h, d) at data[r * row_stride + h * dim + d] (strides {row_stride, dim, 1}): the
// heads of one row are contiguous, rows may be padded or interleaved with other tensors (e.g. a
// fused q|k|v projection output, row_stride = 3*heads*dim).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "diffcp/core/dtype.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp {

// "[2, 3, 4]": a shape in error messages.
inline std::string shape_str(std::span<const std::int64_t> s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

template <typename VoidPtr>  // void* or const void*
struct BasicTensorView {
  static constexpr int kMaxRank = 4;
  VoidPtr data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::host;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{}, stride{};  // stride: elements between neighbours

  // A contiguous row-major view of `shape` at `data`.
  static BasicTensorView contiguous(VoidPtr data, DType dtype, std::initializer_list<std::int64_t> shape,
                                    Device device = Device::host) {
    BasicTensorView t;
    DIFFCP_CHECK(shape.size() <= kMaxRank, "tensor view: rank ", shape.size(), " > ", kMaxRank);
    t.data = data;
    t.dtype = dtype;
    t.device = device;
    t.rank = static_cast<int>(shape.size());
    int d = 0;
    for (std::int64_t s : shape) {
      DIFFCP_CHECK(s >= 0, "tensor view: negative extent ", s, " in dimension ", d);
      t.shape[static_cast<std::size_t>(d++)] = s;
    }
    std::int64_t st = 1;
    for (int i = t.rank - 1; i >= 0; --i) {
      t.stride[static_cast<std::size_t>(i)] = st;
      st *= t.shape[static_cast<std::size_t>(i)];
    }
    return t;
  }
  // A mutable view converts to a const one.
  operator BasicTensorView<const void*>() const
    requires std::is_same_v<VoidPtr, void*>
  {
    return {data, dtype, device, rank, shape, stride};
  }

  std::int64_t size(int d) const { return shape[static_cast<std::size_t>(d)]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[static_cast<std::size_t>(i)];
    return n;
  }
  std::size_t element_size() const { return dtype_size(dtype); }
  bool is_contiguous() const {
    std::int64_t st = 1;
    for (int i = rank - 1; i >= 0; --i) {
      if (shape[static_cast<std::size_t>(i)] != 1 && stride[static_cast<std::size_t>(i)] != st) return false;
      st *= shape[static_cast<std::size_t>(i)];
    }
    return true;
  }
  // The typed pointer; throws when T is not the view's dtype.
  template <typename T>
  auto ptr() const {
    DIFFCP_CHECK(dtype_of<std::remove_const_t<T>>() == dtype, "tensor view holds ", dtype_name(dtype),
                 ", accessed as ", dtype_name(dtype_of<std::remove_const_t<T>>()));
    using Out = std::conditional_t<std::is_same_v<VoidPtr, const void*>, const std::remove_const_t<T>*, T*>;
    return static_cast<Out>(data);
  }
  // "f32[3, 4, 8] host" (strides shown when not contiguous).
  std::string describe() const {
    std::string s = std::string(dtype_name(dtype)) + "[";
    for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(shape[static_cast<std::size_t>(i)]);
    s += "]";
    if (!is_contiguous()) {
      s += " strides (";
      for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(stride[static_cast<std::size_t>(i)]);
      s += ")";
    }
    return s + " " + device_name(device);
  }
};
using TensorView = BasicTensorView<void*>;
using ConstTensorView = BasicTensorView<const void*>;

// Contiguous views of a vector holding `shape` (its size must be the product).
template <typename T>
TensorView view_of(std::vector<T>& v, std::initializer_list<std::int64_t> shape) {
  TensorView t = TensorView::contiguous(v.data(), dtype_of<T>(), shape);
  DIFFCP_CHECK(t.numel() == static_cast<std::int64_t>(v.size()), "view_of: buffer has ", v.size(),
               " elements, shape ", t.describe(), " needs ", t.numel());
  return t;
}
template <typename T>
ConstTensorView view_of(const std::vector<T>& v, std::initializer_list<std::int64_t> shape) {
  ConstTensorView t = ConstTensorView::contiguous(v.data(), dtype_of<T>(), shape);
  DIFFCP_CHECK(t.numel() == static_cast<std::int64_t>(v.size()), "view_of: buffer has ", v.size(),
               " elements, shape ", t.describe(), " needs ", t.numel());
  return t;
}

// Rank-1 view [size] of a span: TensorView, or ConstTensorView for a span of const.
template <typename T>
auto view_of(std::span<T> s) {
  using View = std::conditional_t<std::is_const_v<T>, ConstTensorView, TensorView>;
  return View::contiguous(s.data(), dtype_of<std::remove_const_t<T>>(), {static_cast<std::int64_t>(s.size())});
}

// Checks that `t` (named `what` in the error) is a contiguous tensor of dtype `dtype` and shape
// `shape` (-1: any extent) on `device`. E.g. check_view("x_p", x, DType::f32, {Q_p, H}).
template <typename VoidPtr>
void check_view(const char* what, const BasicTensorView<VoidPtr>& t, DType dtype,
                std::initializer_list<std::int64_t> shape, Device device = Device::host) {
  bool ok = t.rank == static_cast<int>(shape.size()) && t.dtype == dtype && t.device == device &&
            t.is_contiguous() && (t.data != nullptr || t.numel() == 0);
  int d = 0;
  std::string want = std::string(dtype_name(dtype)) + "[";
  for (std::int64_t s : shape) {
    if (ok && s >= 0 && t.shape[static_cast<std::size_t>(d)] != s) ok = false;
    want += (d ? ", " : "") + (s >= 0 ? std::to_string(s) : std::string("*"));
    ++d;
  }
  DIFFCP_CHECK(ok, what, ": got ", t.describe(), (t.data == nullptr && t.numel() ? " (null data)" : ""),
               ", expected a contiguous ", want, "] ", device_name(device), " tensor");
}

// The first n elements of the contiguous tensor `t`, as a rank-1 view [n] (an error if they do not fit).
template <typename VoidPtr>
BasicTensorView<VoidPtr> prefix(const BasicTensorView<VoidPtr>& t, std::int64_t n) {
  DIFFCP_CHECK(t.is_contiguous() && n >= 0 && n <= t.numel(), "prefix: ", n, " elements of ", t.describe());
  return BasicTensorView<VoidPtr>::contiguous(t.data, t.dtype, {n}, t.device);
}

// A view of no elements with t's dtype and memory: a collective's part on a rank that has none.
template <typename VoidPtr>
BasicTensorView<VoidPtr> empty_like(const BasicTensorView<VoidPtr>& t) {
  return BasicTensorView<VoidPtr>::contiguous(t.data, t.dtype, {0}, t.device);
}

// A [rows, heads, dim] view with contiguous heads inside the contiguous tensor `t` (its dtype and
// device): element (r, h, i) at element offset + r * ld + h * dim + i of t; ld = 0 means heads * dim.
// E.g. the k and v halves of a [rows, 2, heads, dim] tensor: offsets 0 and heads * dim, ld = 2 heads dim.
template <typename VoidPtr>
BasicTensorView<VoidPtr> head_view(const BasicTensorView<VoidPtr>& t, std::int64_t rows, std::int64_t heads,
                                   std::int64_t dim, std::int64_t offset = 0, std::int64_t ld = 0) {
  if (ld == 0) ld = heads * dim;
  const std::int64_t end = rows == 0 ? offset : offset + (rows - 1) * ld + heads * dim;
  DIFFCP_CHECK(t.is_contiguous() && rows >= 0 && heads >= 0 && dim >= 0 && offset >= 0 && ld >= heads * dim &&
                   end <= t.numel(),
               "head_view: [", rows, ", ", heads, ", ", dim, "] at offset ", offset, ", row stride ", ld,
               " does not fit in ", t.describe());
  using Byte = std::conditional_t<std::is_same_v<VoidPtr, const void*>, const char, char>;
  BasicTensorView<VoidPtr> v;
  v.data = static_cast<Byte*>(t.data) + offset * static_cast<std::int64_t>(t.element_size());
  v.dtype = t.dtype;
  v.device = t.device;
  v.rank = 3;
  v.shape = {rows, heads, dim, 0};
  v.stride = {ld, dim, 1, 0};
  return v;
}

template <typename T>
struct HeadRows {
  T* data = nullptr;
  std::int64_t rows = 0, heads = 0, dim = 0;
  std::int64_t row_stride = 0;  // elements between consecutive rows, >= heads * dim

  T* at(std::int64_t r, std::int64_t h) const { return data + r * row_stride + h * dim; }
  operator HeadRows<const T>() const { return {data, rows, heads, dim, row_stride}; }

  // The general view of the same memory: [rows, heads, dim], strides {row_stride, dim, 1}.
  BasicTensorView<std::conditional_t<std::is_const_v<T>, const void*, void*>> view() const {
    return {data, dtype_of<std::remove_const_t<T>>(), Device::host, 3, {rows, heads, dim, 0}, {row_stride, dim, 1, 0}};
  }
  // A rank-3 view [rows, heads, dim] with contiguous heads (strides {row_stride, dim, 1}) of T.
  template <typename VoidPtr>
  static HeadRows from(const BasicTensorView<VoidPtr>& t) {
    DIFFCP_CHECK(t.rank == 3 && t.stride[2] == 1 && t.stride[1] == t.shape[2] && t.stride[0] >= t.shape[1] * t.shape[2],
                 "HeadRows: ", t.describe(), " is not a [rows, heads, dim] view with contiguous heads");
    return {t.template ptr<T>(), t.shape[0], t.shape[1], t.shape[2], t.stride[0]};
  }
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
