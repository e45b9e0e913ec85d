// ops/buffer.hpp: Buffer and the memory ops, on the active backend (CPU: src/cpu/elementwise.cpp).
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

Buffer::Buffer(DType dtype, std::int64_t numel, Backend& backend) : backend_(&backend), dtype_(dtype) {
  reserve(numel);
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    backend_ = o.backend_;
    data_ = o.data_;
    dtype_ = o.dtype_;
    numel_ = o.numel_;
    o.data_ = nullptr;
    o.numel_ = 0;
  }
  return *this;
}

void Buffer::reserve(std::int64_t numel) {
  DIFFCP_CHECK(numel >= 0, "buffer: negative size ", numel);
  if (numel <= numel_) return;
  if (backend_ == nullptr) backend_ = &active_backend();
  release();
  data_ = backend_->allocate(static_cast<std::size_t>(numel) * dtype_size(dtype_));
  numel_ = numel;
}

void Buffer::release() noexcept {
  if (data_) backend_->deallocate(data_, bytes());
  data_ = nullptr;
  numel_ = 0;
}

TensorView Buffer::view(std::initializer_list<std::int64_t> shape) const {
  TensorView t = TensorView::contiguous(data_, dtype_, shape, device());
  DIFFCP_CHECK(t.numel() <= numel_, "buffer of ", numel_, " ", dtype_name(dtype_), " elements: view ", t.describe(),
               " does not fit");
  return t;
}

namespace {

// `t` lies on the host or on `b`'s device and is contiguous.
template <typename View>
void check_memory_view(const char* op, const char* what, const View& t, const Backend& b) {
  DIFFCP_CHECK(t.is_contiguous() && (t.device == Device::host || t.device == b.device()), op, ": ", what, " ",
               t.describe(), " is not a contiguous view of host or ", device_name(b.device()), " memory (backend '",
               b.name(), "')");
}

}  // namespace

void fill(TensorView x, float value) {
  Backend& b = backend_for(OpKind::fill, x.dtype);
  DIFFCP_CHECK(x.is_contiguous() && x.device == b.device(), "fill: x ", x.describe(), " is not a contiguous view of ",
               device_name(b.device()), " memory (backend '", b.name(), "')");
  if (x.numel() == 0) return;
  b.fill(x, value);
}

void convert(ConstTensorView src, TensorView dst) {
  const DType side = src.dtype == DType::f32 ? dst.dtype : src.dtype;
  Backend& b = backend_for(OpKind::convert, side);
  const auto rows_ok = [](const auto& t) { return t.is_contiguous() || (t.rank == 2 && t.stride[1] == 1); };
  DIFFCP_CHECK(rows_ok(src) && rows_ok(dst) && src.device == b.device() && dst.device == b.device(), "convert: src ",
               src.describe(), " and dst ", dst.describe(), " must be contiguous or [rows, cols] row-strided views of ",
               device_name(b.device()), " memory (backend '", b.name(), "')");
  const bool same_shape = src.rank == dst.rank && src.shape == dst.shape;
  DIFFCP_CHECK(src.is_contiguous() && dst.is_contiguous() ? src.numel() == dst.numel() : same_shape, "convert: src ",
               src.describe(), " and dst ", dst.describe(), " differ in shape");
  DIFFCP_CHECK(src.dtype == dst.dtype || src.dtype == DType::f32 || dst.dtype == DType::f32, "convert: ",
               dtype_name(src.dtype), " -> ", dtype_name(dst.dtype), " is not f32 <-> another dtype");
  if (src.numel() == 0) return;
  b.convert(src, dst);
}

void copy(TensorView dst, ConstTensorView src) {
  Backend& b = active_backend();
  check_memory_view("copy", "src", src, b);
  check_memory_view("copy", "dst", dst, b);
  DIFFCP_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel(), "copy: src ", src.describe(), " and dst ",
               dst.describe(), " differ in dtype or size");
  if (src.numel() == 0) return;
  b.copy(dst.data, dst.device, src.data, src.device, static_cast<std::size_t>(src.numel()) * dtype_size(src.dtype));
}

namespace {
// [rows, w] of t at p with row stride ld, in the active backend's memory.
template <typename View, typename Ptr>
View row_view(Ptr p, DType t, std::int64_t rows, std::int64_t w, std::int64_t ld) {
  View v = View::contiguous(p, t, {rows, w}, active_device());
  v.stride[0] = ld;
  return v;
}
template <typename To, typename From>
void convert_n(const From* src, To* dst, std::int64_t n) {
  const Device d = active_device();
  convert(ConstTensorView::contiguous(src, dtype_of<From>(), {n}, d), TensorView::contiguous(dst, dtype_of<To>(), {n}, d));
}
}  // namespace

void convert(const float* src, bf16_t* dst, std::int64_t n) { convert_n(src, dst, n); }
void convert(const bf16_t* src, float* dst, std::int64_t n) { convert_n(src, dst, n); }
void device_copy(float* dst, const float* src, std::int64_t n) { convert_n(src, dst, n); }

void convert_rows(const void* src, DType src_t, std::int64_t ld_src, void* dst, DType dst_t, std::int64_t ld_dst,
                  std::int64_t rows, std::int64_t cols) {
  DIFFCP_CHECK(rows >= 0 && cols >= 0 && ld_dst >= cols && (ld_src >= cols || ld_src == 0), "convert_rows: ", rows,
               " rows of ", cols, ", row strides ", ld_src, ", ", ld_dst, "; expected strides >= cols (or ld_src = 0)");
  convert(row_view<ConstTensorView>(src, src_t, rows, cols, ld_src), row_view<TensorView>(dst, dst_t, rows, cols, ld_dst));
}

void fill(float* x, std::int64_t n, float value) {
  fill(TensorView::contiguous(x, DType::f32, {n}, active_device()), value);
}

namespace {
void check_rows(const char* op, std::int64_t w, std::int64_t ld_src, std::int64_t ld_dst, DType from, DType to) {
  DIFFCP_CHECK(w >= 0 && ld_src >= w && ld_dst >= w, op, ": w = ", w, ", row strides ", ld_src, ", ", ld_dst);
  DIFFCP_CHECK(from == to || (from == DType::f32 && to == DType::bf16) || (from == DType::bf16 && to == DType::f32),
               op, ": ", dtype_name(from), " -> ", dtype_name(to), " rows, expected one dtype or f32 <-> bf16");
}
void check_host_rows(const char* op, std::span<const std::int64_t> rows, std::int64_t M) {
  for (std::int64_t r : rows) DIFFCP_CHECK(r >= 0 && r < M, op, ": row ", r, " outside [0, ", M, ")");
}
DType non_f32(DType a, DType b) { return a == DType::f32 ? b : a; }

// One gather (scatter: the [M, w] side is dst) of n rows listed in `rows` ([n] i64, host or device).
void move_rows(bool scatter, const void* src, DType src_t, std::int64_t ld_src, ConstTensorView rows, std::int64_t M,
               std::int64_t w, void* dst, DType dst_t, std::int64_t ld_dst) {
  const char* op = scatter ? "scatter_rows" : "gather_rows";
  const std::int64_t n = rows.numel();
  check_rows(op, w, ld_src, ld_dst, src_t, dst_t);
  DIFFCP_CHECK(M >= 0 && n >= 0, op, ": ", n, " rows of ", M);
  if (n == 0 || w == 0) return;
  Backend& b = backend_for(scatter ? OpKind::scatter_rows : OpKind::gather_rows, non_f32(src_t, dst_t));
  if (scatter)
    b.scatter_rows(row_view<ConstTensorView>(src, src_t, n, w, ld_src), rows, row_view<TensorView>(dst, dst_t, M, w, ld_dst));
  else
    b.gather_rows(row_view<ConstTensorView>(src, src_t, M, w, ld_src), rows, row_view<TensorView>(dst, dst_t, n, w, ld_dst));
}
ConstTensorView device_rows(const std::int64_t* rows, std::int64_t n) {
  return ConstTensorView::contiguous(rows, DType::i64, {n}, active_device());
}
}  // namespace

void gather_rows(const void* src, DType src_t, std::int64_t M, std::int64_t ld_src, std::span<const std::int64_t> rows,
                 std::int64_t w, void* dst, DType dst_t, std::int64_t ld_dst) {
  check_host_rows("gather_rows", rows, M);
  move_rows(false, src, src_t, ld_src, view_of(rows), M, w, dst, dst_t, ld_dst);
}
void scatter_rows(const void* src, DType src_t, std::int64_t ld_src, std::span<const std::int64_t> rows,
                  std::int64_t w, void* dst, DType dst_t, std::int64_t M, std::int64_t ld_dst) {
  check_host_rows("scatter_rows", rows, M);
  move_rows(true, src, src_t, ld_src, view_of(rows), M, w, dst, dst_t, ld_dst);
}
void gather_rows(const void* src, DType src_t, std::int64_t M, std::int64_t ld_src, const std::int64_t* rows,
                 std::int64_t n, std::int64_t w, void* dst, DType dst_t, std::int64_t ld_dst) {
  move_rows(false, src, src_t, ld_src, device_rows(rows, n), M, w, dst, dst_t, ld_dst);
}
void scatter_rows(const void* src, DType src_t, std::int64_t ld_src, const std::int64_t* rows, std::int64_t n,
                  std::int64_t w, void* dst, DType dst_t, std::int64_t M, std::int64_t ld_dst) {
  move_rows(true, src, src_t, ld_src, device_rows(rows, n), M, w, dst, dst_t, ld_dst);
}

}  // namespace diffcp

namespace diffcp {

namespace {
// ws sized to t's elements in `dtype`, viewed with t's shape (contiguous).
TensorView like(const ConstTensorView& t, DType dtype, Workspace& ws) {
  DIFFCP_CHECK(t.is_contiguous(), "compute seam: ", t.describe(), " is not contiguous");
  ws.resize(dtype, t.numel());
  TensorView v = TensorView::contiguous(ws.view().data, dtype, {}, ws.view().device);
  v.rank = t.rank;
  v.shape = t.shape;
  std::int64_t st = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    v.stride[static_cast<std::size_t>(i)] = st;
    st *= t.shape[static_cast<std::size_t>(i)];
  }
  return v;
}
void check_compute(DType compute) {
  DIFFCP_CHECK(compute == DType::f32 || compute == DType::bf16, "compute dtype ", dtype_name(compute),
               ": expected f32 or bf16");
}
}  // namespace

ConstTensorView to_compute(ConstTensorView src, DType compute, Workspace& ws) {
  check_compute(compute);
  DIFFCP_CHECK(src.dtype == DType::f32, "to_compute: ", src.describe(), " is not f32");
  if (compute == DType::f32) return src;
  const TensorView out = like(src, compute, ws);
  convert(src, out);
  return out;
}

TensorView compute_out(TensorView dst, DType compute, Workspace& ws) {
  check_compute(compute);
  DIFFCP_CHECK(dst.dtype == DType::f32, "compute_out: ", dst.describe(), " is not f32");
  return compute == DType::f32 ? dst : like(dst, compute, ws);
}

void from_compute(ConstTensorView src, TensorView dst) {
  if (src.data == dst.data && src.dtype == dst.dtype) return;
  convert(src, dst);
}

}  // namespace diffcp
