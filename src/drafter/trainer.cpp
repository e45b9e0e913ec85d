#include "diffcp/drafter/trainer.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/balance/redistribute.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/data.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/drafter/hf_format.hpp"
#include "diffcp/drafter/model.hpp"
#include "diffcp/drafter/optim.hpp"
#include "diffcp/drafter/sharded_state.hpp"

namespace diffcp {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// Anchors of global micro-batch g (train) or held-out micro-batch g (eval): the same on every CP
// rank of the group, and the same whichever DP x accumulation split produced g.
std::mt19937_64 anchor_rng(std::uint64_t seed, std::int64_t g, std::uint64_t salt) {
  std::seed_seq seq{seed, static_cast<std::uint64_t>(g), salt};
  return std::mt19937_64(seq);
}

// The context-parallel group's view of one packed micro-batch.
struct MicroBatchBuilder {
  const DataSource& data;
  const DrafterConfig& cfg;
  const Balancer& balancer;
  Communicator& cp;
  Communicator& redist;
  int J;
  std::int64_t bucket;
  std::int64_t context;  // samples are right-truncated to it
  double redist_ms = 0;  // time in redistribute_rows, summed over the builds

  // greedy: also the packed target greedy tokens (empty unless every member has them).
  DrafterBatch build(bool heldout, const std::vector<std::size_t>& members, std::int64_t anchors, std::mt19937_64& rng,
                     std::vector<std::int32_t>* greedy = nullptr) {
    const auto& samples = heldout ? data.heldout() : data.train();
    DrafterBatch mb;
    const PackedBatch batch = sample_anchors(samples, members, anchors, cfg.block, rng, context);
    for (std::size_t u = 0; u < members.size(); ++u) {
      const Sample& smp = samples[members[u]];
      const auto L = static_cast<std::ptrdiff_t>(batch.lengths[u]);
      mb.tokens.insert(mb.tokens.end(), smp.tokens.begin(), smp.tokens.begin() + L);
      mb.loss_mask.insert(mb.loss_mask.end(), smp.loss_mask.begin(), smp.loss_mask.begin() + L);
      if (greedy != nullptr && !smp.greedy.empty()) greedy->insert(greedy->end(), smp.greedy.begin(), smp.greedy.begin() + L);
    }
    if (greedy != nullptr && greedy->size() != mb.tokens.size()) greedy->clear();
    const CostModel cost(batch, cfg.layer_windows());  // the layers' windows: each rank's real work
    const Plan plan = balancer.plan(batch, cost, cp.size(), J);
    mb.shard = chunked_shard(batch, cp.size(), cp.rank(), plan.chunks_of_rank());
    mb.shard.bucket = bucket;
    // The loader's slice of the target hidden states, then one all-to-all-v to the planned ranks.
    const std::int64_t T = cfg.target_layers * cfg.hidden;
    const PosRange slice = loader_slices(batch.context_rows(), cp.size())[static_cast<std::size_t>(cp.rank())];
    std::vector<float> loaded(static_cast<std::size_t>((slice.end - slice.begin) * T));
    const auto starts = batch.sample_starts();
    for (std::size_t u = 0; u < members.size(); ++u) {
      const std::int64_t lo = std::max(slice.begin, starts[u]), hi = std::min(slice.end, starts[u] + batch.lengths[u]);
      if (lo < hi) data.hidden(heldout, members[u], lo - starts[u], hi - starts[u], loaded.data() + (lo - slice.begin) * T);
    }
    const auto t0 = Clock::now();
    mb.hidden_p = redistribute_rows(redist, batch, plan, loaded, T);
    redist_ms += ms_since(t0);
    return mb;
  }
};

// The option checks that need no communication: every rank fails the same way before any collective.
void validate(const TrainOptions& opt, int W) {
  DIFFCP_CHECK(opt.dp >= 1 && W % opt.dp == 0, "TrainOptions::dp = ", opt.dp, " does not divide the ", W, " ranks");
  const int cp_size = opt.cp > 0 ? opt.cp : W / opt.dp;
  DIFFCP_CHECK(cp_size * opt.dp == W, "TrainOptions::cp ", cp_size, " x TrainOptions::dp ", opt.dp, " = ", cp_size * opt.dp,
               " ranks, but the world communicator has ", W);
  DIFFCP_CHECK(opt.steps >= 1 && opt.accum >= 1 && opt.anchors >= 0 && opt.context >= 1,
               "TrainOptions::steps, TrainOptions::accum and TrainOptions::context must be >= 1, TrainOptions::anchors >= 1 "
               "(0: the preset's)");
  DIFFCP_CHECK(opt.lr >= 0 && opt.clip > 0 && opt.warmup >= 0 && opt.warmup < 1,
               "TrainOptions::lr must be > 0 (0: the preset's), TrainOptions::clip > 0, warm-up in [0, 1)");
  DIFFCP_CHECK(std::isfinite(opt.selector_weight) && opt.selector_weight >= 0, "TrainOptions::selector_weight ",
               opt.selector_weight, ", expected finite and >= 0");
  DIFFCP_CHECK(opt.arch.empty() || opt.arch == "dflash" || opt.arch == "dflash2", "TrainOptions::arch '", opt.arch,
               "', expected dflash or dflash2");
  DIFFCP_CHECK(opt.collectives == "auto" || opt.collectives == "flat" || opt.collectives == "hierarchical",
               "TrainOptions::collectives '", opt.collectives, "': expected flat, hierarchical or auto");
  DIFFCP_CHECK(opt.shard == "auto" || opt.shard == "none" || opt.shard == "optimizer" || opt.shard == "full",
               "TrainOptions::shard '", opt.shard, "': expected none, optimizer, full or auto");
  DIFFCP_CHECK(opt.oproj == "auto" || opt.oproj == "all" || opt.oproj == "owned", "TrainOptions::oproj '", opt.oproj,
               "': expected all, owned or auto");
  DIFFCP_CHECK(opt.recompute == "auto" || opt.recompute == "on" || opt.recompute == "off", "TrainOptions::recompute '",
               opt.recompute, "': expected on, off or auto");
  (void)compute_dtype(opt.dtype, "TrainOptions::dtype");
  DIFFCP_CHECK(!opt.resume || !opt.out.empty(), "TrainOptions::resume needs TrainOptions::out (the directory of checkpoint.bin)");
  DIFFCP_CHECK(opt.init.empty() || opt.preset.empty(), "TrainOptions::init '", opt.init, "' and TrainOptions::preset '",
               opt.preset, "': give one (the drafter directory's config.json is the shape)");
}

}  // namespace

struct Trainer::Impl {
  Impl(Communicator& world_, TrainOptions opt_, TrainLogger log_);
  // The run's backend, the constructing thread's active one: every entry point installs it (with
  // the compute dtype), so the run computes there whichever thread calls it.
  Backend& backend = active_backend();

  // The pack that global micro-batch g visits: pack order_e[g mod n] in epoch e = g / n, a fresh
  // order each epoch, a function of (seed, e) only, so resumed runs and any DP x accumulation
  // split agree.
  std::size_t pack_of(std::int64_t g);
  // The constructor's parts, in order.
  void open_data(bool real_shape);
  void describe_data(double lr);
  void make_drafter(DrafterWeights& init, bool real_shape, int W);
  void resume();

  Communicator& world;
  const TrainOptions opt;
  const TrainLogger log;
  int cp_size = 0, rank = 0, dp_rank = 0;
  CollAlgo collectives = CollAlgo::hierarchical;
  DType compute = DType::f32;  // TrainOptions::dtype
  std::unique_ptr<Communicator> cp, redist, vocab;  // the CP group, its redistribution and LM head twins
  DrafterConfig cfg;
  std::int64_t anchors = 0;
  std::unique_ptr<DataSource> data;
  std::vector<std::vector<std::size_t>> train_packs, eval_packs;
  std::unique_ptr<Balancer> balancer;
  std::unique_ptr<MicroBatchBuilder> builder;
  TrainResult res;  // summary()
  ShardMode shard = ShardMode::none;
  std::unique_ptr<Drafter> drafter;
  std::unique_ptr<ShardedState> state;  // after the drafter: destroyed before it
  AdamW adam;
  std::int64_t step = 0;  // steps done
  std::string ckpt_path;
  std::int64_t order_epoch = -1;
  std::vector<std::size_t> order;
  // This run's measurements (result()).
  std::vector<double> step_ms;
  double tokens = 0, busy = 0, t_build = 0, t_redist = 0, t_reduce = 0, t_optim = 0;
};

Trainer::Impl::Impl(Communicator& world_, TrainOptions opt_, TrainLogger log_)
    : world(world_), opt(std::move(opt_)), log(std::move(log_)) {
  const int W = world.size();
  validate(opt, W);
  cp_size = opt.cp > 0 ? opt.cp : W / opt.dp;
  collectives = opt.collectives == "auto" ? CollAlgo::hierarchical : parse_coll_algo(opt.collectives);
  DrafterWeights init;
  if (!opt.init.empty()) init = import_dflash(opt.init);
  cfg = opt.init.empty() ? drafter_preset(opt.preset.empty() ? "tiny" : opt.preset) : init.config;
  const std::string own = cfg.has_selector() ? "dflash2" : "dflash";
  DIFFCP_CHECK(opt.arch.empty() || opt.arch == own || opt.init.empty(), "TrainOptions::arch '", opt.arch, "': the `init` drafter '",
               opt.init, "' is ", own, ", and its folder fixes the architecture");
  DIFFCP_CHECK(opt.arch != "dflash" || own == "dflash", "TrainOptions::arch 'dflash': the preset '", opt.preset, "' is DFlash2");
  if (opt.arch == "dflash2") cfg = as_dflash2(cfg);
  // The paper's recipe for real shapes (SPEC A.1); the tiny and small synthetic ones train faster with more.
  const bool real_shape = cfg.vocab > 4096;
  const double lr = opt.lr > 0 ? opt.lr : real_shape ? 6e-4 : 5e-3;
  anchors = opt.anchors > 0 ? opt.anchors : real_shape ? 512 : 12;
  rank = world.rank();
  dp_rank = rank / cp_size;
  // CP groups are consecutive ranks (node-local first); DP groups are the same CP index.
  cp = world.split(dp_rank, rank % cp_size, "cp");
  cp->discover_topology();  // the nodes of the CP group: DIFFCP_NODE or shared memory
  redist = cp->split(0, cp->rank(), "redistribute");
  vocab = cp->split(0, cp->rank(), "lm_head");  // the vocabulary-parallel LM head's

  open_data(real_shape);
  describe_data(lr);
  make_drafter(init, real_shape, W);
  adam.lr = lr;
  adam.weight_decay = opt.weight_decay;
  ckpt_path = opt.out.empty() ? "" : opt.out + "/checkpoint.bin";
  if (opt.resume) resume();
  if (rank == 0 && !opt.out.empty()) std::filesystem::create_directories(opt.out);
  res.topology = cp->topology().describe();
  res.collectives = collectives == CollAlgo::hierarchical && cp->hierarchy_useful() ? "hierarchical" : "flat";
  res.uniform_loss = std::log(static_cast<double>(cfg.vocab));
  res.checkpoint = ckpt_path;
}

// The training data: the synthetic corpus (the paper's regime for real shapes: long samples, Q << S)
// or the shards of `opt.data`, their target layers checked against an imported drafter's; packed
// into micro-batches of the context length, the balancer and the micro-batch builder.
void Trainer::Impl::open_data(bool real_shape) {
  if (opt.data.empty()) {
    SyntheticSpec spec;
    spec.seed = opt.seed;
    spec.max_length = std::min<std::int64_t>(spec.max_length, opt.context);
    spec.min_length = std::min(spec.min_length, spec.max_length);
    if (real_shape) {  // the paper's regime: long samples (half to all of the context), Q << S
      spec.max_length = std::max<std::int64_t>(opt.context, cfg.block + 2);
      spec.min_length = std::max<std::int64_t>(spec.max_length / 2, cfg.block + 2);
      spec.train_samples = 16;
      spec.heldout_samples = std::min<std::int64_t>(opt.heldout, 2);  // heldout 0: no evaluation
    }
    data = make_synthetic_source(cfg, spec);
  } else {
    data = make_shard_source(cfg, opt.data, opt.heldout);
  }
  if (!data->target_layer_ids().empty()) {  // the shards say which target layers they hold
    const bool depth_known = data->target_depth() > 0;
    DIFFCP_CHECK(opt.init.empty() || (cfg.target_layer_ids == data->target_layer_ids() &&
                                      (!depth_known || cfg.target_depth == data->target_depth())),
                 "TrainOptions::data '", opt.data, "' holds target layers ", nlohmann::json(data->target_layer_ids()).dump(),
                 " of ", data->target_depth(), ", the drafter of TrainOptions::init '", opt.init, "' fuses layers ",
                 nlohmann::json(cfg.target_layer_ids).dump(), " of ", cfg.target_depth);
    cfg.target_layer_ids = data->target_layer_ids();
    if (depth_known || opt.init.empty()) cfg.target_depth = data->target_depth();
  }
  train_packs = pack_samples(data->train(), opt.context);
  eval_packs = pack_samples(data->heldout(), opt.context);
  order.resize(train_packs.size());
  balancer = make_balancer(opt.balancer);
  builder = std::make_unique<MicroBatchBuilder>(
      MicroBatchBuilder{*data, cfg, *balancer, *cp, *redist, opt.J, opt.bucket, opt.context});
}

// What the run reports about its data: samples truncated to the context, samples with fewer anchor
// candidates than asked, what tau is measured against; the learning rate and anchors chosen.
void Trainer::Impl::describe_data(double lr) {
  res.train_samples = static_cast<std::int64_t>(data->train().size());
  for (const Sample& smp : data->train()) {
    res.truncated += static_cast<std::int64_t>(smp.tokens.size()) > opt.context ? 1 : 0;
    res.few_anchors += anchor_candidates(smp, cfg.block, opt.context) < anchors ? 1 : 0;
  }
  bool greedy_known = !data->heldout().empty();
  for (const Sample& smp : data->heldout()) greedy_known &= !smp.greedy.empty();
  res.tau_reference = greedy_known ? "target greedy tokens" : "dataset tokens";
  res.lr = lr;
  res.anchors = anchors;
}

// The drafter on the CP group with its sharded state (the shard mode, output projection and dtype
// resolved), its initial parameters (seeded or imported), embedding and LM head (whole, or the
// vocabulary slice of this CP rank under --shard full).
void Trainer::Impl::make_drafter(DrafterWeights& init, bool real_shape, int W) {
  shard = resolve_shard_mode(opt.shard, real_shape, W);
  res.shard = shard_mode_name(shard);
  compute = compute_dtype(opt.dtype, "TrainOptions::dtype");
  res.dtype = opt.dtype;
  const OProj oproj = opt.oproj != "auto" ? parse_oproj(opt.oproj) : choose_oproj_by_shape(cfg.attn());
  res.oproj = oproj_name(oproj);
  drafter = std::make_unique<Drafter>(*cp, cfg, SplitKVOptions{oproj, collectives, compute});
  state = std::make_unique<ShardedState>(world, drafter->layout(), shard);
  drafter->use_state(*state);
  res.recompute = opt.recompute == "on" || (opt.recompute == "auto" && shard == ShardMode::full);
  drafter->set_recompute(res.recompute);
  drafter->set_selector_loss_weight(opt.selector_weight);
  if (opt.init.empty()) drafter->init_params(opt.seed + 7);
  else state->set_params(init.params), init.params = {};
  drafter->set_embedding([src = data.get()](std::span<const std::int32_t> tokens, float* out) { src->embedding_rows(tokens, out); });
  {  // the LM head: whole (none, optimizer) or this CP rank's vocabulary slice (full)
    const bool split = shard == ShardMode::full;
    const auto [v0, v1] = split ? vocab_slice(cfg.vocab, cp->size(), cp->rank()) : std::pair<std::int64_t, std::int64_t>{0, cfg.vocab};
    res.lm_head_mb = static_cast<double>(cfg.hidden * (v1 - v0)) * 4 / (1 << 20);
    drafter->set_lm_head(LmHead(split ? vocab.get() : nullptr, cfg.hidden, cfg.vocab, v0, v1,
                                [src = data.get()](std::int64_t c0, std::int64_t c1, float* out) {
                                  src->lm_head_columns(c0, c1, out);
                                }));
  }
}

// Continues from the checkpoint: the model, its size and the seed must match; this rank's slices
// of the state, whatever mesh wrote the file; the optimizer's step and the step count.
void Trainer::Impl::resume() {
  try {
    CheckpointReader ck(ckpt_path);
    DIFFCP_CHECK(ck.meta().at("config") == cfg.to_json(), "checkpoint '", ckpt_path, "' is for a different model: ",
                 ck.meta().at("config").dump(), " vs ", cfg.to_json().dump());
    DIFFCP_CHECK(static_cast<std::int64_t>(ck.n()) == drafter->layout().total, "checkpoint '", ckpt_path, "': ", ck.n(),
                 " parameters, the model has ", drafter->layout().total);
    DIFFCP_CHECK(ck.meta().at("seed").get<std::uint64_t>() == opt.seed, "checkpoint '", ckpt_path,
                 "' was trained with TrainOptions::seed ", ck.meta().at("seed").get<std::uint64_t>(), ", not ", opt.seed,
                 " (the data order and anchors follow the seed)");
    state->load(ck);  // this rank's slices, whatever mesh wrote the file
    adam.t = ck.meta().at("adam_t").get<std::int64_t>();
    step = ck.meta().at("step").get<std::int64_t>();
  } catch (const nlohmann::json::exception& e) {  // a checksummed file whose header lacks a field
    DIFFCP_FAIL("checkpoint '", ckpt_path, "': header field missing or of the wrong type: ", e.what());
  }
}

std::size_t Trainer::Impl::pack_of(std::int64_t g) {
  const auto n = static_cast<std::int64_t>(train_packs.size());
  if (g / n != order_epoch) {
    order_epoch = g / n;
    std::iota(order.begin(), order.end(), std::size_t{0});
    auto rng = anchor_rng(opt.seed, order_epoch, 0x5e9);
    std::shuffle(order.begin(), order.end(), rng);
  }
  return order[static_cast<std::size_t>(g % n)];
}

Trainer::Trainer(Communicator& world, TrainOptions opt, TrainLogger log)
    : impl_(std::make_unique<Impl>(world, std::move(opt), std::move(log))) {}

Trainer::~Trainer() = default;

StepStats Trainer::step() {
  Impl& m = *impl_;
  const ScopedBackend on(m.backend);
  const TrainOptions& opt = m.opt;
  DIFFCP_CHECK(m.step < opt.steps, "Trainer::step: the run is done (", m.step, " of TrainOptions::steps = ", opt.steps, ")");
  const ScopedF32GemmCompute precision(m.compute);
  const std::int64_t s = m.step, B = m.cfg.block;
  const auto t0 = Clock::now();
  const Drafter::Phases ph0 = m.drafter->phases();
  const double redist0 = m.builder->redist_ms;
  double t_build = 0;
  m.state->zero_grads();
  // loss, weight, tokens, correct[B], counted[B], then DFlash2's selector: loss, rows, covered, correct
  std::vector<double> stats(static_cast<std::size_t>(3 + 2 * B + 4), 0.0);
  const auto sel = static_cast<std::size_t>(3 + 2 * B);
  for (std::int64_t j = 0; j < opt.accum; ++j) {
    const std::int64_t g = (s * opt.dp + m.dp_rank) * opt.accum + j;  // global micro-batch number
    const auto idx = m.pack_of(g);
    auto rng = anchor_rng(opt.seed, g, 0x7a1);
    const auto tb = Clock::now();
    const DrafterBatch mb = m.builder->build(false, m.train_packs[idx], m.anchors, rng);
    t_build += ms_since(tb);
    const DrafterStats st = m.drafter->step(mb, true);
    stats[0] += st.loss_sum;
    stats[1] += st.weight_sum;
    if (m.cp->rank() == 0) stats[2] += static_cast<double>(mb.tokens.size());
    for (std::int64_t k = 0; k < B; ++k) {
      stats[static_cast<std::size_t>(3 + k)] += static_cast<double>(st.correct[static_cast<std::size_t>(k)]);
      stats[static_cast<std::size_t>(3 + B + k)] += static_cast<double>(st.counted[static_cast<std::size_t>(k)]);
    }
    stats[sel] += st.selector_loss_sum;
    stats[sel + 1] += static_cast<double>(st.selector_rows);
    stats[sel + 2] += static_cast<double>(st.selector_covered);
    stats[sel + 3] += static_cast<double>(st.selector_correct);
  }
  // Sum over the whole mesh (CP shares and DP replicas alike) to the owners, then normalise by
  // the global weight, clip and update what this rank owns.
  auto tr = Clock::now();
  m.world.all_reduce<double>(stats);
  const double inv = 1.0 / (stats[1] + 1e-6);
  StepStats out;
  out.grad_norm = m.state->reduce_grads(inv);
  const double t_reduce = ms_since(tr);
  tr = Clock::now();
  out.lr = cosine_lr(m.adam.lr, s, opt.steps, opt.warmup);
  m.state->apply(m.adam, out.lr, opt.clip);
  const double t_optim = ms_since(tr);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  m.step = s + 1;
  out.step = m.step;
  out.loss = stats[0] * inv;
  out.tokens = stats[2];
  out.ms = secs * 1e3;
  out.tokens_per_s = stats[2] / secs;
  for (std::int64_t k = 1; k < B; ++k) {
    const double n = stats[static_cast<std::size_t>(3 + B + k)];
    out.slot_accuracy.push_back(n > 0 ? stats[static_cast<std::size_t>(3 + k)] / n : 0.0);
  }
  if (m.cfg.has_selector()) {
    out.selector_loss = stats[sel] * inv;
    out.candidate_recall = stats[sel + 1] > 0 ? stats[sel + 2] / stats[sel + 1] : 0.0;
    out.selector_accuracy = stats[sel + 2] > 0 ? stats[sel + 3] / stats[sel + 2] : 0.0;
  }
  const Drafter::Phases& ph = m.drafter->phases();
  const double t_redist = m.builder->redist_ms - redist0;
  out.phases = {{"target_features", t_build - t_redist},
                {"redistribution", t_redist},
                {"fusion", ph.fusion - ph0.fusion},
                {"attention", ph.attention - ph0.attention},
                {"attention_comm", ph.attention_comm - ph0.attention_comm},
                {"mlp", ph.mlp - ph0.mlp},
                {"lm_head", ph.lm_head - ph0.lm_head},
                {"gather_wait", ph.gather_wait - ph0.gather_wait},
                {"reduce", t_reduce},
                {"optimizer", t_optim}};
  m.res.loss = out.loss;
  m.step_ms.push_back(out.ms);
  m.tokens += stats[2];
  m.busy += secs;
  m.t_build += t_build - t_redist;
  m.t_redist += t_redist;
  m.t_reduce += t_reduce;
  m.t_optim += t_optim;
  if ((opt.eval_every > 0 && m.step % opt.eval_every == 0) || m.step == opt.steps) out.tau = evaluate();
  if (m.log) m.log(TrainEvent{TrainEvent::Kind::step, m.step, &out, {}});
  return out;
}

double Trainer::evaluate() {
  Impl& m = *impl_;
  const ScopedBackend on(m.backend);
  const ScopedF32GemmCompute precision(m.compute);
  const std::int64_t B = m.cfg.block;
  double tau_sum = 0, responses = 0;
  // Every DP replica runs the same number of rounds: with shard full each forward gathers the
  // parameters over the whole mesh, so a replica without a pack in the last round still takes part.
  const auto dp = static_cast<std::size_t>(m.opt.dp), rounds = (m.eval_packs.size() + dp - 1) / dp;
  for (auto e = static_cast<std::size_t>(m.dp_rank); e < rounds * dp; e += dp) {
    if (e >= m.eval_packs.size()) {
      m.drafter->idle_step();
      continue;
    }
    auto rng = anchor_rng(m.opt.seed, static_cast<std::int64_t>(e), 0xe7a1);
    std::vector<std::int32_t> greedy;
    const DrafterBatch mb = m.builder->build(true, m.eval_packs[e], m.anchors, rng, &greedy);
    const std::vector<std::int32_t>& want = greedy.empty() ? mb.tokens : greedy;  // SPEC: the target's argmax
    if (m.cfg.has_selector() && !greedy.empty()) {  // DFlash2: each choice follows the target's token before it
      DrafterBatch with = mb;
      with.prev_tokens = greedy;
      m.drafter->step(with, false);
    } else {
      m.drafter->step(mb, false);
    }
    const auto& pred = m.drafter->predictions();
    const auto refs = mb.shard.batch.blocks();
    const std::size_t nsamp = mb.shard.batch.lengths.size();
    std::vector<double> per(2 * nsamp, 0.0);  // [tau sum, blocks] per sample
    for (std::int64_t i = mb.shard.blocks.begin; i < mb.shard.blocks.end; ++i) {
      const auto& r = refs[static_cast<std::size_t>(i)];
      std::int64_t accepted = 0;
      for (std::int64_t k = 1; k < B; ++k) {
        const auto row = static_cast<std::size_t>((i - mb.shard.blocks.begin) * B + k);
        if (pred[row] != want[static_cast<std::size_t>(r.anchor + k)]) break;
        ++accepted;
      }
      per[2 * static_cast<std::size_t>(r.sample)] += 1.0 + static_cast<double>(accepted);
      per[2 * static_cast<std::size_t>(r.sample) + 1] += 1.0;
    }
    m.cp->all_reduce<double>(per);
    for (std::size_t u = 0; u < nsamp; ++u)
      if (per[2 * u + 1] > 0) tau_sum += per[2 * u] / per[2 * u + 1], responses += 1;
  }
  std::vector<double> t{tau_sum, responses};
  m.world.all_reduce<double>(t);  // every CP rank of a group holds the same sums: divide by cp
  m.res.tau = t[1] > 0 ? t[0] / t[1] : 0.0;
  return m.res.tau;
}

void Trainer::save(const std::string& path) {
  Impl& m = *impl_;
  const ScopedBackend on(m.backend);
  const auto dir = std::filesystem::path(path).parent_path();
  if (m.rank == 0 && !dir.empty()) std::filesystem::create_directories(dir);
  m.state->save(path, {{"config", m.cfg.to_json()}, {"step", m.step}, {"seed", m.opt.seed}, {"adam_t", m.adam.t},
                       {"cp", m.cp_size}, {"dp", m.opt.dp}, {"shard", m.res.shard}});
  m.world.barrier();
  if (m.log) m.log(TrainEvent{TrainEvent::Kind::checkpoint, m.step, nullptr, path});
}

TrainResult Trainer::run() {
  const TrainOptions& opt = impl_->opt;
  const std::string& path = checkpoint_path();
  while (step_index() < opt.steps) {
    const std::int64_t done = step().step;
    if (opt.save_every > 0 && done % opt.save_every == 0 && done < opt.steps && !path.empty()) save(path);
    if (opt.stop_at > 0 && done == opt.stop_at) return result();  // simulated kill (tests)
  }
  if (!path.empty()) save(path);
  return result();
}

TrainResult Trainer::result() {
  Impl& m = *impl_;
  const ScopedBackend on(m.backend);
  TrainResult res = m.res;
  if (m.opt.keep_params) res.params = m.state->gather_params();
  if (!m.step_ms.empty()) {
    const auto& ph = m.drafter->phases();
    const auto n = static_cast<double>(m.step_ms.size());
    // The model's phases include the evaluation forwards; the trainer's are per step.
    res.phases = {{"target_features", m.t_build / n}, {"redistribution", m.t_redist / n}, {"fusion", ph.fusion / n},
                  {"attention", ph.attention / n}, {"attention_comm", ph.attention_comm / n}, {"mlp", ph.mlp / n},
                  {"lm_head", ph.lm_head / n}, {"gather_wait", ph.gather_wait / n}, {"reduce", m.t_reduce / n},
                  {"optimizer", m.t_optim / n}};
  }
  std::vector<double> mem{static_cast<double>(m.state->resident_bytes()) / (1 << 20), res.lm_head_mb};
  m.world.all_reduce<double>(mem, ReduceOp::max);
  res.state_mb = mem[0];
  res.lm_head_mb = mem[1];
  if (!m.step_ms.empty()) {
    std::vector<double> sorted = m.step_ms;
    std::sort(sorted.begin(), sorted.end());
    res.step_ms = sorted[sorted.size() / 2];
    res.tokens_per_s = m.tokens / m.busy;
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::vector<double> rss{static_cast<double>(ru.ru_maxrss) / 1024.0};  // KiB -> MiB
  m.world.all_reduce<double>(rss, ReduceOp::max);
  res.peak_rss_mb = rss[0];
  return res;
}

std::int64_t Trainer::step_index() const { return impl_->step; }
const TrainOptions& Trainer::options() const { return impl_->opt; }
const TrainResult& Trainer::summary() const { return impl_->res; }
const std::string& Trainer::checkpoint_path() const { return impl_->ckpt_path; }

TrainResult train(Communicator& world, const TrainOptions& opt, TrainLogger log) {
  Trainer trainer(world, opt, std::move(log));
  return trainer.run();
}

}  // namespace diffcp
