#include "diffcp/drafter/trainer.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/balance/redistribute.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/data.hpp"
#include "diffcp/drafter/hf_format.hpp"
#include "diffcp/drafter/model.hpp"
#include "diffcp/drafter/optim.hpp"
#include "diffcp/drafter/sharded_state.hpp"

namespace diffcp {

namespace {

using Clock = std::chrono::steady_clock;

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

  // greedy: also the packed target greedy tokens (empty unless every member has them).
  DrafterBatch build(bool heldout, const std::vector<std::size_t>& members, std::int64_t anchors, std::mt19937_64& rng,
                     std::vector<std::int32_t>* greedy = nullptr) const {
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
    const CostModel cost(batch);
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
    mb.hidden_p = redistribute_rows(redist, batch, plan, loaded, T);
    return mb;
  }
};

std::string fmt_eta(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  return buf;
}

}  // namespace

TrainResult train(Communicator& world, const TrainOptions& opt) {
  const int W = world.size();
  DIFFCP_CHECK(opt.dp >= 1 && W % opt.dp == 0, "--dp = ", opt.dp, " does not divide the ", W, " ranks");
  const int cp_size = opt.cp > 0 ? opt.cp : W / opt.dp;
  DIFFCP_CHECK(cp_size * opt.dp == W, "--cp ", cp_size, " x --dp ", opt.dp, " = ", cp_size * opt.dp,
               " ranks, but mpirun started ", W);
  DIFFCP_CHECK(opt.steps >= 1 && opt.accum >= 1 && opt.anchors >= 0 && opt.context >= 1,
               "--steps, --accum and --context must be >= 1, --anchors >= 1 (0: the preset's)");
  DIFFCP_CHECK(opt.lr >= 0 && opt.clip > 0 && opt.warmup >= 0 && opt.warmup < 1,
               "--lr must be > 0 (0: the preset's), --clip > 0, warm-up in [0, 1)");
  const CollAlgo collectives = opt.collectives == "auto" ? CollAlgo::hierarchical : parse_coll_algo(opt.collectives);
  DIFFCP_CHECK(!opt.resume || !opt.out.empty(), "--resume needs --out DIR (where the checkpoint is)");
  DIFFCP_CHECK(opt.init.empty() || opt.preset.empty(), "--init '", opt.init, "' and --preset '", opt.preset,
               "': give one (the drafter directory's config.json is the shape)");
  DrafterWeights init;
  if (!opt.init.empty()) init = import_dflash(opt.init);
  DrafterConfig cfg = opt.init.empty() ? drafter_preset(opt.preset.empty() ? "tiny" : opt.preset) : init.config;
  // The paper's recipe for real shapes (SPEC A.1); the tiny and small synthetic ones train faster with more.
  const bool real_shape = cfg.vocab > 4096;
  const double lr = opt.lr > 0 ? opt.lr : real_shape ? 6e-4 : 5e-3;
  const std::int64_t anchors = opt.anchors > 0 ? opt.anchors : real_shape ? 512 : 12;
  const int rank = world.rank(), dp_rank = rank / cp_size;
  // CP groups are consecutive ranks (node-local first); DP groups are the same CP index.
  const auto cp = world.split(dp_rank, rank % cp_size, "cp");
  cp->discover_topology();  // the nodes of the CP group: DIFFCP_NODE or shared memory
  const auto redist = cp->split(0, cp->rank(), "redistribute");
  const auto vocab = cp->split(0, cp->rank(), "lm_head");  // the vocabulary-parallel LM head's

  std::unique_ptr<DataSource> data;
  if (opt.data.empty()) {
    SyntheticSpec spec;
    spec.seed = opt.seed;
    spec.max_length = std::min<std::int64_t>(spec.max_length, opt.context);
    spec.min_length = std::min(spec.min_length, spec.max_length);
    if (real_shape) {  // the paper's regime: long samples (half to all of --context), Q << S
      spec.max_length = std::max<std::int64_t>(opt.context, cfg.block + 2);
      spec.min_length = std::max<std::int64_t>(spec.max_length / 2, cfg.block + 2);
      spec.train_samples = 16;
      spec.heldout_samples = std::min<std::int64_t>(opt.heldout, 2);  // --heldout 0: no evaluation
    }
    data = make_synthetic_source(cfg, spec);
  } else {
    data = make_shard_source(cfg, opt.data, opt.heldout);
  }
  if (!data->target_layer_ids().empty()) {  // the shards say which target layers they hold
    const bool depth_known = data->target_depth() > 0;
    DIFFCP_CHECK(opt.init.empty() || (cfg.target_layer_ids == data->target_layer_ids() &&
                                      (!depth_known || cfg.target_depth == data->target_depth())),
                 "--data '", opt.data, "' holds target layers ", nlohmann::json(data->target_layer_ids()).dump(), " of ",
                 data->target_depth(), ", the drafter of --init '", opt.init, "' fuses layers ",
                 nlohmann::json(cfg.target_layer_ids).dump(), " of ", cfg.target_depth);
    cfg.target_layer_ids = data->target_layer_ids();
    if (depth_known || opt.init.empty()) cfg.target_depth = data->target_depth();
  }
  const auto train_packs = pack_samples(data->train(), opt.context), eval_packs = pack_samples(data->heldout(), opt.context);
  const auto balancer = make_balancer(opt.balancer);
  const MicroBatchBuilder builder{*data, cfg, *balancer, *cp, *redist, opt.J, opt.bucket, opt.context};
  TrainResult res;
  for (const Sample& smp : data->train()) {
    res.truncated += static_cast<std::int64_t>(smp.tokens.size()) > opt.context ? 1 : 0;
    res.few_anchors += anchor_candidates(smp, cfg.block, opt.context) < anchors ? 1 : 0;
  }
  bool greedy_known = !data->heldout().empty();
  for (const Sample& smp : data->heldout()) greedy_known &= !smp.greedy.empty();
  res.tau_reference = greedy_known ? "target greedy tokens" : "dataset tokens";
  res.lr = lr;
  res.anchors = anchors;
  if (rank == 0 && (res.truncated > 0 || res.few_anchors > 0))
    std::fprintf(stderr, "diffcp train: of %zu training samples, %lld are longer than --context %lld (right-truncated to it) and "
                 "%lld have fewer than %lld candidate anchor positions (they get all of theirs)\n",
                 data->train().size(), static_cast<long long>(res.truncated), static_cast<long long>(opt.context),
                 static_cast<long long>(res.few_anchors), static_cast<long long>(anchors));

  // auto: full for the real shapes on more than one rank (their replicated state does not fit),
  // none for the synthetic ones (it fits, and the per-layer gathers would only cost time).
  const ShardMode shard = opt.shard == "auto" ? (W > 1 && real_shape ? ShardMode::full : ShardMode::none) : parse_shard_mode(opt.shard);
  res.shard = shard_mode_name(shard);
  Drafter drafter(*cp, cfg, {OProj::all, collectives});
  ShardedState state(world, drafter.layout(), shard);
  drafter.use_state(state);
  DIFFCP_CHECK(opt.recompute == "auto" || opt.recompute == "on" || opt.recompute == "off", "--recompute '", opt.recompute,
               "': expected on, off or auto");
  res.recompute = opt.recompute == "on" || (opt.recompute == "auto" && shard == ShardMode::full);
  drafter.set_recompute(res.recompute);
  if (opt.init.empty()) drafter.init_params(opt.seed + 7);
  else state.set_params(init.params), init.params = {};
  drafter.set_embedding([&data](std::span<const std::int32_t> tokens, float* out) { data->embedding_rows(tokens, out); });
  {  // the LM head: whole (none) or this CP rank's vocabulary slice
    const bool split = shard != ShardMode::none;
    const auto [v0, v1] = split ? vocab_slice(cfg.vocab, cp->size(), cp->rank()) : std::pair<std::int64_t, std::int64_t>{0, cfg.vocab};
    std::vector<float> w(static_cast<std::size_t>(cfg.hidden * (v1 - v0)));
    data->lm_head_columns(v0, v1, w.data());
    res.lm_head_mb = static_cast<double>(w.size()) * 4 / (1 << 20);
    drafter.set_lm_head(LmHead(split ? vocab.get() : nullptr, cfg.hidden, cfg.vocab, std::move(w), v0));
  }
  AdamW adam;
  adam.lr = lr;
  adam.weight_decay = opt.weight_decay;
  std::int64_t start = 0;
  const std::string ckpt_path = opt.out.empty() ? "" : opt.out + "/checkpoint.bin";
  if (opt.resume) try {
    CheckpointReader ck(ckpt_path);
    DIFFCP_CHECK(ck.meta().at("config") == cfg.to_json(), "checkpoint '", ckpt_path, "' is for a different model: ",
                 ck.meta().at("config").dump(), " vs ", cfg.to_json().dump());
    DIFFCP_CHECK(static_cast<std::int64_t>(ck.n()) == drafter.layout().total, "checkpoint '", ckpt_path, "': ", ck.n(),
                 " parameters, the model has ", drafter.layout().total);
    DIFFCP_CHECK(ck.meta().at("seed").get<std::uint64_t>() == opt.seed, "checkpoint '", ckpt_path, "' was trained with --seed ",
                 ck.meta().at("seed").get<std::uint64_t>(), ", not ", opt.seed, " (the data order and anchors follow the seed)");
    state.load(ck);  // this rank's slices, whatever mesh wrote the file
    adam.t = ck.meta().at("adam_t").get<std::int64_t>();
    start = ck.meta().at("step").get<std::int64_t>();
  } catch (const nlohmann::json::exception& e) {  // a checksummed file whose header lacks a field
    DIFFCP_FAIL("checkpoint '", ckpt_path, "': header field missing or of the wrong type: ", e.what());
  }
  if (rank == 0 && !opt.out.empty()) std::filesystem::create_directories(opt.out);
  std::ofstream log;
  if (rank == 0 && !opt.log.empty()) {
    log.open(opt.log, opt.resume ? std::ios::app : std::ios::trunc);
    DIFFCP_CHECK(log.good(), "--log '", opt.log, "': cannot write");
  }

  const std::int64_t B = cfg.block;
  auto evaluate = [&]() {
    // Greedy acceptance length on held-out micro-batches: per block 1 + matching prefix of the
    // draft argmax and the true next tokens; averaged per response, then over responses.
    double tau_sum = 0, responses = 0;
    // Every DP replica runs the same number of rounds: with --shard full each forward gathers the
    // parameters over the whole mesh, so a replica without a pack in the last round still takes part.
    const std::size_t dp = static_cast<std::size_t>(opt.dp), rounds = (eval_packs.size() + dp - 1) / dp;
    for (std::size_t e = static_cast<std::size_t>(dp_rank); e < rounds * dp; e += dp) {
      if (e >= eval_packs.size()) {
        state.gather_rounds_only();
        continue;
      }
      auto rng = anchor_rng(opt.seed, static_cast<std::int64_t>(e), 0xe7a1);
      std::vector<std::int32_t> greedy;
      const DrafterBatch mb = builder.build(true, eval_packs[e], anchors, rng, &greedy);
      const std::vector<std::int32_t>& want = greedy.empty() ? mb.tokens : greedy;  // SPEC: the target's argmax
      drafter.step(mb, false);
      const auto& pred = drafter.predictions();
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
      cp->all_reduce<double>(per);
      for (std::size_t u = 0; u < nsamp; ++u)
        if (per[2 * u + 1] > 0) tau_sum += per[2 * u] / per[2 * u + 1], responses += 1;
    }
    std::vector<double> t{tau_sum, responses};
    world.all_reduce<double>(t);  // every CP rank of a group holds the same sums: divide by cp
    return t[1] > 0 ? t[0] / t[1] : 0.0;
  };

  res.topology = cp->topology().describe();
  res.collectives = collectives == CollAlgo::hierarchical && cp->hierarchy_useful() ? "hierarchical" : "flat";
  res.uniform_loss = std::log(static_cast<double>(cfg.vocab));
  res.checkpoint = ckpt_path;
  const auto t_start = Clock::now();
  const bool tty = isatty(2);
  auto save = [&](std::int64_t done) {
    if (!ckpt_path.empty())
      state.save(ckpt_path, {{"config", cfg.to_json()}, {"step", done}, {"seed", opt.seed}, {"adam_t", adam.t},
                             {"cp", cp_size}, {"dp", opt.dp}, {"shard", res.shard}});
    world.barrier();
  };
  std::vector<double> step_ms;
  double tokens = 0, busy = 0, t_build = 0, t_reduce = 0, t_optim = 0;
  auto ms_since = [](Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); };
  // Global micro-batch g visits pack order_e[g mod n] in epoch e = g / n: a fresh order each epoch,
  // a function of (seed, e) only, so resumed runs and any DP x accumulation split agree.
  std::int64_t order_epoch = -1;
  std::vector<std::size_t> order(train_packs.size());
  auto pack_of = [&](std::int64_t g) {
    const auto n = static_cast<std::int64_t>(train_packs.size());
    if (g / n != order_epoch) {
      order_epoch = g / n;
      std::iota(order.begin(), order.end(), std::size_t{0});
      auto rng = anchor_rng(opt.seed, order_epoch, 0x5e9);
      std::shuffle(order.begin(), order.end(), rng);
    }
    return order[static_cast<std::size_t>(g % n)];
  };
  auto finish = [&]() {
    if (opt.keep_params) res.params = state.gather_params();
    const std::int64_t steps_run = static_cast<std::int64_t>(step_ms.size());
    if (steps_run > 0) {
      const auto& ph = drafter.phases();
      const double n = static_cast<double>(steps_run);
      // The model's phases include the evaluation forwards; the trainer's are per step.
      res.phases = {{"target_features", t_build / n}, {"fusion", ph.fusion / n}, {"attention", ph.attention / n},
                    {"mlp", ph.mlp / n}, {"lm_head", ph.lm_head / n}, {"gather_wait", ph.gather_wait / n},
                    {"reduce", t_reduce / n}, {"optimizer", t_optim / n}};
    }
    std::vector<double> mem{static_cast<double>(state.resident_bytes()) / (1 << 20), res.lm_head_mb};
    world.all_reduce<double>(mem, ReduceOp::max);
    res.state_mb = mem[0];
    res.lm_head_mb = mem[1];
    if (!step_ms.empty()) {
      std::sort(step_ms.begin(), step_ms.end());
      res.step_ms = step_ms[step_ms.size() / 2];
      res.tokens_per_s = tokens / busy;
    }
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    std::vector<double> rss{static_cast<double>(ru.ru_maxrss) / 1024.0};  // KiB -> MiB
    world.all_reduce<double>(rss, ReduceOp::max);
    res.peak_rss_mb = rss[0];
    return res;
  };
  for (std::int64_t s = start; s < opt.steps; ++s) {
    const auto t0 = Clock::now();
    state.zero_grads();
    std::vector<double> stats(static_cast<std::size_t>(3 + 2 * B), 0.0);  // loss, weight, tokens, correct[B], counted[B]
    for (std::int64_t j = 0; j < opt.accum; ++j) {
      const std::int64_t g = (s * opt.dp + dp_rank) * opt.accum + j;  // global micro-batch number
      const auto idx = pack_of(g);
      auto rng = anchor_rng(opt.seed, g, 0x7a1);
      const auto tb = Clock::now();
      const DrafterBatch mb = builder.build(false, train_packs[idx], anchors, rng);
      t_build += ms_since(tb);
      const DrafterStats st = drafter.step(mb, true);
      stats[0] += st.loss_sum;
      stats[1] += st.weight_sum;
      if (cp->rank() == 0) stats[2] += static_cast<double>(mb.tokens.size());
      for (std::int64_t k = 0; k < B; ++k) {
        stats[static_cast<std::size_t>(3 + k)] += static_cast<double>(st.correct[static_cast<std::size_t>(k)]);
        stats[static_cast<std::size_t>(3 + B + k)] += static_cast<double>(st.counted[static_cast<std::size_t>(k)]);
      }
    }
    // Sum over the whole mesh (CP shares and DP replicas alike) to the owners, then normalise by
    // the global weight, clip and update what this rank owns.
    auto tr = Clock::now();
    world.all_reduce<double>(stats);
    const double inv = 1.0 / (stats[1] + 1e-6);
    const double grad_norm = state.reduce_grads(inv);
    t_reduce += ms_since(tr);
    tr = Clock::now();
    const double lr_now = cosine_lr(lr, s, opt.steps, opt.warmup);
    state.apply(adam, lr_now, opt.clip);
    t_optim += ms_since(tr);
    res.loss = stats[0] * inv;
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    const double tok_s = stats[2] / secs;
    step_ms.push_back(secs * 1e3);
    tokens += stats[2];
    busy += secs;
    const bool eval_now = (opt.eval_every > 0 && (s + 1) % opt.eval_every == 0) || s + 1 == opt.steps;
    if (eval_now) res.tau = evaluate();
    if (rank == 0) {
      nlohmann::json line{{"step", s + 1}, {"loss", res.loss}, {"lr", lr_now}, {"grad_norm", grad_norm},
                          {"tokens_per_s", tok_s}, {"step_ms", secs * 1e3}};
      std::vector<double> acc;
      for (std::int64_t k = 1; k < B; ++k) {
        const double n = stats[static_cast<std::size_t>(3 + B + k)];
        acc.push_back(n > 0 ? stats[static_cast<std::size_t>(3 + k)] / n : 0.0);
      }
      line["slot_accuracy"] = acc;
      if (eval_now) line["tau"] = res.tau;
      if (log.is_open()) log << line.dump() << "\n" << std::flush;
      // On a terminal the bar redraws every step; in a log, one line per 5 % of the run.
      const std::int64_t every = tty ? 1 : std::max<std::int64_t>(1, opt.steps / 20);
      if (opt.progress && ((s + 1) % every == 0 || eval_now || s + 1 == opt.steps)) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
        const double eta = elapsed / static_cast<double>(s + 1 - start) * static_cast<double>(opt.steps - s - 1);
        const int width = 24, done = static_cast<int>(width * (s + 1) / opt.steps);
        std::fprintf(stderr, "%s[%s%s] step %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | ETA %s%s", tty ? "\r" : "",
                     std::string(static_cast<std::size_t>(done), '#').c_str(),
                     std::string(static_cast<std::size_t>(width - done), '.').c_str(), static_cast<long long>(s + 1),
                     static_cast<long long>(opt.steps), res.loss, lr_now, tok_s, fmt_eta(eta).c_str(),
                     eval_now ? (" | tau " + std::to_string(res.tau).substr(0, 5)).c_str() : "");
        if (!tty || s + 1 == opt.steps) std::fprintf(stderr, "\n");
      }
    }
    if (opt.save_every > 0 && (s + 1) % opt.save_every == 0 && s + 1 < opt.steps) save(s + 1);
    if (opt.stop_at > 0 && s + 1 == opt.stop_at) return finish();  // simulated kill (tests)
  }
  save(opt.steps);
  return finish();
}

}  // namespace diffcp
