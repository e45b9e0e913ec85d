#include "diffcp/dit/run.hpp"

#include <algorithm>
#include <memory>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/ring_attention.hpp"
#include "diffcp/dit/usp.hpp"
#include "diffcp/dit/vmajor.hpp"

namespace diffcp {

DType weights_dtype(const std::string& name, bool file_is_bf16, const char* what) {
  DIFFCP_CHECK(name == "auto" || name == "f32" || name == "bf16", what, " '", name, "': expected auto, f32 or bf16");
  return name == "bf16" || (name == "auto" && file_is_bf16) ? DType::bf16 : DType::f32;
}

void check_shard_weights(bool shard, DType storage, DType compute, const char* shard_what, const char* weights_what) {
  DIFFCP_CHECK(!(shard && storage == DType::f32 && compute == DType::bf16), shard_what,
               " with bf16 compute needs the weights stored in bf16: ", weights_what, " bf16");
}

CfgGroups make_cfg_groups(Communicator& world) {
  const int P = world.size();
  DIFFCP_CHECK(P % 2 == 0, "`cfg_parallel` splits the ranks into two equal halves, one per classifier-free guidance ",
               "pass; P = ", P, " is odd (run an even number of ranks)");
  const int half = P / 2, p = world.rank();
  CfgGroups g;
  g.group = world.split(p / half, p % half, "cfg.group");
  g.pair = world.split(p % half, p / half, "cfg.pair");
  return g;
}

std::uint64_t cfg_pair_bytes(const DitConfig& cfg, const DitShape& shape, const DitShard& half_shard) {
  return static_cast<std::uint64_t>(shape.batch * half_shard.image_p * cfg.in_channels()) * sizeof(float);
}

DitRun run_dit_sampling(Communicator& world, const DitWeights& w, const DitShape& shape, AttentionExchange& ex,
                        const DitConditioning& cond, const std::vector<float>& noise, const SampleOptions& opt,
                        AttentionExchange* negative_ex, const CfgGroups* cfg_groups) {
  const bool cfg = uses_negative_pass(w.config(), cond, opt), split = cfg_groups != nullptr;
  DIFFCP_CHECK(!split || cfg, "`cfg_parallel`: this run has no negative pass to run beside the prompt's (",
               w.config().accepts_negative() ? "no negative prompt, or a guidance scale <= 1" : "the family has no classifier-free guidance",
               ")");
  DIFFCP_CHECK(!split || negative_ex == nullptr, "run_dit_sampling: CFG-parallel runs one pass per rank; no negative exchange");
  DIFFCP_CHECK(split || !cfg || (negative_ex != nullptr && negative_ex != &ex), "run_dit_sampling: classifier-free guidance ",
               "needs a second exchange for the negative prompt's pass");
  Communicator& pass_comm = split ? *cfg_groups->group : world;  // the ranks of this rank's pass(es)
  const int pass = split ? cfg_groups->pass() : 0;
  DitModel model(w, pass == 1 ? negative_shape(shape, cond) : shape, ex);
  std::unique_ptr<DitModel> neg;
  if (cfg && !split) neg = std::make_unique<DitModel>(w, negative_shape(shape, cond), *negative_ex);
  model.set_step_cache(opt.step_cache, pass_comm);
  if (neg) neg->set_step_cache(opt.step_cache, pass_comm);
  model.set_profile(opt.profile);
  if (neg) neg->set_profile(opt.profile);
  std::vector<float> x_p = shard_latent(noise, w.config(), shape, model.shard());
  ex.reset_stats();
  if (neg) negative_ex->reset_stats();
  const std::uint64_t pair0 = split ? cfg_groups->pair->stats().total().bytes_sent : 0;
  const SampleTimings t = euler_sample(model, x_p, cond, opt, neg.get(), CfgPair{split ? cfg_groups->pair.get() : nullptr});
  DitRun r;
  r.latent = gather_latent(pass_comm, x_p, w.config(), shape, model.shard());
  r.step_ms = t.step_ms;
  r.comm_ms = t.comm_ms;
  r.stats = ex.stats();
  r.cache_bytes = ex.cache_bytes();
  r.group_size = ex.group_size();
  r.link_group_size = ex.link_group_size();
  if (split) r.cfg_pair_bytes = cfg_groups->pair->stats().total().bytes_sent - pair0;
  if (neg) {
    r.stats += negative_ex->stats();
    r.cache_bytes += negative_ex->cache_bytes();
  }
  // Step caching: each pass's counts from a rank that ran it (every rank of a pass agrees).
  std::vector<double> counts(4, 0.0);
  for (const DitModel* m : {&model, neg.get()})
    if (m != nullptr && m->step_cache() != nullptr) {
      const int q = m == &model ? pass : 1;
      counts[static_cast<std::size_t>(2 * q)] = m->step_cache()->stats().computed;
      counts[static_cast<std::size_t>(2 * q + 1)] = m->step_cache()->stats().cached;
    }
  if (model.step_cache() != nullptr) r.rel_l1 = model.step_cache()->stats().rel_l1;
  world.all_reduce<double>(counts, ReduceOp::max);
  for (int q = 0; q < 2; ++q) {
    r.steps_computed[q] = static_cast<int>(counts[static_cast<std::size_t>(2 * q)]);
    r.steps_cached[q] = static_cast<int>(counts[static_cast<std::size_t>(2 * q + 1)]);
  }
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

DitBytesPrediction& DitBytesPrediction::operator*=(double f) {
  for (double* v : {&inter, &tapa_inter, &qkv, &tapa_qkv, &ring, &scales}) *v *= f;
  return *this;
}

DitMemory dit_memory_per_rank(const DitConfig& cfg, const DitShape& shape, const DitShard& shard, DType storage,
                              int weight_shards, DType compute, bool packed_weights) {
  const DitLayout L(cfg);
  const std::int64_t Mp = shape.batch * shard.tokens_p(), H = cfg.hidden();
  const bool rounded_copy = storage == DType::f32 && compute == DType::bf16;
  const bool bf16_gemms = packed_weights && (storage == DType::bf16 || compute == DType::bf16);
  // Packed copies (dit/weights.hpp packed): every matrix replicated; sharded, units[0] and one slice
  // (at most the largest Linear of a block).
  std::int64_t largest = 0;
  for (std::size_t u = 1; u < L.units.size(); ++u)
    for (const std::int64_t n : L.units[u].n) largest = std::max(largest, n);
  const std::int64_t packed = !bf16_gemms ? 0 : weight_shards > 1 ? 2 * (L.units[0].size + largest) : 2 * L.matrices;
  // Wan: the context, its keys and values per block (sized for a batch of prompts), the cross-attention's statistics
  const double T = static_cast<double>(shard.context), b = static_cast<double>(shape.batch);
  const double cross = cfg.cross_attention()
                           ? 4.0 * (4 * b * T * static_cast<double>(H) + b * T + static_cast<double>(Mp * (1 + cfg.heads)) +
                                    18.0 * static_cast<double>(H))
                           : 0.0;
  return {static_cast<double>(dit_weight_bytes(L, storage, weight_shards) + (rounded_copy ? 2 * L.matrices : 0) + packed),
          4.0 * static_cast<double>(Mp) * static_cast<double>(4 * H + 3 * H + cfg.mlp_in()) + cross};
}

}  // namespace diffcp
