// Device memory owned by a backend (ops/backend.hpp), and the memory ops every layer uses instead
// of host loops: fill, convert (f32 <-> bf16) and copies between the host and the device.
//
// A Buffer is the RAII handle of one allocation: it knows its backend, device, dtype and size, and
// frees itself. Layers keep their scratch in Buffers sized once per shape (reserve() only grows),
// and hand views of them to the ops; host code never dereferences a Buffer of a device other than
// the host (the guard device, testing/guard_backend.hpp, faults if it does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "diffcp/core/dtype.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp {

class Buffer {
 public:
  Buffer() = default;
  // `numel` elements of `dtype` in the device memory of `backend` (default: the active one).
  Buffer(DType dtype, std::int64_t numel, Backend& backend = active_backend());
  ~Buffer() { release(); }
  Buffer(Buffer&& o) noexcept { *this = static_cast<Buffer&&>(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Holds at least `numel` elements afterwards: reallocates (contents not kept) only to grow, so a
  // workspace sized for the largest shape is allocated once.
  void reserve(std::int64_t numel);

  void* data() const { return data_; }
  template <typename T>
  T* ptr() const {
    DIFFCP_CHECK(dtype_of<T>() == dtype_, "buffer holds ", dtype_name(dtype_), ", accessed as ",
                 dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  std::int64_t numel() const { return numel_; }
  std::size_t bytes() const { return static_cast<std::size_t>(numel_) * dtype_size(dtype_); }
  Device device() const { return backend_ ? backend_->device() : Device::host; }
  Backend* backend() const { return backend_; }

  // A contiguous view of the first prod(shape) elements (an error if they do not fit); no shape: [numel].
  TensorView view(std::initializer_list<std::int64_t> shape) const;
  TensorView view() const { return view({numel_}); }

 private:
  void release() noexcept;
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  std::int64_t numel_ = 0;
};

// A typed, resizable Buffer for a layer's scratch and saved activations, in the active backend's
// memory: resize(n) sets the size and reallocates only to grow, or when another backend has become
// the active one; unlike std::vector it neither keeps the contents when it reallocates nor zeroes
// new elements. Steps of repeating shapes allocate nothing. data() / begin() / end() are device pointers: hand them to ops
// and collectives, never dereference them on the host unless the backend is the host's.
template <typename T>
class DeviceVector {
 public:
  DeviceVector() = default;
  DeviceVector(DeviceVector&& o) noexcept : buf_(static_cast<Buffer&&>(o.buf_)), size_(o.size_) { o.size_ = 0; }
  DeviceVector& operator=(DeviceVector&& o) noexcept {
    buf_ = static_cast<Buffer&&>(o.buf_);
    size_ = o.size_;
    o.size_ = 0;
    return *this;
  }
  // Returns whether it had to allocate (the layers count their allocations).
  bool resize(std::int64_t n) {
    const bool moves = buf_.backend() != &active_backend(), grows = n > (moves ? 0 : buf_.numel());
    if (moves) buf_ = Buffer(dtype_of<T>(), 0);
    if (grows) buf_.reserve(n);
    size_ = n;
    return grows;
  }
  T* data() const { return static_cast<T*>(buf_.data()); }
  std::size_t size() const { return static_cast<std::size_t>(size_); }
  bool empty() const { return size_ == 0; }
  T* begin() const { return data(); }
  T* end() const { return data() + size_; }
  // [size] of the backend's device.
  TensorView view() const { return buf_.view({size_}); }
  // Sized to n and a copy of src [n], which is host memory or (from = the active device) device
  // memory: the one way layers upload host inputs.
  void assign(const T* src, std::int64_t n, Device from = Device::host);
  void assign(std::span<const T> host) { assign(host.data(), static_cast<std::int64_t>(host.size())); }

 private:
  Buffer buf_;
  std::int64_t size_ = 0;
};

// A layer's scratch or saved tensor whose dtype is chosen at run time (the layer's compute dtype):
// what DeviceVector<T> is for one fixed T. resize(dtype, n) reallocates only to grow, or when the
// dtype or the active backend changes; contents are not kept.
class Workspace {
 public:
  // Returns whether it had to allocate (the layers count their allocations).
  bool resize(DType dtype, std::int64_t n) {
    const bool moves = buf_.backend() != &active_backend() || buf_.dtype() != dtype;
    const bool grows = n > (moves ? 0 : buf_.numel());
    if (moves) buf_ = Buffer(dtype, 0);
    if (grows) buf_.reserve(n);
    size_ = n;
    return grows;
  }
  DType dtype() const { return buf_.dtype(); }
  std::int64_t size() const { return size_; }
  // [size] of the backend's device; or a contiguous view of the first prod(shape) elements.
  TensorView view() const { return buf_.view({size_}); }
  TensorView view(std::initializer_list<std::int64_t> shape) const { return buf_.view(shape); }

 private:
  Buffer buf_;
  std::int64_t size_ = 0;
};

// The compute-dtype seam of a mixed-precision layer: the f32 tensors at a layer's boundary and its
// f32 accumulators meet the kernels and payloads of the compute dtype (f32 or bf16) here, and only
// here, so a method is written once for both.
// `src` (f32) in `compute`: src itself for f32 (no copy), else rounded to bf16 into `ws` (same shape).
ConstTensorView to_compute(ConstTensorView src, DType compute, Workspace& ws);
// Where an op of `compute` writes a result that ends in the f32 tensor `dst`: dst itself for f32,
// else `ws` (bf16, dst's shape); from_compute() then widens it into dst.
TensorView compute_out(TensorView dst, DType compute, Workspace& ws);
// dst (f32) = src widened; nothing when src is dst (compute_out's f32 case). Contiguous views of
// equal element counts.
void from_compute(ConstTensorView src, TensorView dst);

// The memory ops, on the active backend. Each view names its device (host or the active backend's);
// the error names the view that does not fit.

// x[n] = value; x contiguous, on the device.
void fill(TensorView x, float value);
// dst = src in dst's dtype (f32 <-> bf16 round to nearest even, or a copy for one dtype), both on the
// device: [n] contiguous, or [rows, cols] with row strides (stride[1] = 1) of the same shape.
void convert(ConstTensorView src, TensorView dst);
// dst = src, contiguous, same dtype and element count; either side on the host or the active
// backend's device.
void copy(TensorView dst, ConstTensorView src);
// Raw-pointer forms for the layers, whose pointers point into the active backend's memory (as the
// ops' do): n elements converted or copied, and `rows` rows of `cols` elements from src (src_t,
// row stride ld_src) to dst (dst_t, row stride ld_dst), one dtype (an interleave / de-interleave
// of rows, e.g. [lse | D] statistics, or raw u8 rows) or f32 <-> bf16; ld_src = 0 repeats src's one
// row in every row of dst (a bias broadcast).
void convert(const float* src, bf16_t* dst, std::int64_t n);
void convert(const bf16_t* src, float* dst, std::int64_t n);
void device_copy(float* dst, const float* src, std::int64_t n);
void convert_rows(const void* src, DType src_t, std::int64_t ld_src, void* dst, DType dst_t, std::int64_t ld_dst,
                  std::int64_t rows, std::int64_t cols);
void fill(float* x, std::int64_t n, float value);
// Row gather / scatter, with a dtype change or not (token packing; rows are host metadata):
//   gather_rows:  dst[i, :w] (row stride ld_dst) = src[rows[i], :w] (M rows, row stride ld_src)
//   scatter_rows: dst[rows[i], :w] (M rows, row stride ld_dst) = src[i, :w] (row stride ld_src)
// src_t -> dst_t: one dtype (f32, bf16, u8), or f32 <-> bf16 (rounded / widened).
void gather_rows(const void* src, DType src_t, std::int64_t M, std::int64_t ld_src, std::span<const std::int64_t> rows,
                 std::int64_t w, void* dst, DType dst_t, std::int64_t ld_dst);
void scatter_rows(const void* src, DType src_t, std::int64_t ld_src, std::span<const std::int64_t> rows,
                  std::int64_t w, void* dst, DType dst_t, std::int64_t M, std::int64_t ld_dst);
// The same with the row list in the active backend's memory: rows: [n] i64, made there (dit/ops.hpp
// token_rows), read when the op runs: no host metadata, no host sync. Each row in [0, M): checked by
// the CPU backend and the guards when the op runs; the CUDA kernels skip a row outside.
void gather_rows(const void* src, DType src_t, std::int64_t M, std::int64_t ld_src, const std::int64_t* rows,
                 std::int64_t n, std::int64_t w, void* dst, DType dst_t, std::int64_t ld_dst);
void scatter_rows(const void* src, DType src_t, std::int64_t ld_src, const std::int64_t* rows, std::int64_t n,
                  std::int64_t w, void* dst, DType dst_t, std::int64_t M, std::int64_t ld_dst);
// A host copy of a device view (the way tests and file writers read device results).
template <typename T>
std::vector<T> to_host(ConstTensorView src) {
  std::vector<T> out(static_cast<std::size_t>(src.numel()));
  copy(view_of(std::span<T>(out)), src);
  return out;
}
template <typename T>
void DeviceVector<T>::assign(const T* src, std::int64_t n, Device from) {
  resize(n);
  copy(view(), ConstTensorView::contiguous(src, dtype_of<T>(), {n}, from));
}
// A device Buffer holding a copy of host data.
template <typename T>
Buffer to_device(std::span<const T> host, Backend& backend = active_backend()) {
  Buffer b(dtype_of<T>(), static_cast<std::int64_t>(host.size()), backend);
  ScopedBackend on(backend);
  copy(b.view(), view_of(host));
  return b;
}

}  // namespace diffcp
