#include "diffcp/dit/session.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/core/stats.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "diffcp/dit/unipc.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

DitRunConfig::DitRunConfig(const DitRunOptions& o, const DitConfig& m, int P_, int rank_, const SafeTensorsSet* ck,
                           DitFileFormat format)
    : options(o), model(m), P(P_), rank(rank_) {
  mode = parse_exchange_mode(o.mode);
  compute = compute_dtype(o.dtype, "`dtype`");
  wire = parse_wire(o.wire);
  check_wire_supported(wire, compute);  // the active backend runs the codec
  schedule = {parse_cache_schedule(o.cache_schedule), o.cache_ratio, o.warmup, o.sync_every};
  schedule.validate();
  step_cache = parse_step_cache(o.step_cache);
  DIFFCP_CHECK(!step_cache.enabled || m.double_blocks + m.single_blocks >= 2, "`step_cache` ", o.step_cache,
               ": the model has ", m.double_blocks + m.single_blocks, " block(s); First-Block Cache needs at least two");
  DIFFCP_CHECK(o.steps >= 1, "`steps` = ", o.steps, ", expected >= 1");
  DIFFCP_CHECK(!o.profile || o.steps >= 2, "`profile` times the steps after the first (the warm-up): `steps` ", o.steps,
               " leaves none; run at least 2");
  DIFFCP_CHECK(!o.cfg_parallel || P % 2 == 0, "`cfg_parallel` splits the ranks into two equal halves, one per ",
               "classifier-free guidance pass; P = ", P, " is odd (run an even number of ranks)");
  DIFFCP_CHECK(m.guidance_embed || m.true_cfg() || !o.guidance, "`guidance` ", o.guidance.value_or(0),
               ": this model has no guidance_in (not guidance-distilled, e.g. FLUX.1-schnell); drop `guidance`");
  DIFFCP_CHECK(!o.guidance || std::isfinite(*o.guidance), "`guidance` ", o.guidance.value_or(0), ", expected a finite number");
  // FLUX.1's true CFG has its own scale; the true-CFG families' is `guidance`.
  DIFFCP_CHECK(m.family == DitFamily::flux1 || o.true_cfg_scale == 1.0, "`true_cfg_scale`: FLUX.1's classifier-free ",
               "guidance scale (FluxPipeline's true_cfg_scale); this model (", dit_family_name(m.family), ") ",
               m.true_cfg() ? "takes its classifier-free guidance scale as `guidance`" : "has no classifier-free guidance");
  DIFFCP_CHECK(std::isfinite(o.true_cfg_scale), "`true_cfg_scale` ", o.true_cfg_scale, ", expected a finite number");
  pass_P = o.cfg_parallel ? P / 2 : P;
  pass_rank = rank % pass_P;
  deg = resolve_usp_degrees(pass_P, m.heads, o.ulysses_degree, o.ring_degree);
  // TAPA's groups against the Ulysses groups (make_attention_exchange checks them again, collectively).
  DIFFCP_CHECK(o.group_size >= 0, "`group_size` = ", o.group_size, ", expected >= 1 (or 0: the ranks of a node)");
  if (ck != nullptr) check_dit_checkpoint(m, *ck, format);  // names every missing, extra or misshapen tensor
  storage = weights_dtype(o.weights_dtype, ck != nullptr && linear_weights_in_bf16(m, *ck, format), "`weights_dtype`");
  weight_shards = o.shard_weights ? pass_P : 1;
  check_shard_weights(o.shard_weights, storage, compute, "`shard_weights`", "`weights_dtype`");
}

bool linear_weights_in_bf16(const DitConfig& cfg, const SafeTensorsSet& ck, DitFileFormat format) {
  for (const DitLayout::Tensor& t : DitLayout(cfg).tensors)
    if (t.linear_weight)
      for (const DitFilePart& part : dit_file_parts(t, cfg, format))
        if (ck.info(part.name).dtype != "BF16") return false;
  return true;
}

DitGeneration plan_generation(const DitRunConfig& run, const DitShape& shape, DitConditioning cond,
                              const std::string& scheduler_config) {
  const DitRunOptions& o = run.options;
  const DitConfig& cfg = run.model;
  shape.validate();
  DitGeneration g;
  g.shape = shape;
  const double guidance = o.guidance.value_or(cfg.family == DitFamily::flux1 ? 3.5
                                              : cfg.family == DitFamily::sd3 ? 7.0
                                              : cfg.family == DitFamily::wan ? 5.0  // WanPipeline's
                                                                             : 4.0);
  // auto: the pipeline's own scheduler; else FLUX.2's dynamic shift (Flux2Pipeline's sigmas on
  // FLUX.2-dev's scheduler, compute_empirical_mu); else FLUX's shifted schedule for
  // guidance-distilled models (FLUX.1-dev), linear otherwise (schnell).
  const bool from_scheduler = o.schedule == "auto" && !scheduler_config.empty();
  const bool flux2_default = o.schedule == "auto" && !from_scheduler && cfg.family == DitFamily::flux2;
  g.schedule_name = from_scheduler ? "scheduler_config"
                    : flux2_default ? "flux2"
                    : o.schedule == "auto" ? (cfg.guidance_embed ? "flux" : "linear")
                                           : o.schedule;
  if (cfg.accepts_negative()) {
    const bool flux1 = cfg.family == DitFamily::flux1;
    const double scale = flux1 ? o.true_cfg_scale : guidance;
    const char* field = flux1 ? "`true_cfg_scale`" : "`guidance`";
    DIFFCP_CHECK(scale <= 1 || cond.has_negative(), field, " ", scale, ": classifier-free guidance needs the negative ",
                 "prompt's embeddings (`negative_text_embeddings`: the pipeline's negative_prompt_embeds), or ", field,
                 " 1 for one conditional pass");
    if (scale <= 1) {  // one conditional pass
      cond.negative_txt.clear();
      cond.negative_pooled.clear();
      cond.negative_tokens = 0;
    }
  }
  FlowMatchEulerScheduler flux2_scheduler;
  flux2_scheduler.dynamic = true;
  const nlohmann::json sched = from_scheduler ? read_json_file(scheduler_config, "scheduler config") : nlohmann::json();
  if (from_scheduler && sched.is_object() && sched.value("_class_name", std::string()) == "UniPCMultistepScheduler") {
    // Wan's folders: UniPC's flow schedule and its multistep update (dit/unipc.hpp)
    const UniPCFlowScheduler unipc = unipc_scheduler_from_json(sched, scheduler_config);
    unipc.schedule(o.steps, g.opt.timesteps, g.opt.model_timesteps);
    g.opt.unipc = unipc.solver;
    g.schedule_name = "scheduler_config (UniPC, order " + std::to_string(unipc.solver.order) + ")";
  } else {
    g.opt.timesteps = from_scheduler ? flow_match_scheduler_from_json(sched, scheduler_config)
                                           .pipeline_sigmas(o.steps, shape.image_tokens(), cfg.family)
                      : flux2_default ? flux2_scheduler.pipeline_sigmas(o.steps, shape.image_tokens(), DitFamily::flux2)
                                      : flow_schedule(o.steps, parse_time_schedule(g.schedule_name), shape.image_tokens());
  }
  g.opt.guidance = guidance;
  g.opt.compute = run.compute;
  g.opt.true_cfg_scale = o.true_cfg_scale;
  g.opt.step_cache = run.step_cache;
  g.cond = std::move(cond);
  g.negative_pass = uses_negative_pass(cfg, g.cond, g.opt);
  DIFFCP_CHECK(!o.cfg_parallel || g.negative_pass, "`cfg_parallel`: this run has no negative pass to run beside the prompt's (",
               cfg.true_cfg() ? "`guidance` <= 1"
               : cfg.accepts_negative() ? "`true_cfg_scale` <= 1"
                                        : std::string(dit_family_name(cfg.family)) + " has no classifier-free guidance" +
                                              (cfg.guidance_embed ? ": its `guidance` is the distilled guidance embedding" : ""),
               ")");
  g.shard = make_dit_shard(cfg, shape, run.pass_P, run.pass_rank, run.deg.ulysses);  // any token count (padding)
  if (g.negative_pass) {
    try {
      make_dit_shard(cfg, negative_shape(shape, g.cond), run.pass_P, run.pass_rank, run.deg.ulysses);
    } catch (const Error& e) {
      DIFFCP_FAIL("`negative_text_embeddings`: ", e.what());
    }
  }
  return g;
}

// One pass's exchange and model over `comm` (the ranks that run it).
struct DitSession::Pass {
  std::unique_ptr<AttentionExchange> exchange;
  std::unique_ptr<DitModel> model;
  Communicator* comm = nullptr;
};

namespace {
constexpr int kPairKey = 1 << 20;  // passes_ keys of cfg_parallel pairs: kPairKey + 2 pair + q

std::unique_ptr<AttentionExchange> make_exchange(const DitRunConfig& run, Communicator& comm) {
  auto ex = make_attention_exchange(run.mode, comm, run.options.group_size, run.schedule, run.deg.ulysses);
  ex->set_wire(run.wire);
  return ex;
}
}  // namespace

DitSession::DitSession(Communicator& world, DitRunConfig run, const SafeTensorsSet* ck, DitFileFormat format,
                       std::uint64_t weight_seed)
    : world_(world), run_(std::move(run)) {
  DIFFCP_CHECK(world_.size() == run_.P && world_.rank() == run_.rank, "DitSession: the run config is rank ", run_.rank,
               " of P = ", run_.P, ", the communicator's rank ", world_.rank(), " of ", world_.size());
  if (run_.options.cfg_parallel) {
    groups_ = std::make_unique<CfgGroups>(make_cfg_groups(world_));
    // The halves make their exchanges apart: one that fails on one half only would leave the other
    // waiting in the pair's all-gather. Make one now and agree over all ranks.
    std::string err;
    try {
      make_exchange(run_, *groups_->group);
    } catch (const Error& e) {
      err = e.what();
    }
    std::vector<std::int32_t> failed{err.empty() ? 0 : 1};
    world_.all_reduce<std::int32_t>(failed);
    DIFFCP_CHECK(failed[0] == 0, "`cfg_parallel`: the exchange of ", err.empty() ? "the other half" : "this half",
                 " cannot be made", err.empty() ? "" : ": ", err);
  }
  w_ = std::make_unique<DitWeights>(run_.model, run_.storage, run_.options.shard_weights ? &pass_comm() : nullptr);
  w_->set_packing(run_.options.pack_weights);
  if (ck != nullptr)
    w_->load(*ck, format);
  else
    w_->init_random(weight_seed);
}

DitSession::~DitSession() = default;

DitRun DitSession::sample(const DitGeneration& g, const std::vector<float>& noise) {
  DIFFCP_CHECK(run_.model.condition_channels == 0 && run_.model.image_dim == 0, "sample: a Wan image-to-video model ",
               "samples through its pipeline (velocity per call, with its condition and image context)");
  const auto ex = make_exchange(run_, pass_comm());
  // Classifier-free guidance on all ranks: the negative prompt's pass on its own exchange (its own
  // V-Major caches); cfg_parallel: on the other half.
  const auto ex_neg = g.negative_pass && !groups_ ? make_exchange(run_, world_) : nullptr;
  return run_dit_sampling(world_, *w_, g.shape, *ex, g.cond, noise, g.opt, ex_neg.get(), groups_.get());
}

DitRun DitSession::sample_reference(const DitGeneration& g, const std::vector<float>& noise, bool single_rank, int ulysses) {
  SampleOptions opt = g.opt;
  opt.on_velocity = {};
  opt.step_cache = {};  // the exact run: the CFG passes one after the other, every block
  opt.profile = nullptr;
  // Every rank samples the whole image alone (P = 1): all of them hold the same latent.
  const std::unique_ptr<Communicator> self = single_rank ? world_.split(world_.rank(), 0, "compare.self") : nullptr;
  Communicator& comm = single_rank ? *self : world_;
  const int group_size = single_rank ? 1 : run_.options.group_size, U = single_rank ? 1 : ulysses;
  const auto flat = make_attention_exchange(ExchangeMode::flat, comm, group_size, run_.schedule, U);
  const auto flat_neg = g.negative_pass ? make_attention_exchange(ExchangeMode::flat, comm, group_size, run_.schedule, U) : nullptr;
  return run_dit_sampling(comm, *w_, g.shape, *flat, g.cond, noise, opt, flat_neg.get());
}

DitReport DitSession::report(const DitGeneration& g, const DitRun& run) {
  const DitRunOptions& o = run_.options;
  DitReport r;
  r.P = world_.size();
  r.steps = o.steps;
  r.group_size = run.link_group_size;
  r.cfg_passes = g.negative_pass ? 2 : 1;
  const DitWeights& w = *w_;
  // Per rank per denoising step, averaged over ranks.
  const double gathered = w.gather_comm() ? static_cast<double>(w.gather_comm()->stats()[CommOp::recv].bytes_recv) : 0.0;
  std::vector<double> per_step{static_cast<double>(run.stats.bytes_intra), static_cast<double>(run.stats.bytes_inter),
                               static_cast<double>(run.stats.messages), static_cast<double>(run.stats.ring_bytes),
                               gathered, w.gather_stats().wait_ms, static_cast<double>(run.stats.scale_bytes),
                               static_cast<double>(run.cfg_pair_bytes)};
  world_.all_reduce<double>(per_step);
  for (double& v : per_step) v /= static_cast<double>(world_.size()) * o.steps;
  r.bytes_intra = per_step[0];
  r.bytes_inter = per_step[1];
  r.messages = per_step[2];
  r.ring_bytes = per_step[3];
  r.weight_gather_bytes = per_step[4];
  r.weight_gather_wait_ms = per_step[5];
  r.scale_bytes = per_step[6];
  r.cfg_pair_bytes = per_step[7];
  // The largest over ranks: caches, weights, the process's peak resident memory (ru_maxrss: KiB).
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::vector<double> maxes{static_cast<double>(run.cache_bytes), static_cast<double>(w.bytes()),
                            1024.0 * static_cast<double>(ru.ru_maxrss)};
  world_.all_reduce<double>(maxes, ReduceOp::max);
  r.cache_bytes = maxes[0];
  r.weights_bytes = maxes[1];
  r.peak_rss_bytes = maxes[2];
  std::vector<double> vsum{static_cast<double>(run.stats.v_hidden), static_cast<double>(run.stats.v_started), run.stats.v_wait_ms};
  world_.all_reduce<double>(vsum);
  r.v_wait_ms = vsum[2] / world_.size() / o.steps;
  r.v_phase1_hidden = vsum[1] > 0 ? vsum[0] / vsum[1] : 0.0;
  r.predicted = dit_predicted_bytes(run_.model, g.shape, g.shard, run_.deg, run_.pass_P, run_.mode, run_.schedule, o.steps,
                                    run.group_size, run.link_group_size, run_.compute, run_.wire);
  if (g.negative_pass) {  // the negative prompt's pass moves its own bytes
    const DitShape ns = negative_shape(g.shape, g.cond);
    r.predicted += dit_predicted_bytes(run_.model, ns, make_dit_shard(run_.model, ns, run_.pass_P, run_.pass_rank, run_.deg.ulysses),
                                       run_.deg, run_.pass_P, run_.mode, run_.schedule, o.steps, run.group_size,
                                       run.link_group_size, run_.compute, run_.wire);
    if (groups_) r.predicted *= 0.5;  // each rank runs one of the two passes: the average over the ranks
  }
  r.predicted_cfg_pair_bytes = groups_ ? static_cast<double>(cfg_pair_bytes(run_.model, g.shape, g.shard)) : 0.0;
  r.predicted_weights_bytes = static_cast<double>(dit_weight_bytes(w.layout(), w.storage(), w.shards()));
  r.predicted_weight_gather_bytes = static_cast<double>(dit_gather_bytes(w.layout(), w.storage(), w.shards()) *
                                                        (g.negative_pass && !groups_ ? 2 : 1));
  for (int q = 0; q < r.cfg_passes; ++q) {
    r.steps_computed.push_back(run_.step_cache.enabled ? run.steps_computed[q] : o.steps);
    r.steps_cached.push_back(run.steps_cached[q]);
  }
  r.rel_l1 = run.rel_l1;
  r.step_ms = median(run.step_ms);
  r.exposed_comm_ms = median(run.comm_ms);
  for (const double v : run.step_ms) r.total_ms += v;
  for (const double v : run.comm_ms) r.mean_exposed_comm_ms += v / o.steps;
  if (g.opt.profile != nullptr) {
    r.profile_ms.assign(g.opt.profile->ms.begin(), g.opt.profile->ms.end());
    world_.all_reduce<double>(r.profile_ms, ReduceOp::max);
    for (double& v : r.profile_ms) v = o.steps > 1 ? v / (o.steps - 1) : 0.0;
  }
  return r;
}

DitShape DitSession::velocity_shape(const std::vector<std::int64_t>& x, std::int64_t height, std::int64_t width,
                                    const std::vector<std::int64_t>& txt, const std::vector<std::int64_t>& pooled_dims,
                                    std::int64_t frames) const {
  const DitConfig& c = run_.model;
  DIFFCP_CHECK(frames == 1 || c.family == DitFamily::wan, "velocity: ", frames, " latent frames, but ",
               dit_family_name(c.family), " is an image model (one frame)");
  const bool per_image = txt.size() == 3;
  DIFFCP_CHECK(x.size() == 3 && (txt.size() == 2 || (per_image && txt[0] == x[0])) && txt.back() == c.text_dim &&
                   x[2] == c.embed_in_channels(),
               "velocity: x must be [b, N_img, ", c.embed_in_channels(), "]",
               c.condition_channels > 0 ? " (the latent's " + std::to_string(c.in_channels()) + " channels, then the condition's)"
                                        : std::string(),
               " and txt [T, ", c.text_dim, "] or [b, T, ", c.text_dim, "], got ", shape_str(x), " and ", shape_str(txt));
  std::int64_t pooled = 0;  // its values
  if (!pooled_dims.empty()) {
    pooled = 1;
    for (const std::int64_t d : pooled_dims) pooled *= d;
  }
  // Wan I2V: the pooled slot carries the image context, [I_ctx, image_dim] (per-image text: [b, I_ctx, image_dim]).
  std::int64_t image_context = 0;
  if (c.image_dim > 0) {
    const std::size_t n = per_image ? 3 : 2;
    DIFFCP_CHECK(pooled_dims.size() == n && pooled_dims[n - 2] >= 1 && pooled_dims[n - 1] == c.image_dim &&
                     (!per_image || pooled_dims[0] == x[0]),
                 "velocity: the image context is ", shape_str(pooled_dims), ", expected ",
                 per_image ? "[b, I_ctx, " : "[I_ctx, ", c.image_dim, "]",
                 per_image ? " (per-image text: each image's own)" : "",
                 ", I_ctx >= 1: this Wan image-to-video model cross-attends to CLIP's image tokens");
    image_context = pooled_dims[n - 2];
    DIFFCP_CHECK(c.image_pos_tokens == 0 || image_context == c.image_pos_tokens, "velocity: an image context of ",
                 image_context, " tokens; the model's position table (FLF2V's pos_embed_seq_len) has ", c.image_pos_tokens);
  }
  const DitShape shape{x[0], width, height, txt[txt.size() - 2], frames, image_context};
  shape.validate();
  DIFFCP_CHECK(x[1] == shape.image_tokens(), "velocity: ", x[1], " image tokens, ",
               frames == 1 ? "a " : std::to_string(frames) + " frames of ", width, "x", height,
               frames == 1 ? " image has " : " have ", shape.image_tokens());
  const std::int64_t want = c.image_dim > 0 ? pooled : per_image ? x[0] * c.pooled_dim : c.pooled_dim;
  DIFFCP_CHECK(pooled == want, "velocity: pooled has ", pooled, " values, expected ", want,
               per_image ? " (one pooled vector per image with per-image text)" : "");
  return shape;
}

DitSession::Pass& DitSession::pass_run(int key, const DitShape& shape, Communicator& comm) {
  std::unique_ptr<Pass>& slot = passes_[key];
  if (!slot) slot = std::make_unique<Pass>();
  Pass& r = *slot;
  const DitShape& s = r.model ? r.model->shape() : DitShape{};
  if (r.model && s.batch == shape.batch && s.width == shape.width && s.height == shape.height &&
      s.text_tokens == shape.text_tokens && s.frames == shape.frames && s.image_context == shape.image_context)
    return r;
  r.model.reset();  // the model uses the exchange: destroyed first
  if (r.exchange) retired_ += r.exchange->stats();
  r.exchange = make_exchange(run_, comm);
  r.model = std::make_unique<DitModel>(*w_, shape, *r.exchange);
  r.comm = &comm;
  r.model->set_step_cache(run_.step_cache, comm);
  return r;
}

std::vector<float> DitSession::pass_velocity(Pass& r, const std::vector<float>& x, const std::vector<float>& txt,
                                             const std::vector<float>& pooled, double t, double guidance, int step, int steps,
                                             const std::vector<double>& token_t) {
  const DitConfig& c = run_.model;
  const DitShard& s = r.model->shard();
  // The model reads and writes the active backend's memory (host data go there and back).
  DeviceVector<float> x_p, txt_p, pooled_d, v_p;
  const DitShape& shape = r.model->shape();
  x_p.assign(shard_rows(x, c.embed_in_channels(), shape, s));
  // Per-image text ([b, T, text_dim]): each image's rows sharded alike, image-major.
  const std::size_t per_txt = static_cast<std::size_t>(shape.text_tokens * c.text_dim), b = static_cast<std::size_t>(shape.batch);
  const bool per_image = shape.batch > 1 && txt.size() == b * per_txt;
  const std::size_t per_pooled = static_cast<std::size_t>(c.image_dim > 0 ? shape.image_context * c.image_dim : c.pooled_dim);
  DIFFCP_CHECK(x.size() == b * static_cast<std::size_t>(shape.image_tokens() * c.embed_in_channels()) &&
                   (txt.size() == per_txt || per_image) && pooled.size() == (per_image ? b : 1) * per_pooled,
               "velocity: ", x.size(), " latent, ", txt.size(), " text and ", pooled.size(), " pooled values do not fit ",
               shape.batch, " image(s) of ", shape.image_tokens(), " tokens and ", shape.text_tokens,
               " text tokens (velocity_shape checks the arrays)");
  std::vector<float> txt_rows;
  for (std::int64_t j = 0; j < (per_image ? shape.batch : 1); ++j) {
    const std::vector<float> rows = shard_text(std::vector<float>(txt.begin() + j * per_txt, txt.begin() + (j + 1) * per_txt),
                                               c.text_dim, s);
    txt_rows.insert(txt_rows.end(), rows.begin(), rows.end());
  }
  txt_p.assign(txt_rows);
  pooled_d.assign(pooled.data(), pooled.size());
  v_p.resize(b * static_cast<std::size_t>(s.image_p * c.in_channels()));
  const ScopedF32GemmCompute precision(run_.compute);
  r.exchange->set_compute(run_.compute);
  r.exchange->begin_step(step, steps);
  if (step == 0) r.model->set_step_cache(run_.step_cache, *r.comm);  // a new generation: the cache starts afresh
  DIFFCP_CHECK(token_t.empty() || (c.family == DitFamily::wan && static_cast<std::int64_t>(token_t.size()) == shape.image_tokens()),
               "velocity: ", token_t.size(), " per-token timesteps, expected ",
               c.family == DitFamily::wan ? "one per video token (" + std::to_string(shape.image_tokens()) + ") or none"
                                          : std::string("none (") + dit_family_name(c.family) + " takes one timestep)");
  for (const double v : token_t)
    DIFFCP_CHECK(std::isfinite(v) && v >= 0 && v <= 1, "velocity: a per-token timestep of ", v, ", expected in [0, 1]");
  r.model->velocity(x_p.data(), txt_p.data(), pooled_d.data(), t, guidance, v_p.data(), per_image, token_t);
  return to_host<float>(v_p.view());
}

std::vector<float> DitSession::velocity(int pass, const DitShape& shape, const std::vector<float>& x,
                                        const std::vector<float>& txt, const std::vector<float>& pooled, double t,
                                        double guidance, int step, int steps, const std::vector<double>& token_t) {
  DIFFCP_CHECK(pass >= 0 && pass < kPairKey, "velocity: pass index ", pass, " out of range");
  Pass& r = pass_run(pass, shape, world_);
  return gather_latent(world_, pass_velocity(r, x, txt, pooled, t, guidance, step, steps, token_t), run_.model, shape,
                       r.model->shard());
}

std::array<std::vector<float>, 2> DitSession::velocity_pair(int pair, const DitShape& s0, const DitShape& s1,
                                                            const std::array<const std::vector<float>*, 3>& in0,
                                                            const std::array<const std::vector<float>*, 3>& in1, double t,
                                                            double guidance, int step, int steps,
                                                            const std::vector<double>& token_t) {
  DIFFCP_CHECK(groups_ != nullptr, "velocity_pair: this session was made without `cfg_parallel`");
  DIFFCP_CHECK(pair >= 0 && pair < kPairKey / 2, "velocity_pair: pair index ", pair, " out of range");
  DIFFCP_CHECK(s0.batch == s1.batch && s0.width == s1.width && s0.height == s1.height && s0.frames == s1.frames,
               "velocity_pair: the two passes have ", s0.batch, " and ", s1.batch, " images of ", s0.frames, " x ", s0.width,
               "x", s0.height, " and ", s1.frames, " x ", s1.width, "x", s1.height);
  const int q = groups_->pass();
  const auto& in = q == 0 ? in0 : in1;
  Pass& r = pass_run(kPairKey + 2 * pair + q, q == 0 ? s0 : s1, *groups_->group);
  const std::vector<float> v_p = pass_velocity(r, *in[0], *in[1], *in[2], t, guidance, step, steps, token_t);
  std::vector<float> both_p(2 * v_p.size());
  groups_->pair->all_gather<float>(v_p, both_p);
  std::array<std::vector<float>, 2> out;
  for (std::size_t k = 0; k < 2; ++k)
    out[k] = gather_latent(*groups_->group, std::vector<float>(both_p.begin() + k * v_p.size(), both_p.begin() + (k + 1) * v_p.size()),
                           run_.model, s0, r.model->shard());
  return out;
}

ExchangeStats DitSession::exchange_stats() const {
  ExchangeStats s = retired_;
  for (const auto& [key, r] : passes_)
    if (r->exchange) s += r->exchange->stats();
  return s;
}

std::map<std::string, StepCacheStats> DitSession::step_cache_stats() const {
  std::map<std::string, StepCacheStats> out;
  for (const auto& [key, r] : passes_)
    if (r->model && r->model->step_cache() != nullptr)
      out[key >= kPairKey ? "pair" + std::to_string((key - kPairKey) / 2) + "." + std::to_string(key % 2) : std::to_string(key)] =
          r->model->step_cache()->stats();
  return out;
}

}  // namespace diffcp
