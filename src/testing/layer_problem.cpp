#include "diffcp/testing/layer_problem.hpp"

#include "diffcp/core/random.hpp"

namespace diffcp {

namespace {
std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

template <typename T>
std::vector<T> rows_of(const std::vector<T>& full, std::int64_t width, std::int64_t r0, std::int64_t r1) {
  return {full.begin() + r0 * width, full.begin() + r1 * width};
}
template <typename T>
std::vector<T> chunk_rows(const std::vector<T>& full, std::int64_t width, const std::vector<PosRange>& chunks) {
  std::vector<T> out;
  for (const PosRange& c : chunks) out.insert(out.end(), full.begin() + c.begin * width, full.begin() + c.end * width);
  return out;
}
}  // namespace

LayerProblem::LayerProblem(const AttnLayerConfig& c, const PackedBatch& b, std::uint64_t seed)
    : cfg(c), batch(b), w(c) {
  cfg.validate();
  batch.validate();
  w.init_random(seed);
  const std::int64_t H = cfg.hidden, Q = batch.query_rows(), S = batch.context_rows();
  x = random_normal(static_cast<std::size_t>(Q * H), seed + 1);
  ctx = random_normal(static_cast<std::size_t>(S * H), seed + 2);
  dy = random_normal(static_cast<std::size_t>(Q * H), seed + 3);
}

std::vector<float> LayerProblem::x_rows(const CpShard& s) const {
  return rows_of(x, cfg.hidden, s.blocks.begin * batch.block, s.blocks.end * batch.block);
}
std::vector<float> LayerProblem::dy_rows(const CpShard& s) const {
  return rows_of(dy, cfg.hidden, s.blocks.begin * batch.block, s.blocks.end * batch.block);
}
std::vector<float> LayerProblem::ctx_rows(const CpShard& s) const { return chunk_rows(ctx, cfg.hidden, s.chunks); }

ReferenceLayerResult LayerProblem::reference() const {
  return reference_attention_layer(cfg, batch, w, to_double(x), to_double(ctx), to_double(dy), window);
}

CompareResult LayerCheck::all() const {
  CompareResult r = y;
  r.merge(dx);
  r.merge(dctx);
  r.merge(grad);
  return r;
}

LayerCheck check_layer(const ReferenceLayerResult& ref, const CpShard& s, std::int64_t H, const std::vector<float>& y_p,
                       const std::vector<float>& dx_p, const std::vector<float>& dctx_p, const AttnLayerParams& grad,
                       Tolerance tol) {
  const std::int64_t B = s.batch.block;
  LayerCheck c;
  // Each tensor's tolerance scales with its own magnitude (over ALL rows, so ranks agree).
  c.y = compare<float>(y_p, rows_of(ref.y, H, s.blocks.begin * B, s.blocks.end * B), scaled_to(tol, ref.y));
  c.dx = compare<float>(dx_p, rows_of(ref.dx, H, s.blocks.begin * B, s.blocks.end * B), scaled_to(tol, ref.dx));
  c.dctx = compare<float>(dctx_p, chunk_rows(ref.dctx, H, s.chunks), scaled_to(tol, ref.dctx));
  relative_to_whole(c.y, ref.y);
  relative_to_whole(c.dx, ref.dx);
  relative_to_whole(c.dctx, ref.dctx);
  std::size_t off = 0;
  for (int i = 0; i < AttnLayerParams::kCount; ++i) {
    const auto n = static_cast<std::size_t>(grad.size(static_cast<AttnLayerParams::Id>(i)));
    const std::span<const double> r(ref.grad.data() + off, n);
    c.grad.merge(compare<float>(grad.all().subspan(off, n), r, scaled_to(tol, r)));
    off += n;
  }
  return c;
}

}  // namespace diffcp
