#include "cli/layer_run.hpp"

#include <cmath>
#include <set>
#include <sstream>
#include <string>

#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/cp/splitkv.hpp"

namespace diffcp::cli {

void add_workload_options(CLI::App* c, AttnOptions& opt) {
  c->add_option("--samples", opt.samples, "samples packed in the micro-batch")->capture_default_str();
  c->add_option("--context", opt.context, "context tokens per sample (16k-style), or a range a:b to draw from")->capture_default_str();
  c->add_option("--queries", opt.queries, "query rows per sample; anchors = queries / block")->capture_default_str();
  c->add_option("--block", opt.block, "block size B")->capture_default_str();
  c->add_option("--prompt-fraction", opt.prompt_fraction, "prompt share of each sample (0.25 = 1:3)")->capture_default_str();
  c->add_option("--hidden", opt.hidden, "model width H")->capture_default_str();
  c->add_option("--n-q", opt.n_q, "query heads")->capture_default_str();
  c->add_option("--n-kv", opt.n_kv, "key/value heads (GQA)")->capture_default_str();
  c->add_option("--d-h", opt.d_h, "head dimension")->capture_default_str();
  c->add_option("--rope-theta", opt.rope_theta, "RoPE base")->capture_default_str();
  c->add_option("--rms-eps", opt.rms_eps, "RMSNorm epsilon")->capture_default_str();
  c->add_option("--dtype", opt.dtype, "f32 | bf16 (Split-KV: bf16 attention and row payloads, f32 layer boundary)")
      ->capture_default_str();
  c->add_option("--seed", opt.seed, "seed of the batch, weights and inputs")->capture_default_str();
  c->add_option("--J", opt.J, "chunks per rank for lpt / partition")->capture_default_str();
  c->add_option("--window", opt.window, "a sliding-window layer (z-lab's sliding_attention, causal): each query row "
                                        "sees the keys less than this many positions before it; 0 = full attention")
      ->capture_default_str();
}

void add_layer_options(CLI::App* c, AttnOptions& opt) {
  add_workload_options(c, opt);
  c->add_option("--reps", opt.reps, "timed repetitions after the warm-up (median of the slowest rank reported)")->capture_default_str();
  c->add_option("--warmup", opt.warmup, "untimed repetitions before the timed ones")->capture_default_str();
  c->add_flag("--check", opt.check, "compare output and all gradients with the fp64 single-process reference");
  c->add_option("--bucket", opt.bucket, "round Split-KV's local K/V length up to a multiple of this (1 = off)")->capture_default_str();
  c->add_option("--oproj", opt.oproj, "Split-KV output projection: all (every rank, all Q rows) | owned (reduce-scatter "
                                      "the partial output, project owned rows) | auto (cost model)")->capture_default_str();
  c->add_option("--collectives", opt.collectives, "Split-KV collectives: flat | hierarchical (two-level over nodes) | "
                                                  "auto (hierarchical; flat on one node)")->capture_default_str();
  c->add_option("--link-gbit", opt.link_gbit, "--oproj auto: one rank's link rate in Gbit/s (0: measure it)")->capture_default_str();
}

LayerWorkload make_workload(const AttnOptions& opt) {
  const CountRange context = parse_range(opt.context, "--context");
  LayerWorkload w;
  w.queries = parse_count(opt.queries, "--queries");
  w.dtype = compute_dtype(opt.dtype, "--dtype =");
  DIFFCP_CHECK(opt.block >= 1, "--block = ", opt.block, ", expected >= 1");
  DIFFCP_CHECK(opt.window >= 0 && opt.window <= kMaxKeyWindow, "--window = ", opt.window,
               ", expected 1 .. 2^40 (or 0: full attention)");
  DIFFCP_CHECK(w.queries % opt.block == 0, "--queries = ", w.queries, " per sample is not a multiple of --block = ", opt.block);
  DIFFCP_CHECK(opt.reps >= 1, "--reps = ", opt.reps, ", expected >= 1");
  DIFFCP_CHECK(opt.warmup >= 0, "--warmup = ", opt.warmup, ", expected >= 0");
  DIFFCP_CHECK(opt.bucket >= 1, "--bucket = ", opt.bucket, ", expected >= 1");
  if (opt.oproj != "auto") parse_oproj(opt.oproj);
  if (opt.collectives != "auto") parse_coll_algo(opt.collectives);
  DIFFCP_CHECK(opt.link_gbit >= 0 && std::isfinite(opt.link_gbit), "--link-gbit = ", opt.link_gbit,
               ", expected >= 0 (0: measure)");
  w.cfg = AttnLayerConfig{opt.hidden, opt.n_q, opt.n_kv, opt.d_h, opt.rope_theta, opt.rms_eps};
  w.cfg.validate();
  w.batch = make_random_batch(opt.samples, context.min, w.queries / opt.block, opt.block, opt.prompt_fraction, opt.seed,
                              context.max);
  return w;
}

LayerRunSpec layer_run_spec(const AttnOptions& opt, const std::string& method, const std::string& layout,
                            const ReferenceLayerResult* reference) {
  LayerRunSpec spec;
  spec.method = method;
  spec.layout = layout;
  spec.J = opt.J;
  spec.bucket = opt.bucket;
  spec.warmup = opt.warmup;
  spec.reps = opt.reps;
  spec.reference = reference;
  spec.oproj = opt.oproj;
  spec.collectives = opt.collectives;
  spec.link_gbit = opt.link_gbit;
  spec.dtype = compute_dtype(opt.dtype, "--dtype =");
  return spec;
}

std::vector<std::string> parse_method_list(const std::string& text) {
  std::vector<std::string> out;
  if (text == "all") {
    for (const CpMethod& m : cp_methods()) out.push_back(m.name);
    return out;
  }
  std::set<std::string> seen;
  std::stringstream ss(text);
  std::string name;
  while (std::getline(ss, name, ',')) {
    DIFFCP_CHECK(!name.empty(), "--methods = '", text, "': empty method name in the list");
    DIFFCP_CHECK(seen.insert(name).second, "--methods = '", text, "': '", name, "' is listed twice");
    out.push_back(name);
  }
  DIFFCP_CHECK(!out.empty(), "--methods = '", text, "': expected a comma list of methods or all");
  return out;
}

}  // namespace diffcp::cli
