#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "attention/mask.hpp"
#include "attention/reference.hpp"
#include "cli/commands.hpp"
#include "core/compare.hpp"
#include "core/random.hpp"
#include "cp/shard.hpp"
#include "cp/splitkv_attention.hpp"
#include "workload/batch.hpp"

namespace diffcp::cli {

void add_demo_command(CLI::App& app, DemoOptions& opt) {
  CLI::App* c = app.add_subcommand("demo", "Split-KV attention core (fwd+bwd) on a random packed batch, "
                                           "checked against the fp64 single-process reference");
  c->add_option("--samples", opt.samples, "samples in the packed micro-batch")->capture_default_str();
  c->add_option("--context", opt.context, "context tokens per sample")->capture_default_str();
  c->add_option("--anchors", opt.anchors, "anchors (blocks) per sample")->capture_default_str();
  c->add_option("--block", opt.block, "block size B")->capture_default_str();
  c->add_option("--n-q", opt.n_q, "query heads")->capture_default_str();
  c->add_option("--n-kv", opt.n_kv, "key/value heads")->capture_default_str();
  c->add_option("--d-h", opt.d_h, "head dimension")->capture_default_str();
  c->add_option("--prompt-fraction", opt.prompt_fraction, "prompt share of each sample")->capture_default_str();
  c->add_option("--seed", opt.seed, "random seed")->capture_default_str();
  c->add_flag("--json", opt.json, "print one JSON object instead of text");
}

namespace {
std::vector<double> to_double(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// rows [r0, r1) of a contiguous [rows, width] buffer
template <typename T>
std::vector<T> take_rows(const std::vector<T>& x, std::int64_t width, std::int64_t r0, std::int64_t r1) {
  return {x.begin() + r0 * width, x.begin() + r1 * width};
}
template <typename T>
std::vector<T> gather_rows(const std::vector<T>& x, std::int64_t width, const std::vector<std::int64_t>& rows) {
  std::vector<T> out;
  out.reserve(rows.size() * static_cast<std::size_t>(width));
  for (std::int64_t r : rows) out.insert(out.end(), x.begin() + r * width, x.begin() + (r + 1) * width);
  return out;
}
}  // namespace

int run_demo(Communicator& world, const DemoOptions& opt) {
  DIFFCP_CHECK(opt.n_q >= 1 && opt.n_kv >= 1 && opt.d_h >= 1, "--n-q, --n-kv, --d-h must be >= 1 (got ",
               opt.n_q, ", ", opt.n_kv, ", ", opt.d_h, ")");
  DIFFCP_CHECK(opt.n_q % opt.n_kv == 0, "--n-q = ", opt.n_q, " is not a multiple of --n-kv = ", opt.n_kv);
  const PackedBatch batch = make_random_batch(opt.samples, opt.context, opt.anchors, opt.block,
                                              opt.prompt_fraction, opt.seed);
  const std::int64_t P = world.size(), p = world.rank();
  const std::int64_t S = batch.context_rows(), N = batch.num_blocks(), B = batch.block, Q = N * B;
  const std::int64_t hq = opt.n_q * opt.d_h, hkv = opt.n_kv * opt.d_h;

  // The whole problem, identical on every rank (seeded); each rank then keeps only its share.
  const auto q = random_normal(static_cast<std::size_t>(Q * hq), opt.seed + 11);
  const auto k = random_normal(static_cast<std::size_t>((S + Q) * hkv), opt.seed + 12);
  const auto v = random_normal(static_cast<std::size_t>((S + Q) * hkv), opt.seed + 13);
  const auto dout = random_normal(static_cast<std::size_t>(Q * hq), opt.seed + 14);

  // Contiguous layout: rank p holds context rows [p*S/P, (p+1)*S/P) and blocks [p*N/P, (p+1)*N/P).
  const Shard ctx = even_shard(S, P, p), blk = even_shard(N, P, p);
  std::vector<PosRange> chunks{{ctx.begin, ctx.end}};
  std::vector<std::int64_t> owned;
  for (std::int64_t i = blk.begin; i < blk.end; ++i) owned.push_back(i);
  const BlockMask mask = local_mask(batch, chunks, owned);
  const auto key_rows = full_rows_of_local(batch, chunks, owned);
  std::vector<std::int64_t> query_rows;
  for (std::int64_t r = 0; r < P; ++r) query_rows.push_back(even_shard(N, P, r).size() * B);

  const std::int64_t Qp = blk.size() * B, Lk = mask.key_rows();
  const auto q_p = take_rows(q, hq, blk.begin * B, blk.end * B);
  const auto do_p = take_rows(dout, hq, blk.begin * B, blk.end * B);
  const auto k_p = gather_rows(k, hkv, key_rows), v_p = gather_rows(v, hkv, key_rows);
  std::vector<float> o_p(q_p.size()), dq_p(q_p.size()), dk_p(k_p.size()), dv_p(v_p.size());

  SplitKVAttention attn(world, mask, opt.n_q, opt.n_kv, opt.d_h, query_rows);
  attn.forward(head_rows(q_p, Qp, opt.n_q, opt.d_h), head_rows(k_p, Lk, opt.n_kv, opt.d_h),
               head_rows(v_p, Lk, opt.n_kv, opt.d_h), head_rows(o_p, Qp, opt.n_q, opt.d_h));
  attn.backward(head_rows(do_p, Qp, opt.n_q, opt.d_h), head_rows(dq_p, Qp, opt.n_q, opt.d_h),
                head_rows(dk_p, Lk, opt.n_kv, opt.d_h), head_rows(dv_p, Lk, opt.n_kv, opt.d_h));
  const auto comm_stats = world.stats_json();

  // fp64 single-process reference of the whole problem, compared on this rank's rows.
  const BlockMask full = full_mask(batch);
  const RefShape shape{opt.n_q, opt.n_kv, opt.d_h};
  std::vector<double> o_ref, lse_ref, dq_ref, dk_ref, dv_ref;
  const auto qd = to_double(q), kd = to_double(k), vd = to_double(v), dod = to_double(dout);
  reference_attention_forward(full, shape, qd, kd, vd, o_ref, lse_ref);
  const auto delta_ref = reference_delta(dod, o_ref, Q * opt.n_q, opt.d_h);
  reference_attention_backward(full, shape, qd, kd, vd, dod, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref);

  const Tolerance tol = kTolF32;
  auto cmp = [&](const std::vector<float>& got, const std::vector<double>& ref) {
    return compare<float>(got, ref, tol);
  };
  CompareResult r_o = cmp(o_p, take_rows(o_ref, hq, blk.begin * B, blk.end * B));
  CompareResult r_dq = cmp(dq_p, take_rows(dq_ref, hq, blk.begin * B, blk.end * B));
  CompareResult r_dk = cmp(dk_p, gather_rows(dk_ref, hkv, key_rows));
  CompareResult r_dv = cmp(dv_p, gather_rows(dv_ref, hkv, key_rows));
  // Worst over ranks: max of the error maxima, sum of mismatch counts.
  std::vector<double> errs{r_o.max_abs, r_dq.max_abs, r_dk.max_abs, r_dv.max_abs};
  std::vector<std::int64_t> bad{r_o.mismatched, r_dq.mismatched, r_dk.mismatched, r_dv.mismatched};
  world.all_reduce<double>(errs, ReduceOp::max);
  world.all_reduce<std::int64_t>(bad, ReduceOp::sum);
  const bool pass = bad[0] + bad[1] + bad[2] + bad[3] == 0;

  if (p == 0) {
    const char* names[] = {"o", "dq", "dk", "dv"};
    if (opt.json) {
      nlohmann::json j{{"P", P},        {"samples", opt.samples}, {"context", opt.context},
                       {"anchors", opt.anchors}, {"block", B},     {"S", S},
                       {"Q", Q},        {"n_q", opt.n_q},       {"n_kv", opt.n_kv},
                       {"d_h", opt.d_h}, {"check_passed", pass}, {"comm_rank0", comm_stats}};
      for (int t = 0; t < 4; ++t) j["max_abs_err"][names[t]] = errs[static_cast<std::size_t>(t)];
      std::cout << j.dump() << std::endl;
    } else {
      std::printf("diffcp demo: Split-KV attention core on %lld ranks\n", static_cast<long long>(P));
      std::printf("  batch: %lld samples x %lld context, %lld anchors/sample, B=%lld -> S=%lld, Q=%lld\n",
                  static_cast<long long>(opt.samples), static_cast<long long>(opt.context),
                  static_cast<long long>(opt.anchors), static_cast<long long>(B), static_cast<long long>(S),
                  static_cast<long long>(Q));
      std::printf("  heads: n_q=%lld n_kv=%lld d_h=%lld; visible pairs per head: %lld\n",
                  static_cast<long long>(opt.n_q), static_cast<long long>(opt.n_kv),
                  static_cast<long long>(opt.d_h), static_cast<long long>(full.visible_pairs()));
      std::printf("  computed: o, lse (forward) and dq, dk, dv (backward) over sharded keys\n");
      for (int t = 0; t < 4; ++t)
        std::printf("  max |err| %-2s vs fp64 reference: %.3g (%lld mismatches, tol %.0e + %.0e*|ref|)\n",
                    names[t], errs[static_cast<std::size_t>(t)], static_cast<long long>(bad[static_cast<std::size_t>(t)]),
                    tol.atol, tol.rtol);
      const auto& ops = comm_stats["ops"];
      std::printf("  rank 0 communication: all_gather %s B, reduce_scatter %s B, all_reduce %s B sent\n",
                  ops["all_gather"]["bytes_sent"].dump().c_str(), ops["reduce_scatter"]["bytes_sent"].dump().c_str(),
                  ops["all_reduce"]["bytes_sent"].dump().c_str());
      std::printf("  result: %s\n", pass ? "MATCHES the single-process fp64 reference" : "MISMATCH");
    }
  }
  return pass ? 0 : 2;
}

}  // namespace diffcp::cli
