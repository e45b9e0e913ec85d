// attention/attention.hpp: the public attention ops hand views of their arguments to the active
// backend (ops/backend.hpp; the CPU kernels are src/cpu/attention.cpp), and FLOP counts.
#include "diffcp/attention/attention.hpp"

#include <initializer_list>
#include <utility>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

namespace {

template <typename T>
void forward_t(const BlockMask& mask, HeadRows<const T> q, HeadRows<const T> k, HeadRows<const T> v, HeadRows<T> o,
               std::span<float> lse, float softmax_scale) {
  backend_for(OpKind::attention_forward, dtype_of<T>())
      .attention_forward(mask, device_view(q), device_view(k), device_view(v), device_view(o), device_view(lse),
                         softmax_scale);
}

template <typename T>
void delta_t(HeadRows<const T> do_, HeadRows<const T> o, std::span<float> delta) {
  backend_for(OpKind::attention_delta, dtype_of<T>())
      .attention_delta(device_view(do_), device_view(o), device_view(delta));
}

template <typename T>
void backward_t(const BlockMask& mask, HeadRows<const T> q, HeadRows<const T> k, HeadRows<const T> v,
                HeadRows<const T> do_, std::span<const float> lse, std::span<const float> delta, HeadRows<T> dq,
                HeadRows<T> dk, HeadRows<T> dv, float softmax_scale) {
  backend_for(OpKind::attention_backward, dtype_of<T>())
      .attention_backward(mask, device_view(q), device_view(k), device_view(v), device_view(do_), device_view(lse),
                          device_view(delta), device_view(dq), device_view(dk), device_view(dv), softmax_scale);
}

}  // namespace

void attention_forward(const BlockMask& mask, HeadRows<const float> q, HeadRows<const float> k,
                       HeadRows<const float> v, HeadRows<float> o, std::span<float> lse, float softmax_scale) {
  forward_t(mask, q, k, v, o, lse, softmax_scale);
}
void attention_forward(const BlockMask& mask, HeadRows<const bf16_t> q, HeadRows<const bf16_t> k,
                       HeadRows<const bf16_t> v, HeadRows<bf16_t> o, std::span<float> lse, float softmax_scale) {
  forward_t(mask, q, k, v, o, lse, softmax_scale);
}

void attention_delta(HeadRows<const float> do_, HeadRows<const float> o, std::span<float> delta) {
  delta_t(do_, o, delta);
}
void attention_delta(HeadRows<const bf16_t> do_, HeadRows<const bf16_t> o, std::span<float> delta) {
  delta_t(do_, o, delta);
}

void attention_backward(const BlockMask& mask, HeadRows<const float> q, HeadRows<const float> k,
                        HeadRows<const float> v, HeadRows<const float> do_, std::span<const float> lse,
                        std::span<const float> delta, HeadRows<float> dq, HeadRows<float> dk, HeadRows<float> dv,
                        float softmax_scale) {
  backward_t(mask, q, k, v, do_, lse, delta, dq, dk, dv, softmax_scale);
}
void attention_backward(const BlockMask& mask, HeadRows<const bf16_t> q, HeadRows<const bf16_t> k,
                        HeadRows<const bf16_t> v, HeadRows<const bf16_t> do_, std::span<const float> lse,
                        std::span<const float> delta, HeadRows<bf16_t> dq, HeadRows<bf16_t> dk, HeadRows<bf16_t> dv,
                        float softmax_scale) {
  backward_t(mask, q, k, v, do_, lse, delta, dq, dk, dv, softmax_scale);
}

namespace {
// The storage dtype of an attention call: q's, and every other view's (else an error naming it).
DType storage_of(const char* op, std::initializer_list<std::pair<const char*, DType>> views) {
  const DType t = views.begin()->second;
  for (const auto& [name, d] : views)
    DIFFCP_CHECK(d == t, op, ": ", name, " holds ", dtype_name(d), ", q holds ", dtype_name(t),
                 " (one storage dtype for every tensor but lse and delta)");
  return t;
}
}  // namespace

void attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView o,
                       std::span<float> lse, float softmax_scale) {
  const DType t = storage_of("attention_forward", {{"q", q.dtype}, {"k", k.dtype}, {"v", v.dtype}, {"o", o.dtype}});
  backend_for(OpKind::attention_forward, t).attention_forward(mask, q, k, v, o, device_view(lse), softmax_scale);
}

void attention_delta(ConstTensorView do_, ConstTensorView o, std::span<float> delta) {
  const DType t = storage_of("attention_delta", {{"do", do_.dtype}, {"o", o.dtype}});
  backend_for(OpKind::attention_delta, t).attention_delta(do_, o, device_view(delta));
}

void attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                        ConstTensorView do_, std::span<const float> lse, std::span<const float> delta, TensorView dq,
                        TensorView dk, TensorView dv, float softmax_scale) {
  const DType t = storage_of("attention_backward", {{"q", q.dtype}, {"k", k.dtype}, {"v", v.dtype}, {"do", do_.dtype},
                                                    {"dq", dq.dtype}, {"dk", dk.dtype}, {"dv", dv.dtype}});
  backend_for(OpKind::attention_backward, t)
      .attention_backward(mask, q, k, v, do_, device_view(lse), device_view(delta), dq, dk, dv, softmax_scale);
}

double attention_forward_flops(const BlockMask& mask, std::int64_t n_q, std::int64_t d_h) {
  return 4.0 * static_cast<double>(d_h) * static_cast<double>(n_q) * static_cast<double>(mask.visible_pairs());
}

double attention_backward_flops(const BlockMask& mask, std::int64_t n_q, std::int64_t d_h) {
  return 2.5 * attention_forward_flops(mask, n_q, d_h);
}

}  // namespace diffcp
