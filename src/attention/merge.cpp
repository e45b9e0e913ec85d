// attention/merge.hpp: views of the partials to the active backend (CPU: src/cpu/merge.cpp).
#include "diffcp/attention/merge.hpp"

#include "diffcp/ops/backend.hpp"

namespace diffcp {

void lse_merge(std::span<const HeadRows<const float>> o_parts, std::span<const std::span<const float>> lse_parts,
               HeadRows<float> o, std::span<float> lse) {
  Backend& b = backend_for(OpKind::lse_merge, DType::f32);
  std::vector<ConstTensorView> o_views, lse_views;
  o_views.reserve(o_parts.size());
  lse_views.reserve(lse_parts.size());
  for (const auto& p : o_parts) o_views.push_back(device_view(p));
  for (const auto& l : lse_parts) lse_views.push_back(device_view(l));
  b.lse_merge(o_views, lse_views, device_view(o), device_view(lse));
}

void lse_rescale(HeadRows<float> o_p, std::span<const float> lse_p, std::span<const float> lse) {
  backend_for(OpKind::lse_rescale, DType::f32).lse_rescale(device_view(o_p), device_view(lse_p), device_view(lse));
}

namespace {
void lse_shift(std::span<float> x, std::span<const float> m, bool to_exp) {
  DIFFCP_CHECK(x.size() == m.size(), "lse_shift: x has ", x.size(), " elements, m ", m.size());
  backend_for(OpKind::lse_shift, DType::f32).lse_shift(device_view(x), device_view(m), to_exp);
}
}  // namespace

void lse_shift_to_exp(std::span<float> x, std::span<const float> m) { lse_shift(x, m, true); }
void lse_shift_from_exp(std::span<float> x, std::span<const float> m) { lse_shift(x, m, false); }

}  // namespace diffcp
