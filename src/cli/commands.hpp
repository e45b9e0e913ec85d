// Subcommands of the diffcp CLI: one options struct, registration and entry point each.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/stats.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/drafter/trainer.hpp"
#include "diffcp/testing/compare.hpp"

namespace diffcp::cli {

// "16k" -> 16384, "2m" -> 2097152, "300" -> 300 (k = 1024, m = 1024^2). Throws diffcp::Error
// naming the flag for anything else or a negative value.
std::int64_t parse_count(const std::string& text, const char* flag);
// "8k" -> {8192, 0} (fixed); "8k:32k" -> {8192, 32768} (lengths drawn from the range).
struct CountRange {
  std::int64_t min, max;
};
CountRange parse_range(const std::string& text, const char* flag);

// A library error's fields, named in backticks (`cache_ratio`: dit/session.hpp), as the CLI's
// flags (--cache-ratio): every `name` of lower-case letters, digits and underscores.
std::string cli_flags(const std::string& message);

// For --dtype `dtype` on the active backend: "" where it has arithmetic of that type, else what a
// run should know, " (bf16 converted to f32 for every GEMM: ..., slower than f32 here)"
// (Backend::native_arithmetic: a CPU without avx512_bf16).
std::string dtype_cost_note(const std::string& dtype);

// What every printed check adds to its JSON object `out` (`attn`, `bench cp`, `dit --compare /
// --reference`), from a comparison already reduced over ranks and tensors: check_passed,
// max_abs_err, max_rel_err (scale-relative: max |d| / max |ref|), max_tol_ratio (max |d| /
// (atol' + rtol |ref|), <= 1 passes), mismatches, and "tolerance": {atol, rtol, atol_scale} with
// atol_scale saying what atol was multiplied by (atol' = atol x atol_scale). JSON has no
// infinity: an infinite figure prints null (max_abs_err / max_tol_ratio: NaN or inf where the
// reference is finite; max_rel_err also when a reference tensor is all zeros and the result is not).
template <typename Json>
void add_check_json(Json& out, bool passed, double max_abs, double max_rel, double max_tol_ratio, std::int64_t mismatches,
                    Tolerance tol, const char* atol_scale) {
  const auto num = [](double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); };
  out["check_passed"] = passed;
  out["max_abs_err"] = num(max_abs);
  out["max_rel_err"] = num(max_rel);
  out["max_tol_ratio"] = num(max_tol_ratio);
  out["mismatches"] = mismatches;
  out["tolerance"] = Json{{"atol", tol.atol}, {"rtol", tol.rtol}, {"atol_scale", atol_scale}};
}

// `diffcp plan` (no MPI): a workload, the chosen balancer(s), their loads and planning time.
struct PlanOptions {
  std::string balancer = "all";
  int P = 8, J = 16;
  std::int64_t samples = 4;
  std::string context = "64k", queries = "8k";
  std::int64_t block = 16;
  double prompt_fraction = 0.25;
  std::uint64_t seed = 1;
  std::string anchors_file;
  int reps = 11;
  bool json = false;
  std::string windows;  // per drafter layer, comma-separated: its sliding window (0 = full attention)
};
void add_plan_command(CLI::App& app, PlanOptions& opt);
int run_plan(const PlanOptions& opt);

// `diffcp attn`: one drafter attention layer, forward + backward, with one CP method (Split-KV by
// default) over the ranks of mpirun, on a seeded random packed micro-batch.
struct AttnOptions {
  std::string method = "splitkv";  // cp/cp_methods.hpp
  std::int64_t samples = 2;
  std::string context = "1k", queries = "256";  // per sample (context may be a range a:b); anchors = queries / block
  std::int64_t block = 16;
  double prompt_fraction = 0.25;
  std::int64_t window = 0;  // a sliding-window layer's window (causal, as z-lab's sliding layers); 0 = full
  std::int64_t hidden = 256, n_q = 8, n_kv = 2, d_h = 32;
  double rope_theta = 1e6, rms_eps = 1e-6;
  std::string dtype = "f32";
  std::uint64_t seed = 1;
  int reps = 3, warmup = 1;
  bool check = false, json = false;
  std::string dump;
  std::string balancer = "none";  // context layout: none | zigzag | lpt | partition
  int J = 16;
  std::int64_t bucket = 4096;  // static-shape bucket of the local K/V length (1 = none)
  std::string oproj = "all";         // Split-KV output projection: all | owned | auto
  std::string collectives = "auto";  // Split-KV collectives: flat | hierarchical | auto (= hierarchical)
  double link_gbit = 0;              // --oproj auto: per-rank link rate (0: measured)
};
void add_attn_command(CLI::App& app, AttnOptions& opt);
int run_attn(Communicator& world, const AttnOptions& opt);

// `diffcp bench cp`: several CP methods on one workload (the generator of `diffcp attn`), one row
// each. Layout per method: splitkv --balancer (lpt), ring zigzag, the others contiguous (none),
// unless --layout-for-all names one for all.
struct BenchCpOptions {
  AttnOptions layer;            // workload, shape, --reps, --warmup, --balancer, --J, --bucket, --check, --json
  std::string methods = "all";  // comma list of cp_methods() names, or all
  std::string layout_for_all;   // empty: each method's usual layout
  std::string csv;              // also write the rows to this CSV file
  BenchCpOptions() {
    layer.reps = 5;
    layer.balancer = "lpt";
  }
};
// `diffcp bench p2p` / `bench coll` (cli/bench_comm.cpp): point-to-point latency and bandwidth,
// rank 0 <-> each rank; the time of each collective.
struct BenchP2pOptions {
  std::string bytes = "4m";
  int reps = 10, latency_reps = 200;
  bool json = false;
};
struct BenchCollOptions {
  std::string bytes = "4m";
  int reps = 5;
  bool json = false;
};
// `bench` with its subcommands `cp`, `p2p` and `coll`.
void add_bench_command(CLI::App& app, BenchCpOptions& cp, BenchP2pOptions& p2p, BenchCollOptions& coll);
void add_bench_p2p_command(CLI::App& bench, BenchP2pOptions& opt);
void add_bench_coll_command(CLI::App& bench, BenchCollOptions& opt);
int run_bench_cp(Communicator& world, const BenchCpOptions& opt);
int run_bench_p2p(Communicator& world, const BenchP2pOptions& opt);
int run_bench_coll(Communicator& world, const BenchCollOptions& opt);

// `diffcp dit` (cli/dit.cpp, options kept there): DiT inference with Ulysses SP, Flat or TAPA.
void add_dit_command(CLI::App& app);
int run_dit(Communicator& world);

// `diffcp export` (no MPI): a checkpoint in the DFlash drafter format (drafter/hf_format.hpp).
struct ExportOptions {
  std::string checkpoint, out, dtype = "f32";
  std::string target_layer_ids;        // comma list; empty = the checkpoint's
  std::int64_t num_target_layers = 0;  // 0 = the checkpoint's
  std::int64_t max_positions = 40960;  // config.json's max_position_embeddings
};
void add_export_command(CLI::App& app, ExportOptions& opt);
int run_export(const ExportOptions& opt);

// `diffcp draft`: one draft block of a DFlash drafter directory (drafter/draft.hpp).
struct DraftOptions {
  std::string model, target_hidden, noise, out, balancer = "lpt";
  int reps = 1;
  bool draft_cache = false;  // draft from a DraftCache (drafter/draft_cache.hpp) holding the context
};
// `diffcp backends`: the registered backends (cli/backends.cpp). select_backend makes `name` the
// active backend for subcommand `command` (registering the CLI's: cpu and the guard device);
// unknown, or a device backend for a command that reads results on the host: an error naming it.
void add_backends_command(CLI::App& app);
int run_backends(const std::string& selected);
Backend& select_backend(const std::string& name, const std::string& command);
// On the guard device: "diffcp COMMAND: guard device: N host syncs in S steps ..." (rank 0's; the
// counter: testing/guard_backend.hpp host_syncs): where a GPU's host would have waited, split
// into the communicators' staging (Communicator::staged_reads) and the computation's.
void print_host_syncs(const char* command, std::int64_t steps);

void add_draft_command(CLI::App& app, DraftOptions& opt);
int run_draft(Communicator& world, const DraftOptions& opt);

// `diffcp train`: the DFlash drafter trainer (drafter/trainer.hpp) with a progress bar on stderr
// and a JSONL metrics file; the library's errors name TrainOptions::<field>, shown as --<field>.
struct TrainCommand {
  TrainOptions train;
  std::string log;       // JSONL metrics, one object per step (appended to with --resume)
  bool progress = true;  // the progress bar (rank 0, stderr)
};
void add_train_command(CLI::App& app, TrainCommand& cmd);
int run_train(Communicator& world, TrainCommand cmd);

}  // namespace diffcp::cli
