#include "diffcp/drafter/draft.hpp"

#include <algorithm>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/drafter/model.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

std::vector<float> draft_block(Communicator& cp, const DrafterConfig& cfg, std::span<const float> params,
                               std::span<const float> target_hidden, std::int64_t ctx, std::span<const float> noise,
                               const std::string& balancer) {
  const std::int64_t H = cfg.hidden, B = cfg.block, T = cfg.target_layers * H;
  DIFFCP_CHECK(ctx >= 1, "draft: the context has ", ctx, " positions, expected >= 1");
  DIFFCP_CHECK(static_cast<std::int64_t>(target_hidden.size()) == ctx * T, "draft: target hidden states hold ",
               target_hidden.size(), " values, expected [ctx, n_t*H] = [", ctx, ", ", T, "]");
  DIFFCP_CHECK(static_cast<std::int64_t>(noise.size()) == B * H, "draft: the noise embedding holds ", noise.size(),
               " values, expected [B, H] = [", B, ", ", H, "]");
  DIFFCP_CHECK(static_cast<std::int64_t>(params.size()) == DrafterLayout(cfg).total, "draft: ", params.size(),
               " parameters, the model has ", DrafterLayout(cfg).total);
  // One sample of ctx + B positions with one anchor at ctx: the block sees context x < ctx and
  // itself. Context rows ctx .. ctx+B-1 exist in the packed layout but no query sees them (zeros).
  PackedBatch batch;
  batch.block = B;
  batch.lengths = {ctx + B};
  batch.anchors = {{ctx}};
  batch.validate();
  // Up to 4 chunks per rank (as training's default), fewer when the context is short; with fewer
  // rows than ranks, contiguous shares (some ranks hold none).
  const std::int64_t S = ctx + B, P = cp.size();
  const int J = static_cast<int>(std::clamp<std::int64_t>(S / P, 1, 4));
  DrafterBatch mb;
  if (S < P) {
    mb.shard = contiguous_shard(batch, cp.size(), cp.rank());
  } else {
    const Plan plan = make_balancer(balancer)->plan(batch, CostModel(batch, cfg.layer_windows()), cp.size(), J);
    mb.shard = chunked_shard(batch, cp.size(), cp.rank(), plan.chunks_of_rank());
  }
  mb.tokens.assign(static_cast<std::size_t>(ctx + B), 0);
  mb.loss_mask.assign(mb.tokens.size(), 0);
  for (const PosRange& r : mb.shard.chunks)
    for (std::int64_t x = r.begin; x < r.end; ++x) {
      const std::size_t at = mb.hidden_p.size();
      mb.hidden_p.resize(at + static_cast<std::size_t>(T), 0.f);
      if (x < ctx) std::copy_n(target_hidden.begin() + x * T, T, mb.hidden_p.begin() + static_cast<std::ptrdiff_t>(at));
    }
  const bool mine = mb.shard.own_query_rows() > 0;
  if (mine) mb.block_input.assign(noise.begin(), noise.end());
  Drafter d(cp, cfg);
  d.state().set_params(params);
  const DeviceVector<float>& out_p = d.forward_hidden(mb);
  // The owner of the block sends its rows to every rank.
  const std::size_t have = mine ? static_cast<std::size_t>(B * H) : 0;
  std::vector<std::size_t> counts(static_cast<std::size_t>(cp.size()));
  cp.all_gather<std::size_t>(std::span<const std::size_t>(&have, 1), std::span<std::size_t>(counts));
  DeviceVector<float> out;  // [B, H]
  out.resize(B * H);
  cp.all_gather_v_async(out_p.data(), out.data(), counts, DType::f32)->wait();
  return to_host<float>(out.view());
}

}  // namespace diffcp
