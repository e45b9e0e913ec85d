#include "diffcp/dit/run.hpp"

#include <memory>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/ring_attention.hpp"
#include "diffcp/dit/usp.hpp"
#include "diffcp/dit/vmajor.hpp"

namespace diffcp {

DitRun run_dit_sampling(Communicator& world, const DitWeights& w, const DitShape& shape, AttentionExchange& ex,
                        const DitConditioning& cond, const std::vector<float>& noise, const SampleOptions& opt,
                        AttentionExchange* negative_ex) {
  const bool cfg = uses_negative_pass(w.config(), cond, opt);
  DIFFCP_CHECK(!cfg || (negative_ex != nullptr && negative_ex != &ex), "run_dit_sampling: classifier-free guidance ",
               "needs a second exchange for the negative prompt's pass");
  DitModel model(w, shape, ex);
  std::unique_ptr<DitModel> neg;
  if (cfg) neg = std::make_unique<DitModel>(w, negative_shape(shape, cond), *negative_ex);
  std::vector<float> x_p = shard_latent(noise, w.config(), shape, model.shard());
  ex.reset_stats();
  if (cfg) negative_ex->reset_stats();
  const SampleTimings t = euler_sample(model, x_p, cond, opt, neg.get());
  DitRun r{gather_latent(world, x_p, w.config(), shape, model.shard()), t.step_ms, t.comm_ms, ex.stats(), ex.cache_bytes()};
  if (cfg) {
    r.stats += negative_ex->stats();
    r.cache_bytes += negative_ex->cache_bytes();
  }
  const ScopedCommDevice host(world, Device::host);  // host metadata
  world.all_reduce<double>(r.step_ms, ReduceOp::max);
  world.all_reduce<double>(r.comm_ms, ReduceOp::max);
  return r;
}

DitBytesPrediction dit_predicted_bytes(const DitConfig& cfg, const DitShape& shape, const DitShard& shard, UspDegrees deg,
                                       int P, ExchangeMode mode, const CacheSchedule& schedule, int steps, int group_size,
                                       int link_group_size, DType compute, Wire wire) {
  const std::int64_t n_tok = shape.batch * shard.tokens_p();
  const std::int64_t hdim = cfg.hidden() / deg.ulysses, layers = cfg.double_blocks + cfg.single_blocks;
  const WireFormat f{compute, wire, cfg.head_dim};
  VMajorBytes tapa = vmajor_predicted_bytes(deg.ulysses, group_size, n_tok, hdim, layers, schedule, steps, false, f);
  VMajorBytes run = vmajor_predicted_bytes(deg.ulysses, group_size, n_tok, hdim, layers, schedule, steps,
                                           mode == ExchangeMode::cocodiff, f);
  const std::uint64_t ring_hop = ring_kv_bytes(deg.ring, n_tok, cfg.hidden(), f);
  const std::uint64_t ring = static_cast<std::uint64_t>(steps * layers) * ring_hop;
  int ring_inter_ranks = 0;
  for (int p = 0; p < P; ++p) ring_inter_ranks += !ring_next_in_group(p, deg.ulysses, deg.ring, link_group_size);
  const std::uint64_t ring_inter = ring * static_cast<std::uint64_t>(ring_inter_ranks) / static_cast<std::uint64_t>(P);
  tapa.inter += ring_inter;
  run.inter += ring_inter;
  const double inv = 1.0 / steps;
  DitBytesPrediction b;
  b.inter = static_cast<double>(run.inter) * inv;
  b.tapa_inter = static_cast<double>(tapa.inter) * inv;
  b.qkv = static_cast<double>(run.inter_qkv) * inv;
  b.tapa_qkv = static_cast<double>(tapa.inter_qkv) * inv;
  b.ring = static_cast<double>(ring) * inv;
  b.scales = static_cast<double>(run.scales + f.scale_share(ring)) * inv;
  return b;
}

DitBytesPrediction& DitBytesPrediction::operator+=(const DitBytesPrediction& o) {
  inter += o.inter;
  tapa_inter += o.tapa_inter;
  qkv += o.qkv;
  tapa_qkv += o.tapa_qkv;
  ring += o.ring;
  scales += o.scales;
  return *this;
}

DitMemory dit_memory_per_rank(const DitConfig& cfg, const DitShape& shape, const DitShard& shard, DType storage,
                              int weight_shards, DType compute) {
  const DitLayout L(cfg);
  const std::int64_t Mp = shape.batch * shard.tokens_p(), H = cfg.hidden();
  const bool rounded_copy = storage == DType::f32 && compute == DType::bf16;
  return {static_cast<double>(dit_weight_bytes(L, storage, weight_shards) + (rounded_copy ? 2 * L.matrices : 0)),
          4.0 * static_cast<double>(Mp * (4 * H + 3 * H + cfg.mlp_in()))};
}

}  // namespace diffcp
